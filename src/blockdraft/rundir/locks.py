"""Advisory locks on outputs: one writer of an output at a time.

A lock is `fcntl.flock` on a file next to the output (`.NAME.blockdraft-lock`) that names its
holder (command, pid, host, since). A second writer is refused with one line naming the holder
(`wait=True`, for the model cache: it waits instead). The kernel drops a dead holder's lock; a
lock still held in the name of a dead process of this host (a child that inherited the file)
is stale and taken over. The file is removed on release; a waiter that then holds a removed
file sees that and tries again, so two writers never both hold one output.

Under torchrun every rank writes into the outputs rank 0 owns: only rank 0 takes their locks
(`lead_process`), so no rank waits on another's lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

LOCK_TAG = ".blockdraft-lock"


def lock_path(output: str | os.PathLike) -> Path:
    """The lock file of an output (a directory or a file): beside it, hidden."""
    p = Path(os.path.abspath(output))  # "." and ".." name the directory they stand for
    return p.parent / f".{p.name}{LOCK_TAG}"


def host() -> str:
    return socket.gethostname()


def lead_process() -> bool:
    """Whether this process takes the output locks: rank 0 under torchrun, else always."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(holder: dict) -> str:
    if not holder:
        return "another process"
    since = time.strftime("%H:%M:%S", time.localtime(holder.get("since", 0)))
    return (f"blockdraft {holder.get('command', '?')} (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, "
            f"since {since})")


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _stale(holder: dict) -> bool:
    return holder.get("host") == host() and isinstance(holder.get("pid"), int) and not pid_alive(holder["pid"])


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise ValueError(f"{path} is a symbolic link; remove it (a lock file is never followed)") from None
        raise e


def acquire(output: str | os.PathLike, command: str, *, wait: bool = False, poll: float = 0.2) -> int:
    """Take the lock of `output` for `command`; returns its descriptor (give it to `release`).
    ValueError naming the holder when it is held (with `wait`, waits for it instead)."""
    path = lock_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    told = False
    while True:
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            if _stale(holder) and _same_file(path, fd):
                os.unlink(path)  # the next round makes a fresh file; the dead holder keeps the old one
                os.close(fd)
                continue
            os.close(fd)
            if not wait:
                raise ValueError(f"{output} is in use by {describe(holder)}; wait for it to finish or "
                                 "choose another output") from None
            if not told:
                print(f"blockdraft: waiting for {describe(holder)}, which is writing {output}", file=sys.stderr)
                told = True
            time.sleep(poll)
            continue
        if not _same_file(path, fd):  # released and removed while we waited: try again
            os.close(fd)
            continue
        record = {"command": command, "pid": os.getpid(), "host": host(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        return fd


def release(output: str | os.PathLike, fd: int) -> None:
    """Remove the lock file (while still held, so no one holds a removed file unawares), then let go."""
    path = lock_path(output)
    try:
        if _same_file(path, fd):
            os.unlink(path)
    finally:
        os.close(fd)


@contextmanager
def locked(output: str | os.PathLike, command: str, *, wait: bool = False, lead: bool | None = None):
    """Hold the lock of `output` for the block. `lead`: whether this process locks (default:
    `lead_process()`; the other ranks of a torchrun job run the block without it)."""
    if not (lead_process() if lead is None else lead):
        yield None
        return
    fd = acquire(output, command, wait=wait)
    try:
        yield fd
    finally:
        release(output, fd)
