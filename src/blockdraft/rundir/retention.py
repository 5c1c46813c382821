"""Which checkpoints a run keeps, and which one `--resume` continues from (issue 43, item 2).

`OUT/checkpoint/` is always the newest resumable state, replaced by one swap (`atomic.atomic_dir`)
as before. With `--keep-checkpoints N` above 1 the one it replaces is renamed whole into
`OUT/checkpoints/step-NNNNNNN/` while the new one waits complete beside it, and the kept ones past
the newest N-1 are then removed, each renamed to a temporary first: a kill at any moment leaves
every `step-*` directory and `checkpoint/` complete (at worst one more than N until the next save).
`--save-best` keeps the drafter of the best held-out tau in `OUT/best/`, its step and tau in
`best.json`, swapped in the same way.

A resume takes the newest complete one by step (`newest`), and names the incomplete ones it
passed over: a save killed before its swap leaves only a temporary, never a checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from .ownership import MARKER, is_temp, leftovers, owned_by, remove_leftovers_in, temp_path, write_marker
from .state import STATE_JSON, STATE_TENSORS, find_checkpoint

OWNER = "train"
CURRENT, KEPT, BEST, BEST_JSON = "checkpoint", "checkpoints", "best", "best.json"
_STEP = re.compile(r"^step-(\d+)$")


def kept_name(step: int) -> str:
    return f"step-{step:07d}"


def checkpoint_step(path: Path) -> int | None:
    """The step a checkpoint holds (its trainer_state.json), None where that cannot be read."""
    try:
        step = json.loads((path / STATE_JSON).read_text())["progress"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def _complete(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and all((path / n).is_file() for n in (STATE_JSON, STATE_TENSORS))


def candidates(out: str | Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """(the complete checkpoints as (step, directory), newest first; the incomplete ones found: saves
    killed before their swap, a kept directory missing its files). `checkpoint/` (taken back from a
    killed swap where needed) comes first among equal steps, and first of all where its step cannot
    be read, so loading it says what is wrong with it."""
    out = Path(out)
    found: list[tuple[float, int, Path]] = []
    current = find_checkpoint(out / CURRENT)
    if current is not None:
        step = checkpoint_step(current)
        found.append((float("inf") if step is None else step, 1, current))
    partial = [p for p in leftovers(out / CURRENT, ("tmp",)) if p.is_dir()]
    kept = out / KEPT
    if kept.is_dir() and not kept.is_symlink():
        for p in sorted(kept.iterdir()):
            m = _STEP.match(p.name)
            if m and _complete(p):
                found.append((int(m[1]), 0, p))
            elif m:
                partial.append(p)
    found.sort(key=lambda x: (x[0], x[1]), reverse=True)
    return [(int(s) if s != float("inf") else -1, p) for s, _, p in found], partial


def newest(out: str | Path, say=None) -> Path | None:
    """The newest complete checkpoint in `out` (None: none), and `say(line)` for each incomplete one
    passed over."""
    found, partial = candidates(out)
    for p in partial if say else ():
        say(f"ignored an incomplete checkpoint, {p} (a save cut short before it was complete)")
    return found[0][1] if found else None


def keeper(out: Path, keep: int):
    """`atomic_dir`'s `keep_old` for `checkpoint/` under --keep-checkpoints `keep` (None: keep 1,
    the old one removed as before): the replaced one goes to checkpoints/step-N."""
    if keep <= 1:
        return None

    def where(final: Path) -> Path | None:
        step = checkpoint_step(final)
        if step is None:  # unreadable: not worth keeping
            return None
        kept = out / KEPT
        kept.mkdir(exist_ok=True)
        if not (kept / MARKER).exists():
            write_marker(kept, OWNER)
        dest = kept / kept_name(step)
        if dest.exists():  # the same step kept before (a resume went back): the newer copy wins
            _discard(dest)
        return dest

    return where


def prune(out: Path, keep: int, newest_step: int) -> None:
    """Keep the newest `keep` - 1 of checkpoints/ older than `newest_step` (the rest: removed, each
    renamed away first, so none is ever half removed under its own name)."""
    kept = out / KEPT
    if not kept.is_dir() or kept.is_symlink():
        return
    steps = sorted(((int(m[1]), p) for p in kept.iterdir() if (m := _STEP.match(p.name))), reverse=True)
    stay = [p for s, p in steps if s < newest_step][:max(0, keep - 1)]
    for _, p in steps:
        if p not in stay:
            _discard(p)
    remove_leftovers_in(kept, OWNER)  # what a killed prune had renamed away


def _discard(path: Path) -> None:
    if path.is_symlink() or not owned_by(path, OWNER):
        return  # never made by train: left alone (the claim of --out refuses such a directory)
    gone = temp_path(path, "old")
    path.rename(gone)
    shutil.rmtree(gone, ignore_errors=True)


def check_kept(out: Path) -> None:
    """checkpoints/ holds only train's step directories (and their temporaries), before any work:
    pruning removes only what train wrote."""
    kept = out / KEPT
    if not kept.exists():
        return
    if kept.is_symlink() or not kept.is_dir():
        raise ValueError(f"{kept} is not a directory blockdraft train made; move it away or choose another --out")
    entries = [e for e in kept.iterdir() if e.name != MARKER and not is_temp(e.name)]
    if entries and not owned_by(kept, OWNER):
        raise ValueError(f"{kept} holds files blockdraft train did not write; move it away or choose another --out")
    foreign = [e.name for e in entries if not (_STEP.match(e.name) and e.is_dir() and not e.is_symlink()
                                               and owned_by(e, OWNER))]
    if foreign:
        raise ValueError(f"{kept} holds files blockdraft train did not write ({', '.join(sorted(foreign)[:5])}); "
                         "move them away or choose another --out")


def read_best(out: Path) -> dict | None:
    """best/best.json: {"step", "eval_tau"} of the drafter kept there, None when there is no best/.
    A best/ whose best.json cannot be read is an error: read as none, the next evaluation would
    replace a better drafter with a worse one."""
    path = out / BEST / BEST_JSON
    if not (out / BEST).exists():
        return None
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or " ".join(str(e).split())
        got, problem = None, f"cannot be read ({why})"
    else:
        problem = "does not hold a step and an eval_tau"
    ok = isinstance(got, dict) and isinstance(got.get("step"), int) and not isinstance(got.get("step"), bool) \
        and isinstance(got.get("eval_tau"), (int, float)) and not isinstance(got.get("eval_tau"), bool)
    if not ok:
        raise ValueError(f"{path} {problem}: --save-best compares each evaluation with it; restore it, or move "
                         f"{out / BEST} away to keep the best from now on")
    return got


def best_record(step: int, tau: float) -> str:
    return json.dumps({"step": step, "eval_tau": tau}) + "\n"
