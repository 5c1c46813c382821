"""The training step's loss, made chunk by chunk on both sides (the drafter's logits and the target's
label logits, from its final states) with each chunk's gradient taken as its value is
(train.loss.fused_chunks), against a brute force written here: the target's own logits at every label
position from its forward, every supervised slot's draft logits at once, per-slot losses from
log-softmax by hand (KL through torch's kl_div), the slot weights by their definition (fixed gamma, or
D-PACE's sums of products over each block, in loops) and autograd for every weight's gradient. For
each kind, loss, weighting and vocabulary; from the target itself and from stored outputs whose argmax
is known (where a hard loss runs no label head). And no tensor of the step holds more than a chunk's
rows of the vocabulary; D-PACE runs each chunk's heads once."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from blockdraft.config import FULL_VOCAB_ONLY, DrafterConfig
from blockdraft.data.features import FeatureMemo
from blockdraft.model import DFlashDrafter
from blockdraft.model.blocks import label_positions
from blockdraft.train.loss import DPace
from blockdraft.train.step import Batch, compute_loss, prepare
from conftest import tiny_rows, tiny_target

KIND_KW = {"dflash": {}, "dspark": dict(markov_rank=8, confidence_head=True),
           "dflash2": dict(selector_rank=8, selector_top_k=4, conv_group_size=8),
           "domino": dict(emb_dim=8, gru_hidden_dim=6)}


def sharp_target():
    """A tiny target whose distributions are far from uniform (its head's weights x 10), so the soft
    losses and their gradients are far from 0."""
    t = tiny_target("llama")
    with torch.no_grad():
        t.model.get_output_embeddings().weight.mul_(10)
    return t


def drafter(t, kind, vocab):
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=2, block_size=4, kind=kind,
                                               draft_vocab_size=40 if vocab else None, **KIND_KW[kind]))
    with torch.no_grad():  # every weight away from its start (the kinds' own heads start at zero)
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    if vocab:
        d.set_draft_vocab(torch.randperm(t.vocab_size - 1, generator=torch.Generator().manual_seed(3))[:40])
    return d


def brute_force(t, d, b, anchors, loss, gamma):
    """`gamma` a number (fixed slot weights) or DPace (its alpha)."""
    p = prepare(t, d, b, anchors=anchors)
    h = d(p.features, p.block_embeds, p.layout)[p.supervised]
    rows = d.vocab_rows
    terms = d.kind.slot_terms(d, lambda x: t.head(x, rows), rows, t.embed)
    draft = terms.logits(h, p.prev)  # [S, Vd]: all at once
    Bz, T = b.input_ids.shape
    with torch.no_grad():  # the target's own logits at every position, its own forward
        every = t(b.input_ids, position_ids=b.position_ids).logits.reshape(Bz * T, -1)
    full = every[label_positions(p.anchors, d.block_size)[p.supervised]]  # [S, V]
    top = full.argmax(-1)
    lab = full if rows is None else full[:, rows]
    logq = draft.float() - draft.float().exp().sum(-1, keepdim=True).log()
    inside = torch.ones_like(top, dtype=torch.bool) if rows is None else torch.isin(top, rows)
    col = torch.tensor([0 if not ok else (int(x) if rows is None else rows.tolist().index(int(x)))
                        for x, ok in zip(top, inside)])
    plain = torch.ones(len(top)) if isinstance(gamma, DPace) else \
        torch.tensor([math.exp(-(k - 1) / gamma) for j, k in p.supervised.nonzero().tolist()])
    if loss == "hard":
        per = -logq[torch.arange(len(col)), col]
        plain = plain * inside
    elif loss == "soft":
        per = -(lab.float().softmax(-1) * logq).sum(-1)
    else:
        per = F.kl_div(logq, lab.float().log_softmax(-1), reduction="none", log_target=True).sum(-1)
    w = plain
    if isinstance(gamma, DPace):  # each supervised slot k of block j: sum over supervised m >= k of c_1 .. c_m
        q = torch.where(inside, logq.detach()[torch.arange(len(col)), col].exp(), torch.zeros(len(col)))
        c = {tuple(jk): (1 - gamma.alpha) * float(q[s]) + gamma.alpha
             for s, jk in enumerate(p.supervised.nonzero().tolist())}
        dp = []
        for j, k in p.supervised.nonzero().tolist():
            total = 0.0
            for m in range(k, d.block_size):
                if (j, m) in c:
                    total += math.prod(c.get((j, i), 1.0) for i in range(m + 1))
            dp.append(total)
        w = torch.tensor(dp) * plain
    added, _ = terms.added(draft, lab, h, p.prev, top)
    value = (w * per).sum() / w.sum()
    if added is not None:  # a kind's added term: its slots weighed as the token loss's, plainly under D-PACE
        value = value + terms.weight * (plain * added).sum() / plain.sum()
    return value


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2", "domino"])
@pytest.mark.parametrize("loss", ["hard", "soft", "kl"])
@pytest.mark.parametrize("weighting", ["gamma", "dpace"])
@pytest.mark.parametrize("vocab", [False, True])
@pytest.mark.parametrize("source", ["target", "stored"])
def test_the_fused_step_gives_the_brute_force_loss_and_every_gradient(kind, loss, weighting, vocab, source,
                                                                      monkeypatch):
    import blockdraft.train.step as step_mod

    # several chunks, one ragged; D-PACE's chunks of whole blocks (at most 3 slots each) near 7 slots
    monkeypatch.setattr(step_mod, "loss_chunk_slots", lambda device, width: 7)
    t = sharp_target()
    if vocab and kind in FULL_VOCAB_ONLY:  # Domino scores the whole vocabulary: its config refuses a draft one
        with pytest.raises(ValueError, match="full"):
            drafter(t, kind, vocab)
        return
    d = drafter(t, kind, vocab)
    rows = tiny_rows(n=3, L=24)
    b = Batch(rows["input_ids"], rows["loss_mask"], rows["position_ids"])
    anchors = prepare(t, d, b, generator=torch.Generator().manual_seed(1)).anchors
    cached = FeatureMemo(t, rows)(torch.arange(3)) if source == "stored" else None
    gamma = 2.0 if weighting == "gamma" else DPace(0.3)
    got, _ = compute_loss(t, d, b, anchors=anchors, loss=loss, gamma=gamma, cached=cached)
    want = brute_force(t, d, b, anchors, loss, gamma)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    same_gradients(d, got, want)


def same_gradients(d, got, want):
    """Every drafter weight's gradient of `got` is that of `want`, to 1e-4 of the largest entry."""
    grads = torch.autograd.grad(got, list(d.parameters()), allow_unused=True)
    ref = torch.autograd.grad(want, list(d.parameters()), allow_unused=True)
    for (name, _), g, r in zip(d.named_parameters(), grads, ref):
        assert (g is None) == (r is None), name
        if r is not None:
            assert r.abs().max() > 0, name
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4 * float(r.abs().max()),
                                       msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
@pytest.mark.parametrize("loss", ["kl", "hard"])
def test_d_pace_at_any_chunk_is_the_brute_force(chunk, loss, monkeypatch):
    """A chunk smaller than a block still holds the whole block (D-PACE's weights read all of it);
    one chunk for every slot is the same loss."""
    import blockdraft.train.step as step_mod

    monkeypatch.setattr(step_mod, "loss_chunk_slots", lambda device, width: chunk)
    t = sharp_target()
    d = drafter(t, "dflash", True)
    rows = tiny_rows(n=3, L=24)
    b = Batch(rows["input_ids"], rows["loss_mask"], rows["position_ids"])
    anchors = prepare(t, d, b, generator=torch.Generator().manual_seed(2)).anchors
    got, m = compute_loss(t, d, b, anchors=anchors, loss=loss, gamma=DPace(0.5))
    want = brute_force(t, d, b, anchors, loss, DPace(0.5))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    same_gradients(d, got, want)


@pytest.mark.parametrize("gamma", [2.0, DPace(0.5)], ids=["gamma", "dpace"])
@pytest.mark.parametrize("vocab", [False, True])
def test_no_tensor_holds_more_than_a_chunks_rows_of_the_vocabulary(gamma, vocab, monkeypatch):
    """Every tensor a kl step makes, forward and backward, with a vocabulary wider than anything else:
    none has more elements than a chunk's span of rows (its slots, and the label positions they
    read, at most 2 blocks more) times the vocabulary, while the step has about 3 chunks' worth of
    label positions (the old labels were [P, V] in one piece), and D-PACE runs each head once per chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import blockdraft.train.step as step_mod

    chunk = 8
    monkeypatch.setattr(step_mod, "loss_chunk_slots", lambda device, width: chunk)
    t = sharp_target()
    d = drafter(t, "dflash", vocab)
    rows = tiny_rows(n=4, L=44)  # 176 tokens: no mask is as wide as the vocabulary
    b = Batch(rows["input_ids"], rows["loss_mask"], rows["position_ids"])
    anchors = prepare(t, d, b, generator=torch.Generator().manual_seed(1)).anchors
    p = prepare(t, d, b, anchors=anchors)
    positions = int(p.target_logits.hidden.shape[0])
    assert positions > 3 * (chunk + 2 * d.block_size)  # a [P, V] tensor would be caught
    largest = []
    weights = {w.untyped_storage().data_ptr() for w in [*t.parameters(), *d.parameters()]}

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in out if isinstance(out, (tuple, list)) else [out]:
                rows = getattr(t, "_rows_cache", None)  # the head's draft-vocabulary rows, kept between steps
                frozen = weights | ({rows[1].untyped_storage().data_ptr()} if rows else set())
                if isinstance(x, torch.Tensor) and x.dim() and x.shape[-1] in (t.vocab_size, 40) \
                        and x.untyped_storage().data_ptr() not in frozen:  # not a view of the head's weight
                    largest.append(x.numel() // x.shape[-1])
            return out

    calls = {"draft": 0, "label": 0}
    real = t.head

    def head(h, ids=None):
        calls["draft" if h.requires_grad else "label"] += 1
        return real(h, ids)

    monkeypatch.setattr(t, "head", head)
    with Sizes():
        loss, m = compute_loss(t, d, b, anchors=anchors, loss="kl", gamma=gamma)
        loss.backward()
    assert largest and max(largest) <= chunk + 2 * d.block_size, max(largest)
    chunks = calls["draft"]
    assert chunks >= m["supervised_slots"] // (chunk + d.block_size)
    assert calls == {"draft": chunks, "label": chunks}  # each head once per chunk, none again in backward


def test_a_hard_loss_from_stored_outputs_runs_no_label_head(monkeypatch):
    """The stored argmax is all a hard loss reads: the head runs only on the draft's slots."""
    t = tiny_target("llama")
    d = drafter(t, "dflash", False)
    rows = tiny_rows(n=3, L=24)
    b = Batch(rows["input_ids"], rows["loss_mask"], rows["position_ids"])
    cached = FeatureMemo(t, rows)(torch.arange(3))
    calls = []
    real = t.head

    def head(h, ids=None):
        calls.append(h.requires_grad)
        return real(h, ids)

    monkeypatch.setattr(t, "head", head)
    compute_loss(t, d, b, loss="hard", cached=cached, generator=torch.Generator().manual_seed(1))
    assert calls and all(calls)  # only the drafter's rows (which carry gradients), no no-grad label rows
    calls.clear()
    compute_loss(t, d, b, loss="soft", cached=cached, generator=torch.Generator().manual_seed(1))
    assert calls.count(False) == 1  # the soft loss reads the label rows: one head over them


@pytest.mark.parametrize("host", [True, False])
def test_a_chunks_label_rows_are_the_heads_rows_of_its_slots(host):
    """Labels.rows(i, j): the head on the span of final states slots i..j read (each row once) or, with
    no host index, on each slot's row; against the head on every state, indexed per slot."""
    from blockdraft.train.loss import Labels

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(30, 8, generator=g), torch.randn(50, 8, generator=g)
    # overlapping blocks (rows repeat and step back), a run of consecutive rows, a single slot
    index = torch.tensor([0, 1, 2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 11, 29])
    calls = []

    def head(h):
        calls.append(h.shape[0])
        return h @ weight.T

    lab = Labels(None, index, None, hidden, head, index.clone() if host else None)
    every = hidden @ weight.T
    for i, j in [(0, 6), (5, 12), (6, 11), (12, 14), (12, 15), (14, 15), (0, 15)]:  # (12, 14): two rows, reversed
        calls.clear()
        torch.testing.assert_close(lab.rows(i, j), every[index[i:j]], rtol=1e-6, atol=1e-6)
        want = int(index[i:j].max() - index[i:j].min()) + 1 if host else j - i
        assert calls == [want]  # one head over the span, or over the slots
    torch.testing.assert_close(lab.per_slot(), every[index], rtol=1e-6, atol=1e-6)
