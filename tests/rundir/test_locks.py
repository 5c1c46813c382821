"""One writer per output (issue 34): a second writer of a train run, a feature cache, an answers
file or a converted drafter is refused with one line naming the holder; a lock a dead process left
is taken over; under torchrun only rank 0 takes the output's lock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blockdraft.rundir import locks
from blockdraft.cli import main
from blockdraft.rundir.ownership import MARKER
from conftest import dead_pid
from .test_ownership import TRAIN, one_line_error, tiny_drafter_dir

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}

HOLD = """
import sys, time
from blockdraft.rundir import locks
fd = locks.acquire(sys.argv[1], "holder")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def holder(out: Path, seconds: float = 60) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out), str(seconds)], env=ENV, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "out"
    p = holder(out)
    try:
        with pytest.raises(ValueError, match=rf"{out} is in use by blockdraft holder \(pid {p.pid} on {locks.host()}"):
            locks.acquire(out, "me")
    finally:
        p.kill()
        p.wait()
    fd = locks.acquire(out, "me")  # the kernel let go of a killed holder's lock; its file is taken over
    locks.release(out, fd)
    assert not locks.lock_path(out).exists()  # a released lock leaves nothing behind


def test_the_model_cache_waits_for_the_holder(tmp_path):
    out = tmp_path / "entry"
    p = holder(out, seconds=1.5)
    t0 = time.time()
    with locks.locked(out, "cache", wait=True, lead=True):
        assert time.time() - t0 > 0.5 and p.poll() is not None
    p.wait()


STALE = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"command": "train", "pid": int(sys.argv[2]), "host": socket.gethostname()}).encode())
print("held", flush=True)
time.sleep(60)
"""


def test_a_lock_held_in_a_dead_writers_name_is_taken_over(tmp_path):
    """A child that inherited a killed writer's lock still holds it; the record names the dead writer."""
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", STALE, str(locks.lock_path(out)), str(dead_pid())], env=ENV,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        fd = locks.acquire(out, "train")
        assert p.poll() is None  # taken over, not waited for
        locks.release(out, fd)
    finally:
        p.kill()
        p.wait()


def test_under_torchrun_only_rank_zero_takes_the_output_lock(tmp_path, monkeypatch):
    out = tmp_path / "run"
    fd = locks.acquire(out, "rank 0")
    try:
        monkeypatch.setenv("RANK", "1")
        with locks.locked(out, "rank 1") as got:  # no wait, no refusal: rank 0 holds it for the job
            assert got is None
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(ValueError, match="in use"):
            with locks.locked(out, "another job's rank 0"):
                pass
    finally:
        locks.release(out, fd)


def test_every_writer_refuses_an_output_in_use(tmp_path, tiny_target_dir, chat_data, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "p", "messages": [{"role": "user", "content": "hi"}]}\n')
    src = tiny_drafter_dir(tmp_path)
    cases = {
        "run": ["train", "--target", tiny_target_dir, "--data", chat_data, *TRAIN],
        "cache": ["extract", "--target", tiny_target_dir, "--data", chat_data, "--max-length", "128", "--threads", "1"],
        "answers.jsonl": ["regenerate", "--target", tiny_target_dir, "--prompts", str(prompts), "--max-new-tokens",
                          "2", "--threads", "1", "--no-progress"],
        "zlab": ["convert", "--to", "zlab", str(src)],
    }
    for name, argv in cases.items():
        out = tmp_path / name
        fd = locks.acquire(out, "other")
        try:
            dest = [str(out)] if argv[0] == "convert" else ["--out", str(out)]
            one_line_error(capsys, argv + dest, str(out), f"in use by blockdraft other (pid {os.getpid()}")
            assert not out.exists(), name
        finally:
            locks.release(out, fd)


def test_two_trains_into_one_out_never_interleave(tmp_path, tiny_target_dir, chat_data, capsys):
    out = tmp_path / "run"
    argv = ["train", "--target", tiny_target_dir, "--data", chat_data, "--out", str(out), *TRAIN]
    first = subprocess.Popen([sys.executable, "-m", "blockdraft", *argv, "--steps", "100000"], env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").stat().st_size:
            assert first.poll() is None and time.time() < deadline, first.stderr.read()[-2000:] if first.poll() else ""
            time.sleep(0.2)
        one_line_error(capsys, argv + ["--overwrite"], f"in use by blockdraft train (pid {first.pid}")
        one_line_error(capsys, argv + ["--resume"], f"in use by blockdraft train (pid {first.pid}")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert locks.lock_path(out).exists()  # what a kill -9 leaves: taken over by the next run
    assert main(argv + ["--overwrite"]) == 0
    steps = [int(ln.split('"step": ')[1].split(",")[0]) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and (out / MARKER).exists() and not locks.lock_path(out).exists()
