"""Clauses 3, 4, 6 and 7 in training: labels, supervised slots, anchors, loss and metrics."""

from __future__ import annotations

import math

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.model.blocks import supervised_slots
from blockdraft.train import (Batch, accepted_lengths, compute_loss, dflash_loss, eligible_anchors, prepare,
                              sample_anchors, slot_weights, train_step)
from blockdraft.target.tiny import ALL_ARCHS
from conftest import V, tiny_target


def brute_supervised(doc, lm, anchors, B):
    out = []
    for a in anchors:
        row = []
        for k in range(B):
            p = a + k
            row.append(k >= 1 and p < len(doc) and doc[p] == doc[a] and lm[p] == 1)
        out.append(row)
    return torch.tensor(out)


def test_supervised_slots_match_brute_force():
    g = torch.Generator().manual_seed(0)
    doc = torch.tensor([0] * 13 + [1] * 9 + [2] * 10)
    lm = (torch.rand(32, generator=g) < 0.7).long()
    anchors = torch.arange(32)
    got = supervised_slots(doc, lm, anchors, 5)
    assert torch.equal(got, brute_supervised(doc.tolist(), lm.tolist(), anchors.tolist(), 5))
    assert not got[:, 0].any()  # slot 0 is never trained


def test_eligible_anchors_match_brute_force():
    g = torch.Generator().manual_seed(1)
    doc = torch.tensor([0] * 7 + [1] * 20 + [2] * 3)
    lm = (torch.rand(30, generator=g) < 0.5).long()
    sup = brute_supervised(doc.tolist(), lm.tolist(), list(range(30)), 4)
    ref = [bool(lm[p]) and bool(sup[p].any()) for p in range(30)]
    assert eligible_anchors(doc, lm, 4).tolist() == ref


def test_sample_anchors_sorted_unique_eligible_and_fair():
    doc = torch.tensor([0] * 400 + [1] * 12 + [2] * 400)
    lm = torch.ones(812, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(doc, lm, 4, 30, generator=g)
    assert len(a) == 30 and torch.equal(a, torch.sort(torch.unique(a)).values)
    assert eligible_anchors(doc, lm, 4)[a].all()
    per_doc = torch.bincount(doc[a], minlength=3).tolist()
    assert per_doc[1] == 10  # the short document gets its share: 11 eligible, 30 // 3 = 10 asked for
    assert abs(per_doc[0] - per_doc[2]) <= 1
    # all eligible positions when there are few
    few = sample_anchors(doc[:12], torch.tensor([0] * 6 + [1] * 6), 4, 100)
    assert few.tolist() == [6, 7, 8, 9, 10]  # loss_mask 1 at the anchor, and a token after it
    # deterministic for a seed
    b = sample_anchors(doc, lm, 4, 30, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)


def test_slot_weights_follow_the_paper_formula():
    w = slot_weights(16, 7.0)
    assert w[0] == 0
    for k in range(1, 16):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)


def test_accepted_lengths_match_brute_force():
    g = torch.Generator().manual_seed(0)
    match = torch.rand(200, 8, generator=g) < 0.8
    ref = []
    for row in match.tolist():
        n = 1
        for k in range(1, 8):
            if not row[k]:
                break
            n += 1
        ref.append(n)
    assert accepted_lengths(match).tolist() == ref


@pytest.mark.parametrize("kind", ["soft", "hard", "kl"])
def test_loss_matches_a_slot_by_slot_reference(kind):
    g = torch.Generator().manual_seed(0)
    sup = torch.rand(5, 4, generator=g) < 0.7
    sup[:, 0] = False
    sup[0, 1] = True
    S = int(sup.sum())
    dl, tl = torch.randn(S, 11, generator=g), torch.randn(S, 11, generator=g) * 2
    loss, m = dflash_loss(dl, tl, sup, gamma=3.0, kind=kind)
    num = den = 0.0
    i = 0
    for j in range(5):
        for k in range(4):
            if not sup[j, k]:
                continue
            w = math.exp(-(k - 1) / 3.0)
            q = torch.softmax(dl[i], -1)
            p = torch.softmax(tl[i], -1)
            if kind == "hard":
                ell = -math.log(q[tl[i].argmax()])
            elif kind == "soft":
                ell = -(p * q.log()).sum().item()
            else:
                ell = (p * (p.log() - q.log())).sum().item()
            num, den, i = num + w * ell, den + w, i + 1
    assert math.isclose(float(loss), num / den, rel_tol=1e-5)


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_labels_are_the_targets_own_logits_at_a_plus_k_minus_1(arch):
    t = tiny_target(arch)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    ids = torch.randint(0, V - 1, (2, 30))
    lm = torch.ones_like(ids)
    lm[:, :6] = 0
    doc = torch.tensor([[0] * 14 + [1] * 16, [0] * 30])
    batch = Batch(ids, lm, document_ids=doc)
    p = prepare(t, d, batch, max_anchors=9, generator=torch.Generator().manual_seed(0))
    # reference: each document alone through the model, logits at a + k - 1
    full, feat = {}, {}
    for r in range(2):
        for dd in doc[r].unique().tolist():
            cols = (doc[r] == dd).nonzero().flatten()
            out = t.model(ids[r:r + 1, cols], output_hidden_states=True)
            for c, col in enumerate(cols.tolist()):
                full[r * 30 + col] = out.logits[0, c]
                feat[r * 30 + col] = out.hidden_states[t.layer_ids[0] + 1][0, c]
    ref = []
    for j, a in enumerate(p.anchors.tolist()):
        for k in range(4):
            if p.supervised[j, k]:
                ref.append(full[a + k - 1])
    torch.testing.assert_close(p.target_logits.per_slot(), torch.stack(ref), rtol=1e-5, atol=1e-5)
    f = torch.stack([feat[i] for i in range(60)])
    torch.testing.assert_close(p.features[:, : t.hidden_size], f, rtol=1e-5, atol=1e-5)


def test_no_label_crosses_a_document_boundary():
    t = tiny_target("llama")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=6))
    doc = torch.tensor([[0] * 10 + [1] * 10])
    batch = Batch(torch.randint(0, V - 1, (1, 20)), torch.ones(1, 20, dtype=torch.long), document_ids=doc)
    p = prepare(t, d, batch, max_anchors=100)
    for j, a in enumerate(p.anchors.tolist()):
        for k in range(6):
            if p.supervised[j, k]:
                assert doc[0, a + k] == doc[0, a]
    assert 9 not in p.anchors.tolist() and 19 not in p.anchors.tolist()  # last token of a document: nothing to predict


def test_backends_give_the_same_loss():
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=2, block_size=4))
    batch = Batch(torch.randint(0, V - 1, (2, 40)), torch.ones(2, 40, dtype=torch.long))
    a = {}
    for backend in ("dense", "chunked"):
        a[backend], _ = compute_loss(t, d, batch, max_anchors=7, generator=torch.Generator().manual_seed(3),
                                     backend=backend)
    torch.testing.assert_close(a["dense"], a["chunked"], rtol=1e-5, atol=1e-6)


def test_bad_batches():
    t = tiny_target("llama")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=8))
    with pytest.raises(ValueError, match="shorter than a block"):
        compute_loss(t, d, Batch(torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)))
    with pytest.raises(ValueError, match="loss mask is empty"):
        compute_loss(t, d, Batch(torch.zeros(1, 20, dtype=torch.long), torch.zeros(1, 20, dtype=torch.long)))
    lonely = torch.zeros(1, 20, dtype=torch.long)
    lonely[0, 19] = 1  # one loss token, nothing after it to predict
    with pytest.raises(ValueError, match="anchor"):
        compute_loss(t, d, Batch(torch.zeros(1, 20, dtype=torch.long), lonely))
    with pytest.raises(ValueError, match="shape"):
        Batch(torch.zeros(1, 20, dtype=torch.long), torch.zeros(1, 19, dtype=torch.long))


def test_overfitting_one_batch_drives_the_loss_down():
    t = tiny_target("llama", seed=1)
    with torch.no_grad():  # a confident target, so there is something to learn
        t.model.get_output_embeddings().weight.mul_(40)
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    batch = Batch(torch.randint(0, V - 1, (1, 48)), torch.ones(1, 48, dtype=torch.long))
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    first = train_step(t, d, opt, batch, max_anchors=64, loss="kl")
    for _ in range(80):
        last = train_step(t, d, opt, batch, max_anchors=64, loss="kl")
    assert last["loss"] < 0.3 * first["loss"]
    assert last["tau"] > first["tau"] + 0.5


def brute_dpace(q, sup, alpha):
    """D-PACE by its definition, one slot at a time: slot k weighs the sum over supervised j >= k
    of the product over slots i <= j of (1 - alpha) q_i + alpha (1 where i is not supervised)."""
    N, B = sup.shape
    w = torch.zeros(N, B)
    for n in range(N):
        for k in range(B):
            if not sup[n, k]:
                continue
            for j in range(k, B):
                if sup[n, j]:
                    w[n, k] += math.prod(((1 - alpha) * float(q[n, i]) + alpha) if sup[n, i] else 1.0
                                         for i in range(j + 1))
    return w


def test_dpace_weights_match_their_definition():
    from blockdraft.train.loss import dpace_weights

    g = torch.Generator().manual_seed(1)
    sup = torch.rand(7, 6, generator=g) < 0.75
    sup[:, 0] = False
    sup[0] = torch.tensor([False, True, True, False, True, True])  # a hole in the middle
    q = torch.rand(7, 6, generator=g)
    for alpha in (0.5, 0.2, 1.0):
        torch.testing.assert_close(dpace_weights(q, sup, alpha), brute_dpace(q, sup, alpha))
    assert torch.equal(dpace_weights(torch.ones(1, 4), torch.tensor([[False, True, True, True]]), 0.5),
                       torch.tensor([[0.0, 3.0, 2.0, 1.0]]))  # a perfect drafter: the accepted length to go
    with pytest.raises(ValueError, match="alpha"):
        dpace_weights(q, sup, 0.0)


@pytest.mark.parametrize("kind", ["hard", "kl"])
@pytest.mark.parametrize("vocab", [None, torch.arange(0, 40, 3)])
def test_dpace_loss_weighs_slots_by_the_drafts_own_confidence(kind, vocab):
    """The D-PACE loss from per-slot losses and the draft's probability of the target's argmax
    (0 where the draft vocabulary lacks it), computed here by hand; no gradient through the weights."""
    from blockdraft.train.loss import DPace

    g = torch.Generator().manual_seed(2)
    sup = torch.rand(6, 5, generator=g) < 0.8
    sup[:, 0] = False
    S = int(sup.sum())
    Vd = 40 if vocab is None else len(vocab)
    dl = (torch.randn(S, Vd, generator=g) * 2).requires_grad_(True)
    tl = torch.randn(S, 40, generator=g) * 3
    loss, _ = dflash_loss(dl, tl, sup, gamma=DPace(0.3), kind=kind, draft_vocab=vocab)
    top = tl.argmax(-1)
    probs = dl.detach().softmax(-1)
    q = torch.zeros(6, 5)
    per, keep = [], []
    for s in range(S):
        ids = list(range(40)) if vocab is None else vocab.tolist()
        qs = float(probs[s, ids.index(int(top[s]))]) if int(top[s]) in ids else 0.0
        q[sup.nonzero()[s][0], sup.nonzero()[s][1]] = qs
        t = tl[s] if vocab is None else tl[s, vocab]
        logq = dl[s].log_softmax(-1)
        if kind == "hard":
            per.append(-logq[ids.index(int(top[s]))] if int(top[s]) in ids else logq.sum() * 0)
            keep.append(1.0 if int(top[s]) in ids else 0.0)
        else:
            p = t.log_softmax(-1)
            per.append((p.exp() * (p - logq)).sum())
            keep.append(1.0)
    w = brute_dpace(q, sup, 0.3)[sup] * torch.tensor(keep)
    ref = (w * torch.stack(per)).sum() / w.sum()
    torch.testing.assert_close(loss, ref)
    (g1,) = torch.autograd.grad(loss, dl)
    (g2,) = torch.autograd.grad(ref, dl)
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("kind", ["soft", "hard", "kl"])
@pytest.mark.parametrize("vocab", [None, torch.arange(0, 40, 3)])
@pytest.mark.parametrize("weighting", ["gamma", "dpace"])
def test_chunked_loss_equals_the_plain_loss_and_gradient(kind, vocab, weighting):
    from blockdraft.train.loss import DPace, dflash_loss_chunked

    g = torch.Generator().manual_seed(0)
    sup = torch.rand(6, 5, generator=g) < 0.8
    sup[:, 0] = False
    S = int(sup.sum())
    W = torch.randn(40 if vocab is None else len(vocab), 8, generator=g)
    tl = torch.randn(S, 40, generator=g) * 3
    h1 = torch.randn(S, 8, generator=g, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_(True)
    gamma = 2.0 if weighting == "gamma" else DPace(0.5)
    l1, m1 = dflash_loss(h1 @ W.T, tl, sup, gamma=gamma, kind=kind, draft_vocab=vocab)
    l2, m2 = dflash_loss_chunked(h2, lambda h: h @ W.T, tl, sup, gamma=gamma, kind=kind, draft_vocab=vocab, chunk=4)
    l1.backward()
    l2.backward()
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-7)
    assert m1["accepted_lengths"] == m2["accepted_lengths"] and m1["slot_accuracy"] == m2["slot_accuracy"]
