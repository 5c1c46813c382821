"""Drafter kinds, registered by name: what each adds to the DFlash backbone, in one place each.

A kind says which decoder layer the drafter stacks, which modules it adds beside the layers, how
they start (every kind starts as the DFlash function of the same backbone weights, so a DFlash
checkpoint initialises it exactly), the per-slot terms its loss adds (`SlotTerms`), and how its
drafts are read from the final hidden rows (`draft`). The trainer, the loss and the generate loop
ask the kind; none of them tests which kind it is.

- dflash (`base.py`): the backbone alone; a slot's draft is its own argmax (or sample).
- dspark (`dspark.py`): + a Markov bias W2 W1[previous token] on each slot's logits, walked left to
  right from the verified token, + a confidence head.
- dflash2 (`dflash2.py`): + in-block causal convolutions around every attention and MLP sublayer,
  + a candidate selector over each slot's top K, walked greedily from the verified token.
- lilicorr (`lilicorr.py`): (optionally DFlash2's convolutions) + a correlator over the lattice of each
  slot's top K candidates, whose start and pair scores are walked greedily (vLLM's LiLiCorr).
- domino (`domino.py`): + a GRU over the block's tokens before each slot (the anchor first) whose state,
  with the slot's row, adds a correction to its logits, walked left to right from the verified token.

Legend: s slots, Hd hidden, Vd draft vocabulary (the target's when there is none), V target vocabulary.
"""

from __future__ import annotations

from .base import DFlash, Drafted, Kind, SlotTerms
from .dflash2 import DFlash2
from .domino import Domino
from .dspark import DSpark
from .lilicorr import LiLiCorr

KINDS: dict[str, Kind] = {k.name: k for k in (DFlash(), DSpark(), DFlash2(), LiLiCorr(), Domino())}


def get(name: str) -> Kind:
    if name not in KINDS:
        raise ValueError(f"unknown drafter kind {name!r}; choose one of {', '.join(KINDS)}")
    return KINDS[name]


__all__ = ["KINDS", "Drafted", "Kind", "SlotTerms", "get"]
