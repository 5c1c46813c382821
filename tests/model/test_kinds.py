"""Drafter kinds (model/kinds/): each starts as the DFlash function of its backbone, each addition
against a brute-force reading of its definition, and generation stays the target's own."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.generate import speculative_generate
from blockdraft.model import DFlashDrafter
from blockdraft.model.kinds.dflash2 import GroupedConv
from blockdraft.train.build import change_kind
from blockdraft.train.step import Batch, compute_loss, prepare
from conftest import tiny_rows, tiny_target

KIND_KW = {"dspark": dict(markov_rank=8), "dflash2": dict(selector_rank=8, selector_top_k=4, conv_group_size=8),
           "domino": dict(emb_dim=8, gru_hidden_dim=6)}


def target():
    t = tiny_target("llama")
    with torch.no_grad():  # a confident target: greedy decoding is then well defined
        t.model.get_output_embeddings().weight.mul_(8)
    return t


def dflash(t, **kw):
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=2, block_size=4, **kw))
    with torch.no_grad():  # norms away from 1 and 0.1: a start that is not a special case
        for n, p in d.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return d


def batch():
    rows = tiny_rows(n=3, L=24)
    return Batch(rows["input_ids"], rows["loss_mask"])


def perturb(d):
    """Every weight a kind adds, moved off its start."""
    base = {n for n, _ in dflash(target()).named_parameters()}
    with torch.no_grad():
        for n, p in d.named_parameters():
            if n not in base:
                p.add_(torch.randn_like(p) * 0.3)


@pytest.mark.parametrize("kind", ["dspark", "dflash2"])
def test_a_dflash_drafter_becomes_each_kind_with_its_drafts_and_token_loss_unchanged(kind):
    t = target()
    d0 = dflash(t)
    dk = change_kind(d0, {"kind": kind, **KIND_KW[kind]}, "cpu")
    assert dk.config.kind == kind and set(d0.state_dict()) < set(dk.state_dict())
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 20, 21]])
    r0 = speculative_generate(t, d0, ids, max_new_tokens=24)
    rk = speculative_generate(t, dk, ids, max_new_tokens=24)
    assert rk.drafts == r0.drafts and rk.tokens == r0.tokens
    g = torch.Generator().manual_seed(0)
    l0, m0 = compute_loss(t, d0, batch(), generator=g)
    g = torch.Generator().manual_seed(0)
    lk, mk = compute_loss(t, dk, batch(), generator=g)
    assert mk["slot_accuracy"] == m0["slot_accuracy"] and mk["tau"] == m0["tau"]
    p = prepare(t, d0, batch(), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(dk(p.features, p.block_embeds, p.layout), d0(p.features, p.block_embeds, p.layout),
                               rtol=0, atol=0)  # the same final rows: identity convolutions
    if kind == "dflash2":  # and no edge score: the walk is each slot's argmax, whatever the rows
        h, cand = torch.randn(6, 32) * 10, torch.randint(0, t.vocab_size, (6, 4))
        assert bool((dk.candidate_selector.edges(h, cand[:, 0], cand) == 0).all())
    if kind == "dflash2":  # the selector's loss is added; the token loss is the same
        assert float(lk.detach()) > float(l0.detach())


def test_the_data_token_before_each_supervised_slot_is_its_markov_input():
    t = target()
    d = dflash(t, kind="dspark", markov_rank=8)
    b = batch()
    p = prepare(t, d, b, generator=torch.Generator().manual_seed(1))
    flat = b.input_ids.reshape(-1)
    want = [int(flat[int(a) + k - 1]) for j, a in enumerate(p.anchors) for k in range(d.block_size)
            if p.supervised[j, k]]
    assert p.prev.tolist() == want


def test_dspark_loss_equals_a_brute_force_sum_over_slots():
    t = target()
    d = dflash(t, kind="dspark", markov_rank=8)
    perturb(d)
    b = batch()
    g = torch.Generator().manual_seed(2)
    p = prepare(t, d, b, generator=torch.Generator().manual_seed(2))
    loss, _ = compute_loss(t, d, b, generator=g, loss="kl", gamma=2.0)
    hidden = d(p.features, p.block_embeds, p.layout)[p.supervised]
    labels = p.target_logits.per_slot()
    w = torch.exp(-(torch.arange(d.block_size) - 1.0) / 2.0).expand_as(p.supervised)[p.supervised]
    tok, conf = [], []
    for h, y, prev in zip(hidden, labels, p.prev):
        e = d.markov_head.markov_w1.weight[prev]
        q = (t.head(h[None])[0] + d.markov_head.markov_w2.weight @ e).log_softmax(-1)
        pt = y.log_softmax(-1)
        tok.append((pt.exp() * (pt - q)).sum())
        agree = torch.minimum(pt.exp(), q.exp()).sum()
        c = d.confidence_head.proj.weight[0] @ torch.cat([h, e]) + d.confidence_head.proj.bias[0]
        conf.append(torch.nn.functional.binary_cross_entropy_with_logits(c, agree))
    want = (w * torch.stack(tok)).sum() / w.sum() + (w * torch.stack(conf)).sum() / w.sum()
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)


def test_dflash2_convolution_equals_its_definition_and_stays_inside_the_block():
    torch.manual_seed(3)
    conv = GroupedConv(hidden=8, kernel=2, group=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(3, 5, 8)  # 3 blocks of 5 rows
    y, dyn = conv.prepare(x)
    want = torch.zeros_like(x)
    for n in range(3):
        for t_ in range(5):
            for j in range(2):
                if t_ - j < 0:
                    continue
                for c in range(8):
                    w = conv.base_kernel[0, j, c] + dyn[n, t_, 0, j, c // 4]
                    want[n, t_, c] += w * x[n, t_ - j, c]
    torch.testing.assert_close(y, want)
    x2 = x.clone()
    x2[:, 3:] += 1.0  # later rows never reach earlier ones
    torch.testing.assert_close(conv.prepare(x2)[0][:, :3], y[:, :3])


def test_dflash2_walk_equals_brute_force_over_the_candidates():
    t = target()
    d = dflash(t, kind="dflash2", **KIND_KW["dflash2"])
    perturb(d)
    hidden = torch.randn(3, 32)
    head = t.head
    out = d.kind.draft(d, head, hidden, 7, None, None, None)
    sel, prev, want = d.candidate_selector, 7, []
    with torch.no_grad():
        for h in hidden:
            logits = head(h[None])[0]
            cand = logits.topk(4).indices
            score = [float(logits[c] + (sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ h))
                           @ sel.successor_codebook[c]) for c in cand]
            prev = int(cand[max(range(4), key=lambda i: score[i])])
            want.append(prev)
    assert out.tokens.tolist() == want


def test_dspark_chain_reads_the_draft_before_each_slot():
    t = target()
    d = dflash(t, kind="dspark", markov_rank=8)
    perturb(d)
    hidden = torch.randn(3, 32)
    out = d.kind.draft(d, t.head, hidden, 5, None, None, None)
    prev, want = 5, []
    for h in hidden:
        bias = d.markov_head.markov_w2.weight @ d.markov_head.markov_w1.weight[prev]
        prev = int((t.head(h[None])[0] + bias).argmax())
        want.append(prev)
    assert out.tokens.tolist() == want


@pytest.mark.parametrize("kind", ["dspark", "dflash2"])
@pytest.mark.parametrize("threshold", [0.0, 0.4])
def test_each_kind_generates_the_target_greedy_output(kind, threshold):
    t = target()
    d = dflash(t, kind=kind, **KIND_KW[kind])
    perturb(d)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    ref = t.model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 6:]
    r = speculative_generate(t, d, ids, max_new_tokens=30, draft_threshold=threshold)
    assert r.tokens == ref.tolist()


@pytest.mark.parametrize("kind", ["dspark", "dflash2"])
def test_each_kind_draws_its_drafts_from_the_distributions_it_reports(kind):
    """What exact verification needs of a drafter: each slot's token is drawn from the q it hands to
    verification, given the draws before it (slot 2's q depends on slot 1's token)."""
    t = target()
    d = dflash(t, kind=kind, **KIND_KW[kind])
    perturb(d)
    torch.manual_seed(4)
    W = torch.randn(t.vocab_size, 32) * 0.15  # a head with spread-out distributions

    def head(h):
        return h @ W.T

    hidden = torch.randn(2, 32)
    g = torch.Generator().manual_seed(5)
    assert_two_slots_drawn_from(lambda: d.kind.draft(d, head, hidden, 9, None, lambda x: x.float().softmax(-1), g))


def assert_two_slots_drawn_from(draft, n: int = 3000) -> tuple[int, dict]:
    """`draft()` drafting two slots n times: slot 1's tokens are drawn from the q it reports, and slot 2's,
    given the commonest slot-1 draw, from the q it reports then. Returns that draw and slot 2's q per
    slot-1 draw."""
    first, second, q_first, q_second = [], {}, None, {}
    with torch.no_grad():
        for _ in range(n):
            out = draft()
            a, b = out.tokens.tolist()
            first.append(a)
            second.setdefault(a, []).append(b)
            q_first, q_second[a] = out.q[0], out.q[1]
    assert_drawn_from(first, q_first)
    a = max(second, key=lambda k: len(second[k]))  # the commonest first draw, and the second given it
    assert len(second[a]) > 300
    assert_drawn_from(second[a], q_second[a])
    return a, q_second


def assert_drawn_from(tokens: list[int], q: torch.Tensor) -> None:
    """Chi-square test (99.9%, Wilson-Hilferty) of draws against q: one bin per id expecting >= 5 draws,
    one for all the others together."""
    counts = torch.bincount(torch.tensor(tokens), minlength=q.numel()).double()
    expected = q.detach().double() * len(tokens)
    use = expected >= 5
    counts = torch.cat([counts[use], counts[~use].sum()[None]])
    expected = torch.cat([expected[use], expected[~use].sum()[None]]).clamp(min=1e-9)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = max(1, int(use.sum()) - (0 if bool((~use).any()) else 1))
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, (chi2, crit, dof)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dspark", "dflash2", "domino"])
def test_each_kind_samples_from_the_target_distribution(kind):
    """Chi-square test of the third generated token: the second drafted one, whose draft distribution
    depends on the draw before it (DSpark's bias, DFlash2's walk), against the target's own marginal."""
    t = target()
    with torch.no_grad():
        t.model.get_output_embeddings().weight.div_(32)  # a flatter target: many tokens with real mass
    d = dflash(t, kind=kind, **KIND_KW[kind])
    perturb(d)
    with torch.no_grad():
        d.norm.weight.mul_(30)  # a sharp drafter, far from the target: a wrong acceptance rule shows
    ids = torch.tensor([[1, 5, 7, 9, 2, 4]])
    n, V = 1500, t.vocab_size
    counts = torch.zeros(V)
    for i in range(n):
        r = speculative_generate(t, d, ids, max_new_tokens=3, temperature=1.0, seed=i)
        counts[r.tokens[2]] += 1
    with torch.no_grad():
        p1 = t.model(ids).logits[0, -1].softmax(-1)  # [V]
        two = torch.cat([ids.expand(V, -1), torch.arange(V)[:, None]], 1)
        p12 = p1[:, None] * t.model(two).logits[:, -1].softmax(-1)  # [V, V]
        keep = (p12 > 1e-6).nonzero()  # prefixes with any real mass
        three = torch.cat([ids.expand(len(keep), -1), keep], 1)
        expected = (p12[keep[:, 0], keep[:, 1], None] * t.model(three).logits[:, -1].softmax(-1)).sum(0) * n
    assert int((expected >= 5).sum()) >= 10
    assert_drawn_from(sum(([i] * int(c) for i, c in enumerate(counts.tolist())), []), expected / n)


def test_kind_fields_of_another_kind_are_refused():
    t = target()
    with pytest.raises(ValueError, match="another drafter kind"):
        DrafterConfig.for_target(t, kind="dflash", markov_rank=4)
    with pytest.raises(ValueError, match="sample_from_anchor"):
        DrafterConfig.for_target(t, kind="dspark", sample_from_anchor=True)
    cfg = DrafterConfig.for_target(t, kind="dflash2")
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 16, 256, 16)
    assert dataclasses.replace(cfg).kind == "dflash2"


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2", "domino"])
def test_a_kind_is_chained_exactly_when_a_slots_draft_reads_the_token_before_it(kind):
    """`Kind.chained` (llama.cpp's replay counts a chained kind's walk step by step from llama.cpp's
    own previous draft): measured against the draft itself, one slot drafted after every token."""
    t = target()
    d = dflash(t, **({"kind": kind, **KIND_KW[kind]} if kind != "dflash" else {}))
    perturb(d)
    hidden = torch.randn(4, 32)
    with torch.no_grad():
        drafts = [{int(d.kind.draft(d, t.head, h[None], prev, None, None, None, embed=t.embed).tokens)
                   for prev in range(t.vocab_size)} for h in hidden]
    assert d.kind.chained == any(len(tokens) > 1 for tokens in drafts), drafts
