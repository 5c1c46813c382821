"""Tiny randomly initialised targets built in code: for the tests, the consumers' reference suite and
the GPU check, which must run with no model files and no network.

Legend: V vocabulary, H hidden size.
"""

from __future__ import annotations

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")
# hybrid linear/full-attention families with (1 + w) norms; slower on CPU, so only where asked for
HYBRID_ARCHS = ("qwen3_next", "qwen3_5")


def tiny_causal_lm(arch: str, *, vocab: int = 160, layers: int = 6, hidden: int = 32, heads: int = 4,
                   kv_heads: int = 2, intermediate: int | None = None, seed: int = 0, max_positions: int = 512):
    """A randomly initialised transformers causal LM of the given family (fp32, eval mode). Norm
    weights are random too (not ones or zeros), so a missing, doubled or re-implemented norm shows."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions)
    hd = hidden // heads
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**common, head_dim=hd), tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    elif arch == "gemma2":
        cfg, cls = tf.Gemma2Config(**common, head_dim=hd, sliding_window=16, final_logit_softcapping=0.3,
                                   attn_logit_softcapping=20.0), tf.Gemma2ForCausalLM
    elif arch == "gemma3":
        cfg, cls = tf.Gemma3TextConfig(**common, head_dim=hd, sliding_window=16), tf.Gemma3ForCausalLM
    elif arch in HYBRID_ARCHS:
        linear = dict(head_dim=hd, linear_num_value_heads=kv_heads, linear_num_key_heads=kv_heads,
                      linear_key_head_dim=hd, linear_value_head_dim=hd)
        if arch == "qwen3_next":
            cfg = tf.Qwen3NextConfig(**common, **linear, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden)
            cls = tf.Qwen3NextForCausalLM
        else:
            cfg, cls = tf.Qwen3_5TextConfig(**common, **linear), tf.Qwen3_5ForCausalLM
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHS + HYBRID_ARCHS}")
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if _scales_by_w(name, arch) else 0.0))
    return model


def _scales_by_w(param_name: str, arch: str) -> bool:
    """Whether a norm weight multiplies directly (so random weights sit around 1) or as 1 + w (around 0)."""
    if arch.startswith("gemma"):
        return False
    if arch in HYBRID_ARCHS:  # their RMSNorms scale by 1 + w; the gated one inside linear attention by w
        return "linear_attn" in param_name
    return True
