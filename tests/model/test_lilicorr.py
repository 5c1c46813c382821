"""LiLiCorr (model/kinds/lilicorr.py): its start is the DFlash function, its walk drafts what its scores
say, its sampled drafts come from the distributions it reports, and generation stays the target's own.
vLLM's own scores and walk on the same weights: reference/test_vllm_lilicorr.py."""

from __future__ import annotations

import pytest
import torch

from blockdraft.generate import speculative_generate
from blockdraft.model.kinds.lilicorr import LiLiCorr
from blockdraft.train.build import change_kind
from blockdraft.train.step import Batch, compute_loss, prepare
from conftest import tiny_rows
from .test_kinds import assert_two_slots_drawn_from, dflash, perturb, target

KW = {"plain": dict(lilicorr_candidate_topk=4, lilicorr_factor_dim=8, lilicorr_num_heads=2),
      "conv": dict(lilicorr_candidate_topk=4, lilicorr_factor_dim=8, lilicorr_num_heads=2, conv_kernel_size=2,
                   conv_group_size=8)}


@pytest.mark.parametrize("variant", sorted(KW))
def test_a_dflash_drafter_becomes_lilicorr_with_its_drafts_unchanged(variant):
    t = target()
    d0 = dflash(t)
    dk = change_kind(d0, {"kind": "lilicorr", **KW[variant]}, "cpu")
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 20, 21]])
    r0 = speculative_generate(t, d0, ids, max_new_tokens=24)
    rk = speculative_generate(t, dk, ids, max_new_tokens=24)
    assert rk.drafts == r0.drafts and rk.tokens == r0.tokens


@pytest.mark.parametrize("variant", sorted(KW))
@pytest.mark.parametrize("threshold", [0.0, 0.4])
def test_lilicorr_generates_the_target_greedy_output(variant, threshold):
    t = target()
    d = dflash(t, kind="lilicorr", **KW[variant])
    perturb(d)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    ref = t.model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 6:]
    r = speculative_generate(t, d, ids, max_new_tokens=30, draft_threshold=threshold)
    assert r.tokens == ref.tolist()


def brute_path_loss(cor, head, embed, hidden, tokens, supervised, anchor, valid) -> float:
    """The correlator's loss by its definition, block by block and slot by slot: the data's token at a + s
    among slot s's top K (else in place of the K-th), cross-entropy of the scaled start scores (s = 1) or
    of the pair row of the data's candidate at s - 1, over slots supervised with all slots before them."""
    K, (N, B, _) = cor.topk, hidden.shape
    total, count = 0.0, 0
    for n in range(N):
        cands, lps, idx = [], [], []
        for s in range(1, B):
            y = int(tokens[n, s])
            lp = head(hidden[n, s][None])[0].float().log_softmax(-1)
            top = lp.topk(K).indices.tolist()
            if y not in top:
                top[-1] = y
            cands.append(top)
            lps.append(lp[top])
            idx.append(top.index(y))
        start, pairs = cor.scores(embed(torch.tensor(cands))[None], torch.stack(lps)[None], hidden[n, 1:][None],
                                  anchor[n][None], valid[n][None])
        for s in range(1, B):
            if not bool(supervised[n, 1:s + 1].all()):
                break
            row = start[0] if s == 1 else pairs[0, s - 2, idx[s - 2]]
            total += float(-(cor.scale * row).log_softmax(-1)[idx[s - 1]])
            count += 1
    return total / max(count, 1)


@torch.no_grad()
@pytest.mark.parametrize("variant", sorted(KW))
def test_lilicorr_block_loss_is_the_teacher_forced_path_cross_entropy(variant):
    """On a narrow head (8 tokens, K = 4) the data's token is often among the candidates, at any rank."""
    t = target()
    d = dflash(t, kind="lilicorr", **KW[variant])
    perturb(d)
    g = torch.Generator().manual_seed(3)
    W = torch.randn(8, 32, generator=g)
    N, B = 5, d.block_size
    hidden = d.norm(torch.randn(N, B, 32, generator=g) * 3)
    tokens = torch.randint(0, 8, (N, B), generator=g)
    supervised = torch.ones(N, B, dtype=torch.bool)
    supervised[:, 0] = False
    supervised[1, 2:] = False
    supervised[3, 1] = False  # nothing counts after an unsupervised slot
    anchor, valid = torch.randn(N, 32, generator=g), torch.tensor([True, True, False, True, True])
    anchor = anchor * valid[:, None]
    got = d.kind.block_loss(d, lambda h: h @ W.T, t.embed, hidden, tokens, supervised, anchor, valid)
    want = brute_path_loss(d.lilicorr, lambda h: h @ W.T, t.embed, hidden, tokens, supervised, anchor, valid)
    assert want > 0.1 and abs(float(got) - want) < 1e-5, (float(got), want)


@torch.no_grad()
def test_train_adds_the_block_loss_with_the_data_tokens_and_anchor_rows(monkeypatch):
    """compute_loss = the token loss + block_loss on the drafter's rows, the data's tokens at a + k and the
    context row at a - 1, absent (valid false) at a document's first token (anchors 12 and 36: second documents)."""
    t = target()
    d = dflash(t, kind="lilicorr", **KW["conv"])
    perturb(d)
    b = Batch(**tiny_rows(n=3, L=24))  # two documents a row: the second starts at 12
    anchors = torch.tensor([5, 11, 12, 30, 36, 50])
    total, _ = compute_loss(t, d, b, anchors=anchors)
    monkeypatch.delattr(LiLiCorr, "block_loss")  # the token loss alone
    token, _ = compute_loss(t, d, b, anchors=anchors)
    monkeypatch.undo()
    p = prepare(t, d, b, anchors=anchors)
    hidden = d(p.features, p.block_embeds, p.layout)
    ids, B = b.input_ids.reshape(-1), d.block_size
    tokens = ids[(anchors[:, None] + torch.arange(B)).clamp(max=len(ids) - 1)]
    valid = torch.tensor([a % 12 != 0 for a in anchors.tolist()])
    anchor = d.context(p.features[(anchors - 1).clamp(min=0)]) * valid[:, None]
    want = brute_path_loss(d.lilicorr, t.head, t.embed, hidden, tokens, p.supervised, anchor, valid)
    assert want > 0.1 and abs(float(total - token) - want) < 1e-4, (float(total - token), want)


def test_training_the_correlator_lowers_its_loss_and_train_takes_its_flags():
    """A few Adam steps on the correlator alone (the backbone frozen) lower the block loss on the batch
    they fit; `train`'s flags make the kind's config (full vocabulary on a CPU: vLLM refuses a draft one)."""
    from blockdraft.train.build import DrafterOptions

    t = target()
    d = dflash(t, kind="lilicorr", **KW["plain"])
    b = Batch(**tiny_rows(n=3, L=24))
    anchors = torch.tensor([5, 12, 30, 36, 50])
    p = prepare(t, d, b, anchors=anchors)
    with torch.no_grad():
        hidden = d(p.features, p.block_embeds, p.layout)
        tokens = b.input_ids.reshape(-1)[(anchors[:, None] + torch.arange(4)).clamp(max=71)]
        valid = torch.tensor([a % 12 != 0 for a in anchors.tolist()])
        anchor = d.context(p.features[anchors - 1]) * valid[:, None]

    def loss():
        return d.kind.block_loss(d, t.head, t.embed, hidden, tokens, p.supervised, anchor, valid)

    opt = torch.optim.Adam(d.lilicorr.parameters(), lr=3e-3)
    first = float(loss().detach())
    for _ in range(30):
        opt.zero_grad()
        loss().backward()
        opt.step()
    last = float(loss().detach())
    assert last < 0.5 * first, (first, last)
    o = DrafterOptions(kind="lilicorr", lilicorr_candidate_topk=4, conv_kernel_size=2)
    assert o.layout()["conv_group_size"] == 16 and o.vocab_size("cpu", 50000) is None
    with pytest.raises(ValueError, match="power of two"):
        dflash(t, kind="lilicorr", lilicorr_candidate_topk=6)


def test_doctor_reads_lilicorr_by_its_walk_and_checks_its_terms(monkeypatch):
    """doctor's serving = training check walks the training path's rows with the anchor row at a - 1, as
    generation drafts: equal; generation drafting without its anchor row is caught. check_kind holds the
    terms vLLM checks (a mis-sized correlator FAILs)."""
    from blockdraft import doctor
    from blockdraft.model.drafter import ContextCache

    t = target()
    d = dflash(t, kind="lilicorr", **KW["conv"])
    perturb(d)
    with torch.no_grad():
        d.lilicorr.context_proj.weight.mul_(30)  # an anchor that moves the walk
    ids = torch.randint(0, t.vocab_size - 1, (1, 12), generator=torch.Generator().manual_seed(2))
    assert doctor.check_serving(t, d, ids).status == "PASS"
    assert doctor.check_kind(d).status in ("PASS", "WARN")
    monkeypatch.setattr(ContextCache, "anchor", None, raising=False)
    real = ContextCache.__init__

    def no_anchor(self, n):  # the cache never keeps a context row for the walk
        real(self, n)
        type(self).anchor = property(lambda s: None, lambda s, v: None)

    monkeypatch.setattr(ContextCache, "__init__", no_anchor)
    assert doctor.check_serving(t, d, ids).status == "FAIL"
    monkeypatch.undo()
    with torch.no_grad():
        d.lilicorr.relative_slot_bias = torch.nn.Parameter(torch.zeros(2, 5))
    assert doctor.check_kind(d).status == "FAIL"


def test_lilicorr_round_trips_through_its_zlab_directory_and_other_formats_refuse(tmp_path):
    """The z-lab directory (vLLM's reading of it: reference/test_vllm_lilicorr.py) loads back as the same
    drafter; speculators and GGUF, which no release reads LiLiCorr from, are refused in one line."""
    import json

    from blockdraft.checkpoint import load_drafter
    from blockdraft.checkpoint.native import save_drafter
    from blockdraft.engines.exports import export_drafter

    t = target()
    d = dflash(t, kind="lilicorr", **KW["conv"])
    perturb(d)
    path = save_drafter(d, tmp_path / "z")
    cfg = json.loads((tmp_path / "z" / "config.json").read_text())
    assert cfg["architectures"] == ["LiLiCorrDraftModel"] and cfg["dflash_config"]["lilicorr_enabled"] is True
    assert cfg["dflash_config"]["lilicorr_candidate_topk"] == 4 and cfg["dflash_config"]["block_size"] == 4
    back = load_drafter(str(path))
    assert back.config == d.config
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), back.state_dict().values()))
    with pytest.raises(ValueError, match="has no LiLiCorr"):
        export_drafter(d, tmp_path / "s", "speculators")


def test_lilicorr_draws_its_drafts_from_the_distributions_it_reports():
    """Exact verification needs each slot's token drawn from the q it hands over, given the draws before
    it (slot 2's row of pair scores is the one of slot 1's draw)."""
    t = target()
    d = dflash(t, kind="lilicorr", **KW["plain"])
    perturb(d)
    torch.manual_seed(4)
    W = torch.randn(t.vocab_size, 32) * 0.15  # a head with spread-out distributions

    def head(h):
        return h @ W.T

    hidden, anchor = torch.randn(2, 32), torch.randn(32)
    g = torch.Generator().manual_seed(5)
    _, q_second = assert_two_slots_drawn_from(
        lambda: d.kind.draft(d, head, hidden, 9, None, lambda x: (x.float() / 4).softmax(-1), g, embed=t.embed,
                             anchor=anchor))
    assert len({tuple(q.tolist()) for q in q_second.values()}) > 1  # slot 2's q follows slot 1's draw
