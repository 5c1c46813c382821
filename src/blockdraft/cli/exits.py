"""How a command ends: Ctrl-C at any point (one line, exit 130, never inside an import), a run stopped by a
signal after saving (exit 75), an error in one line (exit 2), and the exit of a process that ran in a
torch.distributed group."""

from __future__ import annotations

import contextlib
import os
import sys

from .parsers import train_config


def one_line(e: BaseException) -> str:
    """An error as one line: OSErrors by what failed and where (a full disk names its fix)."""
    import errno

    if isinstance(e, OSError) and e.errno is not None:
        where = f": {e.filename}" if e.filename else ""
        fix = "; free some space or choose another directory" if e.errno == errno.ENOSPC else ""
        return f"{e.strerror}{where}{fix}"
    return " ".join(str(e).split("\n")[0].split()) or type(e).__name__


@contextlib.contextmanager
def interrupts():
    """A list that gets an entry when SIGINT arrives, where Python's own handler is the one in place
    (a caller's own handler is left alone). The interrupt raises KeyboardInterrupt, but never inside
    a module being imported: raised there, torch's native initialisation aborts the process, numpy is
    left half-imported, and importlib's lock callbacks drop it ("Exception ignored in"). It is
    delivered again every 50 ms until no import runs. Once the list holds "handled" (main is
    reporting it), interrupts are ignored."""
    import _thread
    import signal
    import threading

    got: list = []
    later: list = []

    def note(signum, frame):
        if "handled" in got:
            return
        got.append(signum)
        if importing(frame):
            later.append(threading.Timer(0.05, _thread.interrupt_main))
            later[-1].start()
            return
        raise KeyboardInterrupt

    try:
        mine = signal.getsignal(signal.SIGINT) is signal.default_int_handler and bool(signal.signal(signal.SIGINT, note))
    except ValueError:  # not the main thread
        mine = False
    try:
        yield got
    finally:
        got.append("handled")
        for t in later:
            t.cancel()
        if mine:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def rerun_hint(args) -> str:
    """What continues an interrupted command: --resume for a run that saved a checkpoint."""
    if getattr(args, "cmd", None) != "train" or not getattr(args, "fn", None):
        return "rerun the same command to continue" if getattr(args, "cmd", None) else "nothing was done"
    try:
        from pathlib import Path

        from ..rundir.directory import RunDir

        saved = RunDir(Path(train_config(args, getattr(args, "argv", [])).train.out)).newest() is not None
    except (ValueError, OSError, AttributeError):
        saved = False
    if saved:
        return "rerun the same command with --resume to continue from the last checkpoint"
    return "no checkpoint was saved yet: rerun the same command (with --overwrite where it says a run is there)"


def preempted(args, e) -> int:
    """A run stopped by SIGTERM, SIGUSR1 or a first Ctrl-C after saving: one line (rank 0), the
    process group left together, exit code PREEMPTED."""
    from ..preempt import PREEMPTED

    group = sys.modules.get("blockdraft.train.distributed")  # not imported: this process joined no group
    if group is None or group.world()[0] == 0:
        print(f"blockdraft {args.cmd}: {e}", file=sys.stderr)
    if group is not None:
        group.leave()
    return PREEMPTED


def exit_after_group(rc: int) -> None:
    """A process that ran in a torch.distributed group and left it (a torchrun rank's finished or
    preempted run) exits here, after the atexit work, without the interpreter's teardown. There, a
    gloo worker thread of the group (still running after destroy_process_group: something, FSDP's
    state most likely, holds the group) released the last barrier's work, and with it all-gather works
    and their tensors; dropping a tensor's Python object takes the GIL, which a finalizing
    interpreter refuses by ending the thread inside a noexcept destructor: std::terminate, SIGABRT
    'terminate called without an active exception' after a clean finish (core dump read with gdb;
    torch 2.11, 5 of about 40 runs on a loaded CPU; benchmarks/exit_check.sh compares the two ways).
    Everything the run wrote is closed and synced by then; the launcher reads this exit code."""
    d = sys.modules.get("blockdraft.train.distributed")
    if d is None or not d.left_group() or os.environ.get("BLOCKDRAFT_FULL_TEARDOWN"):  # that: the check's control
        return
    import atexit

    atexit._run_exitfuncs()  # trackers, logging, temporary files
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)

