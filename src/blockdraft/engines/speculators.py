"""speculators as a consumer of blockdraft's drafters (one `Consumer` of blockdraft.engines): its
DFlash, DSpark and DFlash2 models load the speculators layout (`convert --to speculators`) for
training and evaluation; its DFlash2 needs the full target vocabulary. It runs the target with
transformers, so any target transformers loads can hand it hidden states.
"""

from __future__ import annotations

from ..config import WINDOW_QUERY, DrafterConfig
from ..releases import SPECULATORS_RELEASE
from .base import Difference, Consumer

SPECULATORS_READ = SPECULATORS_RELEASE


def quirks(fmt: str, cfg: DrafterConfig) -> list[Difference]:
    """What speculators does with the speculators layout that the drafter's function does not say."""
    if fmt != "speculators":
        return []
    out = []
    if cfg.has_sliding and cfg.sliding_window_rule == WINDOW_QUERY:
        out.append(Difference("speculators", False, "trains and evaluates sliding layers with the anchor window "
                                                    "(every slot sees a - W <= p < a); this drafter uses the "
                                                    "query rule that vLLM serves"))
    if cfg.kind == "lilicorr":
        out.append(Difference("speculators", False, f"has no LiLiCorr ({SPECULATORS_READ}): the export is refused"))
    if cfg.kind == "dflash2" and cfg.draft_vocab_size:
        out.append(Difference("speculators", False, "its DFlash2 requires the full target vocabulary "
                                                    "(models/dflash2/core.py): this drafter has a draft vocabulary, "
                                                    "so the export is refused"))
    if cfg.kind == "domino":
        out.append(Difference("speculators", False, f"speculators {SPECULATORS_READ} has no Domino (its issue #773): "
                                                    "the export is refused"))
    return out

CONSUMER = Consumer(
    name="speculators", release=f"speculators {SPECULATORS_READ}", formats=("speculators",),
    kinds={"dflash": "", "dspark": "", "dflash2": "full vocabulary only"}, quirks=quirks,
    refused_kinds={"lilicorr": f"no LiLiCorr in {SPECULATORS_READ}", "domino": "no Domino (its issue #773)"},
)
