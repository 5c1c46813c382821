"""Flex-attention block masks from the chunk plan (docs/scale.md, rule 2): every tile that
holds a visible key is kept, every tile called full is full (both against the dense reference of
clause 5), nothing of Q x K elements is allocated to build them, and a layout builds each layer
kind's mask once."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blockdraft.model.attention import BlockLayout, LayerVisibility
from blockdraft.model.masks import TILE, anchor_block_mask, block_mask_tiles
from blockdraft.train.anchors import sample_anchors


def packed(T, n_docs, n_anchors, B, seed):
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(T, dtype=torch.long)
    for c in sorted(torch.randperm(T - 60, generator=g)[: n_docs - 1].add(30).tolist()):
        doc[c:] += 1
    loss = torch.ones(T, dtype=torch.long)
    loss[:5] = 0
    return doc, sample_anchors(doc, loss, B, n_anchors, g)


def reference_tiles(mask: torch.Tensor):
    """(any, all) per TILE x TILE tile of the dense mask; a short edge tile is never all."""
    Q, K = mask.shape
    pad = torch.zeros(-(-Q // TILE) * TILE, -(-K // TILE) * TILE, dtype=torch.int8)
    inside = torch.zeros_like(pad)
    pad[:Q, :K], inside[:Q, :K] = mask.to(torch.int8), 1
    t = pad.unflatten(0, (-1, TILE)).unflatten(2, (-1, TILE))  # [Qt, TILE, Kt, TILE]
    full_tile = inside.unflatten(0, (-1, TILE)).unflatten(2, (-1, TILE)).amin(dim=(1, 3)) == 1
    return t.amax(dim=(1, 3)) == 1, (t.amin(dim=(1, 3)) == 1) & full_tile


CASES = list(itertools.product([(3000, 2, 400), (1500, 4, 60)], [16, 10], [None, 40, 700], [False, True],
                               ["query", "anchor"]))


@pytest.mark.parametrize("shape,B,W,causal,rule", CASES)
def test_tiles_keep_every_visible_key_and_full_tiles_are_full(shape, B, W, causal, rule):
    T, n_docs, n_anchors = shape
    doc, a = packed(T, n_docs, n_anchors, B, seed=B + (W or 0))
    ref_any, ref_all = reference_tiles(anchor_block_mask(doc, a, B, W, causal, rule))
    partial, full = block_mask_tiles(a, doc, B, W, causal, rule)
    assert not (ref_any & ~(partial | full)).any(), "a tile with a visible key is skipped"
    assert not (full & ~ref_all).any(), "a tile called full hides a key"
    assert not (partial & full).any()
    # and tight: no empty tile computed (exact unless a block straddles two query tiles under the
    # query window, where the plan takes the union of the block's slots), every full context tile found
    if TILE % B == 0 or W is None or rule == "anchor":
        assert torch.equal(partial | full, ref_any)
    else:
        assert int((partial | full).sum()) <= 1.1 * int(ref_any.sum())
    assert int(full.sum()) == int(ref_all[:, : T // TILE].sum())


def test_block_mask_matches_the_dense_rule_element_by_element():
    """The BlockMask flex attention reads: its tiles, and inside partial tiles its mask_mod."""
    doc, a = packed(700, 3, 40, 16, seed=3)
    layout = BlockLayout(doc, torch.zeros_like(doc), a, 16)
    for vis in (LayerVisibility(None, False, "query"), LayerVisibility(48, True, "query"),
                LayerVisibility(48, False, "anchor")):
        bm = layout.block_mask(vis, "cpu")
        ref = anchor_block_mask(doc, a, 16, vis.window, vis.causal, vis.rule)
        Q, K = ref.shape
        tiles = bm.to_dense()[0, 0]  # [Qt, Kt] partial or full
        q, k = torch.arange(Q)[:, None], torch.arange(K)[None, :]
        inside = tiles[q // TILE, k // TILE]
        got = inside & bm.mask_mod(0, 0, q, k)
        assert torch.equal(got, ref)


class LargestTensor(TorchDispatchMode):
    """The most elements any tensor made under it holds."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_building_a_block_mask_allocates_nothing_of_q_by_k():
    """At 8 rows x 64 anchors x block 16 (Q = 8,192, K = 16,384 + Q) the mask is planned from tiles:
    no tensor near Q x K elements (torch's uncompiled create_block_mask makes several)."""
    T, B = 8 * 2048, 16
    doc = torch.arange(T) // 700
    loss = torch.ones(T, dtype=torch.long)
    a = sample_anchors(doc, loss, B, 512, torch.Generator().manual_seed(0))
    layout = BlockLayout(doc, doc, a, B)
    Q, K = a.numel() * B, T + a.numel() * B
    for vis in (LayerVisibility(None, False, "query"), LayerVisibility(2048, True, "query")):
        with LargestTensor() as seen:
            layout.block_mask(vis, "cpu")
        assert seen.largest < Q * K / 1000, (seen.largest, Q * K)


def test_a_layout_builds_each_layer_kinds_mask_once(monkeypatch):
    """Three layers of two kinds, run twice (a recompute, an evaluation): two masks built."""
    import blockdraft.model.attention as attention
    from blockdraft.config import DrafterConfig
    from blockdraft.model import DFlashDrafter

    calls = []
    real = attention.flex_block_mask
    monkeypatch.setattr(attention, "flex_block_mask", lambda *a, **k: calls.append(k) or real(*a, **k))
    d = DFlashDrafter(DrafterConfig(target_hidden_size=32, target_num_layers=6, target_layer_ids=[1, 3], vocab_size=100,
                                    mask_token_id=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, intermediate_size=64, block_size=4,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                    sliding_window=6))
    doc, a = packed(300, 2, 20, 4, seed=0)
    layout = BlockLayout(doc, torch.arange(300), a, 4)
    feats, embeds = torch.randn(300, 64), torch.randn(a.numel(), 4, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = d(feats, embeds, layout, "flex")
        d(feats, embeds, layout, "flex")
        dense = d(feats, embeds, layout, "dense")
    assert len(calls) == 2
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_flex_attention_gets_one_dtype_under_bf16_autocast(monkeypatch):
    """Under bf16 autocast q and k come out of fp32-weighted norms and RoPE while v is bf16; torch
    before 2.10 refuses such a call, so q, k and v must reach flex attention in one dtype."""
    import torch.nn.attention.flex_attention as fa

    from blockdraft.config import DrafterConfig
    from blockdraft.model import DFlashDrafter

    real, seen = fa.flex_attention, []

    def strict(q, k, v, *a, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        if not q.dtype == k.dtype == v.dtype:
            raise ValueError(f"Expected query, key, and value to have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(fa, "flex_attention", strict)
    d = DFlashDrafter(DrafterConfig(target_hidden_size=32, target_num_layers=6, target_layer_ids=[1, 3], vocab_size=100,
                                    mask_token_id=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, intermediate_size=64, block_size=4))
    doc, a = packed(200, 2, 12, 4, seed=1)
    layout = BlockLayout(doc, torch.arange(200), a, 4)
    with torch.no_grad(), warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("ignore")
        out = d(torch.randn(200, 64), torch.randn(a.numel(), 4, 32), layout, "flex")
    assert seen == [(torch.bfloat16,) * 3] and out.isfinite().all()
