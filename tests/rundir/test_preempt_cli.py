"""`blockdraft train` stopped by SIGTERM (issue 43, item 3): it finishes the step, saves it, says so
in one line and exits with code 75 within a bound; `--resume` says which checkpoint it takes and
ends with the losses of a run never stopped. The new settings (--keep-checkpoints, --save-best,
--save-every-min) come from a --config file as from flags and are recorded in train_config.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from blockdraft.cli import main

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--max-length", "128", "--batch-tokens", "256", "--max-anchors", "16", "--draft-vocab", "full",
         "--eval-every", "4", "--save-every", "5", "--no-progress", "--threads", "1", "--eval-fraction", "0.1"]


def losses(out: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_saves_the_step_exits_75_and_resume_is_exact(tmp_path, tiny_target_dir, chat_data, capsys):
    base = ["train", "--target", tiny_target_dir, "--data", chat_data, "--steps", "8", *TRAIN]
    assert main([*base, "--out", str(tmp_path / "ref")]) == 0
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "blockdraft", *base, "--out", str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):  # a step after step 1's save
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.05)
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    took = time.monotonic() - sent
    assert p.returncode == 75, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    step = json.loads((out / "checkpoint" / "trainer_state.json").read_text())["progress"]["step"]
    assert line == (f"blockdraft train: stopped by SIGTERM after step {step}: its checkpoint is {out / 'checkpoint'}; "
                    "rerun the same command with --resume to continue (exit code 75)"), err
    assert 2 <= step < 8 and len(losses(out)) == step
    assert took < 30, took  # one step of this run and one save
    print(f"SIGTERM to exit: {took:.2f} s")
    capsys.readouterr()
    assert main([*base, "--out", str(out), "--resume"]) == 0
    assert f"train: resuming from {out / 'checkpoint'} (step {step})" in capsys.readouterr().out
    assert losses(out) == pytest.approx(losses(tmp_path / "ref"), rel=1e-6, abs=1e-7)


def test_the_new_settings_come_from_a_config_file_and_are_recorded(tmp_path, tiny_target_dir, chat_data, capsys):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"train": {"keep_checkpoints": 2, "save_best": True, "save_every_min": 30.0}}))
    out = tmp_path / "run"
    argv = ["train", "--config", str(cfg), "--target", tiny_target_dir, "--data", chat_data, "--steps", "5",
            "--out", str(out), *TRAIN]
    assert main(argv) == 0
    rec = json.loads((out / "train_config.json").read_text())["train"]
    assert (rec["keep_checkpoints"], rec["save_best"], rec["save_every_min"]) == (2, True, 30.0)
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step")] == ["step-0000001"]
    assert json.loads((out / "best" / "best.json").read_text())["step"] in (4, 5)
    # resumable settings: a resume may change them
    assert main([*argv, "--steps", "6", "--resume", "--keep-checkpoints", "1"]) == 0
    assert not any(p.name.startswith("step") for p in (out / "checkpoints").iterdir())
    capsys.readouterr()
    assert main(["train", "--target", tiny_target_dir, "--data", chat_data, "--steps", "2", "--save-best",
                 "--out", str(tmp_path / "none"), *TRAIN[:-2], "--eval-fraction", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--save-best" in err and "holds no rows out" in err, err


@pytest.mark.slow
def test_kill_9_at_random_points_keeps_whole_checkpoints_and_best_and_resumes(tmp_path, tiny_target_dir, chat_data):
    """--keep-checkpoints 2 --save-best under SIGKILL at random moments: every kept checkpoint and the
    best drafter left is whole, and --resume ends with the uncut run's drafter and best."""
    import random

    from safetensors.torch import load_file

    from blockdraft.checkpoint import load_drafter

    base = ["-m", "blockdraft", "train", "--target", tiny_target_dir, "--data", chat_data, "--steps", "10",
            "--keep-checkpoints", "2", "--save-best", *TRAIN[:8], "--eval-every", "2", "--save-every", "2",
            *TRAIN[12:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    assert subprocess.run([sys.executable, *base, "--out", str(tmp_path / "ref")], env=env).returncode == 0
    wall, rng = time.monotonic() - t0, random.Random(1)
    ref = load_file(str(tmp_path / "ref" / "drafter" / "model.safetensors"))
    for trial in range(3):
        out = tmp_path / f"kill{trial}"
        p = subprocess.Popen([sys.executable, *base, "--out", str(out)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        try:
            p.wait(timeout=rng.uniform(0.5, 0.95) * wall)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        kept = [out / "checkpoint"] + sorted((out / "checkpoints").glob("step-*"))
        for d in (k for k in kept if k.exists()):
            load_file(str(d / "trainer_state.safetensors"))
            json.loads((d / "trainer_state.json").read_text())
        if (out / "best").exists():
            load_drafter(out / "best")
            json.loads((out / "best" / "best.json").read_text())
        again = "--resume" if any(k.exists() for k in kept) else "--overwrite"
        assert subprocess.run([sys.executable, *base, "--out", str(out), again], env=env).returncode == 0
        got = load_file(str(out / "drafter" / "model.safetensors"))
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), trial
        assert json.loads((out / "best" / "best.json").read_text()) == json.loads(
            (tmp_path / "ref" / "best" / "best.json").read_text())
        assert len(list((out / "checkpoints").glob("step-*"))) == 1
        lines = (out / "metrics.jsonl").read_text().splitlines()
        assert lines and len(lines) == len(set(lines))  # nothing logged twice


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_both_ranks_at_one_step_and_resume_is_exact(tmp_path, tiny_target_dir, chat_data):
    """torchrun forwards SIGTERM to its 2 gloo ranks: both save the same step and exit 75 (rank 0 says
    so), and torchrun itself exits 1 (its own SIGTERM ends it with SignalException); a resume under
    torchrun ends with the losses of an uncut 2-rank run."""
    from conftest import free_port

    codes = tmp_path / "codes"
    codes.mkdir()

    def launch(out, *more):
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(free_port()), "-m", "rank_exit", "train", "--target",
                                 tiny_target_dir, "--data", chat_data, "--steps", "8", *TRAIN, "--out", str(out),
                                 *more], env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}",
                                              "OMP_NUM_THREADS": "1", "RANK_EXIT_DIR": str(codes)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    ref = launch(tmp_path / "ref")
    assert ref.communicate(timeout=600) and ref.returncode == 0
    out = tmp_path / "run"
    p = launch(out)
    deadline = time.monotonic() + 600
    while not ((out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.05)
    for f in codes.iterdir():
        f.unlink()  # the reference run's
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert sorted(f.read_text() for f in codes.iterdir()) == ["75", "75"], err[-3000:]  # every rank: preempted
    assert p.returncode == 1 and "SignalException" in err  # torchrun's own, as the README says
    step = json.loads((out / "checkpoint" / "trainer_state.json").read_text())["progress"]["step"]
    assert f"blockdraft train: stopped by SIGTERM after step {step}" in err, err[-3000:]
    assert len(losses(out)) == step < 8
    again = launch(out, "--resume")
    said, err = again.communicate(timeout=600)
    assert again.returncode == 0 and f"train: resuming from {out / 'checkpoint'} (step {step})" in said, err[-3000:]
    assert losses(out) == pytest.approx(losses(tmp_path / "ref"), rel=1e-6, abs=1e-7)


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux: SigCgt in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@pytest.mark.slow  # about 13 s: a start-up stopped, then the rerun
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize("name", ["SIGUSR1", "SIGTERM"])
def test_a_signal_during_start_up_exits_75_with_one_line_and_a_rerun_that_works(tmp_path, tiny_target_dir,
                                                                                 chat_data, name):
    out = tmp_path / "run"
    base = [sys.executable, "-m", "blockdraft", "train", "--target", tiny_target_dir, "--data", chat_data,
            "--steps", "2", *TRAIN, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(base, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    signum = getattr(signal, name)
    deadline = time.monotonic() + 60
    while not catches(p.pid, signum):  # as soon as the command line is read: before torch is imported
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.005)
    p.send_signal(signum)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 75, err
    lines = err.strip().splitlines()
    assert lines[0] == f"blockdraft train: {name}: stopping before the first step (still starting up)", err
    assert lines[-1] == (f"blockdraft train: stopped by {name} during start-up, before step 1: nothing was trained "
                         "or saved; rerun the same command, without --resume, to start (exit code 75)"), err
    assert "Traceback" not in err and not (out / "checkpoint").exists()
    again = subprocess.run(base, env=env, capture_output=True, text=True, timeout=300)  # the advised rerun
    assert again.returncode == 0, again.stderr
    assert (out / "drafter").is_dir()
