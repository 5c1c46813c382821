"""Tiny randomly initialised targets built in code: for the tests, the consumers' reference suite and
the GPU check, which must run with no model files and no network.

Legend: V vocabulary, H hidden size.
"""

from __future__ import annotations

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")
# hybrid linear/full-attention families with (1 + w) norms; slower on CPU, so only where asked for
HYBRID_ARCHS = ("qwen3_next", "qwen3_5")


def tiny_config(arch: str, *, vocab: int = 160, layers: int = 6, hidden: int = 32, heads: int = 4,
                kv_heads: int = 2, intermediate: int | None = None, max_positions: int = 512,
                head_dim: int | None = None):
    """(transformers config, model class) of a tiny target of the given family."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions)
    hd = head_dim or hidden // heads
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
    return cfg, cls


def tiny_causal_lm(arch: str, *, seed: int = 0, device=None, dtype: torch.dtype | None = None, **shape):
    """A randomly initialised transformers causal LM of the given family and `shape` (tiny_config's
    keywords; eval mode; fp32 on the CPU unless `device`/`dtype` say otherwise: it is built there,
    nothing staged on the host). Norm weights are random too (not ones or zeros), so a missing,
    doubled or re-implemented norm shows."""
    cfg, cls = tiny_config(arch, **shape)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype or torch.float32)
        try:
            model = cls(cfg).eval()
        finally:
            torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if _scales_by_w(name, arch) else 0.0))
    return model


# Random targets of real shapes, built in code on their device (`--target random:NAME`): the GPU
# check trains on a Qwen3-8B-shaped target with no download. They take SmolLM2's tokenizer (its
# 49,152 ids fit every vocabulary here), so the bundled data tokenizes as for SmolLM2.
RANDOM_PRESETS = {
    "qwen3-8b": dict(arch="qwen3", vocab=151936, layers=36, hidden=4096, heads=32, kv_heads=8, intermediate=12288,
                     head_dim=128, max_positions=40960),
    "qwen3-0.6b": dict(arch="qwen3", vocab=151936, layers=28, hidden=1024, heads=16, kv_heads=8, intermediate=3072,
                       head_dim=128, max_positions=40960),
    "tiny": dict(arch="qwen3", vocab=49280, layers=8, hidden=64, heads=4, kv_heads=2, intermediate=128,
                 max_positions=4096),
}
RANDOM_PREFIX = "random:"


def own_rng(device=None):
    """A context whose random draws leave the global generators (CPU, and `device`'s if CUDA) as they were."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    cuda = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    return torch.random.fork_rng(devices=cuda)


def random_preset(spec: str) -> dict:
    """The shape of `random:NAME`, or a ValueError naming the presets."""
    name = str(spec)[len(RANDOM_PREFIX):]
    if name not in RANDOM_PRESETS:
        raise ValueError(f"unknown random target {spec!r}; use one of "
                         + ", ".join(RANDOM_PREFIX + k for k in RANDOM_PRESETS))
    return dict(RANDOM_PRESETS[name])


def random_config(spec: str):
    """The transformers config of `random:NAME` (what the memory plan and MFU are computed from)."""
    kw = random_preset(spec)
    return tiny_config(kw.pop("arch"), **kw)[0]


def random_target_model(spec: str, *, device=None, dtype: torch.dtype | None = None, seed: int = 0):
    """The model of `random:NAME`: the same weights for the same seed and device kind, so every rank
    of a run (and a later run training from its features) builds one target. Its head is scaled
    up so that greedy decoding has clear winners (no near-ties for bf16 to flip)."""
    kw = random_preset(spec)
    arch = kw.pop("arch")
    with own_rng(device):  # the caller's random state is untouched, so rank 0 building it and a rank
        model = tiny_causal_lm(arch, seed=seed, device=device, dtype=dtype, **kw)  # on meta stay in step
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    model.config._name_or_path = str(spec)
    return model


def _scales_by_w(param_name: str, arch: str) -> bool:
    """Whether a norm weight multiplies directly (so random weights sit around 1) or as 1 + w (around 0)."""
    if arch.startswith("gemma"):
        return False
    if arch in HYBRID_ARCHS:  # their RMSNorms scale by 1 + w; the gated one inside linear attention by w
        return "linear_attn" in param_name
    return True
