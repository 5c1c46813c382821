"""benchmarks/gpu_check.py in its CPU mode: the script a lent GPU runs stays runnable, and its
checks hold at tiny shapes (dense vs chunked attention forward and backward, training steps on
every backend, greedy identity of speculative generation)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_mode(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    out = tmp_path / "cpu.json"
    report = gpu_check.main(["--cpu", "--out", str(out), "--repeats", "1"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["mode"] == "cpu" and len(report["parity"]) == 2 * 2 * (1 + 2)  # dtypes x causal x windows/rules
    for r in report["parity"]:
        tol = 1e-5 if r["dtype"] == "float32" else 3e-2
        assert r["max_out_diff"] <= tol * max(1.0, r["ref_scale"]), r
        assert r["max_grad_diff"] <= tol * max(1.0, r["ref_grad_scale"]) and r["ref_grad_scale"] > 0, r
    steps = report["train_small"]
    assert {s["backend"] for s in steps} == {"dense", "chunked"} and not any(s["error"] for s in steps)
    losses = [s["loss"] for s in steps]
    assert max(losses) - min(losses) < 1e-4 * max(losses)  # the same step on either backend
    assert report["generation"]["identical"] is True
