"""speculators as a consumer of blockdraft's drafters (one `Engine` of blockdraft.engines): its
DFlash, DSpark and DFlash2 models load the speculators layout (`convert --to speculators`) for
training and evaluation; its DFlash2 needs the full target vocabulary. It runs the target with
transformers, so any target transformers loads can hand it hidden states.
"""

from __future__ import annotations

from .base import Engine

SPECULATORS_READ = "0.9.0"

ENGINE = Engine(
    name="speculators", release=f"speculators {SPECULATORS_READ}", formats=("speculators",),
    kinds={"dflash": "", "dspark": "", "dflash2": "full vocabulary only"},
)
