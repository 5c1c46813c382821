"""Clause 5: the dense reference against a per-element brute force, and the fast paths against the reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from blockdraft.model.masks import (anchor_block_mask, cached_block_mask, chunked_mask_as_dense, document_starts,
                                    flex_mask_mod, plan_chunks)

RULES = ("anchor", "query")


def brute_force(doc, anchors, B, W=None, causal=False, rule="anchor"):
    """Clause 5 read literally, one (query, key) pair at a time. Key p of the flat sequence sits at
    position p, block slot ii of block j at a_j + ii; the "query" rule (dflash's) windows every key
    by its distance to the query's own position, both sides when the block is bidirectional."""
    T, N = len(doc), len(anchors)
    m = torch.zeros(N * B, T + N * B, dtype=torch.bool)
    for q, k in itertools.product(range(N * B), range(T + N * B)):
        j, i = divmod(q, B)
        a = anchors[j]
        qpos = a + i
        if k < T:
            ok = doc[k] == doc[a] and k < a
            kpos = k
            if W is not None and rule == "anchor":
                ok = ok and k >= a - W
        else:
            jj, ii = divmod(k - T, B)
            ok = jj == j and (not causal or ii <= i)
            kpos = a + ii
        if W is not None and rule == "query":
            ok = ok and qpos - kpos < W and (causal or kpos - qpos < W)
        m[q, k] = ok
    return m


def random_layout(seed, T=48, n_docs=3, n_anchors=7):
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(T - 1, generator=g)[: n_docs - 1].add(1).tolist())
    doc = torch.zeros(T, dtype=torch.long)
    for c in cuts:
        doc[c:] += 1
    anchors = torch.sort(torch.randperm(T, generator=g)[:n_anchors]).values
    return doc, anchors


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("W,causal", [(None, False), (5, False), (5, True), (None, True), (2, False), (2, True)])
def test_reference_equals_brute_force(W, causal, rule):
    doc, anchors = random_layout(0, T=30, n_anchors=5)
    ref = anchor_block_mask(doc, anchors, 4, sliding_window=W, causal_in_block=causal, window_rule=rule)
    assert torch.equal(ref, brute_force(doc.tolist(), anchors.tolist(), 4, W, causal, rule))


def test_the_two_window_rules_differ_exactly_past_w_minus_b_plus_1():
    """One document, every anchor: the rules agree while a <= W - B (both windows reach position 0)
    and differ from a = W - B + 1 on (slot B-1's query window starts after 0 first)."""
    T, B, W = 40, 4, 10
    doc, anchors = torch.zeros(T, dtype=torch.long), torch.arange(T - B)
    a_mask = anchor_block_mask(doc, anchors, B, W, True, "anchor")
    q_mask = anchor_block_mask(doc, anchors, B, W, True, "query")
    differs = [bool((a_mask[j * B:(j + 1) * B] != q_mask[j * B:(j + 1) * B]).any()) for j in range(len(anchors))]
    assert differs == [a >= W - B + 1 for a in anchors.tolist()]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("W,causal", [(None, False), (7, False), (7, True), (3, False)])
@pytest.mark.parametrize("max_blocks", [1, 3, 64])
def test_chunked_path_equals_reference(seed, W, causal, max_blocks, rule):
    doc, anchors = random_layout(seed, T=64, n_docs=4, n_anchors=11)
    ref = anchor_block_mask(doc, anchors, 5, sliding_window=W, causal_in_block=causal, window_rule=rule)
    fast = chunked_mask_as_dense(doc, anchors, 5, max_blocks=max_blocks, sliding_window=W, causal_in_block=causal,
                                 window_rule=rule)
    assert torch.equal(fast, ref)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("W,causal", [(None, False), (6, True), (6, False)])
def test_flex_mask_mod_equals_reference(W, causal, rule):
    doc, anchors = random_layout(3, T=40, n_docs=3, n_anchors=6)
    B = 4
    mod = flex_mask_mod(anchors, doc, B, W, causal, rule)
    q = torch.arange(len(anchors) * B)[:, None]
    k = torch.arange(40 + len(anchors) * B)[None, :]
    dense = mod(torch.tensor(0), torch.tensor(0), q, k)
    assert torch.equal(dense, anchor_block_mask(doc, anchors, B, W, causal, rule))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("W,causal", [(None, False), (None, True), (6, True), (6, False), (2, False)])
@pytest.mark.parametrize("a", [1, 3, 9, 20])
def test_cached_drafting_mask_equals_reference(a, W, causal, rule):
    """Drafting one block at anchor a over cached rows 0..a-1 is the reference's row of that block."""
    B, T = 5, a + 1
    ref = anchor_block_mask(torch.zeros(T, dtype=torch.long), torch.tensor([a]), B, W, causal, rule)
    ref = torch.cat([ref[:, :a], ref[:, T:]], dim=1)  # drop the anchor's own row: never visible, never cached
    got = cached_block_mask(torch.arange(a), a, B, sliding_window=W, causal_in_block=causal, window_rule=rule)
    assert torch.equal(torch.ones_like(ref) if got is None else got, ref)


def test_the_rule_itself():
    doc = torch.tensor([0] * 10 + [1] * 10)
    anchors = torch.tensor([4, 12, 15])
    B = 3
    m = anchor_block_mask(doc, anchors, B)
    T = 20
    for j, a in enumerate(anchors.tolist()):
        rows = m[j * B:(j + 1) * B]
        # never the anchor's own context row (its hidden state is not known at inference), never later ones
        assert not rows[:, a:T].any()
        # never another document
        assert not rows[:, :T][:, doc != doc[a]].any()
        # the whole own block, no other block
        assert rows[:, T + j * B:T + (j + 1) * B].all()
        assert rows[:, T:].sum() == B * B
    assert m[B:2 * B, 10:12].all() and not m[B:2 * B, :10].any()  # block 1 sees its doc's prefix only


def test_document_starts():
    doc = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    assert document_starts(doc).tolist() == [0, 0, 2, 2, 2, 5, 6, 6]


def test_chunks_never_span_documents_and_read_only_the_prefix():
    doc = torch.tensor([0] * 50 + [1] * 50)
    anchors = torch.tensor([5, 10, 20, 30, 55, 60, 90])
    chunks = plan_chunks(anchors, doc, max_blocks=2)
    for c in chunks:
        docs = doc[anchors[c.j0:c.j1]]
        assert (docs == docs[0]).all()
        assert c.hi == int(anchors[c.j1 - 1]) and c.lo == (0 if docs[0] == 0 else 50)
    assert sum(c.j1 - c.j0 for c in chunks) == len(anchors)


def test_anchor_outside_sequence_is_an_error():
    with pytest.raises(ValueError, match="outside"):
        anchor_block_mask(torch.zeros(5, dtype=torch.long), torch.tensor([7]), 2)
