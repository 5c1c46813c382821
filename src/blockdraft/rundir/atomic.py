"""Writes that a crash, a kill or a full disk cannot half-finish, and that never delete what they
did not write.

`atomic_dir` builds a directory beside its destination and swaps it in (only over a directory
its own command wrote: `ownership`); `recover_dir` takes back the last complete one after an
interrupted swap; `check_free_space` fails early, naming what is
needed, instead of at the end of a long run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

from .ownership import check_owned, leftovers, owned_by, remove_leftovers, temp_path, write_marker


def nearest_existing(path: str | os.PathLike) -> Path:
    """`path`, or its nearest ancestor that exists (where a directory not made yet will go)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_free_space(path: str | os.PathLike, need_bytes: int, what: str) -> None:
    """ValueError naming `what`, the bytes needed and the bytes free when `path`'s disk is too full."""
    free = shutil.disk_usage(nearest_existing(path)).free
    if free < need_bytes:
        raise ValueError(f"not enough disk space for {what} in {path}: needs {_mb(need_bytes)}, "
                         f"{_mb(free)} free; free some space or choose another directory")


def _mb(n: int) -> str:
    """A size people read: 1.5 GiB, 2.7 MiB, 12.0 KiB, 1000 bytes (never "0.0 MiB" for a small one)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def atomic_dir(final: str | os.PathLike, write: Callable[[Path], None], *, owned: Iterable[str] | None = None,
               need_bytes: int = 0, owner: str = "blockdraft", keep_old: Callable[[Path], Path | None] | None = None
               ) -> Path:
    """Call write(tmp_dir), then swap tmp_dir into place; a crash at any moment leaves either the
    old directory or the new one complete (an old one swapped out is taken back by `recover_dir`).

    `owner`: the command writing it; its marker goes in first, and an existing `final` is replaced
    only when it carries that marker (or is empty), holding nothing but `owned` names (when
    given): anything else is refused before anything is written (`ownership.check_owned`).
    `need_bytes`: checked free before writing. The old directory is removed only after the new one
    is in place, so a swap needs room for both; a failed write (a full disk) removes the partial
    new one and keeps the old. Temporaries a killed writer left beside `final` are removed first.
    `keep_old(final)`: where the directory replaced goes instead of being removed (a path free on the
    same disk, renamed there whole while the new one waits complete beside it), or None."""
    final = Path(final)
    check_owned(final, owner, owned)
    final.parent.mkdir(parents=True, exist_ok=True)
    if need_bytes:
        check_free_space(final.parent, need_bytes, final.name)
    remove_leftovers(final, owner)
    tmp, old = temp_path(final, "tmp"), temp_path(final, "old")
    tmp.mkdir()
    try:
        write_marker(tmp, owner)
        write(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kept = keep_old(final) if keep_old is not None and final.exists() else None
    if final.exists():
        final.rename(old if kept is None else kept)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def recover_dir(final: str | os.PathLike, owner: str | None = None) -> Path | None:
    """The last complete directory: `final`, or the one a killed swap had moved aside (carrying
    `owner`'s marker, when given), taken back."""
    final = Path(final)
    if final.exists():
        return final
    olds = [p for p in leftovers(final, ("old",)) if p.is_dir() and (owner is None or owned_by(p, owner))]
    if not olds:
        return None
    try:
        max(olds, key=lambda p: p.stat().st_mtime).rename(final)
    except FileNotFoundError:  # another rank took it back first
        pass
    return final if final.exists() else None
