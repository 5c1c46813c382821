"""The GPU paths of the training loop, checked on a CPU: checkpoint and evaluation cadence bounded to
a share of the wall time, fused AdamW on CUDA, both memory peaks logged, and the next micro-batch's
host bookkeeping made on a thread with the same result as made inline."""

from __future__ import annotations

import json

import pytest
import torch

from blockdraft.train.cadence import Cadence
from blockdraft.train.trainer import memory_peaks, optimizer_options
from conftest import make


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_period_alone_without_a_share():
    c = Cadence(3, None, first=True, clock=Clock())
    assert [s for s in range(1, 11) if c.due(s, 10)] == [1, 3, 6, 9, 10]


def test_work_that_costs_too_much_of_the_wall_time_is_put_off_but_the_last_step_always_runs():
    clock = Clock()
    c = Cadence(2, 0.05, clock=clock)
    ran = []
    for step in range(1, 41):
        clock.t += 1.0  # a one-second step
        if c.due(step, 40):
            ran.append(step)
            c.run(lambda: setattr(clock, "t", clock.t + 2.0))  # a two-second checkpoint
    # 2 s of work may come after 38 s of training at most (2 / (38 + 2) = 5%): at step 2, then 2 + 38
    assert ran == [2, 40]
    gaps = [b - a for a, b in zip(ran, ran[1:])]
    assert all(g >= 38 for g in gaps[:-1])


def test_a_cheap_checkpoint_keeps_its_period():
    clock = Clock()
    c = Cadence(5, 0.05, clock=clock)
    ran = []
    for step in range(1, 21):
        clock.t += 1.0
        if c.due(step, 20):
            ran.append(step)
            c.run(lambda: setattr(clock, "t", clock.t + 0.1))
    assert ran == [5, 10, 15, 20]


def test_every_rank_takes_rank_0s_decision():
    clock = Clock()
    told = []
    c = Cadence(1, 0.05, clock=clock, agree=lambda flag: told.append(flag) or False)
    assert c.due(1, 5)  # nothing measured yet: due, and nothing to agree on
    c.run(lambda: None)
    clock.t += 100.0
    assert not c.due(2, 5) and told == [True]  # this rank would, rank 0 says no
    assert c.due(5, 5)  # the last step needs no agreement


def test_fused_adamw_on_cuda_only():
    assert optimizer_options(torch.device("cuda", 0)) == {"fused": True}
    assert optimizer_options("cuda:1") == {"fused": True}
    assert optimizer_options(torch.device("cpu")) == {}


def test_allocated_and_reserved_peaks_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append(d))
    assert memory_peaks(torch.device("cuda", 0)) == {"peak_mem_gib": 3.0, "peak_reserved_gib": 5.0}
    assert calls == [torch.device("cuda", 0)]
    assert memory_peaks(torch.device("cpu")) == {}


@pytest.mark.parametrize("ahead", [False, True])
def test_planning_the_next_micro_batch_on_a_thread_trains_the_same(tmp_path, ahead):
    losses = {}
    for name, flag in (("inline", False), ("ahead", ahead)):
        tr = make(tmp_path / name, steps=4, grad_accum=2)
        tr.plan_ahead = flag
        tr.train()
        losses[name] = [json.loads(ln)["loss"] for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        if flag:
            assert tr._planner is not None and not tr._planned  # used, and nothing left behind
    assert losses["ahead"] == losses["inline"]


def test_both_peaks_reach_the_metrics_as_per_rank_lists(tmp_path, monkeypatch):
    import blockdraft.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "memory_peaks", lambda device: {"peak_mem_gib": 3.0, "peak_reserved_gib": 5.0})
    tr = make(tmp_path, steps=2)
    tr.train()
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(m["peak_mem_gib"] == [3.0] and m["peak_reserved_gib"] == [5.0] for m in lines)


def test_each_put_off_says_so_in_one_line_with_its_reason():
    clock, lines = Clock(), []
    c = Cadence(2, 0.05, clock=clock, what="checkpoint", say=lines.append)
    ran = []
    for step in range(1, 11):
        clock.t += 1.0
        if c.due(step, 10):
            ran.append(step)
            c.run(lambda: setattr(clock, "t", clock.t + 2.0))
    put_off = [s for s in range(2, 10, 2) if s not in ran]  # due by the period, not run
    assert ran == [2, 10] and put_off == [4, 6, 8]
    assert len(lines) == len(put_off) and all("\n" not in ln for ln in lines)
    for step, line in zip(put_off, lines):
        since = (2 + step) - 2.0  # now (1 s a step, 2 s the checkpoint) less when step 2's checkpoint began
        assert line.startswith(f"checkpoint of step {step} put off: the last one took 2.0 s, more than 5% of the "
                               f"{since:.1f} s since it began")


def test_a_cadence_that_runs_every_time_says_nothing():
    clock, lines = Clock(), []
    c = Cadence(1, None, clock=clock, say=lines.append)
    for step in range(1, 6):
        clock.t += 1.0
        assert c.due(step, 5)
        c.run(lambda: setattr(clock, "t", clock.t + 100.0))
    assert lines == []


@pytest.mark.parametrize("save_best", [False, True])
def test_save_best_evaluates_at_every_eval_every_on_a_gpu(save_best):
    from blockdraft.train.trainer import Trainer, TrainConfig

    clock, lines = Clock(), []
    save, ev = Trainer.cadences(TrainConfig(out="x", eval_every=2, save_every=2, save_best=save_best), True,
                                lines.append)
    assert save.share == 0.05  # checkpoints stay bounded either way
    ev.clock = clock
    ran = []
    for step in range(1, 11):
        clock.t += 1.0
        if ev.due(step, 10):
            ran.append(step)
            ev.run(lambda: setattr(clock, "t", clock.t + 5.0))  # an evaluation far over 5%
    assert ran == ([2, 4, 6, 8, 10] if save_best else [2, 10])
    assert len(lines) == (0 if save_best else 3)


def test_the_help_states_the_share_the_trainer_uses():
    import argparse

    from blockdraft.cli import build_parser
    from blockdraft.train.trainer import GPU_WORK_SHARE

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub.choices["train"]._actions}
    for dest in ("save_every", "eval_every"):
        assert f"over {GPU_WORK_SHARE:.0%}% of the wall time" in helps[dest]  # argparse's %% is one %
    assert "none put off" in helps["save_best"]
