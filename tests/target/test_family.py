"""Target-family quirks (blockdraft.target.family) and the initialisations that use them: where target
weights are copied into a drafter layer, the drafter's piece computes the target's function."""

from __future__ import annotations

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.target.family import describe, final_norm, norm_rule, pre_mlp_norm, rms_norm_scale
from blockdraft.model import DFlashDrafter
from blockdraft.train.build import init_from_target_layers
from blockdraft.target import TargetModel
from blockdraft.target.tiny import ALL_ARCHS, tiny_causal_lm

ALL = ALL_ARCHS
ONE_PLUS_W = {"gemma2", "gemma3", "qwen3_next", "qwen3_5"}
LAYER_NORM = {"cohere"}  # mean-subtracting: no RMS scale to copy
# what init_from_target_layers must copy from the top two layers of a 4-layer tiny target: every
# piece that computes the drafter piece's function, so a family that silently stops copying shows
N, P, QK, A, M = "input_layernorm", "post_attention_layernorm", "self_attn.k_norm", "self_attn.q_proj", "mlp.down_proj"
COPIED = {"llama": {N, P, A, M}, "qwen2": {N, P, A, M}, "qwen3": {N, P, QK, A, M}, "mistral": {N, P, A, M},
          "gemma2": {N, P, A}, "gemma3": {N, P, QK, A},  # gelu MLPs stay
          "qwen3_next": {N, P, QK}, "qwen3_5": {N, P, QK, M},  # gated attention (q_proj is twice as wide)
          "qwen3_moe": {N, P, QK, A}, "mixtral": {N, P, A}, "phi3": {N, P, M},  # fused qkv_proj stays, gate_up splits
          "olmo2": {A, M},  # no norm before attention or MLP; its q/k norms span all heads
          "granite": {N, P, A, M}, "cohere": {A, M}, "glm4": {N, P, A, M}, "glm4_moe": {N, P, QK, A},
          "deepseek_v3": {N, P},  # MLA latent projections and experts stay
          "gpt_oss": {N, P, A}, "minimax_m2": {N, P, A}, "llama4": {N, P, A},
          "nemotron_h": set(),  # a block is one mixer (Mamba, attention or a relu2 MLP) behind one norm
          "falcon_h1": {N, P, A}}


def target_of(arch):
    return TargetModel(tiny_causal_lm(arch, layers=4), None, [0, 1], mask_token_id=159, name=arch)


@pytest.mark.parametrize("arch", ALL)
def test_the_norm_rule_is_measured_not_read_from_the_class_name(arch):
    m = tiny_causal_lm(arch, layers=4)
    norm = final_norm(m)
    scale = rms_norm_scale(norm)
    x = torch.randn(3, norm.weight.shape[0]) * 2 + 0.5
    if arch in LAYER_NORM:
        assert scale is None and norm_rule(norm) == "not an RMSNorm"
        return
    eps = next(v for v in (getattr(norm, n, None) for n in ("variance_epsilon", "eps", "epsilon")) if v is not None)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(norm(x), ref * scale, rtol=1e-5, atol=1e-5)  # the scale is the norm's function
    want = norm.weight + 1 if arch in ONE_PLUS_W else norm.weight
    torch.testing.assert_close(scale, want.float(), rtol=1e-5, atol=1e-5)
    assert norm_rule(norm) == ("1 + w" if arch in ONE_PLUS_W else "w")
    # the random gains are far from the identity, so a missing or doubled norm shows
    assert (scale - 1).abs().mean() > 0.1


@pytest.mark.parametrize("arch", ALL)
def test_the_pre_mlp_norm_is_what_the_mlp_reads(arch):
    """Measured in the target's own forward: the output of the norm pre_mlp_norm names is the input of
    the layer's MLP (Gemma's post_attention_layernorm normalises the attention output instead, OLMo-2
    has no norm before its MLP)."""
    m = tiny_causal_lm(arch, layers=4)
    layers = [layer for layer in m.model.layers if hasattr(layer, "mlp") or hasattr(layer, "feed_forward")]
    if arch == "nemotron_h":
        assert all(pre_mlp_norm(layer) is None for layer in m.model.layers)
        return
    seen = {}
    hooks = []
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "feed_forward", None) or layer.mlp
        hooks.append(mlp.register_forward_pre_hook(lambda mod, a, i=i: seen.__setitem__(("in", i), a[0])))
        if pre_mlp_norm(layer) is not None:
            hooks.append(pre_mlp_norm(layer).register_forward_hook(
                lambda mod, a, out, i=i: seen.__setitem__(("norm", i), out)))
    with torch.no_grad():
        m(torch.randint(0, 150, (1, 12)))
    for h in hooks:
        h.remove()
    for i, layer in enumerate(layers):
        if arch in ("olmo2", "cohere"):  # post-norm layers; a parallel block reads the input norm
            assert pre_mlp_norm(layer) is None
        else:
            torch.testing.assert_close(seen[("norm", i)].reshape(seen[("in", i)].shape), seen[("in", i)],
                                       rtol=0, atol=0)


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
    pieces = set()
    for i, (dl, tl) in enumerate(zip(d.layers, top)):
        mine = {n[len(f"layers.{i}."):].rsplit(".", 1)[0] for n in copied if n.startswith(f"layers.{i}.")}
        pieces |= mine
        with torch.no_grad():
            if N in mine:
                torch.testing.assert_close(dl.input_layernorm(x), tl.input_layernorm(x), rtol=1e-5, atol=1e-5)
            if P in mine:  # the drafter's pre-MLP norm is the target's (Gemma: pre_feedforward_layernorm)
                torch.testing.assert_close(dl.post_attention_layernorm(x), pre_mlp_norm(tl)(x), rtol=1e-5, atol=1e-5)
            if M in mine:  # also where the target fuses gate and up (Phi-3, GLM-4)
                torch.testing.assert_close(dl.mlp(x), tl.mlp(x), rtol=1e-5, atol=1e-5)
            if A in mine:
                for p in "qkvo":
                    src, dst = getattr(tl.self_attn, f"{p}_proj"), getattr(dl.self_attn, f"{p}_proj")
                    y = torch.randn(5, dst.in_features)
                    torch.testing.assert_close(dst(y), src(y))
            if QK in mine:
                k = torch.randn(5, d.config.head_dim)
                torch.testing.assert_close(dl.self_attn.k_norm(k), tl.self_attn.k_norm(k), rtol=1e-5, atol=1e-5)
    assert {p for p in pieces if p in (N, P, QK, A, M)} == COPIED[arch]


def test_an_attention_with_a_bias_the_drafter_lacks_is_not_copied():
    """gpt-oss and Qwen2 project with biases; the drafter's Qwen3 attention has none, so copying the
    weights alone would compute another function."""
    t = target_of("qwen2")
    top = list(t._layers)[-1:]
    with torch.no_grad():
        top[0].self_attn.k_proj.bias.normal_()
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    copied = init_from_target_layers(d, top, t.model.config)
    assert not any("self_attn" in n and "proj" in n for n in copied) and "layers.0.mlp.down_proj.weight" in copied


def test_describe_names_the_quirks():
    g2 = describe(tiny_causal_lm("gemma2", layers=2))
    assert g2.norm_rule == "1 + w" and g2.logit_softcapping == 0.3 and g2.mlp_activation == "gelu_pytorch_tanh"
    assert g2.embedding_scale == pytest.approx(32 ** 0.5, rel=1e-3)  # Gemma scales embeddings by sqrt(H)
    ll = describe(tiny_causal_lm("llama", layers=2))
    assert ll.norm_rule == "w" and ll.embedding_scale == pytest.approx(1.0) and ll.logit_softcapping is None


@pytest.mark.parametrize("arch", ["gemma2", "qwen3_5", "nemotron_h", "falcon_h1", "granite"])
def test_final_norm_init_takes_the_effective_scale(arch):
    from blockdraft.train.build import init_final_norm_from_target

    t = target_of(arch)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    init_final_norm_from_target(d, t)
    x = torch.randn(4, t.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(d.norm(x), final_norm(t.model)(x), rtol=1e-5, atol=1e-5)
