"""Writes that a crash, a kill or a full disk cannot half-finish, and that never delete what they
did not write.

`atomic_dir` builds a directory beside its destination and swaps it in; `recover_dir` takes back
the last complete one after an interrupted swap; `check_free_space` fails early, naming what is
needed, instead of at the end of a long run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Iterable


def check_free_space(path: str | os.PathLike, need_bytes: int, what: str) -> None:
    """ValueError naming `what`, the bytes needed and the bytes free when `path`'s disk is too full."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    if free < need_bytes:
        raise ValueError(f"not enough disk space for {what} in {path}: needs {_mb(need_bytes)}, "
                         f"{_mb(free)} free; free some space or choose another directory")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def refuse_foreign_files(final: Path, owned: Iterable[str]) -> None:
    """A destination holding anything but the files this writer owns is someone else's: refuse."""
    if not final.exists():
        return
    if not final.is_dir():
        raise ValueError(f"{final} exists and is not a directory; choose a new directory")
    foreign = sorted(p.name for p in final.iterdir() if p.name not in set(owned))
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise ValueError(f"{final} already holds files this command did not write ({shown}); "
                         "choose a new or empty directory")


def atomic_dir(final: str | os.PathLike, write: Callable[[Path], None], *, owned: Iterable[str] | None = None,
               need_bytes: int = 0) -> Path:
    """Call write(tmp_dir), then swap tmp_dir into place; a crash at any moment leaves either the
    old directory or the new one complete (`final.old` is taken back by `recover_dir`).

    `owned`: the names this writer puts in `final`; an existing `final` holding anything else is
    refused before anything is written. `need_bytes`: checked free before writing. The old
    directory is removed only after the new one is in place, so a swap needs room for both; a
    failed write (a full disk) removes the partial new one and keeps the old."""
    final = Path(final)
    if owned is not None:
        refuse_foreign_files(final, owned)
    final.parent.mkdir(parents=True, exist_ok=True)
    if need_bytes:
        check_free_space(final.parent, need_bytes, final.name)
    tmp = final.with_name(final.name + ".tmp")
    old = final.with_name(final.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def recover_dir(final: str | os.PathLike) -> Path | None:
    """The last complete directory: `final`, or `final.old` if a swap was interrupted."""
    final = Path(final)
    old = final.with_name(final.name + ".old")
    if final.exists():
        return final
    if old.exists():
        old.rename(final)
        return final
    return None
