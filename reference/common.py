"""Shared pieces of the reference suite: targets, drafter cases, the SmolLM2 pair, prompts.

The suite runs in the consumers' own environments (`reference/setup.sh`), with blockdraft
imported from the source tree (PYTHONPATH=src). Everything is built in code or read from the
local SmolLM2 cache; nothing is downloaded.

Legend: C context rows, B block size, H hidden size, F feature layers, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.target import TargetModel
from blockdraft.target.tiny import tiny_causal_lm

TINY_V = 160
W, B = 6, 4  # a window shorter than the contexts below: anchors on both sides of W - B + 1 = 3

# name -> DrafterConfig overrides. Every case but "anchor-*" uses the engines' query window.
CASES = {
    "full-2layers": dict(num_layers=2),
    "sliding-causal": dict(num_layers=1, layer_types=["sliding_attention"], sliding_window=W,
                           sliding_causal_in_block=True),
    "sliding-bidirectional": dict(num_layers=1, layer_types=["sliding_attention"], sliding_window=W,
                                  sliding_causal_in_block=False),
    "mixed": dict(num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=W,
                  sliding_causal_in_block=True),
    "draft-vocab": dict(num_layers=2, draft_vocab_size=48),
}
# The newer drafter kinds on the "full-2layers" backbone (full vocabulary: speculators' DFlash2 needs it).
KIND_CASES = {
    "dspark": dict(num_layers=2, kind="dspark", markov_rank=8),
    "dflash2": dict(num_layers=2, kind="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4),
}
ANCHOR_CASES = {
    "anchor-causal": dict(num_layers=1, layer_types=["sliding_attention"], sliding_window=W,
                          sliding_causal_in_block=True, sliding_window_rule="anchor"),
    "anchor-bidirectional": dict(num_layers=1, layer_types=["sliding_attention"], sliding_window=W,
                                 sliding_causal_in_block=False, sliding_window_rule="anchor"),
}


def threads() -> None:
    torch.set_num_threads(int(os.environ.get("REFERENCE_THREADS", "2")))


def tiny_target(seed: int = 0) -> TargetModel:
    """A tiny Qwen3 target (6 layers, hidden 32), features from layers 1 and 3."""
    return TargetModel(tiny_causal_lm("qwen3", vocab=TINY_V, layers=6, hidden=32, seed=seed), None, [1, 3],
                       mask_token_id=TINY_V - 1, name="tiny-qwen3")


def tiny_drafter(target: TargetModel, case: dict, seed: int = 0) -> DFlashDrafter:
    """A drafter whose every weight (norms included) is random and far from its initialisation,
    so that a dropped norm, a wrong window or a transposed head cannot hide."""
    torch.manual_seed(seed)
    d = DFlashDrafter(DrafterConfig.for_target(target, block_size=B, **case))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    if d.config.draft_vocab_size:
        g = torch.Generator().manual_seed(seed)
        d.set_draft_vocab(torch.randperm(TINY_V - 1, generator=g)[: d.config.draft_vocab_size])
    return d.eval()


def save_target(target: TargetModel, path) -> str:
    """A target directory its readers open offline (config + safetensors)."""
    target.model.save_pretrained(path)
    return str(path)


def smollm2_target(layer_ids=None) -> TargetModel:
    return TargetModel.from_pretrained("smollm2", layer_ids=layer_ids)


def smollm2_variants():
    """Drafters for SmolLM2 with real acceptance: the shipped drafter and variants of its weights
    that compute other functions (each still drafts well enough to accept tokens)."""
    from blockdraft.checkpoint import load_drafter

    base = load_drafter("default")
    out = {"shipped": base}

    def variant(**changes):
        d = DFlashDrafter(dataclasses.replace(base.config, **changes))
        sd = base.state_dict()
        if not d.config.draft_vocab_size:
            sd = {k: v for k, v in sd.items() if k != "draft_vocab"}
        d.load_state_dict(sd, strict=False)
        return d.eval()

    out["anchor-causal"] = variant(sliding_window_rule="anchor")
    # a narrow window makes the two rules compute clearly different drafts: under the query rule
    # block position k >= W - 1 sees no context at all. W=8 tied on stage 5's weights (positions
    # that deep are rarely reached); W=3 gives accepted-per-position 97/19/6 (anchor) vs 90/0/0
    out["anchor-causal-w3"] = variant(sliding_window_rule="anchor", sliding_window=3)
    out["query-causal-w3"] = variant(sliding_window_rule="query", sliding_window=3)
    out["query-causal"] = variant(sliding_window_rule="query")
    out["query-causal-full-vocab"] = variant(sliding_window_rule="query", draft_vocab_size=None)
    out["query-bidirectional"] = variant(sliding_window_rule="query", sliding_causal_in_block=False)
    out["full-attention"] = variant(layer_types=["full_attention"], sliding_window=None)
    return out


def full_vocab(d: DFlashDrafter) -> DFlashDrafter:
    """The same drafter scoring the target's whole head: what dflash computes from its directory
    (it reads no draft vocabulary; its load report lists `draft_vocab` as unexpected)."""
    f = DFlashDrafter(dataclasses.replace(d.config, draft_vocab_size=None))
    f.load_state_dict({k: v for k, v in d.state_dict().items() if k != "draft_vocab"})
    return f.eval()


def eval_prompts(n_per_set: int = 2) -> list[list[dict]]:
    """Chat prompts from the evaluation sets (never trained on)."""
    from blockdraft.bench.prompts import load_prompt_set

    return [p for name in ("mtbench", "gsm8k", "humaneval") for p in load_prompt_set(name, n_per_set)]
