"""NVIDIA Model-Optimizer 0.47.0's Domino (`modelopt/torch/speculative/plugins/modeling_domino.py`,
`hf_domino.py`) against blockdraft's, on the same weights.

Its `DominoModule` (the DFlash backbone + `prefix_gru` + `embed_proj`) takes our directory's tensors under
the names and shapes we write. Its training wrapper `HFDominoModel` needs a whole transformers target
converted by `mtsp.convert`; what it computes of the head and the loss is in two methods, run here as
they are written, on a stand-in `self` that holds only what they read (`dflash_block_size`, `dflash_module`,
`_base_model_embeddings`, `dflash_loss_decay_factor`, `_current_lambda_base`): `_apply_domino_head` and
`_compute_domino_loss`.

Model-Optimizer trains `shift_label: true` only (its `modify` refuses false): block position i predicts
the token at a + i + 1, from the row at position i and the GRU over a..a+i. blockdraft's slot k = i + 1
predicts that same token from the GRU over the same tokens, but from the row at position i + 1. So its
head and loss are ours under a one-row shift: fed our rows of slots 1..B-1 at positions 0..B-2, its
corrected logits are ours and its loss is ours (its weights exp(-i/gamma) are ours, exp(-(k-1)/gamma)).
Its own function on its own rows is another drafter's (the anchor's row predicts a + 1): not ours.

Run in `.venv-ref-spec` (nvidia-modelopt --no-deps, plus the pure-python omegaconf and pulp and scipy its
`modelopt.torch` import needs: reference/requirements-spec.txt).
"""

from __future__ import annotations

import functools
import importlib
import json
from types import SimpleNamespace

import pytest
import torch
from common import DOMINO_CASE, B, threads, tiny_drafter, tiny_target
from safetensors.torch import load_file

from blockdraft.checkpoint import save_drafter
from blockdraft.train import Batch, compute_loss
from blockdraft.train.step import prepare

# this environment has the package: missing is a failure, never a skip (reference/README.md)
hf_domino = importlib.import_module("modelopt.torch.speculative.plugins.hf_domino")
modeling_domino = importlib.import_module("modelopt.torch.speculative.plugins.modeling_domino")
threads()

GAMMA = 2.0
PROMPT, NEW = 8, 32
ANCHORS = (8, 12, 16, 20, 24, 28, 32)  # B apart: a + B, where its position B - 1 would learn, is the next anchor


@functools.cache
def _greedy_ids():
    p = torch.randint(0, 159, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    return tiny_target().model.generate(p, max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def greedy_batch(target):
    """A row whose tokens after the prompt are the target's greedy output (the data's token is the argmax):
    Model-Optimizer learns the data, blockdraft's hard loss the argmax. The positions a + B (what
    Model-Optimizer's last block position would learn; ours has no such slot) are out of the loss. Made
    once (the same tiny target every time)."""
    ids = _greedy_ids().clone()
    mask = torch.ones_like(ids)
    mask[:, :PROMPT] = 0
    for a in ANCHORS:
        mask[0, a + B] = 0
    return ids, mask


def their_module(path, prefix_len):
    """Model-Optimizer's DominoModule built from our config.json (its shift_label: true), our tensors
    loaded strictly: every name and shape of ours is one of its."""
    from transformers import Qwen3Config

    raw = json.loads((path / "config.json").read_text())
    dc = raw["dflash_config"]
    cfg = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "dflash_config", "blockdraft")})
    cfg.block_size, cfg.target_layer_ids = raw["block_size"], dc["target_layer_ids"]
    cfg.emb_dim, cfg.gru_hidden_dim, cfg.pure_draft_prefix_len = dc["emb_dim"], dc["gru_hidden_dim"], prefix_len
    cfg.shift_label, cfg.projector_type = True, dc["projector_type"]
    module = modeling_domino.DominoModule(cfg)
    module.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    return module


def written(target, path, prefix_len):
    ours = tiny_drafter(target, dict(DOMINO_CASE, pure_draft_prefix_len=prefix_len))
    with torch.no_grad():  # the GRU reads raw embedding rows (small): large input weights let each token count
        ours.prefix_gru.weight_ih_l0.mul_(20)
    save_drafter(ours, path)
    return ours


def stand_in(module, target, lam):
    return SimpleNamespace(dflash_block_size=B, dflash_module=module, dflash_loss_decay_factor=GAMMA,
                           _base_model_embeddings=target.model.get_input_embeddings(),
                           _current_lambda_base=lambda: lam)


def shifted(rows):
    """Our rows [N, B, H] of slots 1..B-1 at Model-Optimizer's positions 0..B-2; position B-1 a zero row."""
    return torch.cat([rows[:, 1:], torch.zeros_like(rows[:, :1])], 1)


@pytest.mark.parametrize("prefix_len", [0, 1])
def test_modelopt_domino_head_and_loss_are_ours_under_the_one_row_shift(tmp_path, prefix_len):
    """Its `_apply_domino_head` on our rows shifted by one gives our corrected logits of slots 1..B-1
    (pure_draft_prefix_len counted alike: its positions 0..p-1, our slots 1..p, keep the head's logits);
    its `_compute_domino_loss` at lambda 0.6 is our hard loss at that point of the schedule, and the
    gradients it gives the GRU and the projection are ours."""
    target = tiny_target()
    ours = written(target, tmp_path / "d", prefix_len)
    module = their_module(tmp_path / "d", prefix_len)
    ids, mask = greedy_batch(target)
    anchors = torch.tensor([ANCHORS])
    N = len(ANCHORS)
    ours.train()
    ours.train_progress = 0.2  # lambda 1 * (1 - 0.2 / 0.5) = 0.6
    p = prepare(target, ours, Batch(ids, mask), anchors=anchors[0])
    rows = ours(p.features, p.block_embeds, p.layout).detach()  # [N, B, H]
    me = stand_in(module, target, 0.6)
    hidden = shifted(rows).reshape(1, N * B, -1)
    base = target.model.get_output_embeddings()(hidden)
    final = hf_domino.HFDominoModel._apply_domino_head(me, hidden, base, ids, anchors, N)  # [1, N*B, V]
    terms = ours.kind.slot_terms(ours, target.head, None, target.embed)
    with torch.no_grad():
        for j, a in enumerate(ANCHORS):
            prev = torch.tensor([[int(ids[0, a + i]) if i < k else -1 for i in range(B - 1)] for k in range(1, B)])
            want = terms.logits(rows[j, 1:], prev)
            torch.testing.assert_close(final[0, j * B:j * B + B - 1], want, rtol=1e-4, atol=1e-4)
            assert (want - target.head(rows[j, 1:])).abs().max() > 1e-2  # the correction is not nothing
    loss_t, _, m = hf_domino.HFDominoModel._compute_domino_loss(me, base, final, ids, anchors,
                                                                torch.ones(1, N, dtype=torch.bool), mask)
    loss_t.backward()
    loss_o, _ = compute_loss(target, ours, Batch(ids, mask), anchors=anchors[0], loss="hard", gamma=GAMMA)
    loss_o.backward()
    torch.testing.assert_close(loss_t, loss_o, rtol=1e-5, atol=1e-5)
    assert abs(m["final_loss"] - m["base_loss"]) > 1e-2
    for name, param in module.named_parameters():
        if name.startswith(("prefix_gru", "embed_proj")):
            torch.testing.assert_close(param.grad, dict(ours.named_parameters())[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=name)


def test_modelopt_own_alignment_is_another_drafter():
    """Its `modify` refuses shift_label false, and its lambda schedule's default decays over the whole run
    (dflash_lambda_base_decay_ratio 1.0) where SpecForge's and ours decay over half (0.5)."""
    import inspect

    src = inspect.getsource(hf_domino.HFDominoModel.modify)
    assert "shift_label=True (next-token alignment) only" in src
    assert hf_domino.compute_lambda_base(50, 100, 1.0, 1.0) == pytest.approx(0.5)
    from blockdraft.model.kinds.domino import lambda_base

    assert lambda_base(1.0, 1.0, 0.5) == pytest.approx(hf_domino.compute_lambda_base(50, 100, 1.0, 1.0))
