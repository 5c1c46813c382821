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


# ------------------------------------------------------------------ FSDP2
# Drafter parameters sharded over the ranks with torch's own FSDP2 (`fully_shard`): each decoder
# layer is one unit, the root holds fc and the norms. Gradients are reduce-scattered (averaged)
# by FSDP itself. Checkpoints stay in the single-process layout (full tensors, optimizer state
# keyed by parameter index), gathered collectively and written by rank 0, so a run can resume
# with or without sharding.

def shard_drafter(drafter) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in drafter.layers:
        fully_shard(layer)
    fully_shard(drafter)


def _param_names(module) -> list[str]:
    return [n for n, p in module.named_parameters() if p.requires_grad]


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(drafter) -> dict:
    """The drafter's state dict with full tensors on the CPU of rank 0 (other ranks get an empty
    dict). A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(drafter, options=_full_options())


def full_state(drafter, optimizer) -> tuple[dict, dict]:
    """(full_model_state, optimizer state dict keyed by parameter index), as full_model_state."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model_sd = full_model_state(drafter)
    named = get_optimizer_state_dict(drafter, optimizer, options=_full_options())
    if world()[0] != 0:
        return {}, {}
    index = {n: i for i, n in enumerate(_param_names(drafter))}
    groups = [dict(g, params=[index[n] for n in g["params"]]) for g in named["param_groups"]]
    return model_sd, {"state": {index[n]: st for n, st in named["state"].items()}, "param_groups": groups}


def load_full_optimizer_state(drafter, optimizer, indexed: dict) -> None:
    """Load an optimizer state keyed by parameter index (the single-process layout) into the
    optimizer of a sharded drafter; every rank calls it with the same full state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _param_names(drafter)
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in indexed["param_groups"]]
    named = {"state": {names[i]: st for i, st in indexed["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(drafter, optimizer, named, options=StateDictOptions(full_state_dict=True))
