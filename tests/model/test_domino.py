"""Domino (model/kinds/domino.py): it starts as the DFlash function of its backbone, its chained drafts
and its loss equal a brute-force reading of the definition (the GRU's equations written out here, not
nn.GRU), and generation stays the target's own."""

from __future__ import annotations

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.generate import speculative_generate
from blockdraft.model import DFlashDrafter
from blockdraft.model.kinds.domino import lambda_base
from blockdraft.train.build import change_kind
from blockdraft.train.step import Batch, compute_loss, prepare
from conftest import tiny_rows, tiny_target

KW = dict(emb_dim=8, gru_hidden_dim=6)


def target():
    t = tiny_target("llama")
    with torch.no_grad():  # a confident target: greedy decoding is then well defined
        t.model.get_output_embeddings().weight.mul_(8)
    return t


def drafter(t, **kw):
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=2, block_size=4, **kw))
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return d


def domino(t, **kw):
    d = drafter(t, kind="domino", **{**KW, **kw})
    with torch.no_grad():  # every Domino weight off its start, the correction as large as the head's logits
        for n, p in d.named_parameters():
            if n.startswith(("prefix_gru", "embed_proj")):
                # the GRU reads raw embedding rows (small): its input weights large, so each token moves its state
                p.copy_(torch.randn_like(p) * {"embed_proj.2.weight": 2.0, "prefix_gru.weight_ih_l0": 20.0}.get(n, 0.5))
    return d


def batch():
    rows = tiny_rows(n=3, L=24)
    return Batch(rows["input_ids"], rows["loss_mask"])


def gru_state(d, embed_rows: torch.Tensor) -> torch.Tensor:
    """The GRU's equations (bias-free), row by row: [L, Ht] -> the state after the last row [G]."""
    wi, wh = d.prefix_gru.weight_ih_l0.detach(), d.prefix_gru.weight_hh_l0.detach()
    G = wh.shape[1]
    s = torch.zeros(G)
    for x in embed_rows:
        gi, gh = wi @ x, wh @ s
        r = torch.sigmoid(gi[:G] + gh[:G])
        z = torch.sigmoid(gi[G:2 * G] + gh[G:2 * G])
        n = torch.tanh(gi[2 * G:] + r * gh[2 * G:])
        s = (1 - z) * n + z * s
    return s


def corrected(d, t, h: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    """Slot len(prefix)'s logits from its row h [Hd] and the block's tokens before it, by the definition."""
    base = t.head(h[None])[0]
    if len(prefix) < 1 + d.config.pure_draft_prefix_len:
        return base
    g = gru_state(d, t.embed(torch.tensor(prefix)))
    p0, p2 = d.embed_proj[0].weight.detach(), d.embed_proj[2].weight.detach()
    return base + p2 @ torch.nn.functional.silu(p0 @ torch.cat([h, g]))


def test_a_dflash_drafter_becomes_domino_with_its_drafts_and_loss_unchanged():
    t = target()
    d0 = drafter(t)
    dk = change_kind(d0, {"kind": "domino", **KW}, "cpu")
    assert dk.config.kind == "domino" and set(d0.state_dict()) < set(dk.state_dict())
    assert not bool(dk.embed_proj[2].weight.any()) and bool(dk.prefix_gru.weight_ih_l0.any())
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 20, 21]])
    r0 = speculative_generate(t, d0, ids, max_new_tokens=24)
    rk = speculative_generate(t, dk, ids, max_new_tokens=24)
    assert rk.drafts == r0.drafts and rk.tokens == r0.tokens
    for d in (d0, dk):  # under training, half way down lambda's ramp: base and final are one loss
        d.train()
        d.train_progress = 0.25
    l0, m0 = compute_loss(t, d0, batch(), generator=torch.Generator().manual_seed(0), loss="kl")
    lk, mk = compute_loss(t, dk, batch(), generator=torch.Generator().manual_seed(0), loss="kl")
    torch.testing.assert_close(lk, l0, rtol=0, atol=0)
    assert mk["slot_accuracy"] == m0["slot_accuracy"] and mk["tau"] == m0["tau"]


def test_each_slots_prefix_is_the_blocks_data_tokens_from_the_anchor():
    t = target()
    d = domino(t)
    b = batch()
    p = prepare(t, d, b, generator=torch.Generator().manual_seed(1))
    flat = b.input_ids.reshape(-1)
    want = [[int(flat[int(a) + i]) if i < k else -1 for i in range(d.block_size - 1)]
            for j, a in enumerate(p.anchors) for k in range(d.block_size) if p.supervised[j, k]]
    assert p.prev.tolist() == want


@pytest.mark.parametrize("prefix_len", [0, 1])
def test_domino_chain_equals_the_definition_walked_from_the_verified_token(prefix_len):
    t = target()
    d = domino(t, pure_draft_prefix_len=prefix_len)
    hidden = torch.randn(5, 32) * 0.1  # rows whose head logits leave the correction the say
    with torch.no_grad():
        out = d.kind.draft(d, t.head, hidden, 5, None, None, None, embed=t.embed)
        later = d.kind.draft(d, t.head, hidden[1:], [5, int(out.tokens[0])], None, None, None, embed=t.embed)
    prefix = [5]
    with torch.no_grad():
        for h in hidden:
            prefix.append(int(corrected(d, t, h, prefix).argmax()))
    assert out.tokens.tolist() == prefix[1:]
    assert later.tokens.tolist() == prefix[2:]  # resumed mid-block from the tokens before it
    # the correction moves drafts: the head's own argmax differs somewhere
    assert prefix[1:] != t.head(hidden).argmax(-1).tolist() or prefix_len


def test_each_slots_corrected_logits_are_the_definition_whatever_the_slots_before_it():
    """The loss's slots in block order, with gaps (a slot not supervised) and a next block whose first
    slot has a longer prefix than the last slot before it, or one it does not extend: every slot's
    logits are its own prefix's, by the definition."""
    from blockdraft.model.kinds.domino import PAD

    t = target()
    d = domino(t)  # block 4: prefixes of 1..3 tokens
    prefixes = [[5], [5, 9, 2], [3], [5, 9], [5, 9, 8], [7, 7], [7], [2, 4, 1], [2, 4]]
    prev = torch.tensor([p + [PAD] * (3 - len(p)) for p in prefixes])
    h = torch.randn(len(prefixes), d.config.hidden_size)
    terms = d.kind.slot_terms(d, t.head, None, t.embed)
    with torch.no_grad():
        got = terms.logits(h, prev)
    want = torch.stack([corrected(d, t, h[i], p) for i, p in enumerate(prefixes)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # logits of ~10: fp32 sums differ by ~1e-5


def test_domino_loss_equals_a_brute_force_sum_over_slots():
    t = target()
    d = domino(t, pure_draft_prefix_len=1)
    d.train()
    d.train_progress = 0.1  # lambda = 1 - 0.1 / 0.5 = 0.8
    b = batch()
    loss, _ = compute_loss(t, d, b, generator=torch.Generator().manual_seed(2), loss="kl", gamma=2.0)
    p = prepare(t, d, b, generator=torch.Generator().manual_seed(2))
    hidden = d(p.features, p.block_embeds, p.layout).detach()
    labels = p.target_logits.per_slot()
    flat = b.input_ids.reshape(-1)
    lam, num, den, i = 0.8, 0.0, 0.0, 0
    with torch.no_grad():
        for j, a in enumerate(p.anchors.tolist()):
            for k in range(d.block_size):
                if not p.supervised[j, k]:
                    continue
                h, y = hidden[j, k], labels[i].log_softmax(-1)
                i += 1
                kl = [(y.exp() * (y - x.log_softmax(-1))).sum()
                      for x in (corrected(d, t, h, flat[a:a + k].tolist()), t.head(h[None])[0])]
                w = torch.exp(torch.tensor(-(k - 1) / 2.0))
                num, den = num + w * ((1 - lam) * kl[0] + lam * kl[1]), den + w
    torch.testing.assert_close(loss.detach(), num / den, rtol=1e-4, atol=1e-5)


def test_lambda_falls_linearly_over_its_share_of_the_run_and_is_0_off_training():
    assert [lambda_base(1.0, 0.5, x) for x in (0.0, 0.25, 0.5, 0.9)] == [1.0, 0.5, 0.0, 0.0]
    assert lambda_base(1.0, 0.5, None) == 0.0
    t = target()
    d = domino(t)
    d.train_progress = 0.0
    terms = d.kind.slot_terms(d, t.head, None, t.embed)
    d.eval()
    assert terms.base_share == 0.0
    d.train()
    assert terms.base_share == 1.0


@pytest.mark.parametrize("threshold", [0.0, 0.4])
def test_domino_generates_the_target_greedy_output(threshold):
    t = target()
    d = domino(t)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    ref = t.model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 6:]
    r = speculative_generate(t, d, ids, max_new_tokens=30, draft_threshold=threshold)
    assert r.tokens == ref.tolist()


def test_domino_draws_its_drafts_from_the_distributions_it_reports():
    from model.test_kinds import assert_two_slots_drawn_from

    t = target()
    d = domino(t)
    torch.manual_seed(4)
    W = torch.randn(t.vocab_size, 32) * 0.15

    def head(h):
        return h @ W.T

    hidden = torch.randn(2, 32)
    g = torch.Generator().manual_seed(5)
    a, q_second = assert_two_slots_drawn_from(
        lambda: d.kind.draft(d, head, hidden, 9, None, lambda x: x.float().softmax(-1), g, embed=t.embed))
    # the second slot's distribution is the definition's, given the first draw
    g_state = gru_state(d, t.embed(torch.tensor([9, a])))
    p0, p2 = d.embed_proj[0].weight.detach(), d.embed_proj[2].weight.detach()
    want = (head(hidden[1][None])[0] + p2 @ torch.nn.functional.silu(p0 @ torch.cat([hidden[1], g_state]))).softmax(-1)
    torch.testing.assert_close(q_second[a], want, rtol=1e-4, atol=1e-6)


def test_domino_fields_default_to_the_recipes_and_are_checked():
    t = target()
    cfg = DrafterConfig.for_target(t, kind="domino")
    assert (cfg.emb_dim, cfg.gru_hidden_dim, cfg.pure_draft_prefix_len) == (256, 1024, 0)
    assert (cfg.lambda_base_start, cfg.lambda_base_decay_ratio) == (1.0, 0.5)
    with pytest.raises(ValueError, match="another drafter kind"):
        DrafterConfig.for_target(t, kind="dflash", emb_dim=4)
    with pytest.raises(ValueError, match="no slot"):
        DrafterConfig.for_target(t, kind="domino", block_size=4, pure_draft_prefix_len=3)


def test_init_drafter_with_kind_domino_keeps_the_saved_drafters_drafts(tmp_path):
    """`train --init-drafter D --kind domino --emb-dim 8 --gru-hidden-dim 6`'s path (continue_drafter with the
    flags' DrafterOptions): the saved DFlash drafter becomes Domino and drafts what it drafted."""
    from blockdraft.checkpoint import save_drafter
    from blockdraft.train.build import DrafterOptions, continue_drafter

    t = target()
    d0 = drafter(t)
    save_drafter(d0, tmp_path / "d")
    dk = continue_drafter(str(tmp_path / "d"), t, "cpu", options=DrafterOptions(kind="domino", **KW))
    assert (dk.config.kind, dk.config.emb_dim, dk.config.gru_hidden_dim) == ("domino", 8, 6)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 20, 21]])
    r0 = speculative_generate(t, d0, ids, max_new_tokens=24)
    rk = speculative_generate(t, dk, ids, max_new_tokens=24)
    assert rk.drafts == r0.drafts and rk.tokens == r0.tokens
