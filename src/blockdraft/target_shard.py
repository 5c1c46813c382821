"""A frozen target sharded over the training ranks (`train --target-fsdp`): its decoder layers are
FSDP2 units, so each of N ranks holds about 1/N of them and gathers one layer at a time in the
forward; the embedding, final norm, head and rotary tables stay whole on every rank (the drafter
uses them). Features and labels are the unsharded target's (tests/train/test_target_shard.py).

Loading stages the weights once, in rank 0's host RAM (transformers reads the checkpoint there,
with its own key conversions); the other ranks build the model on the meta device. Rank 0 then
broadcasts one decoder layer at a time onto every rank's device, where `fully_shard` keeps that
rank's share and frees the rest: no rank ever holds more than the non-layer weights, its shares
and one whole layer (DESIGN.md section 5, rule 6).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


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

    for mod in module.modules():
        if id(mod) in skipped:
            continue
        for name, t in list(mod._parameters.items()):
            if t is not None:
                mod._parameters[name] = nn.Parameter(moved(t), requires_grad=False)
        for name, t in list(mod._buffers.items()):
            if t is not None:
                mod._buffers[name] = moved(t)
        if ("original_inv_freq" not in mod._buffers and "inv_freq" in mod._buffers
                and isinstance(getattr(mod, "original_inv_freq", None), torch.Tensor)):  # older rotary tables
            mod.original_inv_freq = mod._buffers["inv_freq"]


def shard_target(model: nn.Module, layers: nn.ModuleList, device: torch.device, comm_device: torch.device) -> None:
    """Rank 0's model (on the host) and the others' (on meta) become one model sharded by decoder
    layer: the rest broadcast whole, each layer broadcast and then sharded with FSDP2."""
    from torch.distributed.fsdp import fully_shard

    broadcast_states(model, device, comm_device, skip=list(layers))  # everything outside the layers, whole
    for layer in layers:
        broadcast_states(layer, device, comm_device)
        fully_shard(layer)  # this rank keeps its share of the layer; the whole copy is freed
        # each layer is its own FSDP root (the embedding and head stay whole), and FSDP keeps a root
        # gathered after its forward; a frozen layer has no backward to keep it for
        layer.register_forward_hook(_reshard)


def _reshard(module, _inputs, _output) -> None:
    module.reshard()


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


def load_sharded(local, *, dtype: torch.dtype, device: str, build=None):
    """The transformers model of `local`, sharded by decoder layer over this process group.
    `build(device)` instead makes the model (a random target: rank 0 builds it on its device)."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from .target import find_decoder_layers, text_config
    from .train.distributed import comm_device

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("--target-fsdp shards the target over the ranks of a torchrun launch; run under "
                         "torchrun (or drop --target-fsdp)")
    from .tiny import own_rng

    with own_rng(device):  # loading on the host and building on meta must leave every rank's RNG alike
        if build is not None:
            model = build(device if dist.get_rank() == 0 else "meta")
        elif dist.get_rank() == 0:
            model = AutoModelForCausalLM.from_pretrained(local, dtype=dtype, device_map={"": "cpu"})
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(local), dtype=dtype)
    model.eval().requires_grad_(False)
    layers = find_decoder_layers(model, int(text_config(model).num_hidden_layers))
    shard_target(model, layers, torch.device(device), comm_device())
    return model
