"""torch.distributed glue: process group from torchrun's environment, rank helpers.

`torchrun --nproc-per-node N -m blockdraft train ...` sets RANK/WORLD_SIZE/LOCAL_RANK; the
backend is nccl on CUDA and gloo on CPU. A single process needs none of it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world_size); (0, 1) outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env(device: str) -> tuple[int, int, str]:
    """Join the process group torchrun describes; returns (rank, world, this rank's device)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1 or (dist.is_available() and dist.is_initialized()):
        r, w = world()
        return r, w, device
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), device


def all_reduce_mean(values: dict) -> dict:
    """Average float metrics over ranks (no-op on one process)."""
    r, w = world()
    if w == 1:
        return values
    keys = [k for k, v in values.items() if isinstance(v, float)]
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    out = dict(values)
    out.update({k: float(v) / w for k, v in zip(keys, t.tolist())})
    return out


def average_gradients(params) -> None:
    """DDP-style mean of gradients over ranks (explicit, so accumulation and resume stay simple)."""
    r, w = world()
    if w == 1:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(w)


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()
