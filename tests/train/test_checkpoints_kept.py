"""Which checkpoints a run keeps (issue 43, item 2): --keep-checkpoints N, --save-best, saves by
steps or minutes, and `--resume` from the newest complete one, under a crash at any point of a
save (each file operation of it in turn fails as a kill there would leave it)."""

from __future__ import annotations

import json
import os
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file

import blockdraft.train.trainer as trainer_mod
from blockdraft.checkpoint import load_drafter
from blockdraft.rundir.retention import BEST, KEPT, candidates, kept_name
from conftest import dead_pid, make


def losses(out):
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


def step_of(path):
    return json.loads((path / "trainer_state.json").read_text())["progress"]["step"]


def kept_steps(out):
    return sorted(step_of(p) for p in (out / KEPT).iterdir() if p.name.startswith("step-")) if (out / KEPT).exists() \
        else []


def assert_whole(out):
    """Every checkpoint and the best drafter the run holds under its own name loads whole."""
    names = [out / "checkpoint"] if (out / "checkpoint").exists() else []
    names += [p for p in (out / KEPT).iterdir() if p.name.startswith("step-")] if (out / KEPT).exists() else []
    for p in names:
        assert {"trainer_state.safetensors", "trainer_state.json"} <= {e.name for e in p.iterdir()}, p
        load_file(str(p / "trainer_state.safetensors"))
        if p.parent.name == KEPT:
            assert p.name == kept_name(step_of(p))
    if (out / BEST).exists():
        load_drafter(out / BEST)
        assert set(json.loads((out / BEST / "best.json").read_text())) == {"step", "eval_tau"}


def test_the_newest_n_are_kept_and_resume_names_the_one_it_takes(tmp_path, capsys):
    tr = make(tmp_path, steps=8, keep_checkpoints=3, save_best=True)
    tr.train()
    assert step_of(tmp_path / "checkpoint") == 8 and kept_steps(tmp_path) == [4, 6]  # saved at 1, 2, 4, 6, 8
    evals = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "eval_tau" in r]
    best = max(evals, key=lambda r: r["eval_tau"])  # the first of equal ones
    assert json.loads((tmp_path / BEST / "best.json").read_text()) == {"step": best["step"],
                                                                         "eval_tau": best["eval_tau"]}
    assert_whole(tmp_path)
    # the newest lost: the next one is taken, and said
    shutil.rmtree(tmp_path / "checkpoint")
    again = make(tmp_path, steps=8, keep_checkpoints=3, save_best=True)
    capsys.readouterr()
    again.resume()
    assert again.progress["step"] == 6
    assert f"resuming from {tmp_path / KEPT / kept_name(6)} (step 6)" in capsys.readouterr().out


def test_fewer_kept_on_resume_removes_the_oldest(tmp_path):
    make(tmp_path, steps=4, keep_checkpoints=4).train()
    assert kept_steps(tmp_path) == [1, 2]
    make(tmp_path, steps=6, keep_checkpoints=1).train(resume=True)
    assert kept_steps(tmp_path) == [] and step_of(tmp_path / "checkpoint") == 6


def test_a_save_killed_before_its_swap_is_ignored_saying_so(tmp_path, capsys):
    make(tmp_path, steps=4, keep_checkpoints=2).train()
    from blockdraft.rundir.locks import host
    from blockdraft.rundir.ownership import write_marker

    cut = tmp_path / f".checkpoint.blockdraft-tmp-{host()}-{dead_pid()}"  # as a killed save leaves it
    cut.mkdir()
    write_marker(cut, "train")
    (cut / "trainer_state.json").write_text('{"progress": {"step": 9')  # cut short
    found, partial = candidates(tmp_path)
    assert [s for s, _ in found] == [4, 2] and partial == [cut]
    again = make(tmp_path, steps=6, keep_checkpoints=2)
    capsys.readouterr()
    again.train(resume=True)
    got = capsys.readouterr()
    assert f"ignored an incomplete checkpoint, {cut}" in got.err and "(step 4)" in got.out
    assert not cut.exists()  # a dead writer's temporary, removed by the next save


def test_saves_come_by_steps_or_minutes_whichever_first(tmp_path, monkeypatch):
    """A clock of 25 s per step: --save-every-min 1 saves 3 steps after the last save, --save-every 4
    when that comes first."""
    tr = make(tmp_path, steps=12, keep_checkpoints=20, save_every_min=1.0)
    tr.cfg.save_every = tr.save_cadence.every = 4  # make() sets 2
    clock = types.SimpleNamespace(time=trainer_mod.time.time, perf_counter=trainer_mod.time.perf_counter,
                                  monotonic=lambda: 25.0 * tr.progress["step"])
    monkeypatch.setattr(trainer_mod, "time", clock)
    tr.train()
    # 1 (the first), 4 (steps), 7 (75 s after 4), 8 (steps), 11 (minutes), 12 (the last)
    assert kept_steps(tmp_path) == [1, 4, 7, 8, 11]


class Crash(BaseException):
    """A kill at this point: nothing after it runs (no handler of Exception catches it)."""


def faulty(monkeypatch, tr, window):
    """While the run is at steps `window[0]` to `window[1]`, the k-th file operation (a rename, a
    removal, a tensor file's write) raises Crash; returns the state whose "k" sets it."""
    import blockdraft.checkpoint.native as native_mod
    import blockdraft.rundir.state as state_mod

    state = {"k": 0, "n": 0}

    def hit(name, real):
        def op(*a, **kw):
            if window[0] <= tr.progress["step"] <= window[1]:
                state["n"] += 1
                if state["n"] == state["k"]:
                    raise Crash(f"{name} #{state['n']}")
            return real(*a, **kw)
        return op

    monkeypatch.setattr(os, "rename", hit("rename", os.rename))
    monkeypatch.setattr(shutil, "rmtree", hit("rmtree", shutil.rmtree))
    monkeypatch.setattr(state_mod, "save_file", hit("save_file", state_mod.save_file))
    monkeypatch.setattr(native_mod, "save_file", hit("save_file", native_mod.save_file))
    return state


def test_a_crash_at_any_point_of_a_save_keeps_every_kept_one_whole_and_resumes_exactly(tmp_path, monkeypatch):
    """Steps 3 and 4 save the best drafter (an evaluation at 3) and checkpoint 4 (keeping 2, so 2 moves
    to checkpoints/ and 1 goes); each of their file operations in turn is a kill. What is left holds
    only whole checkpoints and a whole best drafter, and the resume ends where an uncut run does."""
    kw = dict(steps=5, keep_checkpoints=2, save_best=True)
    ref = make(tmp_path / "ref", **kw)
    ref.train()
    k, points = 0, []
    while True:
        k += 1
        out = tmp_path / f"k{k}"
        tr = make(out, **kw)
        with monkeypatch.context() as m:
            state = faulty(m, tr, (3, 4))
            state["k"] = k
            try:
                tr.train()
                break  # every operation of the window passed: all points were tried
            except Crash as e:
                points.append(str(e))
        assert_whole(out)
        again = make(out, **kw)
        again.train(resume=True)
        assert losses(out) == pytest.approx(losses(tmp_path / "ref"), rel=1e-6, abs=1e-7), points[-1]
        assert torch.equal(again.drafter.fc.weight, ref.drafter.fc.weight)
        assert kept_steps(out) == [4] and step_of(out / "checkpoint") == 5
        assert json.loads((out / BEST / "best.json").read_text()) == json.loads(
            (tmp_path / "ref" / BEST / "best.json").read_text())
        shutil.rmtree(out)
    assert len(points) >= 8, points  # the best's swap, the checkpoint's write, move, swap and prune


@pytest.mark.parametrize("damage", [b'{"step": 3, "eval_', b'{"step": 3}', b'{"step": true, "eval_tau": 2.0}', None])
def test_a_damaged_best_json_stops_the_resume_instead_of_being_replaced(tmp_path, damage):
    from blockdraft.train.run import check_resumed_state

    first = make(tmp_path, steps=6, save_best=True)
    first.train()
    kept = (tmp_path / BEST / "model.safetensors").read_bytes()
    if damage is None:
        (tmp_path / BEST / "best.json").unlink()
    else:
        (tmp_path / BEST / "best.json").write_bytes(damage)
    with pytest.raises(ValueError, match=r"best\.json (cannot be read|does not hold a step and an eval_tau).*"
                                         r"restore it, or move .*best away"):
        check_resumed_state(tmp_path, save_best=True)  # before the target loads
    again = make(tmp_path, steps=8, save_best=True)
    with pytest.raises(ValueError, match="best.json"):
        again.train(resume=True)
    assert (tmp_path / BEST / "model.safetensors").read_bytes() == kept  # the best drafter is not replaced
    check_resumed_state(tmp_path, save_best=False)  # a resume without --save-best does not read it
    shutil.rmtree(tmp_path / BEST)  # moved away, as advised: the best starts over
    make(tmp_path, steps=8, save_best=True).train(resume=True)
    assert json.loads((tmp_path / BEST / "best.json").read_text())["step"] > 6
