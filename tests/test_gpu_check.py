"""benchmarks/gpu_check.py in its CPU mode: the script a lent GPU runs stays runnable, fits its budget
and keeps what it measured. Its parts on 2 gloo processes at tiny shapes: parity of every layer kind
against the dense reference, a sharded train (default sliding layer, draft vocabulary, --fsdp
--target-fsdp --gradient-checkpointing) with evaluation and a save, its --resume, and speculative
generation against the target's greedy output. CI also runs it through benchmarks/gpu_device_run.sh
in an environment with the GPU image's versions (.ci/run)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_gpu_check_cpu_mode(tmp_path, smollm2_dir, gpu_check):  # the random target borrows SmolLM2's tokenizer
    out = tmp_path / "out"
    report = gpu_check.main(["--cpu", "--out", str(out), "--work", str(tmp_path / "work")])
    assert json.loads((out / "gpu-check.json").read_text()) == json.loads(json.dumps(report))
    parts = report["parts"]
    failed = {p: v.get("error") for p, v in parts.items() if v["ok"] is False}
    for p, err in failed.items():  # the whole error and the log's tail, for a failure seen only in CI
        print(f"gpu_check part {p} failed:\n{err}\n{parts[p].get('log_tail')}")
    assert not failed, sorted(failed)
    assert report["done"] and parts["big"]["ok"] is None
    assert [p for p in parts if parts[p]["ok"]] == ["preflight", "parity", "train", "resume", "generate"]
    kinds = {(r["window"], r["causal"], r["rule"]) for r in parts["parity"]["rows"]}
    assert len(kinds) == 6 and len(parts["parity"]["rows"]) == 12  # 6 layer kinds x bf16, fp32
    assert all(r["ok"] and r["max_grad_diff"] <= r["tolerance"] * max(1.0, r["ref_grad_scale"])
               for r in parts["parity"]["rows"])
    tr = parts["train"]
    assert tr["steps"] == 3 and tr["tokens_per_s"] > 0 and tr["eval_tau"] >= 1.0 and tr["planned_peak_gib"] > 0
    assert parts["resume"]["steps"] == 4 and parts["resume"]["loss"][:3] == tr["loss"]  # continued, not redone
    assert parts["generate"]["identical"] is True and parts["generate"]["new_tokens"] > 0
    logs = (out / "gpu-check-logs.txt").read_text()
    assert "===== train.log" in logs and "held-out accepted length" in logs
    assert not (tmp_path / "work" / "train").exists()  # measured, then freed


def test_a_run_stopped_mid_part_leaves_the_report_of_the_parts_done(tmp_path, smollm2_dir):
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--out", str(out),
                          "--work", str(tmp_path / "work")], cwd=ROOT, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # stop it while the train part runs
        report = json.loads((out / "gpu-check.json").read_text()) if (out / "gpu-check.json").exists() else {}
        if "parity" in report.get("parts", {}) and (tmp_path / "work" / "train.log").exists():
            break
        time.sleep(0.5)
    time.sleep(3)
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["stopped"] is True and report["done"] is False
    assert report["parts"]["preflight"]["ok"] and report["parts"]["parity"]["ok"]
    assert report["parts"]["train"]["ok"] is False and "stopped" in report["parts"]["train"]["error"]
    assert report["parts"]["generate"]["ok"] is None  # not started after the stop
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True, text=True).stdout.split()
    left = [pid for pid in left if running(int(pid))]
    assert not left, f"processes of the stopped part still run: {left}"


def test_a_part_past_its_time_is_stopped_with_its_whole_process_group(tmp_path, gpu_check):
    pidfile = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(600)']); open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(600)")
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 6 s"):
        gpu_check.run([sys.executable, "-c", script], tmp_path / "x.log", 6)
    assert time.monotonic() - t < 30
    child = int(pidfile.read_text())
    time.sleep(0.5)
    assert not running(child)  # the grandchild went with its group


def running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie left for a parent that does not reap it has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_parts_that_do_not_fit_the_budget_are_skipped_and_said_so(tmp_path, gpu_check):
    c = gpu_check.Check(tmp_path / "out", tmp_path, budget_s=40, cpu=True)
    ran = c.part("preflight", lambda cap: {"cap": cap})
    assert ran["ok"] and ran["cap"] <= 40
    got = c.part("train", lambda cap: pytest.fail("must not start"), need_s=60)
    assert got["ok"] is None and "needs 60" in got["skipped"]
    on_disk = json.loads((tmp_path / "out" / "gpu-check.json").read_text())  # written after every part
    assert set(on_disk["parts"]) == {"preflight", "train"} and on_disk["done"] is False
