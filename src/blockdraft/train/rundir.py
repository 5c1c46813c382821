"""The run directory `blockdraft train --out` writes: owned (`ownership`), locked (`locks`).

Checked whole before any work: it holds only what a run writes (`LAYOUT`), every directory of it
carrying train's marker, and no link. A run already there is continued only with --resume and
replaced only with --overwrite; two runs never write one directory at once (`claim_run`). Its
files are written without following links.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from ..finite import dumps_finite
from ..ownership import claim, leftovers, open_private, remove_leftovers, temp_path, write_marker
from .state import STATE_JSON, STATE_TENSORS

CONFIG_FILE = "train_config.json"  # the run's own settings (trainer.py writes it, preflight.py reads it)

OWNER = "train"
METRICS, SUMMARY = "metrics.jsonl", "summary.json"
LAYOUT = {METRICS: None, CONFIG_FILE: None, SUMMARY: None, "loss.png": None, "slot_accuracy.png": None,
          "drafter": {"config.json": None, "model.safetensors": None},
          "checkpoint": {STATE_JSON: None, STATE_TENSORS: None}}


def holds_run(out: str | os.PathLike) -> bool:
    """Whether `out` holds a run: a checkpoint (also one a killed swap moved aside), a drafter, a
    summary or logged steps."""
    out = Path(out)
    if any((out / n).exists() for n in ("checkpoint", "drafter", SUMMARY)) or leftovers(out / "checkpoint", ("old",)):
        return True
    metrics = out / METRICS
    return metrics.is_file() and metrics.stat().st_size > 0


def check_existing(out: Path, resume: bool, overwrite: bool) -> None:
    """A run already in `out` is never replaced implicitly."""
    if resume and overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: pass one of them")
    if not (resume or overwrite) and holds_run(out):
        raise ValueError(f"{out} already holds a training run; pass --resume to continue it or --overwrite to "
                         "replace it (or choose another --out)")


def clear_run(out: str | os.PathLike) -> None:
    """--overwrite: remove the earlier run's files (all checked to be train's by `claim_run`)."""
    out = Path(out)
    for name in LAYOUT:
        p = out / name
        remove_leftovers(p, OWNER)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
    write_marker(out, OWNER)  # the directory now holds this run


@contextmanager
def claim_run(out: str | os.PathLike, *, resume: bool = False, overwrite: bool = False):
    """Own `out` for a training run (rank 0; the other ranks never write into it)."""
    with claim(out, OWNER, layout=LAYOUT, check=lambda p: check_existing(p, resume, overwrite)):
        yield Path(out)


def append_metrics(out: Path, record: dict) -> None:
    with open_private(out / METRICS, "a") as f:
        f.write(dumps_finite(record, f"metrics of step {record.get('step')}") + "\n")  # never a bare NaN


def truncate_metrics(out: Path, step: int) -> None:
    """Drop the lines of steps after `step`, atomically: a reader sees the old file or the new one,
    never a half-written one."""
    path = out / METRICS
    if path.is_file() and not path.is_symlink():
        keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        remove_leftovers(path)
        tmp = temp_path(path)
        with open_private(tmp, "x") as f:
            f.write("".join(ln + "\n" for ln in keep))
        os.replace(tmp, path)
