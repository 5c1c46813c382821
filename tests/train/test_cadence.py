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
