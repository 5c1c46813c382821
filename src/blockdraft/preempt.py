"""Stopping a run cleanly when asked (issue 43, item 3): SIGTERM or SIGUSR1 (what SLURM and
Kubernetes send before they kill a job) or a first Ctrl-C. Every rank finishes the step it is in,
a resumable checkpoint of that step is written, and the command exits with `PREEMPTED` (75,
sysexits' EX_TEMPFAIL: "try again later"; success is 0, an error 1 or 2, Ctrl-C 130), after which
`train --resume` continues exactly. A second Ctrl-C stops at once (exit 130), losing nothing that
was finished: the checkpoint being written is a temporary until it is whole.

The signal may reach one rank only (or the launcher, which forwards it to all): once per optimizer
step every rank contributes its flag to one small all-reduce (`train.cadence.poll`), which also
carries rank 0's verdict on the time-based save (--save-every-min), so all ranks stop, and save, at
the same step.
"""

from __future__ import annotations

import os
import signal
import threading

PREEMPTED = 75  # the exit code of a run stopped by a signal after saving its checkpoint
SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


class Preempted(Exception):
    """The run stopped on a signal after step `step`, its checkpoint saved in `path`."""

    def __init__(self, step: int, signame: str, path, *, starting: bool = False, resumed: bool = False):
        """`starting`: the signal came before the first step (`resumed`: of a --resume), nothing trained."""
        self.step, self.signame, self.path = step, signame, path
        if not starting:
            say = (f"stopped by {signame} after step {step}: its checkpoint is {path}; rerun the same command "
                   "with --resume to continue")
        elif resumed:
            say = (f"stopped by {signame} during start-up, before any step: the checkpoints in {path.parent} are "
                   "unchanged; rerun the same command (with --resume) to continue")
        else:
            say = (f"stopped by {signame} during start-up, before step 1: nothing was trained or saved; rerun the "
                   "same command, without --resume, to start")
        super().__init__(f"{say} (exit code {PREEMPTED})")


class StepLost(Exception):
    """A step (or evaluation) read features a stopped engine never made (the engines' StopGuard): every
    rank throws it away together, and the run stops as preempted at the last whole step."""


_NOTED: list[str] = []  # the signal this process was asked to stop by (StopSignals), for threads that must know


def noted() -> str | None:
    """The stop signal this process noted (any thread may ask), or None."""
    return _NOTED[0] if _NOTED else None


class StopSignals:
    """While entered (in the main thread): SIGTERM, SIGUSR1 and a first SIGINT only note that a stop
    was asked; a second SIGINT goes to the handler that was there before (the CLI's: exit 130), or
    raises KeyboardInterrupt. `lead`: this process says on stderr that it is stopping."""

    def __init__(self, lead: bool = True, names: tuple = SIGNALS,
                 then="stopping after this step and saving a checkpoint"):
        """`names`: the signals noted; `then`: what the line on stderr says happens next (or a function
        that says it when the signal comes)."""
        self.lead, self.got, self._before = lead, None, {}
        self.names, self.then = names, then

    def _note(self, signum, frame):
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.got is not None:
            before = self._before.get(signum)
            if callable(before):
                return before(signum, frame)
            raise KeyboardInterrupt
        if self.got is None:
            self.got = name
            _NOTED[:] = [name]
            if self.lead:  # os.write: safe inside a handler, where print may be mid-write
                again = "; Ctrl-C again to stop at once" if name == "SIGINT" else ""
                then = self.then() if callable(self.then) else self.then
                os.write(2, f"blockdraft train: {name}: {then}{again}\n".encode())

    def __enter__(self):
        self.got = noted()  # one noted while starting up (`starting_up`) still stands
        if threading.current_thread() is threading.main_thread():
            for name in self.names:
                num = getattr(signal, name, None)
                if num is not None:
                    self._before[num] = signal.signal(num, self._note)
        return self

    def __exit__(self, *exc):
        _NOTED.clear()
        for num, before in self._before.items():
            signal.signal(num, before if before is not None else signal.SIG_DFL)
        self._before.clear()
        return False



def starting_up(lead: bool = True) -> StopSignals:
    """`train`'s start-up (loading the target, the data, the engines), before the training loop's own
    StopSignals: SIGTERM or SIGUSR1 (SLURM's warning) is noted and said at once, and the run stops
    before its first step (Preempted, exit 75) instead of dying by the signal with no word. Ctrl-C
    keeps the CLI's own handling (one line, exit 130)."""
    _TRAINED.clear()

    def then() -> str:
        if _TRAINED:  # after the training loop: nothing is left to stop, the run's last files are written
            return "training is done: exiting once its last files are written"
        return "stopping before the first step (still starting up)"

    return StopSignals(lead, names=("SIGTERM", "SIGUSR1"), then=then)


_TRAINED: list[bool] = []  # the training loop of this command ended (`trained`)


def trained() -> None:
    """The training loop ended: a signal from now on is said as such (`starting_up`)."""
    _TRAINED[:] = [True]
