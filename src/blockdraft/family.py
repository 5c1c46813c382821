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
    """The norm in front of a decoder layer's MLP (Gemma: pre_feedforward_layernorm; Llama, Qwen:
    post_attention_layernorm, which in Gemma instead normalises the attention output)."""
    return getattr(layer, "pre_feedforward_layernorm", None) or getattr(layer, "post_attention_layernorm", None)


def mlp_activation(config) -> str | None:
    for name in ("hidden_activation", "hidden_act"):
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

    norm_rule: str  # "w", "1 + w" or "not an RMSNorm"
    embedding_scale: float
    logit_softcapping: float | None
    mlp_activation: str | None
    rope: str

    def summary(self) -> str:
        cap = f", logit soft-capping {self.logit_softcapping}" if self.logit_softcapping else ""
        return (f"final norm scales by {self.norm_rule}, embedding x{self.embedding_scale:.3g}{cap}, "
                f"MLP {self.mlp_activation}, rope {self.rope}")


def norm_rule(norm: nn.Module | None) -> str:
    s = None if norm is None else rms_norm_scale(norm)
    w = None if norm is None else _weight(norm)
    if s is None or w is None:
        return "not an RMSNorm"
    return "1 + w" if torch.allclose(s, 1 + w.float(), atol=1e-3) and not torch.allclose(s, w.float(), atol=1e-3) \
        else "w"


def describe(model: nn.Module) -> Family:
    tc = getattr(model.config, "text_config", None) or model.config
    base = getattr(model, "model", None)
    rp = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        rope = ", ".join(sorted({str(v.get("rope_type", "default")) for v in rp.values()}))
    else:
        rope = str(rp.get("rope_type", "default")) if isinstance(rp, dict) else "default"
    return Family(norm_rule(getattr(base, "norm", None)), embedding_scale(model),
                  getattr(tc, "final_logit_softcapping", None), mlp_activation(tc), rope)
