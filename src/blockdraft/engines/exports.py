"""Writing a drafter for its consumers, with their word on it: `convert`, `export_drafter`, `export_gguf`.

Each asks every consumer of the format what it would compute from the files (`format_differences`:
the engines' quirks) before anything is written. A serving engine that would compute another
function refuses the export unless `allow_mismatch`; the rest come back as warnings beside the path.
The writing itself is `checkpoint.native`'s, which knows the formats and no engine.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..checkpoint import formats
from ..checkpoint.native import convert_source, write_export, write_gguf
from ..rundir.locks import locked
from .consumers import format_differences
from ..config import kind_refusal
from .base import ANCHOR_RULE_SERVED, Difference


def export_drafter(drafter, dst: str | os.PathLike, to: str, *, verifier: str | None = None,
                   allow_mismatch: bool = False) -> tuple[Path, list[Difference]]:
    """Write `drafter` in format `to`. Returns the directory and the consumers' records; a serving
    engine among them that would compute another function is refused unless `allow_mismatch`."""
    formats.get(to)  # an unknown format is named before the consumers are asked
    refused = kind_refusal(drafter.config.kind, to)
    if refused:  # no reader of the format has the kind at all: one line, not a mismatch to allow
        raise ValueError(refused)
    found = format_differences(to, drafter.config)
    serving = [d for d in found if d.refuse]
    if serving and not allow_mismatch:
        raise ValueError(f"the {to} files would be served as another function: " + "; ".join(map(str, serving))
                         + f". To serve it: {retrain_hint(serving)}, or pass --allow-mismatch")
    return write_export(drafter, dst, to, verifier=verifier), found


def retrain_hint(refusals: list[Difference]) -> str:
    """What makes the drafter one the refusing engines serve: the query rule where the anchor rule is why."""
    if any(d.what == ANCHOR_RULE_SERVED for d in refusals):
        return "retrain it under the rule the engine serves (blockdraft train --init-drafter DIR --window-rule query)"
    return "retrain it for the engine"


def export_gguf(drafter, dst: str | os.PathLike, *, target_gguf: str | os.PathLike | None = None,
                allow_mismatch: bool = False, overwrite: bool = False) -> tuple[Path, list[Difference]]:
    """Write `drafter` as llama.cpp's DFlash GGUF file (`checkpoint.native.write_gguf`), refused where
    llama.cpp would compute another function unless `allow_mismatch`."""
    from ..checkpoint.formats.gguf import check_kind

    check_kind(drafter.config)  # no llama.cpp drafter of this kind at all: one line, not a mismatch to allow
    found = format_differences(formats.GGUF, drafter.config)
    if found and not allow_mismatch:
        raise ValueError("llama.cpp would serve this GGUF as another function: " + "; ".join(map(str, found))
                         + f". To serve it: {retrain_hint(found)}, or pass --allow-mismatch")
    return write_gguf(drafter, dst, target_gguf=target_gguf, overwrite=overwrite), found


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str, *, verifier: str | None = None,
            allow_mismatch: bool = False, num_target_layers: int | None = None,
            target_gguf: str | os.PathLike | None = None, overwrite: bool = False) -> tuple[Path, list[Difference]]:
    """Rewrite a drafter directory in another format; the trained tensors are copied bit for bit.
    One writer of `dst` at a time (`locks`); a directory is replaced only where convert wrote it,
    a GGUF file only with `overwrite` (and where convert wrote it)."""
    drafter = convert_source(src, dst, num_target_layers)
    with locked(dst, "convert", lead=True):
        if to == formats.GGUF:
            return export_gguf(drafter, dst, target_gguf=target_gguf, allow_mismatch=allow_mismatch,
                               overwrite=overwrite)
        return export_drafter(drafter, dst, to, verifier=verifier, allow_mismatch=allow_mismatch)
