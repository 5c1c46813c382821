"""The torch.distributed process group as the lower modules see it: whether this process is in
one, and where its collective tensors must live (docs/scale.md, rule 1: nccl reduces this
rank's cuda device, gloo the CPU). train/distributed.py joins and leaves the group and records
its device here; a target sharded over the ranks (target/shard.py) reads it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_COMM_DEVICE: torch.device | None = None  # set by the group this process joined (train.distributed.init_from_env)


def grouped() -> bool:
    """Whether this process is in a process group. Under torchrun it is even alone (one GPU): the
    collectives then run for real, on nccl too, so a single-GPU run exercises what N GPUs do."""
    return dist.is_available() and dist.is_initialized()


def backend_device(backend: str, device: str | torch.device) -> torch.device:
    """The device whose tensors `backend` reduces: cuda for nccl, the CPU for gloo."""
    return torch.device(device) if backend == "nccl" else torch.device("cpu")


def comm_device() -> torch.device:
    """Where this process's collective tensors must live (the CPU outside torch.distributed)."""
    if _COMM_DEVICE is not None:
        return _COMM_DEVICE
    if grouped():  # a group made by someone else (tests, a launcher): ask its backend
        backend = dist.get_backend()
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_comm_device(device: torch.device | None) -> None:
    """Record the collective device of the group this process joined; None once it left."""
    global _COMM_DEVICE
    _COMM_DEVICE = device


def joined() -> bool:
    """Whether this process joined its group itself (set_comm_device), not a group someone else made."""
    return _COMM_DEVICE is not None


def barrier() -> None:
    """Every rank of the group waits here for the others (nothing outside a group)."""
    if grouped():
        dist.barrier()
