"""NVIDIA NeMo AutoModel 0.7.0 (`nemo_automodel.components.speculative.dflash`, the trainer that ships
DFlash drafters for DeepSeek-V4, GLM-5.2, Kimi-K3 and MiniMax-M3) reads blockdraft's native DFlash
directories with its own class (`Qwen3DFlashDraftModel.from_pretrained`), keeps every tensor we wrote, and
its serving call, its training forward, its loss and its own generation loop compute ours.

NeMo AutoModel runs on its sdpa path (dense additive masks), never flex attention: nothing is compiled.
Run in `.venv-ref-spec`, where `reference/setup.sh` adds it with --no-deps: `reference/run.sh` (PYTHONPATH=src).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from common import ANCHORS, CASES, GREEDY_ANCHORS, B, block_of, greedy_batch, our_rows, random_ids, threads, \
    tiny_target, written
from safetensors.torch import load_file

from blockdraft.generate import speculative_generate
from blockdraft.model import DFlashDrafter
from blockdraft.train import Batch, compute_loss

# this environment has the package: missing is a failure, never a skip (reference/README.md)
draft = importlib.import_module("nemo_automodel.components.speculative.dflash.draft_qwen3")
core = importlib.import_module("nemo_automodel.components.speculative.dflash.core")
threads()

TOL = dict(rtol=1e-4, atol=1e-4)


def load_nemo(path):
    """NeMo's class on our directory, in fp32 on sdpa: every tensor of our file is in its model with our
    values, and nothing it has is left at its initialisation."""
    model, info = draft.Qwen3DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32,
                                                              attn_implementation="sdpa", output_loading_info=True)
    assert not info.get("missing_keys") and not info.get("mismatched_keys"), info
    file, theirs = load_file(str(path / "model.safetensors")), model.state_dict()
    unexpected = set(info.get("unexpected_keys") or ())
    # a draft vocabulary's map and head rows: NeMo scores the target's full head (its own rows are ours)
    assert unexpected <= {"d2t", "lm_head.weight"}, info
    for name, value in file.items():
        if name not in unexpected:
            assert name in theirs and torch.equal(theirs[name], value), name
    return model.eval()


@torch.no_grad()
def their_serving_rows(model, target, ids, C, block):
    """The call NeMo's `spec_generate` makes for a block at anchor C (no mask: its sliding layers band the
    keys themselves, `_sliding_window_mask`)."""
    feats = target(ids[:, :C], return_logits=False).features
    return model(target_hidden=feats, noise_embedding=model.embed_noise_block(target.model, block[None]),
                 position_ids=torch.arange(C + B)[None])[0]


def trainer(model, target, ours, anchors, **kw):
    """NeMo's DFlash training module on the sdpa mask, its random anchor draw replaced by `anchors`."""
    t = core.DFlashTrainerModule(model, target.model.get_output_embeddings(), target.model.get_input_embeddings(),
                                 ours.mask_token_id, block_size=B, attention_backend="sdpa", **kw)
    a = torch.tensor([list(anchors)])
    t._sample_anchor_positions = lambda seq_len, loss_mask, device, doc_remaining=None: (
        a, torch.ones_like(a, dtype=torch.bool))
    return t


@torch.no_grad()
def their_training_rows(model, target, ours, ids, anchors, **kw):
    """NeMo's training forward (its block inputs, its mask, its model) for blocks at `anchors`: [N, B, H]."""
    t = trainer(model, target, ours, anchors, **kw)
    feats = target(ids, return_logits=False).features
    _, _, noise, pos, mask, _ = t._prepare_block_inputs(ids, torch.ones_like(ids))
    out = model(position_ids=pos, noise_embedding=noise, target_hidden=feats, attention_mask=mask)
    return out.reshape(len(anchors), B, -1)


def bidirectional_twin(ours, **changes):
    """Our drafter with the same weights and every sliding layer bidirectional in the block (and `changes`)."""
    twin = DFlashDrafter(dataclasses.replace(ours.config, sliding_causal_in_block=False, **changes))
    twin.load_state_dict(ours.state_dict())
    return twin.eval()


# ------------------------------------------------------------------ the drafter, as NeMo builds it
@pytest.mark.parametrize("case", ["full-2layers", "sliding-causal", "sliding-bidirectional", "mixed", "draft-vocab"])
def test_nemo_loads_our_dflash_directory_and_serves_our_function(tmp_path, case):
    """Its serving call computes ours, the full head's rows included. A sliding layer it serves
    bidirectional in the block (its own band, `_sliding_window_mask`, symmetric, from the query): a
    drafter whose sliding layers are causal in the block is served as its bidirectional twin
    (docs/consumers.md, "NeMo AutoModel")."""
    target = tiny_target()
    ours = written(target, CASES[case], tmp_path / "d")
    theirs = load_nemo(tmp_path / "d")
    assert theirs.target_layer_ids == target.layer_ids and theirs.block_size == B
    assert theirs.mask_token_id == ours.mask_token_id
    causal = CASES[case].get("sliding_causal_in_block", False)
    served = bidirectional_twin(ours) if causal else ours
    ids, rows = random_ids(), ours.vocab_rows
    for C in ANCHORS:
        other = their_serving_rows(theirs, target, ids, C, block_of(ours, ids, C))
        mine = our_rows(target, served, ids, C)
        torch.testing.assert_close(other, mine, **TOL)
        logits = theirs.compute_logits(other, target.model.get_output_embeddings())  # the full head
        torch.testing.assert_close(logits if rows is None else logits[:, rows], target.head(mine, rows), **TOL)
        if causal:
            assert (our_rows(target, ours, ids, C) - other).abs().max() > 1e-2, C


@pytest.mark.parametrize("case", ["full-2layers", "sliding-bidirectional", "mixed", "draft-vocab"])
def test_nemo_trains_our_function_with_one_window_for_every_layer(tmp_path, case):
    """Its training forward (its block inputs, its sdpa mask) on our anchors computes our training rows.
    Its window is the trainer's `sliding_window`, one for every layer: set to ours, it is our drafter
    where every layer slides (a drafter with full layers beside sliding ones trains as its all-sliding
    twin there, and serves per layer); unset, no layer is windowed."""
    target = tiny_target()
    ours = written(target, CASES[case], tmp_path / "d")
    theirs = load_nemo(tmp_path / "d")
    ids = random_ids()
    window = CASES[case].get("sliding_window")
    got = their_training_rows(theirs, target, ours, ids, ANCHORS, sliding_window=window)
    trained = ours if case != "mixed" else bidirectional_twin(ours, layer_types=["sliding_attention"] * 2)
    for i, C in enumerate(ANCHORS):
        torch.testing.assert_close(got[i], our_rows(target, trained, ids, C), **TOL)
    if window:
        unwindowed = their_training_rows(theirs, target, ours, ids, ANCHORS)
        assert (unwindowed[-1] - got[-1]).abs().max() > 1e-2  # the last anchor's context passes the window


@pytest.mark.parametrize("gamma", [2.0, 7.0])
def test_nemo_dflash_loss_and_gradients_are_ours_on_greedy_data(tmp_path, gamma):
    """DFlashTrainerModule's loss (DFlashDecayLoss, slot k from 1 weighted exp(-(k-1)/gamma), over the sum
    of the weights) and every weight's gradient are ours (`loss="hard"`) on the same anchors."""
    target = tiny_target()
    ours = written(target, CASES["full-2layers"], tmp_path / "d")
    theirs = load_nemo(tmp_path / "d").train()
    ids, mask = greedy_batch(target)
    with torch.no_grad():
        feats = target(ids, return_logits=False).features
    got = trainer(theirs, target, ours, GREEDY_ANCHORS, loss_decay_gamma=gamma)(ids, feats, mask)
    got.loss.backward()
    ours.train()
    loss, metrics = compute_loss(target, ours, Batch(ids, mask), anchors=torch.tensor(GREEDY_ANCHORS), loss="hard",
                                 gamma=gamma)
    loss.backward()
    torch.testing.assert_close(got.loss, loss, rtol=1e-5, atol=1e-5)
    assert abs(got.accuracy.item() - metrics["accuracy"]) < 1e-6
    g_t = {n: p.grad for n, p in theirs.named_parameters() if p.grad is not None}
    g_o = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert set(g_t) == set(g_o)
    for name in g_o:
        torch.testing.assert_close(g_t[name], g_o[name], rtol=1e-4, atol=1e-6, msg=name)


def test_nemo_spec_generate_is_the_targets_greedy_output_with_our_drafts(tmp_path):
    """NeMo's own loop reproduces the target's greedy output, and drafts what we draft at every full step."""
    target = tiny_target()
    ours = written(target, CASES["full-2layers"], tmp_path / "d")
    theirs = load_nemo(tmp_path / "d")
    ids = random_ids(12, seed=2)
    ref = target.model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)[0, 12:].tolist()
    blocks, forward = [], target.model.forward

    def seen(input_ids=None, **kw):
        blocks.append(input_ids[0].tolist())
        return forward(input_ids=input_ids, **kw)

    target.model.forward = seen
    try:
        out = theirs.spec_generate(target.model, ids, max_new_tokens=30, stop_token_ids=None, temperature=0.0)
    finally:
        target.model.forward = forward
    assert out[0, 12:].tolist() == ref
    res = speculative_generate(target, ours, ids, max_new_tokens=30)
    assert res.tokens == ref
    # each verify forward after the prefill is [anchor, drafts]; ours shrinks the steps near the end to the
    # room left, NeMo's does not: the full steps are compared
    full = [i for i, v in enumerate(res.verified) if v == B]
    assert len(full) >= len(res.verified) - 2
    assert [blocks[1 + i][1:] for i in full] == [res.drafts[i] for i in full]


def test_nemo_spec_generate_cannot_take_back_a_sliding_layers_drafts_past_its_window(tmp_path):
    """NeMo's loop keeps the draft's cache in a DynamicCache built from the draft's config and crops it
    after each block; transformers (5.19 here) refuses that crop on a sliding layer once the window is
    full. So NeMo's own loop stops on a drafter with sliding layers past the window; its serving call
    and training (above) compute such a drafter, and engines serve it."""
    target = tiny_target()
    written(target, CASES["sliding-bidirectional"], tmp_path / "d")
    theirs = load_nemo(tmp_path / "d")
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        theirs.spec_generate(target.model, random_ids(12, seed=2), max_new_tokens=30, stop_token_ids=None,
                             temperature=0.0)
