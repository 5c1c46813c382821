"""Where a target's layers are, and how they are numbered (clause 1): what both the whole target
(model.py) and a target sharded by decoder layer (shard.py) need, so neither imports the other.

Clause 1 owner: `hidden_states_index` holds the one "+1" between a layer id and the
transformers `output_hidden_states` tuple, and `layer_state` what a decoder layer's output is taken as
(one [Bz, T, H] state; the mean of a hyper-connection target's residual streams).
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


# Families whose decoder layers output hc_mult residual streams (hyper-connections) and whose layer state
# blockdraft reads as vLLM 0.33 records it for DFlash, DSpark and EAGLE-3 (layer_state), by the text
# config's model_type; the value says whether their final state is the final norm of that same mean at the last
# layer (GLM-5-Next's hc_head is a plain mean; DeepSeek-V4's weighs the streams by learned gates), which is what
# an engine's last-layer state gives the labels from (engines/vllm/capture.py)
STREAM_FAMILIES = {"deepseek_v4": False, "glm5_next_text": True}
# hyper-connection families refused, and why (one line each)
STREAM_REFUSED = {"hy_v4": "vLLM 0.33 records no layer states for it (HYV4ForCausalLM has no EAGLE-3 aux-state "
                           "support), so there is no served definition of its layer state to train for"}


def layer_state(output, streams: int | None = None):
    """Clause 1: the [Bz, T, H] state that layer id L stands for, from decoder layer L's forward output (a
    tensor, or a tuple that holds it first). A hyper-connection target's layer (`streams`: its hc_mult)
    outputs [Bz, T, streams, H] after its output mixing (post-mHC: each stream is post * block output plus
    the comb-mixed input streams); its state is the plain mean over the streams, what vLLM 0.33 records as
    the aux state after layer L (DeepSeek-V4: `(idx + 1) in aux_hidden_state_layers`, `mean(dim=1)` of
    hc_post's output; GLM-5-Next: the completed stream entering layer L + 1, hc_contract)."""
    state = output[0] if isinstance(output, tuple) else output
    if streams is None:
        return state
    if state.dim() != 4 or state.shape[-2] != streams:
        raise ValueError(f"a decoder layer's output has shape {tuple(state.shape)}, not [Bz, T, {streams}, H]")
    return state.mean(dim=-2)


def stream_refusal(config) -> str | None:
    """Why blockdraft cannot read this hyper-connection target's layer states (None where it can, or where
    its layers output one stream)."""
    if residual_streams(config) is None:
        return None
    kind = getattr(text_config_of(config), "model_type", None)
    if kind in STREAM_FAMILIES:
        return None
    return STREAM_REFUSED.get(kind, f"blockdraft reads the streams' mean only where vLLM 0.33 was read to record "
                                    f"it ({', '.join(STREAM_FAMILIES)}), not for model type {kind!r}")


def final_from_mean_state(config) -> bool:
    """Whether the target's final normed state is its final norm applied to the last layer's state
    (layer_state of layer n - 1), as an engine's capture turns its last-layer state into labels: true of a
    one-stream target and of GLM-5-Next (a plain mean of the streams), false of DeepSeek-V4 (learned gates)."""
    if residual_streams(config) is None:
        return True
    return STREAM_FAMILIES.get(getattr(text_config_of(config), "model_type", None), False)


def text_config_of(config):
    """The text decoder's config of a model's `config` (a wrapper's text_config, else itself)."""
    return getattr(config, "text_config", None) or config


def residual_streams(config) -> int | None:
    """How many residual streams a decoder layer's output holds per token where a family has
    hyper-connections (GLM-5-Next, DeepSeek-V4, HY-V4: `hc_mult`, the layers output [Bz, T, hc_mult, H]
    even for 1), else None (one [Bz, T, H] state)."""
    n = getattr(text_config_of(config), "hc_mult", None)
    return int(n) if isinstance(n, int) and not isinstance(n, bool) else None
