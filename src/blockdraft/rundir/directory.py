"""`RunDir`: the one object that owns a command's output directory.

It claims and locks the directory (`ownership`, `locks`), checks what is already there and what
the command may replace (`files.LAYOUT` for a training run), saves and resumes the trainer's state
(`state`) with the checkpoints kept and the best drafter (`retention`), swaps directories in whole
(`atomic`), appends the metrics, records the run's settings, and says where the trackers and the
plots write (`trackers.DIRS`, `plots`). `train`, `extract` and `regenerate` reach their outputs
through it; the modules beside it hold the rules it applies.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from . import files, retention, state
from .atomic import check_free_space, recover_dir
from .locks import locked
from .ownership import claim, write_text


class RunDir:
    """`path`: the output (a directory; for `regenerate`, the answers file it locks). `owner`: the
    command whose marker it carries ("train", "extract", "regenerate")."""

    LENGTH = files.LENGTH  # settings a --resume may grow (the schedule then follows the new length)

    def __init__(self, path: str | os.PathLike, owner: str = files.OWNER):
        self.path, self.owner = Path(path), owner

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r}, owner={self.owner!r})"

    # ---------------------------------------------------------------- claiming
    @contextmanager
    def claim(self, *, lead: bool | None = None, resume: bool = False, overwrite: bool = False):
        """Own the directory for this command (checked, locked, marked; removed again when the
        command fails before writing). A training run also checks what a run already there allows
        (--resume / --overwrite). `lead`: whether this process writes it (default: rank 0 of a
        torchrun job, or a process outside one; the other ranks run the block without claiming)."""
        if self.owner == files.OWNER:
            with claim(self.path, self.owner, layout=files.LAYOUT, lead=lead,
                       check=lambda p: files.check_existing(p, resume, overwrite)):
                yield self
        else:
            with claim(self.path, self.owner, lead=lead):
                yield self

    @contextmanager
    def lock(self):
        """One writer of a single output file at a time (regenerate's answers), the others refused."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with locked(self.path, self.owner, lead=True):
            yield self

    def check_space(self, need_bytes: int, what: str) -> None:
        """Room for `what` on the output's file system, found before the work that writes it."""
        check_free_space(self.path, need_bytes, what)  # the nearest existing directory's file system

    def clear(self) -> None:
        """--overwrite: the earlier run's files removed (all checked to be this command's)."""
        files.clear_run(self.path)

    # -------------------------------------------------------------- checkpoints
    @property
    def checkpoint(self) -> Path:
        return self.path / retention.CURRENT

    def newest(self, say=None) -> Path | None:
        """The newest complete checkpoint, current or kept (`say`: a line for each one passed over)."""
        return retention.newest(self.path, say)

    def recover(self) -> Path | None:
        """The current checkpoint, put back in place when a killed swap left it aside."""
        return recover_dir(self.checkpoint, self.owner)

    def save(self, *, drafter, optimizer, progress: dict, keep: int, settings: dict, need_bytes: int,
             **states) -> None:
        """The trainer's state swapped in as the current checkpoint; the one it replaces kept or
        removed, then those past --keep-checkpoints pruned."""
        state.save_state(self.checkpoint, drafter=drafter, optimizer=optimizer, progress=progress,
                         need_bytes=need_bytes, settings=settings, keep_old=retention.keeper(self.path, keep),
                         owner=self.owner, **states)
        retention.prune(self.path, keep, progress["step"])

    def load(self, *, drafter, optimizer, say=None) -> tuple[Path, dict]:
        """The newest complete checkpoint loaded into `drafter` and `optimizer`: (where, progress)."""
        path = self.newest(say) or self.checkpoint
        return path, state.load_state(path, drafter=drafter, optimizer=optimizer)

    def checked_meta(self) -> dict:
        """The newest checkpoint's record, read whole (one error naming the file if it cannot be)."""
        return state.read_meta(self.newest() or self.checkpoint)

    @staticmethod
    def checkpoint_bytes(params: int) -> int:
        return state.checkpoint_bytes(params)

    @staticmethod
    def run_bytes(params: int, keep: int, best: bool) -> int:
        return state.run_bytes(params, keep, best)

    # --------------------------------------------------------------------- best
    @property
    def best(self) -> Path:
        return self.path / retention.BEST

    def read_best(self) -> dict | None:
        return retention.read_best(self.path)

    @staticmethod
    def best_files(step: int, tau: float) -> dict:
        """What the best drafter's directory carries beside it: its step and held-out tau."""
        return {retention.BEST_JSON: retention.best_record(step, tau)}

    # ------------------------------------------------------------------ metrics
    @property
    def metrics(self) -> Path:
        return self.path / files.METRICS

    def start_metrics(self) -> None:
        write_text(self.metrics, "")

    def append_metrics(self, record: dict, kept: int = 0) -> None:
        files.append_metrics(self.path, record, kept=kept)

    def metrics_lines(self, say: bool = True) -> list[str]:
        return files.metrics_lines(self.metrics, say=say) if self.metrics.is_file() else []

    def truncate_metrics(self, step: int) -> None:
        files.truncate_metrics(self.path, step)

    # ----------------------------------------------------------------- settings
    @property
    def settings_file(self) -> Path:
        return self.path / files.CONFIG_FILE

    def saved_settings(self) -> tuple[dict, str | None]:
        return files.saved_settings(self.path)

    def write_settings(self, record: dict) -> None:
        files.write_record(self.path, record)

    @staticmethod
    def resumed_settings(saved: dict, now: dict) -> dict:
        """What a resumed run records: its own settings, but for a length grown on --resume."""
        return files.resumed_record(saved, now)

    def write_summary(self, text: str) -> None:
        write_text(self.path / files.SUMMARY, text)

    # --------------------------------------------------- trackers and the plots
    def open_trackers(self, cfg, record: dict, resumed_step: int | None):
        """--report-to's trackers, each keeping its store inside the run (`trackers.DIRS`, which
        `files.LAYOUT` lists), never in the library's default place."""
        from .trackers import open_trackers

        return open_trackers(cfg, self.path, record, resumed_step)

    def plot(self) -> list[Path]:
        from .plots import plot_run

        return plot_run(self.metrics, self.path)
