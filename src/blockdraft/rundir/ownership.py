"""Ownership that is checked, not assumed.

Every directory a command writes carries a marker, `.blockdraft-owner.json`, naming the command
that wrote it and the run (run id, pid, host, time). A command overwrites, swaps or removes only
a directory that carries its own marker (or an empty one), and refuses anything else with one
line naming the path. Nothing is written through a symbolic link in an output (`open_private`
opens with O_NOFOLLOW; `check_owned` refuses links).

Temporaries are named `.NAME.blockdraft-KIND-HOST-PID` beside what they become: the next run of
the same writer removes the ones whose process is gone (or is itself), on this host, and nothing
else (`remove_leftovers`).

`claim` puts it together for a command's output: checked, locked (`locks`), marked, and on a
failure before anything else was written, removed again: a refused command creates nothing.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable

from .locks import host, lead_process, locked, pid_alive

MARKER = ".blockdraft-owner.json"
_TEMP = re.compile(r"^\.(?P<base>.+)\.blockdraft-(?P<kind>tmp|old)-(?P<host>.+)-(?P<pid>\d+)$")
_RUN_ID: list[str] = []


def run_id() -> str:
    """The id of the command run in progress (a new one per `claim`), in every marker it writes."""
    if not _RUN_ID:
        new_run()
    return _RUN_ID[-1]


def new_run() -> str:
    _RUN_ID.append(uuid.uuid4().hex[:12])
    return _RUN_ID[-1]


def record(command: str) -> dict:
    return {"command": command, "run": run_id(), "pid": os.getpid(), "host": host(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def open_private(path: str | os.PathLike, mode: str = "w"):
    """open() that never follows a symbolic link at `path` (modes w, a, x, wb, xb)."""
    flags = {"w": os.O_TRUNC, "a": os.O_APPEND, "x": os.O_EXCL}[mode[0]]
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link; blockdraft never writes through a link in its "
                             "outputs: remove it") from None
        raise
    binary = "b" in mode
    return os.fdopen(fd, mode.replace("x", "w"), **({} if binary else {"encoding": "utf-8"}))


def write_text(path: str | os.PathLike, text: str) -> None:
    with open_private(path) as f:
        f.write(text)


def replace_text(path: str | os.PathLike, text: str) -> None:
    """Write `path` whole or not at all (`replace_bytes`)."""
    replace_bytes(path, text.encode("utf-8"))


def replace_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary beside it (never through a link), synced, then
    renamed over it; a crash or a full disk midway leaves the old file, never a half-written one."""
    path = Path(path)
    remove_leftovers(path)
    tmp = temp_path(path)
    try:
        with open_private(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def check_file(path: str | os.PathLike, owner: str, ours: Callable[[Path], bool], what: str) -> None:
    """A one-file output (a command's --out, --json, --plot): absent, or a regular file that `ours`
    recognises as `owner`'s (`what` it holds). A link, a directory or anyone else's file is refused
    with one line naming it, before any work: nothing is written through a link or over a user's file."""
    p = Path(path)
    if p.is_symlink():
        raise ValueError(f"{p} is a symbolic link; blockdraft {owner} never writes through a link: remove it or "
                         "choose another path")
    if not p.exists():
        return
    if not p.is_file():
        raise ValueError(f"{p} exists and is not a file; choose another path")
    if p.stat().st_size and not ours(p):
        raise ValueError(f"{p} exists and is not {what} that blockdraft {owner} wrote; move it away or choose "
                         "another path")


def temp_path(final: str | os.PathLike, kind: str = "tmp") -> Path:
    """This process's temporary for `final` (kind tmp: being written; old: being swapped out)."""
    final = Path(os.path.abspath(final))
    return final.parent / f".{final.name}.blockdraft-{kind}-{host()}-{os.getpid()}"


def is_temp(name: str, bases: Iterable[str] | None = None) -> bool:
    m = _TEMP.match(name)
    return m is not None and (bases is None or m["base"] in set(bases))


def _scan(directory: Path, base: str | None, kinds: Iterable[str]) -> list[Path]:
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _TEMP.match(p.name)
        if m and (base is None or m["base"] == base) and m["kind"] in kinds and m["host"] == host() and (
                int(m["pid"]) == os.getpid() or not pid_alive(int(m["pid"]))):
            found.append(p)
    return found


def swapping(final: str | os.PathLike) -> bool:
    """Whether a writer (`atomic.atomic_dir`) has moved the old version of `final` aside and not yet
    swapped the new one in: its `old` temporary lies beside it, a live process's or a killed one's."""
    final = Path(os.path.abspath(final))
    if not final.parent.is_dir():
        return False
    return any((m := _TEMP.match(p.name)) and m["base"] == final.name and m["kind"] == "old"
               for p in final.parent.iterdir())


def leftovers(final: str | os.PathLike, kinds: Iterable[str] = ("tmp", "old")) -> list[Path]:
    """Temporaries of `final` whose process is gone (or is this one), on this host."""
    final = Path(os.path.abspath(final))
    return _scan(final.parent, final.name, tuple(kinds))


def _remove(paths: list[Path], owner: str | None) -> None:
    for p in paths:
        if p.is_symlink():
            continue  # never made by a writer
        if p.is_dir():
            if owner is None or owned_by(p, owner) or all(e.name == MARKER or is_temp(e.name) for e in p.iterdir()):
                shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def remove_leftovers(final: str | os.PathLike, owner: str | None = None) -> None:
    """Remove `final`'s temporaries left by a killed writer. A directory goes only if it carries
    `owner`'s marker or nothing but a marker (`owner` None: any of this writer's names)."""
    _remove(leftovers(final), owner)


def remove_leftovers_in(directory: str | os.PathLike, owner: str | None = None) -> None:
    """`remove_leftovers` for every name in `directory` (a writer of many files: feature shards)."""
    _remove(_scan(Path(directory), None, ("tmp", "old")), owner)


def write_marker(directory: str | os.PathLike, owner: str) -> None:
    """Mark `directory` as written by `owner` (atomically: the marker is whole or absent)."""
    path = Path(directory) / MARKER
    tmp = temp_path(path)
    with open_private(tmp, "x") as f:
        f.write(json.dumps(record(owner)) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def read_marker(directory: str | os.PathLike) -> dict | None:
    try:
        fd = os.open(Path(directory) / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, encoding="utf-8") as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and "command" in got else None


def owned_by(directory: str | os.PathLike, owner: str) -> bool:
    got = read_marker(directory)
    return got is not None and got.get("command") == owner


def _shown(names: list[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def check_owned(path: str | os.PathLike, owner: str, names: Iterable[str] | None = None) -> None:
    """Refuse `path` unless it is absent, an empty directory, or a directory carrying `owner`'s
    marker that holds only `names` (when given) and this writer's temporaries, and no link."""
    p = Path(path)
    if p.is_symlink():
        raise ValueError(f"{p} is a symbolic link; blockdraft {owner} writes only into directories it made")
    if not p.exists():
        return
    if not p.is_dir():
        raise ValueError(f"{p} exists and is not a directory; choose a new directory")
    entries = list(p.iterdir())
    if not entries:
        return
    if not owned_by(p, owner):
        raise ValueError(f"{p} is not empty and holds files blockdraft {owner} did not write "
                         f"({_shown([e.name for e in entries])}; no {MARKER} of {owner}); choose a new or empty "
                         "directory")
    links = [e.name for e in entries if e.is_symlink()]
    if links:
        raise ValueError(f"{p} holds symbolic links ({_shown(links)}); blockdraft never writes through links: "
                         "remove them")
    if names is not None:
        mine = {MARKER, *names}
        foreign = [e.name for e in entries if e.name not in mine and not is_temp(e.name, mine)]
        if foreign:
            raise ValueError(f"{p} holds files blockdraft {owner} did not write ({_shown(foreign)}); move them away "
                             "or choose another directory")


def check_tree(root: str | os.PathLike, owner: str, layout: dict) -> None:
    """`check_owned` on `root` and on each subdirectory `layout` names (name -> None for a file,
    a dict for a directory): the whole output, checked before any work."""
    root = Path(root)
    check_owned(root, owner, layout)
    if root.is_dir():
        for name, sub in layout.items():
            if isinstance(sub, dict):
                check_tree(root / name, owner, sub)


def _first_missing(path: Path) -> Path | None:
    top = None
    while not path.exists() and not path.is_symlink() and path != path.parent:
        top, path = path, path.parent
    return top


def _unmark(path: Path) -> None:
    """Take back a claim's marker when nothing else was written beside it."""
    if path.is_dir() and [e.name for e in path.iterdir()] == [MARKER]:
        (path / MARKER).unlink()


def _remove_made(path: Path, made: Path | None) -> None:
    """Remove the directories a claim made (from `path` up to `made`) where they are empty."""
    while made is not None:
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            return
        if path == made:
            return
        path = path.parent


@contextmanager
def claim(path: str | os.PathLike, owner: str, *, layout: dict | None = None,
          check: Callable[[Path], None] | None = None, prepare: Callable[[Path], None] | None = None,
          lead: bool | None = None):
    """Own the output directory `path` for the block: refused unless `check_tree` passes (any
    directory when `layout` is None: only its marker is checked) and `check(path)` does, then
    locked, `prepare(path)`d and marked. A failure before anything but the marker was written
    removes what the claim made. Only the lead process (rank 0) claims; the others run the block."""
    path = Path(path)
    if not (lead_process() if lead is None else lead):
        yield path
        return
    made, ok = _first_missing(path), False
    new_run()
    try:
        with locked(path, owner, lead=True):
            check_tree(path, owner, layout) if layout is not None else check_owned(path, owner)
            if check is not None:
                check(path)
            path.mkdir(parents=True, exist_ok=True)
            if prepare is not None:
                prepare(path)
            marked = read_marker(path) is None
            if marked:
                write_marker(path, owner)
            try:
                yield path
                ok = True
            finally:
                if not ok and marked:
                    _unmark(path)
    finally:
        if not ok:
            _remove_made(path, made)
