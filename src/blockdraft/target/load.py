"""Loading a target, in the order TargetModel.from_pretrained reads it: the source resolved (its files,
converted once where it is a GGUF, or a `random:` preset built in code; its tokenizer), then its
transformers model built or loaded onto its device and, with --target-fsdp, sharded by decoder layer
over the ranks (shard.py). TargetModel then hooks the feature layers (model.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .classes import auto_class, failed, read_config, stored_keys
from .files import is_random, load_tokenizer, random_target_tokenizer, resolve_target
from .layers import final_norm_of, find_decoder_layers, text_config
from .shard import load_sharded
from .tiny import random_target_model


@dataclass
class TargetSource:
    """Where a target comes from: its name, its tokenizer and its local safetensors directory, or no
    directory (None) for a `random:` preset, built in code from its name."""

    name: str
    local_dir: Path | None
    tokenizer: object

    @property
    def shown(self) -> str:
        """How a message names it: a directory by its path, the embedded target or a GGUF by its name."""
        local = self.local_dir
        return str(local) if local is not None and self.name == local.name else self.name


def resolve_source(name_or_path: str | os.PathLike) -> TargetSource:
    """A `random:` preset (random_source), else the embedded name, a .gguf file (converted once) or a
    local directory (files.resolve_target), with its tokenizer."""
    if is_random(name_or_path):
        return random_source(str(name_or_path))
    local, name = resolve_target(name_or_path)
    return TargetSource(name, local, load_tokenizer(local))


def random_source(spec: str) -> TargetSource:
    """`random:NAME` (tiny.RANDOM_PRESETS): no files; SmolLM2's tokenizer (files.random_target_tokenizer)."""
    return TargetSource(spec, None, random_target_tokenizer())


def spreads(source: TargetSource, model_kwargs: dict) -> bool:
    """Whether `model_kwargs` spread the model of `source` over several devices (a `device_map`;
    a preset built in code takes no loading keywords)."""
    return source.local_dir is not None and model_kwargs.get("device_map") is not None


def load_model(source: TargetSource, *, dtype: torch.dtype, device: str | None = None, shard: bool = False,
               **model_kwargs) -> nn.Module:
    """The transformers model of `source` in `dtype`: a preset built on `device`; files loaded straight
    onto `device` (not staged in host RAM first), or spread by a `device_map` (`model_kwargs`:
    transformers' from_pretrained keywords), by the class classes.auto_class picks (a causal LM, or
    the wrapper of a text decoder). `shard`: sharded by decoder layer over this process group
    (shard.py). A target that does not load raises classes.TargetLoadError with the cause."""
    if source.local_dir is None:
        return build_random(source, dtype=dtype, device=device, shard=shard)
    spread = spreads(source, model_kwargs)
    if shard:
        if spread:
            raise ValueError("--target-fsdp and --target-device-map both place the target: use one")
        return load_sharded(source.local_dir, dtype=dtype, device=device or "cpu")
    if not spread:
        model_kwargs.pop("device_map", None)
        if device is not None:
            model_kwargs["device_map"] = {"": str(device)}
    auto = auto_class(config := read_config(source.local_dir, source.shown), source.shown)
    try:
        return auto.from_pretrained(source.local_dir, config=config, dtype=dtype, use_safetensors=True, **model_kwargs)
    except Exception as e:  # transformers' own error (missing or mismatched weights, memory) is the cause
        raise failed(source.shown, e) from e


def build_random(source: TargetSource, *, dtype: torch.dtype, device: str | None = None,
                 shard: bool = False) -> nn.Module:
    """The model of a `random:` preset built on `device` (tiny.random_target_model); `shard`: built by
    rank 0 and sharded over the process group (shard.py)."""

    def build(dev):
        return random_target_model(source.name, device=dev, dtype=dtype)

    model = load_sharded(None, dtype=dtype, device=device or "cpu", build=build) if shard else build(device)
    if model.get_output_embeddings().weight.shape[0] < len(source.tokenizer):
        raise ValueError(f"{source.name}: its vocabulary is smaller than the tokenizer's")
    return model


def load_head_only(source: TargetSource, *, dtype: torch.dtype, device: str | None = None,
                   final_norm: bool = False) -> nn.Module:
    """The model of `source` with its decoder layers on the meta device: only the embedding and the
    head (and, with `final_norm`, the final norm) read from its safetensors, straight onto `device`.
    A preset is built whole (the same weights as the run that extracted), then its layers dropped."""
    if source.local_dir is None:
        model = build_random(source, dtype=dtype, device=device)
        for layer in find_decoder_layers(model, int(text_config(model).num_hidden_layers)):
            layer.to("meta")
        return model
    from safetensors import safe_open

    local = source.local_dir
    config = read_config(local, source.shown)
    with torch.device("meta"):
        model = auto_class(config, source.shown).from_config(config)
    files = sorted(local.glob("*.safetensors"))
    names = {n for f in files for n in safe_open(str(f), "pt").keys()}
    stored = stored_keys(local, model)  # parameter name -> stored key, where a checkpoint keeps another layout
    params = dict(model.named_parameters(remove_duplicate=False))
    mods = [model.get_input_embeddings(), model.get_output_embeddings()]
    if final_norm:
        mods.append(final_norm_of(model))
    for k, mod in enumerate(mods):
        for attr, param in list(mod.named_parameters(recurse=False)):
            pname = next(n for n, p in params.items() if p is param)
            tied = next((n for n in names if n.endswith("embed_tokens.weight")), None) if k < 2 else None
            key = pname if pname in names else stored.get(pname) or tied  # a tied head is stored as the embedding
            if key is None:
                raise ValueError(f"{local} has no tensor for {pname}")
            f = next(f for f in files if key in safe_open(str(f), "pt").keys())
            with safe_open(str(f), "pt", device=str(device or "cpu")) as fh:  # read straight onto the device
                setattr(mod, attr, nn.Parameter(fh.get_tensor(key).to(dtype=dtype), requires_grad=False))
    return model
