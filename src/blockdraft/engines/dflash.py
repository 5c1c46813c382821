"""z-lab's dflash as a consumer of blockdraft's drafters (one `Engine` of blockdraft.engines): its
`DFlashDraftModel` and `DFlash2DraftModel` load the z-lab layout (`convert --to zlab`, and `train`'s
own directories); it has no DSpark model. It runs the target with transformers, so any target
transformers loads can hand it hidden states.
"""

from __future__ import annotations

from .base import Engine

DFLASH_READ = "0.1.0"

ENGINE = Engine(
    name="dflash", release=f"dflash {DFLASH_READ}", formats=("zlab",),
    kinds={"dflash": "", "dflash2": "z-lab layout"},
    refused_kinds={"dspark": "it drops the Markov and confidence heads"},
)
