"""A command's output directory, owned by one object (`RunDir`, in `directory`).

The modules here hold its rules: `ownership` (markers, temporaries, claiming), `locks` (one writer
at a time), `atomic` (whole-directory swaps, free space), `state` (the trainer's resumable state),
`retention` (the checkpoints kept, the best drafter), `files` (what a training run holds: metrics,
settings), `trackers` and `plots` (what --report-to and the end of a run write into it). None of
them knows a model; they sit at the bottom of the layers, beside `options`.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "RunDir":  # imported on use: `rundir.ownership` alone pulls in no torch
        from .directory import RunDir

        return RunDir
    raise AttributeError(name)
