"""Target-family quirks (blockdraft.family) and the initialisations that use them: where target
weights are copied into a drafter layer, the drafter's piece computes the target's function."""

from __future__ import annotations

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.family import describe, norm_rule, pre_mlp_norm, rms_norm_scale
from blockdraft.model import DFlashDrafter
from blockdraft.model.drafter import init_from_target_layers
from blockdraft.target import TargetModel
from blockdraft.tiny import ARCHS, HYBRID_ARCHS, tiny_causal_lm

ALL = ARCHS + HYBRID_ARCHS
ONE_PLUS_W = {"gemma2", "gemma3", "qwen3_next", "qwen3_5"}


def target_of(arch):
    return TargetModel(tiny_causal_lm(arch, layers=4), None, [0, 1], mask_token_id=159, name=arch)


@pytest.mark.parametrize("arch", ALL)
def test_the_norm_rule_is_measured_not_read_from_the_class_name(arch):
    m = tiny_causal_lm(arch, layers=4)
    norm = m.model.norm
    scale = rms_norm_scale(norm)
    x = torch.randn(3, norm.weight.shape[0]) * 2 + 0.5
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + (getattr(norm, "variance_epsilon", None)
                                                             or getattr(norm, "eps")))
    torch.testing.assert_close(norm(x), ref * scale, rtol=1e-5, atol=1e-5)  # the scale is the norm's function
    want = norm.weight + 1 if arch in ONE_PLUS_W else norm.weight
    torch.testing.assert_close(scale, want.float(), rtol=1e-5, atol=1e-5)
    assert norm_rule(norm) == ("1 + w" if arch in ONE_PLUS_W else "w")


def test_a_layer_norm_is_not_taken_for_an_rms_norm():
    ln = torch.nn.LayerNorm(16)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
    assert rms_norm_scale(ln) is None


@pytest.mark.parametrize("arch", ALL)
def test_copied_pieces_compute_the_target_layers_function(arch):
    t = target_of(arch)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=2, block_size=4))
    top = list(t._layers)[-2:]
    copied = init_from_target_layers(d, top, t.model.config.get_text_config())
    x = torch.randn(5, t.hidden_size)
    for i, (dl, tl) in enumerate(zip(d.layers, top)):
        mine = {n[len(f"layers.{i}."):] for n in copied if n.startswith(f"layers.{i}.")}
        assert {"input_layernorm.weight", "post_attention_layernorm.weight"} <= mine
        with torch.no_grad():
            torch.testing.assert_close(dl.input_layernorm(x), tl.input_layernorm(x), rtol=1e-5, atol=1e-5)
            # the drafter's pre-MLP norm is the target's pre-MLP norm (Gemma: pre_feedforward_layernorm)
            torch.testing.assert_close(dl.post_attention_layernorm(x), pre_mlp_norm(tl)(x), rtol=1e-5, atol=1e-5)
            if "mlp.down_proj.weight" in mine:
                torch.testing.assert_close(dl.mlp(x), tl.mlp(x), rtol=1e-5, atol=1e-5)
            if "self_attn.q_proj.weight" in mine:
                torch.testing.assert_close(dl.self_attn.q_proj(x), tl.self_attn.q_proj(x))
            if "self_attn.k_norm.weight" in mine:
                k = torch.randn(5, d.config.head_dim)
                torch.testing.assert_close(dl.self_attn.k_norm(k), tl.self_attn.k_norm(k), rtol=1e-5, atol=1e-5)
    gelu = arch.startswith("gemma")
    assert ("layers.1.mlp.down_proj.weight" in copied) is (not gelu and arch != "qwen3_next")  # gelu, MoE stay
    if arch in ("qwen3", "gemma3"):
        assert "layers.1.self_attn.k_norm.weight" in copied


def test_describe_names_the_quirks():
    g2 = describe(tiny_causal_lm("gemma2", layers=2))
    assert g2.norm_rule == "1 + w" and g2.logit_softcapping == 0.3 and g2.mlp_activation == "gelu_pytorch_tanh"
    assert g2.embedding_scale == pytest.approx(32 ** 0.5, rel=1e-3)  # Gemma scales embeddings by sqrt(H)
    ll = describe(tiny_causal_lm("llama", layers=2))
    assert ll.norm_rule == "w" and ll.embedding_scale == pytest.approx(1.0) and ll.logit_softcapping is None


@pytest.mark.parametrize("arch", ["gemma2", "qwen3_5"])
def test_final_norm_init_takes_the_effective_scale(arch):
    from blockdraft.train.build import init_final_norm_from_target

    t = target_of(arch)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    init_final_norm_from_target(d, t)
    x = torch.randn(4, t.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(d.norm(x), t.model.model.norm(x), rtol=1e-5, atol=1e-5)
