"""z-lab's `dflash` package (0.1.0) loads blockdraft's native directories as written and computes
the same drafter; its own generation loop reproduces the target's greedy output.

Run in the speculators/dflash environment: `reference/run.sh` (PYTHONPATH=src).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from common import ANCHOR_CASES, CASES, TINY_V, B, W, full_vocab, smollm2_target, smollm2_variants, threads, \
    tiny_drafter, tiny_target

from blockdraft.checkpoint import save_drafter
from blockdraft.generate import speculative_generate
from blockdraft.generate.speculative import CPU_VERIFY_CHUNK

# this environment has the package: missing is a failure, never a skip (reference/README.md)
dflash_model = importlib.import_module("dflash.model")
threads()


def load_dflash(path):
    m = dflash_model.DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32)
    return m.eval()


@torch.no_grad()
def both_hidden(target, ours, theirs, ids, C):
    """The block at anchor C over context rows 0..C-1: our cached drafting and dflash's forward
    (no cache: its own mask over [context ; block] keys). Returns normed hidden [B, H] each."""
    feats = target(ids[:, :C], return_logits=False).features[0]  # [C, F*H]
    block = torch.full((B,), ours.mask_token_id, dtype=torch.long)
    block[0] = ids[0, C]
    emb = target.embed(block)  # [B, H]
    mine = ours.draft_hidden(feats, torch.arange(C), emb, C, ours.new_context_cache())
    pos = torch.arange(C + B)[None]
    other = theirs(target_hidden=feats[None], noise_embedding=emb[None], position_ids=pos, past_key_values=None,
                   use_cache=False)[0]
    return mine, other


@pytest.mark.parametrize("case", sorted(CASES))
def test_dflash_drafter_equals_ours(tmp_path, case):
    target = tiny_target()
    ours = tiny_drafter(target, CASES[case])
    save_drafter(ours, tmp_path / "d",
                 head_rows=target.head_rows(ours.draft_vocab) if ours.config.draft_vocab_size else None)
    theirs = load_dflash(tmp_path / "d")
    assert theirs.target_layer_ids == target.layer_ids and theirs.block_size == B
    ids = torch.randint(0, TINY_V - 1, (1, 40), generator=torch.Generator().manual_seed(1))
    rows = ours.vocab_rows
    for C in (1, W - B, W - B + 1, W, 17, 35):  # anchors before and after the window leaves position 0
        mine, other = both_hidden(target, ours, theirs, ids, C)
        torch.testing.assert_close(other, mine, rtol=1e-4, atol=1e-4)
        # dflash scores the target's full head; on a draft vocabulary its rows equal ours
        full = theirs.compute_logits(other, target.model.get_output_embeddings())
        mine_logits = target.head(mine, rows)
        torch.testing.assert_close(full if rows is None else full[:, rows], mine_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", sorted(ANCHOR_CASES))
def test_dflash_windows_from_the_query_so_an_anchor_drafter_differs_past_w_minus_b_plus_1(tmp_path, case):
    """The sliding-window table, measured with dflash's own code: equal while the anchor's window
    and every query's window reach position 0, different from a = W - B + 1 on."""
    target = tiny_target()
    ours = tiny_drafter(target, ANCHOR_CASES[case])
    save_drafter(ours, tmp_path / "d")
    theirs = load_dflash(tmp_path / "d")
    ids = torch.randint(0, TINY_V - 1, (1, 40), generator=torch.Generator().manual_seed(1))
    for C in range(1, 20):
        mine, other = both_hidden(target, ours, theirs, ids, C)
        diff = (mine - other).abs().max().item()
        if C <= W - B:
            assert diff < 1e-4, (C, diff)
        else:
            assert diff > 1e-3, (C, diff)


def dflash_generate(theirs, model, ids, n):
    """dflash's own loop; its timing calls torch.cuda.synchronize, which a CPU run replaces."""
    real = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        return dflash_model.dflash_generate(theirs, model, ids, n, stop_token_ids=None, return_stats=True)
    finally:
        torch.cuda.synchronize = real


@pytest.mark.parametrize("case", ["sliding-causal", "full-2layers", "mixed"])
def test_dflash_spec_generate_is_the_targets_greedy_output(tmp_path, case):
    target = tiny_target()
    ours = tiny_drafter(target, CASES[case])
    save_drafter(ours, tmp_path / "d")
    theirs = load_dflash(tmp_path / "d")
    ids = torch.randint(0, TINY_V - 1, (1, 12), generator=torch.Generator().manual_seed(2))
    ref = target.model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)[0, 12:].tolist()
    out = theirs.spec_generate(target.model, ids, max_new_tokens=30, stop_token_ids=None)
    assert out[0, 12:].tolist() == ref
    assert speculative_generate(target, ours, ids, max_new_tokens=30).tokens == ref


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_target([1, 8, 14, 21, 27])


TARGET_GREEDY: dict = {}  # prompt ids -> SmolLM2's greedy continuation (transformers' generate), made once


@pytest.mark.parametrize("variant", ["query-causal-full-vocab", "full-attention", "query-bidirectional"])
def test_smollm2_acceptance_per_step_equals_dflash(tmp_path, smollm2, variant):
    """A trained drafter on the real target: dflash's loop and ours commit the same tokens in the
    same steps (the drafter computes the same drafts at every step), and both equal the target's
    greedy output. dflash scores the full head, so ours does too here: with the shipped draft
    vocabulary a step whose best draft lies outside it differs (stage 5's weights had one)."""
    from common import eval_prompts

    from blockdraft.data.chat import encode_prompt as encode

    ours = full_vocab(smollm2_variants()[variant])
    save_drafter(ours, tmp_path / "d")
    theirs = load_dflash(tmp_path / "d")
    steps = []
    for messages in eval_prompts(1):
        ids = encode(smollm2.tokenizer, messages)
        P = ids.shape[1]
        key = tuple(ids[0].tolist())
        if key not in TARGET_GREEDY:  # the target's greedy output: the same prompt gives it for every variant
            TARGET_GREEDY[key] = smollm2.model.generate(ids, max_new_tokens=48, do_sample=False)[0, P:].tolist()
        ref = TARGET_GREEDY[key]
        stats = dflash_generate(theirs, smollm2.model, ids, 48)
        assert stats.output_ids[0, P:].tolist() == ref
        res = speculative_generate(smollm2, ours, ids, max_new_tokens=48, verify_chunk=CPU_VERIFY_CHUNK)
        assert res.tokens == ref
        # dflash shrinks its last block to the tokens left, as ours does: step for step the same
        assert list(stats.acceptance_lengths) == res.accepted, (variant, messages[0]["content"][:40])
        steps += res.accepted
    assert sum(a > 1 for a in steps) >= 10  # drafts were accepted: the comparison has teeth


@torch.no_grad()
def test_dflash_serves_a_dflash2_directory_as_blockdraft_computes_it(tmp_path):
    """z-lab's dflash has its own DFlash2DraftModel: it loads our native DFlash2 directory with nothing
    missing or left over, its rows are ours (convolutions included), its greedy selector walk from
    the anchor drafts what ours drafts, and its generation is the target's greedy output."""
    from common import KIND_CASES

    target = tiny_target()
    ours = tiny_drafter(target, KIND_CASES["dflash2"])
    save_drafter(ours, tmp_path / "d")
    theirs, info = dflash_model.DFlash2DraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32,
                                                                 output_loading_info=True)
    theirs.eval()
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.randint(0, TINY_V - 1, (1, 40), generator=torch.Generator().manual_seed(1))
    head = target.model.get_output_embeddings()
    for C in (1, 2, 5, 17, 35):
        mine, other = both_hidden(target, ours, theirs, ids, C)
        torch.testing.assert_close(other, mine, rtol=1e-4, atol=1e-4)
        drafts = ours.kind.draft(ours, target.head, mine[1:], int(ids[0, C]), None, None, None).tokens
        walk, _, _ = theirs.propose(other[None, 1:], ids[:, C], head, 0.0)
        assert torch.equal(drafts, walk[0]), C
    ref = target.model.generate(ids[:, :12], max_new_tokens=30, do_sample=False, pad_token_id=0)[0, 12:].tolist()
    assert dflash_generate(theirs, target.model, ids[:, :12], 30).output_ids[0, 12:].tolist() == ref
