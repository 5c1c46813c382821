"""What a training run's directory holds (`RunDir` applies it): owned (`ownership`), locked (`locks`).

Checked whole before any work: it holds only what a run writes (`LAYOUT`), every directory of it
carrying train's marker, and no link. A run already there is continued only with --resume and
replaced only with --overwrite; two runs never write one directory at once (`claim_run`). Its
files are written without following links.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from ..finite import dumps_finite
from .ownership import claim, leftovers, open_private, remove_leftovers, replace_text, write_marker
from .retention import BEST, BEST_JSON, KEPT, check_kept, newest
from .state import STATE_JSON, STATE_TENSORS, read_meta
from .trackers import DIRS as TRACKER_DIRS
from .trackers import STATE as TRACKER_STATE

CONFIG_FILE = "train_config.json"  # the run's own settings (trainer.py writes it, preflight.py reads it)

# a run's length may grow on --resume (a finished run continued further: the GPU check does), with a
# warning: the cosine schedule after the checkpoint then follows the new length
LENGTH = {"steps", "epochs"}

OWNER = "train"
METRICS, SUMMARY = "metrics.jsonl", "summary.json"
LAYOUT = {METRICS: None, CONFIG_FILE: None, SUMMARY: None, "loss.png": None, "slot_accuracy.png": None,
          "drafter": {"config.json": None, "model.safetensors": None},
          "checkpoint": {STATE_JSON: None, STATE_TENSORS: None},
          KEPT: None,  # step-N directories (retention.check_kept)
          BEST: {"config.json": None, "model.safetensors": None, BEST_JSON: None},
          # --report-to's stores (trackers), each the library's own
          TRACKER_STATE: None, **{d: None for d in TRACKER_DIRS.values()}}


def holds_run(out: str | os.PathLike) -> bool:
    """Whether `out` holds a run: a checkpoint (also one a killed swap moved aside), a drafter, a
    summary or logged steps."""
    out = Path(out)
    if any((out / n).exists() for n in ("checkpoint", "drafter", SUMMARY, KEPT, BEST)) or leftovers(
            out / "checkpoint", ("old",)):
        return True
    metrics = out / METRICS
    return metrics.is_file() and metrics.stat().st_size > 0


def check_existing(out: Path, resume: bool, overwrite: bool) -> None:
    """A run already in `out` is never replaced implicitly."""
    if resume and overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: pass one of them")
    check_kept(out)
    if not (resume or overwrite) and holds_run(out):
        if newest(out) is None:
            raise ValueError(f"{out} holds a training run that saved no checkpoint yet (nothing to --resume); pass "
                             "--overwrite to replace it (or choose another --out)")
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


def append_metrics(out: Path, record: dict, kept: int = 0) -> None:
    """One step's line. A write that fails (a full disk) names the file and what --resume repairs."""
    path = out / METRICS
    try:
        with open_private(path, "a") as f:
            f.write(dumps_finite(record, f"metrics of step {record.get('step')}") + "\n")  # never a bare NaN
    except OSError as e:
        raise ValueError(f"could not append the metrics of step {record.get('step')} to {path} "
                         f"({e.strerror or e}); " + (f"the checkpoint of step {kept} is kept: free space and rerun "
                                                      "with --resume" if kept else "free space and rerun")) from None


def metrics_lines(path: Path, say: bool = True) -> list[str]:
    """metrics.jsonl's records. A last line cut short (a crash or a full disk during an append) is
    dropped, saying so (`say`); any other line that is not a step's record is one error naming the file."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    keep = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
            ok = isinstance(rec, dict) and isinstance(rec.get("step"), int)
        except ValueError:
            ok = False
        if ok:
            keep.append(ln)
        elif i == len(lines):  # no newline after it: the append was cut short
            if say:
                print(f"blockdraft train: warning: the last line of {path} was cut short (a crash or a full disk "
                      "during an append); dropped it", file=sys.stderr)
        else:
            raise ValueError(f"{path}:{i} is not a step's metrics record; restore the file or start a new --out")
    return keep


def truncate_metrics(out: Path, step: int) -> None:
    """Drop the lines of steps after `step` (and a torn last line), atomically: a reader sees the old
    file or the new one, never a half-written one."""
    path = out / METRICS
    if path.is_file() and not path.is_symlink():
        keep = [ln for ln in metrics_lines(path) if json.loads(ln)["step"] <= step]
        replace_text(path, "".join(ln + "\n" for ln in keep))


def saved_settings(out: str | os.PathLike) -> tuple[dict, str | None]:
    """The settings the run in `out` recorded, and where they came from when not train_config.json:
    that file, or (lost or damaged) the copy the checkpoint keeps. One error naming the file when
    neither can be read: a resume never compares against (or records) settings it cannot read."""
    path = Path(out) / CONFIG_FILE
    try:
        saved = json.loads(path.read_text())
        if _is_record(saved):
            return saved, None
        why = "it is not a run's settings"
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
    ckpt = newest(out)
    kept = read_meta(ckpt).get("settings") if ckpt is not None else None
    if _is_record(kept):
        return kept, f"{path} is unreadable ({why}); the run's settings were recovered from {ckpt / STATE_JSON}"
    raise ValueError(f"--resume: {path} is unreadable ({why}) and the checkpoint keeps no copy of the run's settings,"
                     " so this run's cannot be checked against them; restore the file or start a new --out")


def _is_record(saved) -> bool:
    return isinstance(saved, dict) and isinstance(saved.get("train"), dict) and all(
        isinstance(v, dict) for v in saved.values())


def resumed_record(saved: dict, now: dict) -> dict:
    """What train_config.json records after a resume: the run's own settings, never this command's,
    but for a length grown on --resume (the schedule follows it from the checkpoint on)."""
    rec = {part: dict(values) for part, values in saved.items()}
    rec["train"].update({k: now["train"][k] for k in LENGTH if k in now.get("train", {})})
    return rec


def write_record(out: Path, record: dict) -> None:
    replace_text(out / CONFIG_FILE, json.dumps(record, indent=1))
