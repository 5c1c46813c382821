"""A frozen target sharded over the training ranks (`train --target-fsdp`): its decoder layers are
FSDP2 units under one root (their owner), so each of N ranks holds about 1/N of them and gathers
one layer at a time in the forward, the next one's gather prefetched; the embedding, final norm,
head and rotary tables stay whole on every rank (the drafter uses them). Features and labels are
the unsharded target's (tests/train/test_target_shard.py).

Loading stages the weights once, in rank 0's host RAM (transformers reads the checkpoint there,
with its own key conversions); the other ranks build the model on the meta device. Rank 0 then
broadcasts one decoder layer at a time onto every rank's device, where `fully_shard` keeps that
rank's share and frees the rest: no rank ever holds more than the non-layer weights, its shares
and one whole layer (docs/scale.md, rule 6). Before any broadcast the ranks compare rank 0's
list of tensors (names, shapes, dtypes) with their own: a mismatch is one ValueError on every rank.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..process_group import comm_device
from .classes import auto_class, failed, read_config
from .layers import find_decoder_layers, text_config
from .tiny import own_rng


def _states(module: nn.Module, skip=()):
    """(name, store, key, tensor) of each parameter and buffer of `module` outside the submodules in
    `skip`, in the order broadcast_states sends them (`store[key]` is where the tensor lives)."""
    skipped = {id(m) for s in skip for m in s.modules()}
    for prefix, mod in module.named_modules():
        if id(mod) in skipped:
            continue
        for store in (mod._parameters, mod._buffers):
            for key, t in list(store.items()):
                if t is not None:
                    yield (f"{prefix}.{key}" if prefix else key), store, key, t


def broadcast_states(module: nn.Module, device: torch.device, comm_device: torch.device, skip=()) -> None:
    """Give every rank rank 0's parameters and buffers of `module` (but not of the submodules in
    `skip`), on `device`. Rank 0's may be on the host, the others' on the meta device;
    tied tensors stay tied; parameters stay frozen."""
    import torch.distributed as dist

    rank, skipped, done = dist.get_rank(), {id(m) for s in skip for m in s.modules()}, {}

    def moved(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            buf = (t.detach().to(comm_device) if rank == 0
                   else torch.empty(t.shape, dtype=t.dtype, device=comm_device))
            dist.broadcast(buf, 0)
            done[id(t)] = buf.to(device)
        return done[id(t)]

    for _, store, key, t in list(_states(module, skip)):
        store[key] = nn.Parameter(moved(t), requires_grad=False) if isinstance(t, nn.Parameter) else moved(t)
    for mod in module.modules():
        if id(mod) in skipped:
            continue
        if ("original_inv_freq" not in mod._buffers and "inv_freq" in mod._buffers
                and isinstance(getattr(mod, "original_inv_freq", None), torch.Tensor)):  # older rotary tables
            mod.original_inv_freq = mod._buffers["inv_freq"]


def tensor_manifest(model: nn.Module, layers: nn.ModuleList) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of every tensor shard_target broadcasts, in its order: what every rank's
    model must hold alike for the broadcasts to pair up."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for module, skip, prefix in [(model, list(layers), "")] + [(x, (), names[id(x)] + ".") for x in layers]:
        seen = set()
        for name, _, _, t in _states(module, skip):
            if id(t) not in seen:  # a tied tensor is sent once
                seen.add(id(t))
                out.append((prefix + name, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
    return out


def _said(entry, name: str) -> str:
    if entry is None:
        return "nothing"
    return ("" if entry[0] == name else f"{entry[0]} ") + f"{list(entry[1])} {entry[2]}"


def _first_difference(ref: list, mine: list, rank: int) -> str | None:
    """A one-line account of the first tensor where this rank's manifest differs from rank 0's."""
    for i in range(max(len(ref), len(mine))):
        a = ref[i] if i < len(ref) else None
        b = mine[i] if i < len(mine) else None
        if a != b:
            name = (a or b)[0]
            return (f"--target-fsdp: rank {rank}'s target differs from rank 0's at tensor {i} ({name}): "
                    f"rank 0 has {_said(a, name)}, rank {rank} {_said(b, name)}; the ranks broadcast the "
                    "weights into same-shaped tensors, so every rank must build the model alike (same "
                    "config, dtype and transformers version; rank 0 loads it with from_pretrained, the others "
                    "with from_config, which differ for a family that keeps some modules in fp32)")
    return None


def check_same_tensors(model: nn.Module, layers: nn.ModuleList, comm_device: torch.device) -> None:
    """Rank 0's tensor_manifest against every rank's own, before any broadcast: a mismatch would
    broadcast into wrong buffers (a hang, or garbage). All ranks agree on the outcome, so each
    raises the same ValueError (the lowest differing rank's) and none waits in a broadcast."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = tensor_manifest(model, layers)
    box = [mine if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, device=comm_device)
    found: list = [None] * world
    dist.all_gather_object(found, _first_difference(box[0], mine, rank))
    message = next((m for m in found if m is not None), None)
    if message is not None:
        raise ValueError(message)


def _owner(model: nn.Module, layers: nn.ModuleList) -> nn.Module:
    """The module holding `layers` (a family's base or text model): every forward enters through it."""
    for mod in model.modules():
        if any(child is layers for child in mod.children()):
            return mod
    raise ValueError(f"{type(model).__name__} does not hold its decoder layers as a child module")


def shard_target(model: nn.Module, layers: nn.ModuleList, device: torch.device, comm_device: torch.device) -> None:
    """Rank 0's model (on the host) and the others' (on meta) become one model sharded by decoder
    layer: the rest broadcast whole, each layer broadcast and then sharded with FSDP2.

    One FSDP root, the layers' owner, with everything outside the layers ignored (whole on every
    rank): under one root, layer i prefetches layer i + 1's all-gather during its own forward
    instead of each layer, as its own root, waiting for its gather. Frozen: no backward, so every
    layer is resharded after its forward."""
    from torch.distributed.fsdp import fully_shard

    check_same_tensors(model, layers, comm_device)
    broadcast_states(model, device, comm_device, skip=list(layers))  # everything outside the layers, whole
    for layer in layers:
        broadcast_states(layer, device, comm_device)
        fully_shard(layer, reshard_after_forward=True)  # this rank keeps its share; the whole copy is freed
    root = _owner(model, layers)
    sharded = {id(p) for layer in layers for p in layer.parameters()}
    fully_shard(root, ignored_params={p for p in root.parameters() if id(p) not in sharded})
    for layer, following in zip(layers, list(layers)[1:]):
        layer.set_modules_to_forward_prefetch([following])


@contextlib.contextmanager
def gathered(layers):
    """The given (sharded) layers whole for the duration (a collective on every rank): reading a
    target layer's weights, e.g. to start the drafter from them. A no-op for unsharded layers."""
    sharded = [layer for layer in layers if hasattr(layer, "unshard")]
    for layer in sharded:
        layer.unshard()
    try:
        yield
    finally:
        for layer in sharded:
            layer.reshard()


def _rank_model(local, dtype: torch.dtype) -> nn.Module:
    """Rank 0: the target of `local` read onto the host; the other ranks: the same class built on the meta
    device (classes.auto_class: a causal LM, or the wrapper of a text decoder). A failure on any rank is a
    TargetLoadError with the cause (each rank reads the same files, so all fail alike)."""
    import torch.distributed as dist

    auto = auto_class(config := read_config(local), local)
    try:
        if dist.get_rank() == 0:
            return auto.from_pretrained(local, config=config, dtype=dtype, device_map={"": "cpu"},
                                        use_safetensors=True)
        with torch.device("meta"):
            return auto.from_config(config, dtype=dtype)
    except Exception as e:  # transformers' own error is the cause
        raise failed(local, e) from e

def load_sharded(local, *, dtype: torch.dtype, device: str, build=None):
    """The transformers model of `local`, sharded by decoder layer over this process group.
    `build(device)` instead makes the model (a random target: rank 0 builds it on its device)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("--target-fsdp shards the target over the ranks of a torchrun launch; run under "
                         "torchrun (or drop --target-fsdp)")
    with own_rng(device):  # loading on the host and building on meta must leave every rank's RNG alike
        model = build(device if dist.get_rank() == 0 else "meta") if build is not None else _rank_model(local, dtype)
    model.eval().requires_grad_(False)
    layers = find_decoder_layers(model, int(text_config(model).num_hidden_layers))
    shard_target(model, layers, torch.device(device), comm_device())
    return model
