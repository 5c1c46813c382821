"""LiLiCorr (model/kinds/lilicorr.py): its start is the DFlash function, its walk drafts what its scores
say, its sampled drafts come from the distributions it reports, and generation stays the target's own.
vLLM's own scores and walk on the same weights: reference/test_vllm_lilicorr.py."""

from __future__ import annotations

import pytest
import torch

from blockdraft.generate import speculative_generate
from blockdraft.model.kinds.lilicorr import LatticeInputs
from blockdraft.train.build import change_kind
from .test_kinds import assert_drawn_from, dflash, perturb, target

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
