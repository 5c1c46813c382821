"""z-lab's dflash as a consumer of blockdraft's drafters (one `Consumer` of blockdraft.engines): its
`DFlashDraftModel` and `DFlash2DraftModel` load the z-lab layout (`convert --to zlab`, and `train`'s
own directories); it has no DSpark model. It runs the target with transformers, so any target
transformers loads can hand it hidden states.
"""

from __future__ import annotations

from ..config import WINDOW_ANCHOR, DrafterConfig
from .base import ANCHOR_RULE_SERVED, Difference, Consumer, ignores_draft_vocab

DFLASH_READ = "0.1.0"


def quirks(fmt: str, cfg: DrafterConfig) -> list[Difference]:
    """What dflash 0.1.0 does with the z-lab layout that the drafter's function does not say."""
    if fmt != "zlab":
        return []
    out = []
    if cfg.has_sliding and cfg.sliding_window_rule == WINDOW_ANCHOR:
        out.append(Difference("dflash", True, ANCHOR_RULE_SERVED))
    if cfg.draft_vocab_size:
        out.append(Difference("dflash", False, ignores_draft_vocab(cfg)))
    if cfg.kind == "lilicorr":
        out.append(Difference("dflash", False, "has no LiLiCorr (dflash/model.py: DFlash and DFlash2 only): it "
                                               "does not load this LiLiCorrDraftModel directory"))
    if cfg.kind == "dspark":  # it has DFlash and DFlash2 only (dflash/model.py, benchmark.py)
        out.append(Difference("dflash", False, "has no DSpark: it loads this directory as a DFlashDraftModel and "
                                               "drops markov_head.* and confidence_head.* as unexpected weights, so "
                                               "it drafts the backbone's argmax without the Markov bias (output "
                                               "stays lossless; drafts differ)"))
    if cfg.kind == "domino":  # no DominoDraftModel in dflash 0.1.0
        out.append(Difference("dflash", False, "has no Domino (no DominoDraftModel): it does not load this drafter"))
    return out

CONSUMER = Consumer(
    name="dflash", release=f"dflash {DFLASH_READ}", formats=("zlab",),
    kinds={"dflash": "", "dflash2": "z-lab layout"},
    refused_kinds={"dspark": "it drops the Markov and confidence heads", "lilicorr": "no LiLiCorr",
                   "domino": "no DominoDraftModel: it has no GRU correction"}, quirks=quirks,
)
