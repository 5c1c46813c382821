"""torch.distributed glue: process group from torchrun's environment, rank helpers, collectives.

`torchrun --nproc-per-node N -m blockdraft train ...` sets RANK/WORLD_SIZE/LOCAL_RANK; the
backend is nccl on CUDA and gloo on CPU. A single process needs none of it.

docs/scale.md, rule 1: a collective's tensors live on the device its backend serves
(nccl: this rank's cuda device; gloo: the CPU). `comm_device()` (process_group.py, where a sharded
target reads it too) is that device, and every tensor this module hands to a collective is made
there; metrics, counts and barriers included.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from ..process_group import backend_device, barrier, comm_device, grouped, joined, set_comm_device  # noqa: F401

# how long a collective may wait for a rank doing work alone (rank 0 writing a checkpoint or the
# final drafter, a slow first compile) before the watchdog calls the run dead
DEFAULT_TIMEOUT_MIN = 60.0


def world() -> tuple[int, int]:
    """(rank, world_size); (0, 1) outside torch.distributed."""
    if grouped():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env(device: str, timeout_min: float | None = None, gpu_offset: int = 0) -> tuple[int, int, str]:
    """Join the process group torchrun describes (also a group of one: torchrun on one GPU); returns
    (rank, world, this rank's device). Without torchrun's environment no group is made.

    nccl gets the rank's device (`device_id`: the group is bound to it, barriers use it) and
    both backends a `timeout` long enough for the longest work one rank does alone. `gpu_offset`: the
    node's GPUs below it are not the ranks' (an engine's, `train --engine vllm`): local rank k takes
    GPU offset + k."""
    launched = "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if not (size > 1 or launched) or grouped():
        r, w = world()
        if gpu_offset and device == "cuda":  # one process beside the engine: the first GPU after its
            device = f"cuda:{gpu_offset}"
        return r, w, device
    backend = "nccl" if device.startswith("cuda") else "gloo"
    kw = {}
    if backend == "nccl":
        local = gpu_offset + int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
        kw["device_id"] = torch.device(device)
    minutes = DEFAULT_TIMEOUT_MIN if timeout_min is None else float(timeout_min)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=minutes), **kw)
    set_comm_device(backend_device(backend, device))
    if dist.get_world_size() > 1:
        watch_aborts()
    return dist.get_rank(), dist.get_world_size(), device


# ------------------------------------------------------------------ one rank's failure stops them all
ABORT_KEY = "blockdraft/abort"
WATCH_S = 2.0  # how often every rank looks for another's failure
ABORT_GRACE_S = 3.0  # how long a failed rank waits after posting, before its exit cuts its peers' connections
_WATCH: dict = {}


def _store():
    """The group's key-value store (torchrun's rendezvous store), or None where there is none to reach."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def post_abort(line: str) -> None:
    """This rank stopped on an error (`line`, what it printed): every other rank stops within WATCH_S
    too, saying which rank, on which host, and why, instead of waiting in a collective until the
    group's timeout (an hour by default)."""
    import socket

    store = _store() if grouped() else None
    if store is None:
        return
    try:
        store.set(ABORT_KEY, f"{dist.get_rank()}\t{socket.gethostname()}\t{line}")
    except Exception:  # noqa: BLE001 (the store's server may be gone with its rank: the timeout is left)
        return
    time.sleep(ABORT_GRACE_S)  # the others read it before this process's exit breaks their collectives


def watch_aborts(period: float = WATCH_S) -> None:
    """A daemon thread that ends this process (exit 2, one line) once another rank has posted a failure."""
    import sys
    import threading

    store, me = _store(), dist.get_rank()
    if store is None or _WATCH.get("thread") is not None:
        return
    done = _WATCH["done"] = threading.Event()
    command = next((a for a in sys.argv[1:2] if a.isalpha()), "")

    def watch() -> None:
        while not done.wait(period):  # a check, not the store's blocking wait, which logs each timeout
            try:
                if not store.check([ABORT_KEY]):
                    continue
                rank, host, line = store.get(ABORT_KEY).decode().split("\t", 2)
            except Exception:  # noqa: BLE001 (the store went with its host: the collective's own error is left)
                return
            if int(rank) == me:
                return
            print(f"blockdraft{' ' + command if command else ''}: error: rank {rank} on {host} stopped, so this "
                  f"rank does too: {line}", file=sys.stderr, flush=True)
            os._exit(2)

    _WATCH["thread"] = threading.Thread(target=watch, name="blockdraft-abort-watch", daemon=True)
    _WATCH["thread"].start()


def stop_watching() -> None:
    if _WATCH.get("thread") is not None:
        _WATCH["done"].set()
        _WATCH["thread"].join()
        _WATCH.clear()


_LEFT = False  # this process left a group it had joined (cli.entry then exits without the teardown)


def leave() -> None:
    """Leave the process group this module joined (at the end of a command)."""
    global _LEFT
    if joined() and grouped():
        # every rank gets here only after a clean finish; leaving together keeps a rank's teardown
        # from cutting a peer's connection while it still sends (gloo aborts the peer then)
        dist.barrier()
        stop_watching()
        dist.destroy_process_group()
        _LEFT = True
    set_comm_device(None)


def left_group() -> bool:
    """Whether this process joined a process group and left it (`leave`)."""
    return _LEFT


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over ranks, moved to the collective device and back to where it came from."""
    if not grouped():
        return t
    home = t.device
    x = t.to(comm_device())
    dist.all_reduce(x)
    return x.to(home)


def all_reduce_mean(values: dict) -> dict:
    """Average float metrics over ranks (no-op on one process): one collective for all of them."""
    r, w = world()
    if not grouped():
        return values
    keys = [k for k, v in values.items() if isinstance(v, float)]
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t)
    out = dict(values)
    out.update({k: float(v) / w for k, v in zip(keys, t.tolist())})
    return out


def all_gather_floats(values: list[float]) -> list[float]:
    """Every rank's `values`, concatenated in rank order (one value per rank: a per-rank figure)."""
    if not grouped():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    out = [torch.empty_like(t) for _ in range(world()[1])]
    dist.all_gather(out, t)
    return torch.cat(out).tolist()


def check_same(tensors, what: str) -> None:
    """Every rank holds the same `tensors` (compared by a float64 checksum), or a ValueError naming
    `what`: ranks that start from different drafters train different models. One host read; nothing
    at all outside a process group."""
    if not grouped():
        return
    value = torch.stack([t.detach().double().sum() for t in tensors]).sum()
    got = all_gather_floats([float(value)])
    if any(v != got[0] for v in got):
        raise ValueError(f"the ranks hold different {what} (checksums {got}); every rank must build it from the "
                         "same seed and files")


BUCKET_BYTES = 64 * 2**20


def average_gradients(params, bucket_bytes: int = BUCKET_BYTES) -> int:
    """DDP-style mean of gradients over ranks, in flat buckets of about `bucket_bytes` (one
    collective per bucket, not one per parameter). Returns the number of collectives issued."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grouped() or not grads:
        return 0
    w = world()[1]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    buckets = []
    for group in by_kind.values():
        cur, size = [], 0
        for g in group:
            nbytes = g.numel() * g.element_size()
            if cur and size + nbytes > bucket_bytes:
                buckets.append(cur)
                cur, size = [], 0
            cur.append(g)
            size += nbytes
        buckets.append(cur)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])  # [sum of numel] on the gradients' device
        dist.all_reduce(flat)
        flat.div_(w)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(buckets)


def clip_grad_norm(params, max_norm: float) -> float:
    """Clip the gradients to `max_norm` and return their total norm over all ranks' shards (under
    FSDP2 a gradient is a DTensor shard: the norm of the whole, not of this rank's piece)."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    full = getattr(norm, "full_tensor", None)
    if full is not None:  # a DTensor: the whole norm (torch 2.13 already makes it Replicate; older ones Partial)
        norm = full()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


# ------------------------------------------------------------------ FSDP2
# Drafter parameters sharded over the ranks with torch's own FSDP2 (`fully_shard`): each decoder
# layer is one unit, the root holds fc and the norms. Gradients are reduce-scattered (averaged)
# by FSDP itself, once per optimizer step (`gradient_sync`). Checkpoints stay in the
# single-process layout (full tensors, optimizer state keyed by parameter index), gathered
# collectively and written by rank 0, so a run can resume with or without sharding.

def mixed_precision_policy(device: str | torch.device):
    """FSDP2's precision for a drafter trained on `device`: on CUDA (bf16 autocast) the shards are
    all-gathered as bf16, so no layer re-casts its fp32 weights in every forward and recompute, and
    gradients are reduce-scattered in fp32; None on a CPU (no autocast there: plain fp32)."""
    if torch.device(device).type != "cuda":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # inputs are not cast: the residual stream between layers stays fp32, as under autocast alone
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_drafter(drafter, device: str | torch.device = "cpu") -> None:
    """Each decoder layer one FSDP2 unit, the root the rest, at the precision training runs at on
    `device` (mixed_precision_policy)."""
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision_policy(device)
    kw = {} if policy is None else {"mp_policy": policy}
    for layer in drafter.layers:
        fully_shard(layer, **kw)
    fully_shard(drafter, **kw)


def gradient_sync(module, enabled: bool) -> None:
    """FSDP2: whether the next backward reduce-scatters its gradients (only the last micro-batch
    of an accumulated step needs to); a no-op for a module that is not sharded."""
    fn = getattr(module, "set_requires_gradient_sync", None)
    if fn is not None:
        fn(enabled)


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
