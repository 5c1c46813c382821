"""Clauses 2, 4 and 5 in the drafter: feature width, fast vs reference attention, what a block can see."""

from __future__ import annotations

import warnings

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.model import BlockLayout, DFlashDrafter
from blockdraft.model.blocks import block_input_ids
from conftest import tiny_target

H = 32


def make_drafter(block_size=4, layers=2, sliding=True, causal=False, num_features=3, seed=0):
    torch.manual_seed(seed)
    kw = dict(target_hidden_size=H, target_num_layers=6, target_layer_ids=list(range(1, 1 + num_features)),
              vocab_size=100, mask_token_id=99, hidden_size=H, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=64, block_size=block_size)
    if sliding:
        kw.update(layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1), sliding_window=6,
                  sliding_causal_in_block=causal)
    d = DFlashDrafter(DrafterConfig(**kw))
    with torch.no_grad():  # non-trivial norms so the test sees them
        for name, p in d.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return d


def layout_and_inputs(d, T=40, anchors=(3, 9, 12, 25, 31, 33), doc_cut=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    doc = (torch.arange(T) >= doc_cut).long()
    pos = torch.where(doc == 0, torch.arange(T), torch.arange(T) - doc_cut)
    a = torch.tensor(anchors)
    feats = torch.randn(T, d.config.feature_size, generator=g) * 3
    embeds = torch.randn(len(a), d.block_size, H, generator=g)
    return BlockLayout(doc, pos, a, d.block_size, max_chunk_blocks=2), feats, embeds


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_equals_dense_forward_and_backward(causal):
    d = make_drafter(causal=causal)
    layout, feats, embeds = layout_and_inputs(d)
    outs, grads = {}, {}
    for backend in ("dense", "chunked"):
        d.zero_grad()
        e = embeds.clone().requires_grad_(True)
        out = d(feats, e, layout, backend)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs[backend] = out.detach()
        grads[backend] = [p.grad.clone() for p in d.parameters()] + [e.grad]
    torch.testing.assert_close(outs["chunked"], outs["dense"], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads["chunked"], grads["dense"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_flex_equals_dense_forward():
    d = make_drafter(causal=True)
    layout, feats, embeds = layout_and_inputs(d)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = d(feats, embeds, layout, "flex")
        dense = d(feats, embeds, layout, "dense")
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["dense", "chunked"])
def test_a_block_sees_only_its_documents_prefix_and_itself(backend):
    """Perturb everything a block must not see; its output must not move (and must move for what it sees)."""
    d = make_drafter(sliding=False)
    layout, feats, embeds = layout_and_inputs(d)
    base = d(feats, embeds, layout, backend).detach()
    for j, a in enumerate(layout.anchors.tolist()):
        doc = layout.document_ids
        hidden = (torch.arange(len(doc)) >= a) | (doc != doc[a])  # its own row, later rows, other documents
        f2 = feats.clone()
        f2[hidden] += torch.randn_like(f2[hidden]) * 5
        e2 = embeds.clone()
        others = [i for i in range(len(layout.anchors)) if i != j]
        e2[others] += 5
        out = d(f2, e2, layout, backend).detach()
        torch.testing.assert_close(out[j], base[j], rtol=1e-5, atol=1e-5)
        visible = (~hidden).nonzero().flatten()
        if len(visible):
            f3 = feats.clone()
            f3[visible[-1]] += 5
            assert not torch.allclose(d(f3, embeds, layout, backend)[j], base[j], atol=1e-4)


def test_padded_anchors_change_nothing():
    """Extra (padding) blocks never influence the real ones, whatever the backend."""
    d = make_drafter()
    layout, feats, embeds = layout_and_inputs(d)
    base = d(feats, embeds, layout, "chunked").detach()
    pad = torch.tensor([1, 2, 5, 8, 30, 39])
    a2 = torch.sort(torch.cat([layout.anchors, pad]))
    e2 = torch.cat([embeds, torch.randn(len(pad), d.block_size, H)])[a2.indices]
    l2 = BlockLayout(layout.document_ids, layout.position_ids, a2.values, d.block_size)
    real = torch.argsort(a2.indices)[: len(layout.anchors)]
    for backend in ("dense", "chunked"):
        out = d(feats, e2, l2, backend).detach()
        torch.testing.assert_close(out[real], base, rtol=1e-5, atol=1e-5)


def test_fc_width_is_f_times_ht_and_checked():
    d = make_drafter(num_features=3)
    assert d.fc.in_features == 3 * H
    layout, feats, embeds = layout_and_inputs(d)
    with pytest.raises(ValueError, match="expects 96 = 3 layers x 32"):
        d(feats[:, : 2 * H], embeds, layout)


def test_target_embedding_and_head_are_not_drafter_parameters():
    t = tiny_target("llama")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    names = [n for n, _ in d.named_parameters()]
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert d.config.target_layer_ids == t.layer_ids and d.config.vocab_size == t.vocab_size


def test_block_input_ids_are_anchor_then_mask():
    ids = torch.arange(10, 30)
    blocks = block_input_ids(ids, torch.tensor([0, 7]), 4, mask_token_id=99)
    assert blocks.tolist() == [[10, 99, 99, 99], [17, 99, 99, 99]]


def test_config_json_roundtrip(tmp_path):
    d = make_drafter(causal=True)
    path = tmp_path / "config.json"
    d.config.to_json(path)
    back = DrafterConfig.from_json(path)
    assert back == d.config
    assert back.sliding_causal_in_block is True and back.target_layer_ids == [1, 2, 3]


@pytest.mark.parametrize("change,match", [
    (dict(block_size=1), "block_size"),
    (dict(mask_token_id=100), "mask_token_id"),
    (dict(mask_token_id=-1), "mask_token_id"),
    (dict(target_layer_ids=[1, 5]), "out of range"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=None), "sliding_window"),
    (dict(hidden_size=64), "hidden_size"),
    (dict(num_key_value_heads=3), "multiple"),
])
def test_config_rejects_bad_values(change, match):
    kw = dict(target_hidden_size=H, target_num_layers=6, target_layer_ids=[1, 2], vocab_size=100, mask_token_id=99,
              hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        DrafterConfig(**kw)


def test_unknown_config_field_is_an_error():
    d = make_drafter()
    data = d.config.to_dict()
    data["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        DrafterConfig.from_dict(data)


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x [S, H, D] rotated at integer positions pos [S], the half-split convention."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = pos[:, None].float() * inv[None, :]  # [S, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def naive_block(d, feats, emb, layout, j):
    """One block through the drafter, written from the contract with explicit loops and matmuls."""
    c = d.config
    a = int(layout.anchors[j])
    doc, pos = layout.document_ids, layout.position_ids
    seen = [p for p in range(a) if doc[p] == doc[a]]  # clause 5, full-attention layers
    ctx = _rms(feats[seen] @ d.fc.weight.T, d.hidden_norm.weight, c.rms_norm_eps)  # clause 2
    ctx_pos = pos[seen]
    blk_pos = pos[a] + torch.arange(c.block_size)
    h = emb[j]
    for layer in d.layers:
        at = layer.self_attn
        x = _rms(h, layer.input_layernorm.weight, c.rms_norm_eps)
        q = _rms((x @ at.q_proj.weight.T).view(-1, at.hq, at.d), at.q_norm.weight, c.rms_norm_eps)
        kin = torch.cat([ctx, x])
        k = _rms((kin @ at.k_proj.weight.T).view(-1, at.hkv, at.d), at.k_norm.weight, c.rms_norm_eps)
        v = (kin @ at.v_proj.weight.T).view(-1, at.hkv, at.d)
        q = _rope(q, blk_pos, c.rope_theta)
        k = _rope(k, torch.cat([ctx_pos, blk_pos]), c.rope_theta)
        outs = []
        for hq in range(at.hq):
            hk = hq // (at.hq // at.hkv)
            w = torch.softmax(q[:, hq] @ k[:, hk].T / at.d ** 0.5, dim=-1)
            outs.append(w @ v[:, hk])
        h = h + torch.cat(outs, -1) @ at.o_proj.weight.T
        y = _rms(h, layer.post_attention_layernorm.weight, c.rms_norm_eps)
        m = layer.mlp
        h = h + (torch.nn.functional.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return _rms(h, d.norm.weight, c.rms_norm_eps)


@pytest.mark.parametrize("backend", ["dense", "chunked"])
def test_drafter_matches_a_naive_reference(backend):
    d = make_drafter(sliding=False)
    layout, feats, embeds = layout_and_inputs(d)
    with torch.no_grad():
        out = d(feats, embeds, layout, backend)
        for j in range(len(layout.anchors)):
            torch.testing.assert_close(out[j], naive_block(d, feats, embeds, layout, j), rtol=1e-4, atol=1e-4)




def test_a_drafter_to_be_loaded_draws_no_random_weights(monkeypatch):
    """Loading (checkpoints, the gathered FSDP drafter) builds with initialize=False: no random fill
    of weights that are all overwritten next (two fills of a 1B-parameter drafter on the host)."""
    cfg = make_drafter().config
    fills = []
    for name in ("normal_", "uniform_"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real, **k: fills.append(t.shape) or _real(t, *a, **k))
    DFlashDrafter(cfg, initialize=False)
    assert fills == []
    assert torch.nn.init.normal_.__name__ == "normal_"  # nn.init is itself again afterwards
    DFlashDrafter(cfg)
    assert fills  # the ordinary build still fills them


def test_build_drafter_makes_the_drafter_on_its_device(monkeypatch):
    """build_drafter creates the parameters on the training device (no fp32 host copy first)."""
    from blockdraft.model import drafter as drafter_mod
    from blockdraft.train.build import DrafterOptions, build_drafter

    seen = []
    real_init = drafter_mod.DFlashDrafter.__init__

    def spy(self, *a, **k):
        real_init(self, *a, **k)
        seen.append({p.device.type for p in self.parameters()})

    monkeypatch.setattr(drafter_mod.DFlashDrafter, "__init__", spy)
    target = tiny_target()
    rows = {"input_ids": torch.randint(0, 90, (2, 16)), "loss_mask": torch.ones(2, 16, dtype=torch.long)}
    opts = DrafterOptions(init_from_target=False, final_norm_init="0.1", draft_vocab=0)
    d = build_drafter(opts, target, rows, "meta")
    assert seen == [{"meta"}] and {p.device.type for p in d.parameters()} == {"meta"}
