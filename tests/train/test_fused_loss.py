"""The training step's loss, made chunk by chunk with each chunk's gradient taken as its value is
(train.loss.fused_chunks), against a brute force written here: every supervised slot's draft logits at
once, per-slot losses from log-softmax by hand, the slot weights by their definition, and autograd
for every weight's gradient. For each kind, loss and vocabulary; from the target itself and from
stored outputs whose argmax is known (where a hard loss runs no label head)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.data.features import FeatureMemo
from blockdraft.model import DFlashDrafter
from blockdraft.train.step import Batch, compute_loss, prepare
from conftest import tiny_rows, tiny_target

KIND_KW = {"dflash": {}, "dspark": dict(markov_rank=8, confidence_head=True),
           "dflash2": dict(selector_rank=8, selector_top_k=4, conv_group_size=8)}


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
    p = prepare(t, d, b, anchors=anchors)
    h = d(p.features, p.block_embeds, p.layout)[p.supervised]
    rows = d.vocab_rows
    terms = d.kind.slot_terms(d, lambda x: t.head(x, rows), rows)
    draft = terms.logits(h, p.prev)  # [S, Vd]: all at once
    full = p.target_logits.per_slot()  # [S, V]
    top = full.argmax(-1)
    lab = full if rows is None else full[:, rows]
    logq = draft.float() - draft.float().exp().sum(-1, keepdim=True).log()
    k = torch.arange(d.block_size).float()
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0
    w = w.expand_as(p.supervised)[p.supervised]
    if loss == "hard":
        inside = torch.ones_like(top, dtype=torch.bool) if rows is None else torch.isin(top, rows)
        col = torch.tensor([0 if not ok else (int(x) if rows is None else rows.tolist().index(int(x)))
                            for x, ok in zip(top, inside)])
        per = -logq[torch.arange(len(col)), col]
        w = w * inside
    else:
        pt = lab.float().softmax(-1)
        per = -(pt * logq).sum(-1)
    added, _ = terms.added(draft, lab, h, p.prev, top)
    value = (w * per).sum() / w.sum()
    if added is not None:
        value = value + terms.weight * (w * added).sum() / w.sum()
    return value


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
@pytest.mark.parametrize("loss", ["hard", "soft"])
@pytest.mark.parametrize("vocab", [False, True])
@pytest.mark.parametrize("source", ["target", "stored"])
def test_the_fused_step_gives_the_brute_force_loss_and_every_gradient(kind, loss, vocab, source, monkeypatch):
    import blockdraft.train.step as step_mod

    monkeypatch.setattr(step_mod, "loss_chunk_slots", lambda device, width: 7)  # several chunks, one ragged
    t = tiny_target("llama")
    d = drafter(t, kind, vocab)
    rows = tiny_rows(n=3, L=24)
    b = Batch(rows["input_ids"], rows["loss_mask"], rows["position_ids"])
    anchors = prepare(t, d, b, generator=torch.Generator().manual_seed(1)).anchors
    cached = FeatureMemo(t, rows)(torch.arange(3)) if source == "stored" else None
    got, _ = compute_loss(t, d, b, anchors=anchors, loss=loss, gamma=2.0, cached=cached)
    grads = torch.autograd.grad(got, list(d.parameters()), allow_unused=True)
    want = brute_force(t, d, b, anchors, loss, 2.0)
    ref = torch.autograd.grad(want, list(d.parameters()), allow_unused=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, _), g, r in zip(d.named_parameters(), grads, ref):
        assert (g is None) == (r is None), name
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


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
