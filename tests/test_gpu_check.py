"""benchmarks/gpu_check.py in its CPU mode: the script a lent GPU runs stays runnable, and each of
its parts works on 2 gloo processes at tiny shapes: `blockdraft train` under torchrun, replicated
and --fsdp (the same losses), `extract` and training from its cache, speculative generation
against the target's greedy output, the attention backends against the dense reference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_mode(tmp_path, smollm2_dir):  # the random target borrows SmolLM2's tokenizer
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    out = tmp_path / "cpu.json"
    report = gpu_check.main(["--cpu", "--out", str(out), "--work", str(tmp_path / "work")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    parts = ("parity", "train", "train_fsdp", "train_target_fsdp", "extract", "train_from_cache", "generate")
    failed = {p: report[p].get("error") for p in parts if not report[p]["ok"]}
    for p, err in failed.items():  # the whole error and the log's tail, for a failure seen only in CI
        print(f"gpu_check part {p} failed:\n{err}")
    assert not failed, sorted(failed)
    assert report["ranks"] == 2 and report["device_map"]["ok"] is None  # needs 2 GPUs
    assert len(report["parity"]["rows"]) == 2 * 2 * (1 + 2)  # dtypes x causal x windows/rules
    for r in report["parity"]["rows"]:
        tol = 1e-5 if r["dtype"] == "float32" else 3e-2
        assert r["max_out_diff"] <= tol * max(1.0, r["ref_scale"]), r
        assert r["max_grad_diff"] <= tol * max(1.0, r["ref_grad_scale"]) and r["ref_grad_scale"] > 0, r
    rep, fsdp = report["train"], report["train_fsdp"]
    assert rep["steps"] == fsdp["steps"] == 3
    assert fsdp["loss"] == pytest.approx(rep["loss"], rel=1e-5)  # sharded or not, the same training
    assert report["train_target_fsdp"]["loss"] == pytest.approx(rep["loss"], rel=1e-5)  # the target sharded too
    for run in (rep, fsdp, report["train_target_fsdp"], report["train_from_cache"]):
        assert run["tokens_per_s"] > 0 and run["first_step_s"] > 0 and run["eval_tau"] >= 1.0
        assert run["planned_peak_gib"] > 0 and run["drafter_params"] > 0
    assert report["extract"]["rows"] > 0 and report["extract"]["dtype"] == "float32"
    assert report["generate"]["identical"] is True and report["generate"]["new_tokens"] > 0
