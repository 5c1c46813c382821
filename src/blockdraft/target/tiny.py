"""Tiny randomly initialised targets built in code: for the tests, the consumers' reference suite and
the GPU check, which must run with no model files and no network.

Legend: V vocabulary, H hidden size.
"""

from __future__ import annotations

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")
# hybrid linear/full-attention families with (1 + w) norms; slower on CPU, so only where asked for
HYBRID_ARCHS = ("qwen3_next", "qwen3_5")
# every other family people train drafters for: mixtures of experts, multipliers and logit scales,
# LayerNorm, MLA, attention sinks, chunked attention and NoPE layers
MORE_ARCHS = ("qwen3_moe", "mixtral", "phi3", "olmo2", "granite", "cohere", "glm4", "glm4_moe", "deepseek_v3",
              "gpt_oss", "minimax_m2", "llama4")
# hybrids whose recurrent layers are Mamba-2 mixers
MAMBA_ARCHS = ("nemotron_h", "falcon_h1")
# families with recurrent layers: a crop undoes their state only from what the cache recorded (generate/recurrent.py)
RECURRENT_ARCHS = HYBRID_ARCHS + MAMBA_ARCHS
ALL_ARCHS = ARCHS + HYBRID_ARCHS + MORE_ARCHS + MAMBA_ARCHS
# families transformers (5.25) ships only as a wrapper around a text decoder, saved and loaded by their
# image-text-to-text class (target/classes.py): GLM-5-Next, Mistral-Large-4 and Kimi-K2.5 (a DeepSeek-V3
# text model) as ForConditionalGeneration, and Mistral-4's causal LM, mapped only there. Each is present
# where this transformers has its class (wrapper_archs)
WRAPPER_ARCHS = ("mistral4", "kimi_k25", "mistral_large4", "glm5_next")
WRAPPER_CLASSES = {"mistral4": "Mistral4ForCausalLM", "kimi_k25": "Kimi_K25ForConditionalGeneration",
                   "mistral_large4": "MistralLarge4ForConditionalGeneration",
                   "glm5_next": "Glm5NextForConditionalGeneration"}
# causal LMs whose decoder layers output hc_mult residual streams (hyper-connections): DeepSeek-V4, with its
# sliding, compressed-sparse and heavily-compressed attention layers; present where transformers has it.
# GLM-5-Next (a wrapper above) has them too
STREAM_ARCHS = ("deepseek_v4",)
STREAM_CLASSES = {"deepseek_v4": "DeepseekV4ForCausalLM"}
# norms that scale by 1 + w (around 0 when random); the gated norm inside a DeltaNet scales by w
_ONE_PLUS_W = ("gemma2", "gemma3", "qwen3_next", "qwen3_5")


def tiny_config(arch: str, *, vocab: int = 160, layers: int = 6, hidden: int = 32, heads: int = 4,
                kv_heads: int = 2, intermediate: int | None = None, max_positions: int = 512,
                head_dim: int | None = None):
    """(transformers config, model class) of a tiny target of the given family. Each family keeps
    the quirk it is known for switched on and small enough to matter in a short test: a sliding
    window or attention chunk of 8-16 tokens, soft-capping, multipliers and logit scales far from 1."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions)
    shape = dict(vocab=vocab, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                 intermediate=intermediate, max_positions=max_positions, hd=head_dim or hidden // heads)
    builders = {**_dense_families(tf, common, shape), **_expert_families(tf, common, shape),
                **_hybrid_families(tf, common, shape), **_wrapper_families(tf, common, shape),
                **_stream_families(tf, common, shape)}
    if arch not in builders:
        known = ALL_ARCHS + WRAPPER_ARCHS + STREAM_ARCHS
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {known}")
    needs = {**WRAPPER_CLASSES, **STREAM_CLASSES}.get(arch)
    if needs and not hasattr(tf, needs):
        raise ValueError(f"transformers {tf.__version__} has no {needs} (tiny architecture {arch!r})")
    return builders[arch]()


def _dense_families(tf, common: dict, s: dict) -> dict:
    """Builders of the dense families' (config, class), by name."""
    hd = s["hd"]
    return {
        "llama": lambda: (tf.LlamaConfig(**common), tf.LlamaForCausalLM),
        "qwen2": lambda: (tf.Qwen2Config(**common), tf.Qwen2ForCausalLM),
        "qwen3": lambda: (tf.Qwen3Config(**common, head_dim=hd), tf.Qwen3ForCausalLM),
        "mistral": lambda: (tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM),
        "gemma2": lambda: (tf.Gemma2Config(**common, head_dim=hd, sliding_window=16, final_logit_softcapping=0.3,
                                           attn_logit_softcapping=20.0), tf.Gemma2ForCausalLM),
        "gemma3": lambda: (tf.Gemma3TextConfig(**common, head_dim=hd, sliding_window=16), tf.Gemma3ForCausalLM),
        # fused qkv_proj and gate_up_proj
        "phi3": lambda: (tf.Phi3Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2), tf.Phi3ForCausalLM),
        # norms after attention and MLP (none before), q/k norms over all heads
        "olmo2": lambda: (tf.Olmo2Config(**common, pad_token_id=0, eos_token_id=2), tf.Olmo2ForCausalLM),
        # muP multipliers; logits divided by logits_scaling
        "granite": lambda: (tf.GraniteConfig(**common, embedding_multiplier=3.0, residual_multiplier=0.5,
                                             attention_multiplier=0.2, logits_scaling=4.0), tf.GraniteForCausalLM),
        # LayerNorm (no bias), parallel attention + MLP, logits times logit_scale, tied head
        "cohere": lambda: (tf.CohereConfig(**common, logit_scale=0.25, pad_token_id=0, bos_token_id=1,
                                           eos_token_id=2), tf.CohereForCausalLM),
        # sandwich norms, fused gate_up_proj, partial rotary
        "glm4": lambda: (tf.Glm4Config(**common, head_dim=hd, pad_token_id=0, eos_token_id=2), tf.Glm4ForCausalLM),
    }


def _expert_families(tf, common: dict, s: dict) -> dict:
    """Builders of the mixture-of-experts families' (config, class), by name."""
    hd, hidden, heads = s["hd"], s["hidden"], s["heads"]
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=hidden)
    yarn = dict(rope_type="yarn", rope_theta=150000.0, factor=s["max_positions"] / 64,
                original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0, truncate=False)
    return {
        "qwen3_moe": lambda: (tf.Qwen3MoeConfig(**common, **moe, head_dim=hd, num_experts=4), tf.Qwen3MoeForCausalLM),
        "mixtral": lambda: (tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
                            tf.MixtralForCausalLM),
        "glm4_moe": lambda: (tf.Glm4MoeConfig(**common, **moe, head_dim=hd, n_routed_experts=4, n_shared_experts=1,
                                              first_k_dense_replace=1, use_qk_norm=True), tf.Glm4MoeForCausalLM),
        # multi-head latent attention, MoE after the first layer
        "deepseek_v3": lambda: (tf.DeepseekV3Config(**{**common, "num_key_value_heads": heads}, **moe, n_routed_experts=4,
                                                    n_shared_experts=1, n_group=1, topk_group=1,
                                                    first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                                                    qk_rope_head_dim=4, qk_nope_head_dim=hd, v_head_dim=hd,
                                                    head_dim=4), tf.DeepseekV3ForCausalLM),
        # attention sinks, sliding and full layers alternating, MoE
        "gpt_oss": lambda: (tf.GptOssConfig(**common, head_dim=hd, num_local_experts=4, num_experts_per_tok=2,
                                            sliding_window=8, rope_parameters=yarn), tf.GptOssForCausalLM),
        "minimax_m2": lambda: (tf.MiniMaxM2Config(**common, head_dim=hd, num_local_experts=4, num_experts_per_tok=2,
                                                  bos_token_id=1, eos_token_id=2), tf.MiniMaxM2ForCausalLM),
        # chunked attention on the rope layers, every 4th layer NoPE, MoE every other layer
        "llama4": lambda: (tf.Llama4TextConfig(**common, head_dim=hd, intermediate_size_mlp=2 * hidden,
                                               num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                               attention_chunk_size=8, no_rope_layer_interval=4),
                           tf.Llama4ForCausalLM),
    }


def _hybrid_families(tf, common: dict, s: dict) -> dict:
    """Builders of the families with recurrent (linear-attention, Mamba) layers, by name."""
    hd, hidden, kv = s["hd"], s["hidden"], s["kv_heads"]
    linear = dict(head_dim=hd, linear_num_value_heads=kv, linear_num_key_heads=kv, linear_key_head_dim=hd,
                  linear_value_head_dim=hd)
    pattern = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"]
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return {
        "qwen3_next": lambda: (tf.Qwen3NextConfig(**common, **linear, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=hidden,
                                                  shared_expert_intermediate_size=hidden), tf.Qwen3NextForCausalLM),
        "qwen3_5": lambda: (tf.Qwen3_5TextConfig(**common, **linear), tf.Qwen3_5ForCausalLM),
        # Mamba-2, attention and MLP layers, each its own block
        "nemotron_h": lambda: (tf.NemotronHConfig(
            vocab_size=s["vocab"], hidden_size=hidden, intermediate_size=s["intermediate"] or 2 * hidden,
            layers_block_type=[pattern[i % len(pattern)] for i in range(s["layers"])],
            num_attention_heads=s["heads"], num_key_value_heads=kv, head_dim=hd,
            max_position_embeddings=s["max_positions"], mamba_num_heads=4, mamba_head_dim=hd, ssm_state_size=8,
            n_groups=2, chunk_size=8, **ids), tf.NemotronHForCausalLM),
        # attention and Mamba-2 side by side in every layer, muP multipliers
        "falcon_h1": lambda: (tf.FalconH1Config(
            **common, head_dim=hd, mamba_d_ssm=2 * hidden, mamba_n_heads=4, mamba_d_head=2 * hidden // 4,
            mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8, mamba_rms_norm=True, embedding_multiplier=2.0,
            lm_head_multiplier=0.5, key_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.8,
            mlp_multipliers=[1.2, 0.9], ssm_multipliers=[0.8, 1.1, 0.9, 1.2, 1.0], ssm_in_multiplier=1.1,
            ssm_out_multiplier=0.9, **ids), tf.FalconH1ForCausalLM),
    }


def wrapper_archs() -> tuple[str, ...]:
    """The WRAPPER_ARCHS whose class this transformers has."""
    import transformers as tf

    return tuple(a for a in WRAPPER_ARCHS if hasattr(tf, WRAPPER_CLASSES[a]))


def _wrapper_families(tf, common: dict, s: dict) -> dict:
    """Builders of the wrapped text decoders' (config, class), by name: multi-head latent attention with
    experts after the first layer (all four), a DeepSeek sparse-attention indexer (Mistral-Large-4 and
    GLM-5-Next), soft-capped logits (Mistral-Large-4), linear-attention layers and hyper-connection
    residual streams (GLM-5-Next); one-layer vision towers."""
    hd, hidden, heads = s["hd"], s["hidden"], s["heads"]
    mla = dict(**{**common, "num_key_value_heads": heads}, moe_intermediate_size=hidden, n_routed_experts=4,
               num_experts_per_tok=2, kv_lora_rank=16, qk_nope_head_dim=hd, v_head_dim=hd)
    # the sparse-attention indexer keeps 64 positions, more than a test's sequence: in transformers 5.25 a
    # forward without a cache or attention mask selects other positions than one with either, once a
    # sequence outgrows index_topk (Mistral-Large-4: logits 0.37 apart at 10 tokens with 8 kept)
    dsa = dict(index_topk=64, index_head_dim=hd, index_n_heads=2)
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cls = {a: getattr(tf, c, None) for a, c in WRAPPER_CLASSES.items()}
    return {
        "mistral4": lambda: (tf.Mistral4Config(**mla, q_lora_rank=24, qk_rope_head_dim=4, first_k_dense_replace=1,
                                               **ids), cls["mistral4"]),
        "kimi_k25": lambda: (tf.Kimi_K25Config(
            text_config=dict(model_type="deepseek_v3", **mla, q_lora_rank=24, qk_rope_head_dim=4, n_shared_experts=1,
                             n_group=1, topk_group=1, first_k_dense_replace=1, **ids),
            vision_config=dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                               pos_emb_height=4, pos_emb_width=4), projection_hidden_size=16), cls["kimi_k25"]),
        "mistral_large4": lambda: (tf.MistralLarge4Config(
            text_config=dict(**mla, **dsa, qk_rope_head_dim=4, **ids),
            vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, head_dim=8, image_size=28, patch_size=14)),
            cls["mistral_large4"]),
        "glm5_next": lambda: (tf.Glm5NextConfig(
            text_config=dict(**mla, **dsa, index_kpool=4, q_lora_rank=24, qk_rope_head_dim=0, linear_head_dim=hd,
                             linear_num_heads=heads, hc_mult=2, hc_sinkhorn_iters=3, **ids),
            vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=hidden,
                               projection_intermediate_size=32)), cls["glm5_next"]),
    }


def stream_archs() -> tuple[str, ...]:
    """The STREAM_ARCHS whose class this transformers has."""
    import transformers as tf

    return tuple(a for a in STREAM_ARCHS if hasattr(tf, STREAM_CLASSES[a]))


def _stream_families(tf, common: dict, s: dict) -> dict:
    """Builders of the hyper-connection causal LMs' (config, class): DeepSeek-V4 with two streams, its three
    attention kinds in turn (a sliding window of 8; compressed sparse attention pooling 4 tokens, of which the
    indexer keeps 2 entries; heavily compressed attention pooling 8) and a hash-routed first MoE layer."""
    n = s["layers"]
    kinds = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
    cfg = {k: v for k, v in common.items() if k != "intermediate_size"}
    return {
        "deepseek_v4": lambda: (tf.DeepseekV4Config(
            **{**cfg, "num_key_value_heads": 1}, head_dim=16, q_lora_rank=24, o_groups=2, o_lora_rank=16,
            moe_intermediate_size=s["hidden"], n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            hc_mult=2, hc_sinkhorn_iters=3, sliding_window=8, index_n_heads=2, index_head_dim=8, index_topk=2,
            layer_types=[kinds[i % 3] for i in range(n)], mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1),
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            pad_token_id=0, bos_token_id=1, eos_token_id=2), getattr(tf, "DeepseekV4ForCausalLM", None)),
    }


def _mix_streams(name: str, p: torch.Tensor) -> bool:
    """Give a hyper-connection's weights (DeepSeek-V4's and GLM-5-Next's attn_hc / ffn_hc / hc_head) values
    that mix the streams unevenly: their own init (zero biases, fn of std 0.02) keeps every stream nearly the
    same, where taking one stream for their mean would not show. Whether `name` was one."""
    if not ("_hc." in name or "hc_head." in name):
        return False
    if name.endswith(("base", "hc_base")):
        p.copy_(torch.randn_like(p))
    elif name.endswith(("fn", "hc_fn")):
        p.copy_(torch.randn_like(p) * 0.1)
    return True


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
            if _mix_streams(name, p):
                continue
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if _scales_by_w(name, arch) else 0.0))
            elif arch in MAMBA_ARCHS and name.endswith("dt_bias"):
                # Mamba's own init writes ~1% of a token per step (dt 0.001-0.1) through small
                # projections (state norm ~1e-4): a state that kept rejected tokens would hardly
                # show. Steps near 1 and unit-scale inputs make every token count.
                p.copy_(torch.randn_like(p) * 0.3 + 0.5)
            elif arch in MAMBA_ARCHS and name.endswith("in_proj.weight"):
                p.mul_(20)
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
    if arch not in _ONE_PLUS_W:
        return True
    if arch in HYBRID_ARCHS:  # their RMSNorms scale by 1 + w; the gated one inside linear attention by w
        return "linear_attn" in param_name
    return False
