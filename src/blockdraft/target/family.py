"""Target-family quirks, with one owner: what a target's norms, embedding, MLP, head and rope do,
measured on the model itself rather than read from a class name.

Every initialisation that copies target weights into a drafter (`init_from_target_layers`, the
final-norm and context inits) and `doctor` ask this module. Gemma, Qwen3-Next and Qwen3.5 norms
scale by `1 + w`, Llama's and Qwen3's by `w`: the scale is measured by running the norm on a
known input. The drafter's own layers are Qwen3's (scale `w`, silu MLP), as every engine reads
them, so a norm is copied as its effective scale and an MLP of another activation is not copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

DRAFTER_ACTIVATION = "silu"  # Qwen3 MLP: what vLLM, SGLang and dflash build for the drafter layers


def _eps(norm: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(norm, name, None)
        if isinstance(v, float):
            return v
    return 1e-6


def _weight(norm: nn.Module) -> torch.Tensor | None:
    w = getattr(norm, "weight", None)
    return None if w is None or w.is_meta or w.dim() != 1 else w


@torch.no_grad()
def rms_norm_scale(norm: nn.Module) -> torch.Tensor | None:
    """The per-channel scale s of an RMSNorm, norm(x) = x / rms(x) * s, measured on two known inputs
    (None if the module is not such a norm: a LayerNorm, a gated norm, a bias). Gemma-style
    norms give 1 + w, Llama-style ones w."""
    w = _weight(norm)
    if w is None:
        return None
    H, eps = w.shape[0], _eps(norm)
    x = torch.full((1, H), 1.0e3, dtype=torch.float32, device=w.device)
    try:
        s = norm(x.to(w.dtype)).float()[0]  # x / rms(x) = 1 everywhere, so the output is the scale itself
        g = torch.Generator(device="cpu").manual_seed(0)
        y = (torch.randn(1, H, generator=g) * 3 + 1).to(w.device)
        got = norm(y.to(w.dtype)).float()
    except Exception:  # a norm that needs other inputs (a gate) is not a plain RMSNorm
        return None
    want = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * s
    tol = 1e-2 if w.dtype in (torch.bfloat16, torch.float16) else 1e-4
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(s.abs().max().clamp(min=1))):
        return None
    return s


def pre_mlp_norm(layer: nn.Module) -> nn.Module | None:
    """The norm in front of a decoder layer's MLP (Gemma: pre_feedforward_layernorm; Falcon-H1:
    pre_ff_layernorm; Llama, Qwen, GLM-4: post_attention_layernorm). A layer that also normalises
    its MLP's output (post_feedforward_layernorm: Gemma, OLMo-2) uses post_attention_layernorm on
    the attention output instead, so OLMo-2's post-norm layers have none."""
    for name in ("pre_feedforward_layernorm", "pre_ff_layernorm"):
        norm = getattr(layer, name, None)
        if norm is not None:
            return norm
    if getattr(layer, "post_feedforward_layernorm", None) is not None:
        return None
    return getattr(layer, "post_attention_layernorm", None)


FINAL_NORM_NAMES = ("norm", "final_layernorm", "norm_f", "ln_f", "final_norm")


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm a causal LM's base applies after its last decoder layer (Llama: model.norm,
    Falcon-H1: final_layernorm, Nemotron-H: norm_f), or None."""
    base = getattr(model, "model", model)
    base = getattr(base, "language_model", base)
    for name in FINAL_NORM_NAMES:
        mod = getattr(base, name, None)
        if isinstance(mod, nn.Module):
            return mod
    return None


def logit_transform(config) -> tuple[float, float, float | None]:
    """(multiplier, divisor, soft-cap) that the family's forward applies to lm_head's output:
    Granite divides by logits_scaling, Cohere multiplies by logit_scale, Falcon-H1 by
    lm_head_multiplier, Gemma soft-caps. `output_logits` applies them in the model's order."""
    tc = getattr(config, "text_config", None) or config
    mul = 1.0
    for name in ("logit_scale", "lm_head_multiplier"):
        v = getattr(tc, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            mul *= float(v)
    div = getattr(tc, "logits_scaling", None)
    div = float(div) if isinstance(div, (int, float)) and not isinstance(div, bool) else 1.0
    cap = getattr(tc, "final_logit_softcapping", None)
    return mul, div, (float(cap) if cap else None)


def output_logits(logits: torch.Tensor, transform: tuple[float, float, float | None]) -> torch.Tensor:
    """lm_head's output -> the model's logits, as its own forward computes them."""
    mul, div, cap = transform
    if mul != 1.0:
        logits = logits * mul
    if div != 1.0:
        logits = logits / div
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def mlp_activation(config) -> str | None:
    for name in ("hidden_activation", "mlp_hidden_act", "hidden_act"):
        v = getattr(config, name, None)
        if v:
            return str(v)
    return None


@torch.no_grad()
def embedding_scale(model: nn.Module) -> float:
    """What the target's input-embedding module multiplies its rows by (Gemma: sqrt(H)); the
    drafter, as z-lab's reference, embeds with the raw rows."""
    emb = model.get_input_embeddings()
    if emb.weight.is_meta:
        return 1.0
    ids = torch.arange(min(8, emb.weight.shape[0]), device=emb.weight.device)
    raw = emb.weight[ids].float()
    out = emb(ids).float()
    return float((out * raw).sum() / raw.pow(2).sum().clamp(min=1e-30))


@dataclass
class Family:
    """A target's quirks as measured."""

    norm_rule: str  # "w", "1 + w", "not an RMSNorm" or "none"
    embedding_scale: float
    logit_softcapping: float | None
    mlp_activation: str | None
    rope: str
    logit_scale: float = 1.0  # what the forward multiplies lm_head's output by (Granite 1 / logits_scaling)
    recurrent: bool = False  # Mamba / linear-attention layers: a crop undoes their state only from recorded states

    def summary(self) -> str:
        cap = f", logit soft-capping {self.logit_softcapping}" if self.logit_softcapping else ""
        scale = f", logits x{self.logit_scale:.3g}" if self.logit_scale != 1.0 else ""
        rec = ", recurrent layers (rolled back from the states the cache records per verify)" if self.recurrent else ""
        return (f"final norm scales by {self.norm_rule}, embedding x{self.embedding_scale:.3g}{cap}{scale}, "
                f"MLP {self.mlp_activation}, rope {self.rope}{rec}")


def norm_rule(norm: nn.Module | None) -> str:
    if norm is None:
        return "none"
    s = rms_norm_scale(norm)
    w = None if norm is None else _weight(norm)
    if s is None or w is None:
        return "not an RMSNorm"
    return "1 + w" if torch.allclose(s, 1 + w.float(), atol=1e-3) and not torch.allclose(s, w.float(), atol=1e-3) \
        else "w"


def describe(model: nn.Module) -> Family:
    tc = getattr(model.config, "text_config", None) or model.config
    rp = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        rope = ", ".join(sorted({str(v.get("rope_type", "default")) for v in rp.values()}))
    else:
        rope = str(rp.get("rope_type", "default")) if isinstance(rp, dict) else "default"
    mul, div, cap = logit_transform(tc)
    return Family(norm_rule(final_norm(model)), embedding_scale(model), cap, mlp_activation(tc), rope,
                  logit_scale=mul / div, recurrent=has_recurrent_layers(tc))


RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "hybrid", "hybrid_sliding", "conv")


def has_recurrent_layers(config) -> bool:
    """Whether some decoder layers keep a recurrent (Mamba, DeltaNet) or convolution state, by the
    layer types transformers' cache is built from."""
    tc = getattr(config, "text_config", None) or config
    types = getattr(tc, "layer_types", None) or []
    return any(t in RECURRENT_LAYER_TYPES for t in types)


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[Bz, T] bool: where a packed document begins (its position does not follow the previous one)."""
    first = torch.ones_like(position_ids[:, :1], dtype=torch.bool)
    return torch.cat([first, position_ids[:, 1:] != position_ids[:, :-1] + 1], dim=1)


@torch.no_grad()
def isolates_packed_documents(model: nn.Module) -> bool:
    """Whether the model's own forward keeps packed documents (position ids restarting at 0, no cache
    and no attention mask) apart, measured: the second of two packed documents must get the logits
    it gets alone. transformers builds a block-diagonal attention mask from the position ids, but
    a recurrent layer (Mamba, Gated DeltaNet) carries its state over the boundary, and gpt-oss's
    eager attention mask (transformers 5.24) lets the second document see the first."""
    emb = model.get_input_embeddings().weight
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(emb.shape[0], 1000), (1, 12), generator=g).to(emb.device)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None].to(emb.device)
    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, 5:].float()
    alone = model(input_ids=ids[:, 5:], position_ids=pos[:, 5:], use_cache=False).logits[0].float()
    tol = 1e-3 if emb.dtype == torch.float32 else 3e-2
    return bool((packed - alone).abs().max() <= tol * max(1.0, float(alone.abs().max())))
