"""Preemption (issue 43, item 3): SIGTERM, SIGUSR1 or a first Ctrl-C finishes the step, saves it and
stops with Preempted (the CLI's exit code 75); --resume then trains exactly as a run never stopped.
A second Ctrl-C stops at once, keeping the last complete checkpoint."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from blockdraft.preempt import Preempted
from conftest import make


def losses(out):
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


def step_of(path):
    return json.loads((path / "trainer_state.json").read_text())["progress"]["step"]


def signal_after(tr, step, *signums):
    """Send this process `signums` as soon as step `step` is done (inside the trainer's step, as a
    signal arriving at any moment of it would be seen)."""
    real = tr.step

    def step_():
        got = real()
        if tr.progress["step"] == step:
            for s in signums:
                os.kill(os.getpid(), s)
        return got

    tr.step = step_


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("preempt") / "ref"
    tr = make(out, steps=6)
    tr.train()
    return out, tr.drafter.fc.weight.detach().clone()


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_a_signal_saves_the_step_stops_and_resumes_exactly(tmp_path, reference, name):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    tr = make(tmp_path, steps=6)
    signal_after(tr, 3, getattr(signal, name))  # save_every 2: step 3 is no step-based save
    with pytest.raises(Preempted) as got:
        tr.train()
    assert (got.value.step, got.value.signame) == (3, name)
    assert "exit code 75" in str(got.value) and "--resume" in str(got.value)
    assert step_of(tmp_path / "checkpoint") == 3 and len(losses(tmp_path)) == 3
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers given back
    again = make(tmp_path, steps=6)
    again.train(resume=True)
    assert losses(tmp_path) == pytest.approx(losses(reference[0]), rel=1e-6, abs=1e-7)
    assert torch.equal(again.drafter.fc.weight, reference[1])


def test_a_second_ctrl_c_stops_at_once_keeping_the_last_checkpoint(tmp_path, reference):
    tr = make(tmp_path, steps=6)
    signal_after(tr, 3, signal.SIGINT, signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        tr.train()
    assert step_of(tmp_path / "checkpoint") == 2  # step 3 not saved: stopped at once
    again = make(tmp_path, steps=6)
    again.train(resume=True)
    assert losses(tmp_path) == pytest.approx(losses(reference[0]), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_signal_while_starting_up_stops_before_the_first_step_and_writes_nothing(tmp_path, name):
    from blockdraft.preempt import starting_up

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    tr = make(tmp_path, steps=6)
    with starting_up():
        os.kill(os.getpid(), getattr(signal, name))  # SLURM's warning while the target loads: noted only
        with pytest.raises(Preempted) as got:
            tr.train()
    assert {s: signal.getsignal(s) for s in before} == before
    assert (got.value.step, got.value.signame) == (0, name)
    assert "during start-up, before step 1: nothing was trained or saved" in str(got.value)
    assert "without --resume" in str(got.value) and "exit code 75" in str(got.value)
    assert not (tmp_path / "checkpoint").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert tr.progress["step"] == 0


def test_a_signal_while_a_resume_starts_up_leaves_its_checkpoint_as_it_was(tmp_path, reference):
    from blockdraft.preempt import starting_up

    first = make(tmp_path, steps=6)
    signal_after(first, 3, signal.SIGTERM)
    with pytest.raises(Preempted):
        first.train()
    state = (tmp_path / "checkpoint" / "trainer_state.json").read_bytes()
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    again = make(tmp_path, steps=6)
    with starting_up():
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(Preempted) as got:
            again.train(resume=True)
    assert "during start-up, before any step" in str(got.value) and "(with --resume)" in str(got.value)
    assert (tmp_path / "checkpoint" / "trainer_state.json").read_bytes() == state
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
    last = make(tmp_path, steps=6)
    last.train(resume=True)  # and the resume it advises is exact
    assert losses(tmp_path) == pytest.approx(losses(reference[0]), rel=1e-6, abs=1e-7)


def records(out):
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("save_best", [False, True])
def test_an_evaluation_a_stop_put_off_is_run_by_the_resume_as_an_uncut_run_runs_it(tmp_path, save_best):
    ref = make(tmp_path / "ref", steps=6, save_best=save_best)  # eval_every 3: evaluations at 3 and 6
    ref.train()
    want = records(tmp_path / "ref")
    assert [r["step"] for r in want if "eval_tau" in r] == [3, 6]
    out = tmp_path / "run"
    tr = make(out, steps=6, save_best=save_best)
    signal_after(tr, 3, signal.SIGTERM)  # the step an evaluation is due at
    with pytest.raises(Preempted):
        tr.train()
    assert step_of(out / "checkpoint") == 3 and [r["step"] for r in records(out)] == [1, 2, 3]
    assert "eval_tau" not in records(out)[-1]  # owed to the resume
    make(out, steps=6, save_best=save_best).train(resume=True)
    got = records(out)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    from blockdraft.rundir.trackers import figures

    def kept(r):  # every figure but the timings, lists as NAME/i
        return {k: v for k, v in figures(r).items() if not k.endswith("_s") and k not in ("elapsed", "tokens_per_s")}

    for g, w in zip(got, want):  # the same figures, the evaluation of step 3 included
        assert set(g) == set(w), g["step"]
        assert kept(g) == pytest.approx(kept(w), rel=1e-6, abs=1e-7), g["step"]
    if save_best:
        assert json.loads((out / "best" / "best.json").read_text()) == json.loads(
            (tmp_path / "ref" / "best" / "best.json").read_text())
    assert "owed_eval" not in json.loads((out / "checkpoint" / "trainer_state.json").read_text())["progress"]


def test_a_signal_after_the_training_loop_says_the_run_is_finishing(tmp_path, capfd):
    from blockdraft.preempt import starting_up

    tr = make(tmp_path, steps=2)
    with starting_up():
        tr.train()
        capfd.readouterr()
        os.kill(os.getpid(), signal.SIGUSR1)  # while the summary and the plots are written
        assert capfd.readouterr().err == "blockdraft train: SIGUSR1: training is done: exiting once its last files " \
                                         "are written\n"
    assert (tmp_path / "drafter").is_dir()
