"""SpecForge 0.2.0 (sgl-project's trainer of DFlash and DSpark drafters) reads blockdraft's native
directories with its own loader (`AutoDraftModel.from_pretrained`, the path its warm start takes),
keeps every tensor we wrote, and its model and loss code compute our drafter and our loss.

Where SpecForge computes something else by its own design, the test measures exactly that: its
serving loop (`spec_generate`) passes no mask, so every layer is bidirectional and unwindowed there;
its training mask makes sliding layers causal and leaves the block unwindowed; DFlash learns the data's
tokens; DSpark's training shifts the slots by one against its own drafting (docs/consumers.md, "SpecForge").

SpecForge runs on its sdpa path (dense boolean masks), never flex attention: nothing is compiled.
Run in `.venv-ref-spec`, where `reference/setup.sh` adds SpecForge with --no-deps: `reference/run.sh`
(PYTHONPATH=src).
"""

from __future__ import annotations

import dataclasses

import importlib

import pytest
import torch
import torch.nn.functional as F
from common import ANCHORS, CASES, DOMINO_CASE, GREEDY_ANCHORS, KIND_CASES, TINY_V, B, W, block_of, greedy_batch, \
    our_rows, random_ids, threads, tiny_drafter, tiny_target, written
from safetensors.torch import load_file

from blockdraft.checkpoint import save_drafter
from blockdraft.train import Batch, compute_loss
from blockdraft.train.loss import slot_losses, slot_weights

# this environment has the package: missing is a failure, never a skip (reference/README.md)
auto = importlib.import_module("specforge.modeling.auto")
family = importlib.import_module("specforge.algorithms.common.dflash_family_model")
mask_utils = importlib.import_module("specforge.training.model_utils")
threads()

TOL = dict(rtol=1e-4, atol=1e-4)
DSPARK_CASES = {
    "dspark-markov": dict(KIND_CASES["dspark"], confidence_head=False),
    "dspark-confidence": dict(KIND_CASES["dspark"], confidence_head=True),
    # equal query and KV heads (the default for an MHA target): SpecForge wants attention_mode "mha" said
    "dspark-mha": dict(KIND_CASES["dspark"], confidence_head=True, num_key_value_heads=4),
}
GAMMA = 2.0


def load_specforge(path, dropped=()):
    """SpecForge's loader on our directory, in fp32. Every tensor of our file must be in its model with
    our values, but for `dropped` (which must be exactly what its load report calls unexpected)."""
    model, info = auto.AutoDraftModel.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert not info.get("missing_keys") and not info.get("mismatched_keys"), info
    assert set(info.get("unexpected_keys") or ()) == set(dropped), info
    file, theirs = load_file(str(path / "model.safetensors")), model.state_dict()
    for name, value in file.items():
        if name not in dropped:
            assert name in theirs and torch.equal(theirs[name], value), name
    return model.eval()


def fix_anchors(trainer, anchors):
    """Replace the trainer's random anchor draw (`_sample_anchor_positions`) by ours."""
    a = torch.tensor([list(anchors)])
    trainer._sample_anchor_positions = lambda seq_len, loss_mask, device: (a, torch.ones_like(a, dtype=torch.bool))


def trainer(kind, model, target, ours, anchors, **kw):
    cls = family.OnlineDSparkModel if kind == "dspark" else family.OnlineDFlashModel
    t = cls(model, target.model.get_output_embeddings(), target.model.get_input_embeddings(), ours.mask_token_id,
            block_size=B, attention_backend="sdpa", **kw)
    fix_anchors(t, anchors)
    return t


@torch.no_grad()
def their_training_rows(model, target, ours, ids, anchors, kind="dflash"):
    """SpecForge's training forward (its mask builder, its model) for blocks at `anchors`: [N, B, H]."""
    feats = target(ids, return_logits=False).features
    _, _, out = trainer(kind, model, target, ours, anchors)._forward_draft_blocks(ids, feats, torch.ones_like(ids))
    return out.reshape(len(anchors), B, -1)


@torch.no_grad()
def their_serving_rows(model, target, ids, C, block):
    """The call SpecForge's `spec_generate` makes for a block at anchor C: no mask, is_causal False."""
    feats = target(ids[:, :C], return_logits=False).features
    return model(target_hidden=feats, noise_embedding=target.embed(block)[None], position_ids=torch.arange(C + B)[None],
                 is_causal=False)[0]


def dspark_logits(ours, target, h, prev):
    return ours.kind.slot_terms(ours, lambda x: target.head(x), None).logits(h, prev)


# ------------------------------------------------------------------ the drafter, as SpecForge builds it
@pytest.mark.parametrize("case", ["full-2layers", "sliding-causal", "mixed", "draft-vocab"])
def test_specforge_loads_our_dflash_directory_and_trains_our_function(tmp_path, case):
    """Its training forward (sdpa masks, sliding layers windowed from the query) gives our rows and,
    through the target's head, our logits. It has no draft vocabulary: d2t and the head rows are
    reported unexpected and dropped; its full-head logits on our rows are ours."""
    target = tiny_target()
    ours = written(target, CASES[case], tmp_path / "d")
    theirs = load_specforge(tmp_path / "d", ("d2t", "lm_head.weight") if ours.config.draft_vocab_size else ())
    assert theirs.target_layer_ids == target.layer_ids and theirs.block_size == B
    assert theirs.mask_token_id == ours.mask_token_id
    ids = random_ids()
    rows = their_training_rows(theirs, target, ours, ids, ANCHORS)
    head = target.model.get_output_embeddings()
    for j, C in enumerate(ANCHORS):
        mine = our_rows(target, ours, ids, C)
        torch.testing.assert_close(rows[j], mine, **TOL)
        full = head(rows[j])
        vocab = ours.vocab_rows
        torch.testing.assert_close(full if vocab is None else full[:, vocab], target.head(mine, vocab), **TOL)


@pytest.mark.parametrize("case", ["full-2layers", "sliding-causal", "mixed", "sliding-bidirectional"])
def test_specforge_serves_every_layer_bidirectional_and_unwindowed(tmp_path, case):
    """spec_generate's forward has no mask: a full-attention drafter is ours there, one with causal
    sliding layers is not (bidirectional in the block), and a bidirectional sliding one is ours only
    while its window reaches position 0 (C <= W - B: no window). Its output stays the target's greedy
    output."""
    target = tiny_target()
    ours = written(target, CASES[case], tmp_path / "d")
    theirs = load_specforge(tmp_path / "d")
    ids = random_ids()
    for C in ANCHORS:
        diff = (their_serving_rows(theirs, target, ids, C, block_of(ours, ids, C)) - our_rows(target, ours, ids, C))
        if case == "full-2layers" or (case == "sliding-bidirectional" and C <= W - B):
            assert diff.abs().max() < 1e-4, (C, diff.abs().max())
        else:
            assert diff.abs().max() > 1e-2, (C, diff.abs().max())
    prompt = ids[:, :12]
    greedy = target.model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, 12:].tolist()
    out = theirs.spec_generate(target.model, prompt, max_new_tokens=24, stop_token_ids=None, temperature=0.0)
    assert out[0, 12:].tolist() == greedy


@pytest.mark.parametrize("case", ["sliding-bidirectional", "sliding-causal-narrow"])
def test_specforge_trains_sliding_layers_causal_and_unwindowed_in_the_block(tmp_path, case):
    """Its sliding training mask: causal inside the block whatever the config says, and no window
    between block slots. A one-layer bidirectional sliding drafter differs on every slot but the last
    (which sees the whole block either way); a causal one with W = 2 < B agrees on slots 0 and 1 and
    differs from slot W on (where ours stops seeing slot 0)."""
    narrow = dict(CASES["sliding-causal"], sliding_window=2)
    target = tiny_target()
    ours = written(target, narrow if case == "sliding-causal-narrow" else CASES[case], tmp_path / "d")
    theirs = load_specforge(tmp_path / "d")
    ids = random_ids()
    rows = their_training_rows(theirs, target, ours, ids, ANCHORS)
    for j, C in enumerate(ANCHORS):
        diff = (rows[j] - our_rows(target, ours, ids, C)).abs().amax(-1)  # [B] per slot
        if case == "sliding-causal-narrow":
            assert diff[:2].max() < 1e-4 and diff[2:].min() > 1e-3, (C, diff)
        else:
            assert diff[:-1].min() > 1e-3 and diff[-1] < 1e-4, (C, diff)


@pytest.mark.parametrize("case", sorted(DSPARK_CASES))
def test_specforge_builds_our_dspark_heads(tmp_path, case):
    """Its DSparkDraftModel reads the heads from dflash_config, takes markov_head.* and confidence_head.*
    with nothing dropped, and from its own rows gives our Markov-corrected logits and our confidence
    logits (previous token: the data's); its greedy chain (`_sample_draft_tokens`, the verified token
    first) drafts our tokens, and its spec_generate is the target's greedy output."""
    target = tiny_target()
    ours = written(target, DSPARK_CASES[case], tmp_path / "d")
    theirs = load_specforge(tmp_path / "d")
    assert theirs.markov_head is not None and theirs.markov_head.markov_rank == ours.config.markov_rank
    assert (theirs.confidence_head is not None) == bool(ours.config.confidence_head)
    ids = random_ids()
    rows = their_training_rows(theirs, target, ours, ids, ANCHORS, kind="dspark")
    head = target.model.get_output_embeddings()
    for j, C in enumerate(ANCHORS):
        mine, other = our_rows(target, ours, ids, C)[1:], rows[j, 1:]  # the drafting slots 1..B-1
        prev = ids[0, C:C + B - 1]
        with torch.no_grad():
            torch.testing.assert_close(theirs.apply_logits_head(head(other), prev_token_ids=prev, hidden_states=other),
                                       dspark_logits(ours, target, mine, prev), **TOL)
            conf = theirs.predict_confidence(other, prev_token_ids=prev)
            if ours.config.confidence_head:
                torch.testing.assert_close(conf, ours.confidence_head(mine, ours.markov_head.markov_w1(prev)), **TOL)
            else:
                assert conf is None
            block = block_of(ours, ids, C)
            served = their_serving_rows(theirs, target, ids, C, block)
            chain = theirs._sample_draft_tokens(target.model, served[None], block[None])[0]
            drafted = ours.kind.draft(ours, target.head, mine, int(ids[0, C]), None, None, None).tokens
        assert torch.equal(chain, drafted), (C, chain, drafted)
    prompt = ids[:, :12]
    greedy = target.model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, 12:].tolist()
    assert theirs.spec_generate(target.model, prompt, max_new_tokens=24, stop_token_ids=None,
                                temperature=0.0)[0, 12:].tolist() == greedy


def test_specforge_refuses_what_it_cannot_build(tmp_path):
    """No DFlash2 architecture; DSpark's Markov head scores the whole vocabulary (markov_w2 [V, r]):
    both are errors at load, not silent drops."""
    target = tiny_target()
    written(target, KIND_CASES["dflash2"], tmp_path / "d2")
    with pytest.raises(ValueError, match="DFlash2DraftModel"):
        auto.AutoDraftModel.from_pretrained(str(tmp_path / "d2"), dtype=torch.float32)
    written(target, dict(KIND_CASES["dspark"], draft_vocab_size=48), tmp_path / "dv")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        auto.AutoDraftModel.from_pretrained(str(tmp_path / "dv"), dtype=torch.float32)


def test_specforge_takes_our_mask_token_and_falls_back_to_pad(tmp_path):
    """Its MASK id: the config's dflash_config.mask_token_id first (ours); without one, the tokenizer's
    mask token, a row past the tokenizer, then pad, eos, unk (training/model_utils.resolve_mask_token_id)."""
    target = tiny_target()
    ours = written(target, CASES["full-2layers"], tmp_path / "d")
    theirs = load_specforge(tmp_path / "d")

    @dataclasses.dataclass
    class Tokenizer:
        size: int
        mask_token_id: int | None = None
        pad_token_id: int | None = 3
        eos_token_id: int | None = 2
        unk_token_id: int | None = 1

        def __len__(self):
            return self.size

    def resolve(tok):
        return mask_utils.resolve_mask_token_id(explicit=None, tokenizer=tok, draft_model=theirs,
                                                embedding_vocab_size=TINY_V)

    assert resolve(Tokenizer(TINY_V)) == ours.mask_token_id
    theirs.config.dflash_config.pop("mask_token_id")
    assert resolve(Tokenizer(TINY_V, mask_token_id=7)) == 7
    assert resolve(Tokenizer(TINY_V - 10)) == TINY_V - 10  # the first embedding row past the tokenizer
    assert resolve(Tokenizer(TINY_V)) == 3
    assert resolve(Tokenizer(TINY_V, pad_token_id=None)) == 2
    assert resolve(Tokenizer(TINY_V, pad_token_id=None, eos_token_id=None)) == 1


# ------------------------------------------------------------------------------------------- the loss
def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", ["full-2layers", "sliding-causal"])
def test_specforge_dflash_loss_is_our_hard_loss_on_greedy_data(tmp_path, case):
    """OnlineDFlashModel's loss (cross-entropy on the data token, weights exp(-(k-1)/gamma) from slot 1,
    over the sum of the weights) and every weight's gradient are ours (`loss="hard"`) on the same anchors
    when the data is the target's greedy output (its accuracy too, though a random drafter's is 0 in
    both); on other data its loss is ours with the data's tokens in place of the target's argmax (DFlash
    is trained on the data's tokens)."""
    target = tiny_target()
    ours = written(target, CASES[case], tmp_path / "d")
    theirs = load_specforge(tmp_path / "d")
    ids, mask = greedy_batch(target)
    anchors = torch.tensor(GREEDY_ANCHORS)
    with torch.no_grad():
        feats = target(ids, return_logits=False).features
    t = trainer("dflash", theirs.train(), target, ours, GREEDY_ANCHORS, loss_decay_gamma=GAMMA)
    loss_t, acc_t, _ = t(ids, feats, mask)
    loss_t.backward()
    ours.train()
    loss_o, metrics = compute_loss(target, ours, Batch(ids, mask), anchors=anchors, loss="hard", gamma=GAMMA)
    loss_o.backward()
    torch.testing.assert_close(loss_t, loss_o, rtol=1e-5, atol=1e-5)
    assert abs(acc_t.item() - metrics["accuracy"]) < 1e-6
    g_t, g_o = grads(theirs), grads(ours)
    assert set(g_t) == set(g_o)
    for name in g_o:
        torch.testing.assert_close(g_t[name], g_o[name], rtol=1e-4, atol=1e-6, msg=name)

    ids = random_ids(40, seed=5)  # not the target's output: its labels are no longer ours
    with torch.no_grad():
        feats = target(ids, return_logits=False).features
        loss_t, _, _ = t(ids, feats, mask)
        loss_o, _ = compute_loss(target, ours, Batch(ids, mask), anchors=anchors, loss="hard", gamma=GAMMA)
        rows = torch.stack([our_rows(target, ours, ids, a) for a in GREEDY_ANCHORS])  # [N, B, H]
        pos = anchors[:, None] + torch.arange(B)
        sup = (pos < ids.shape[1]) & (torch.arange(B) > 0)
        sup &= mask[0, pos.clamp(max=ids.shape[1] - 1)].bool()
        per = slot_losses(target.head(rows[sup]), None, "hard", ids[0, pos[sup]])
        w = slot_weights(B, GAMMA).expand(len(anchors), B)[sup]
        top = target(ids).logits.argmax(-1)[0, pos[sup] - 1]
    assert (top != ids[0, pos[sup]]).float().mean() > 0.9  # the labels differ at nearly every slot
    assert abs(loss_t - loss_o) > 3e-4  # a random drafter's loss is near log V either way: a small gap
    torch.testing.assert_close(loss_t, (w * per).sum() / w.sum(), rtol=1e-5, atol=1e-5)


def their_dspark_terms(t, ids, feats, final, anchors, shift):
    """OnlineDSparkModel's objective on its own rows, slot k labelled with the token at a + k + shift and
    reading the one before it (our convention: shift 0; its own training: shift 1)."""
    T = ids.shape[1]
    a = torch.tensor([list(anchors)])
    _, _, out = t._forward_draft_blocks(ids, feats, torch.ones_like(ids))
    lab = a[..., None] + torch.arange(B) + shift  # [1, N, B]
    safe = lab.clamp(max=T - 1)
    targets = ids[0][safe]
    prev = ids[0][(lab - 1).clamp(max=T - 1)]
    valid = (lab < T) & (torch.arange(B) + shift > 0)
    return t._compute_dspark_loss(output_hidden=out, target_ids=targets, eval_mask=valid, prev_token_ids=prev,
                                  safe_label_indices=safe, target_last_hidden_states=final)


def test_specforge_dspark_loss_shares_our_terms_and_trains_slot_k_for_a_plus_k_plus_1(tmp_path):
    """OnlineDSparkModel's cross-entropy and confidence BCE (target: 1 - L1/2 between the corrected draft
    and the target's distribution, i.e. sum min(p, q)), its L1 weight 0, equal our hard loss + confidence
    loss and gradients when fed our slot convention (its weights exp(-k/gamma) are ours times exp(-1/gamma),
    which the normalisation cancels). Its own forward labels slot k with the token at a + k + 1 (slot 0
    predicts, prev = the token at a + k): that value is our kind's terms computed with the shift."""
    target = tiny_target()
    ours = written(target, DSPARK_CASES["dspark-confidence"], tmp_path / "d")
    theirs = load_specforge(tmp_path / "d")
    ids, mask = greedy_batch(target)
    anchors = GREEDY_ANCHORS[:-2]  # inside the row: its own forward reads a + B
    with torch.no_grad():
        out = target(ids, return_logits=False, return_final_hidden=True)
    feats, final = out.features, out.final_hidden
    t = trainer("dspark", theirs.train(), target, ours, anchors, loss_decay_gamma=GAMMA, dspark_ce_loss_alpha=1.0,
                dspark_l1_loss_alpha=0.0, dspark_confidence_head_alpha=1.0)
    loss_t, _ = their_dspark_terms(t, ids, feats, final, anchors, shift=0)
    loss_t.backward()
    ours.train()
    loss_o, _ = compute_loss(target, ours, Batch(ids, mask), anchors=torch.tensor(anchors), loss="hard", gamma=GAMMA)
    loss_o.backward()
    torch.testing.assert_close(loss_t, loss_o, rtol=1e-5, atol=1e-5)
    g_t, g_o = grads(theirs), grads(ours)
    assert set(g_t) == set(g_o)
    for name in g_o:
        torch.testing.assert_close(g_t[name], g_o[name], rtol=1e-4, atol=1e-6, msg=name)

    # its own training forward: slot k learns the token at a + k + 1
    with torch.no_grad():
        own, _, _ = t(ids, feats, mask, target_last_hidden_states=final)
        shifted, _ = their_dspark_terms(t, ids, feats, final, anchors, shift=1)
        torch.testing.assert_close(own, shifted, rtol=1e-6, atol=1e-6)
        rows = torch.stack([our_rows(target, ours, ids, a) for a in anchors])  # [N, B, H], all slots
        a = torch.tensor(anchors)[:, None] + torch.arange(B)  # [N, B] slot k's own position a + k
        draft = dspark_logits(ours, target, rows.reshape(-1, rows.shape[-1]), ids[0, a].reshape(-1))
        labels = target.head(final[0, a].reshape(-1, final.shape[-1]))  # the target at a + k predicts a + k + 1
        ce = F.cross_entropy(draft, ids[0, a + 1].reshape(-1), reduction="none")
        agree = torch.minimum(labels.softmax(-1), draft.softmax(-1)).sum(-1)
        e = ours.markov_head.markov_w1(ids[0, a].reshape(-1))
        bce = F.binary_cross_entropy_with_logits(ours.confidence_head(rows.reshape(-1, rows.shape[-1]), e), agree,
                                                 reduction="none")
        w = torch.exp(-torch.arange(B, dtype=torch.float32) / GAMMA).expand(len(anchors), B).reshape(-1)
    torch.testing.assert_close(own, (w * (ce + bce)).sum() / w.sum(), rtol=1e-5, atol=1e-5)
    assert abs(own - loss_t) > 1e-2


# ------------------------------------------------------------------------------------------- Domino
def domino_prefixes(ids, a):
    """Our `prev` for slots 1..B-1 of the block at anchor a: the block's tokens a..a+k-1, -1 past them."""
    return torch.tensor([[int(ids[0, a + i]) if i < k else -1 for i in range(B - 1)] for k in range(1, B)])


def domino_written(target, path, prefix_len):
    ours = tiny_drafter(target, dict(DOMINO_CASE, pure_draft_prefix_len=prefix_len))
    with torch.no_grad():  # the GRU reads raw embedding rows (small): large input weights let each token count
        ours.prefix_gru.weight_ih_l0.mul_(20)
    save_drafter(ours, path)
    return ours


@pytest.mark.parametrize("prefix_len", [0, 1])
def test_specforge_builds_our_domino_and_drafts_our_chain(tmp_path, prefix_len):
    """Its DominoDraftModel loads our directory with nothing dropped; on its own training rows its
    `apply_logits_head` (teacher-forced block tokens) gives our corrected logits for slots 1..B-1; its greedy
    `_sample_draft_tokens` on its serving rows (the verified token first) drafts our chain; its spec_generate
    is the target's greedy output."""
    target = tiny_target()
    ours = domino_written(target, tmp_path / "d", prefix_len)
    theirs = load_specforge(tmp_path / "d")
    assert type(theirs).__name__ == "DominoDraftModel" and theirs.suffix_start == 1 + prefix_len
    assert not theirs.shift_label and theirs.prefix_gru.hidden_size == 6
    ids = random_ids()
    rows = their_training_rows(theirs, target, ours, ids, ANCHORS)
    head = target.model.get_output_embeddings()
    emb = target.model.get_input_embeddings()
    moved = 0
    for j, C in enumerate(ANCHORS):
        mine = our_rows(target, ours, ids, C)
        with torch.no_grad():
            logits = theirs.apply_logits_head(head(rows[j])[None, None], hidden_states=rows[j][None, None],
                                              prev_token_embeddings=emb(ids[:, C:C + B])[None])[0, 0]
            terms = ours.kind.slot_terms(ours, target.head, None, target.embed)
            want = terms.logits(mine[1:], domino_prefixes(ids, C))
            torch.testing.assert_close(logits[1:], want, **TOL)
            moved += int((want - target.head(mine[1:])).abs().max() > 1e-2)
            block = block_of(ours, ids, C)
            served = their_serving_rows(theirs, target, ids, C, block)
            chain = theirs._sample_draft_tokens(target.model, served[None], block[None])[0]
            drafted = ours.kind.draft(ours, target.head, mine[1:], int(ids[0, C]), None, None, None,
                                      embed=target.embed).tokens
        assert torch.equal(chain, drafted), (C, chain, drafted)
    assert moved == len(ANCHORS)  # the correction is not nothing
    if prefix_len:  # spec_generate once (it is the target's greedy output either way)
        return
    prompt = ids[:, :12]
    greedy = target.model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, 12:].tolist()
    assert theirs.spec_generate(target.model, prompt, max_new_tokens=24, stop_token_ids=None,
                                temperature=0.0)[0, 12:].tolist() == greedy


@pytest.mark.parametrize("progress", [0.2])
def test_specforge_domino_loss_is_our_hard_loss_on_greedy_data(tmp_path, progress):
    """OnlineDominoModel (shift_label false) at its strategy's lambda_base for this point of the run
    (`linear_lambda_base`, lambda_base_start 1, decay ratio 0.5: 0.6, both terms): (1 - lambda) final + lambda base
    cross-entropy, weights exp(-(k-1)/gamma) from slot 1, and every weight's gradient, are our hard loss at
    that progress on the same anchors (greedy data: the data's token is the target's argmax)."""
    strategies = importlib.import_module("specforge.training.strategies.base")
    from blockdraft.model.kinds.domino import lambda_base

    target = tiny_target()
    ours = domino_written(target, tmp_path / "d", 1)
    theirs = load_specforge(tmp_path / "d")
    ids, mask = greedy_batch(target)
    anchors = torch.tensor(GREEDY_ANCHORS)
    lam = strategies.linear_lambda_base(int(progress * 100), 100, 1.0, 0.5)
    assert lam == lambda_base(1.0, 0.5, progress)
    with torch.no_grad():
        feats = target(ids, return_logits=False).features
    t = family.OnlineDominoModel(theirs.train(), target.model.get_output_embeddings(),
                                 target.model.get_input_embeddings(), ours.mask_token_id, block_size=B,
                                 attention_backend="sdpa", loss_decay_gamma=GAMMA, shift_label=False)
    fix_anchors(t, GREEDY_ANCHORS)
    loss_t, acc_t, m_t = t(ids, feats, mask, lambda_base=lam)
    loss_t.backward()
    ours.train()
    ours.train_progress = progress
    loss_o, metrics = compute_loss(target, ours, Batch(ids, mask), anchors=anchors, loss="hard", gamma=GAMMA)
    loss_o.backward()
    torch.testing.assert_close(loss_t, loss_o, rtol=1e-5, atol=1e-5)
    assert abs(acc_t.item() - metrics["accuracy"]) < 1e-6
    assert abs(m_t["final_loss"] - m_t["base_loss"]) > 1e-2  # the two terms differ: lambda matters
    g_t, g_o = grads(theirs), grads(ours)
    assert set(g_t) == set(g_o) and {"prefix_gru.weight_ih_l0", "embed_proj.2.weight"} <= set(g_o)
    for name in g_o:
        torch.testing.assert_close(g_t[name], g_o[name], rtol=1e-4, atol=1e-6, msg=name)
