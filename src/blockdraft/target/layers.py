"""Where a target's layers are, and how they are numbered (clause 1): what both the whole target
(model.py) and a target sharded by decoder layer (shard.py) need, so neither imports the other.

Clause 1 owner: `hidden_states_index` holds the one "+1" between a layer id and the
transformers `output_hidden_states` tuple.
"""

from __future__ import annotations

from torch import nn

from .family import final_norm


def hidden_states_index(layer_id: int) -> int:
    """Clause 1: the output of decoder layer L is `hidden_states[L + 1]` in transformers'
    `output_hidden_states` tuple (index 0 is the embedding output). It is also the
    speculators-format id, which names the *input* of layer L + 1."""
    return int(layer_id) + 1


def layer_id_from_hidden_states_index(index: int) -> int:
    """Inverse of `hidden_states_index`."""
    return int(index) - 1


def final_norm_of(model: nn.Module) -> nn.Module:
    """family.final_norm, or a ValueError naming the base's modules."""
    mod = final_norm(model)
    if mod is None:
        base = getattr(model, "model", model)
        raise ValueError(f"{type(model).__name__} has no final norm that blockdraft can find (its base holds "
                         f"{', '.join(n for n, _ in base.named_children())})")
    return mod


def find_decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The ModuleList of decoder layers (Llama/Qwen/Mistral/Gemma: `*.layers`; a multimodal wrapper's
    text decoder: `model.language_model.layers`)."""
    for name, mod in model.named_modules():
        if name.endswith("layers") and isinstance(mod, nn.ModuleList) and len(mod) == num_layers:
            if not any(part in name for part in ("vision", "visual", "audio")):  # a wrapper's other towers
                return mod
    raise ValueError(f"could not find the {num_layers} decoder layers of {type(model).__name__}")


def text_config(model: nn.Module):
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def residual_streams(config) -> int:
    """How many residual streams a decoder layer's output holds per token: `hc_mult` of a family with
    hyper-connections (GLM-5-Next, DeepSeek-V4: [Bz, T, hc_mult, H]), else 1."""
    tc = getattr(config, "text_config", None) or config
    n = getattr(tc, "hc_mult", None)
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
