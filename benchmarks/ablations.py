"""What moves held-out tau per CPU-hour: short training runs at equal wall-clock budgets.

Every configuration starts from the same flags (`--base`, default: the README's main command on
the bundled data) with its own changes, is calibrated on a few steps (their time per step on the run's
own clock, target forwards included, loading excluded, sets how many steps fit the budget), then trains for
those steps with the cosine schedule fitted to them. All runs share the held-out split (a hash
of each conversation) and run one after another in this process's machine, so their figures
are taken under the same load.

    python benchmarks/ablations.py --budget-min 6 --out runs/ablations --json benchmarks/results/ablations.json
    python benchmarks/ablations.py --only base,gamma1 --budget-min 3 ...

Each run's metrics.jsonl is copied beside the JSON (`<name>-metrics.jsonl`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BASE = ["--max-rows", "256", "--eval-fraction", "0.02", "--eval-every", "100000", "--save-every", "100000",
        "--no-progress"]
CONFIGS = {  # name -> flags on top of the base
    "base": ["--gamma-schedule", "fixed"],  # the paper's gamma (7 at block 16); the default was fixed then
    "gamma1": ["--gamma-schedule", "fixed", "--gamma", "1"],
    "gamma-acceptance": ["--gamma-schedule", "acceptance"],
    "gamma-dpace": ["--gamma-schedule", "dpace"],  # speculators' D-PACE slot weights (its default)
    "block8": ["--gamma-schedule", "fixed", "--block-size", "8"],
    "layers2": ["--gamma-schedule", "fixed", "--draft-layers", "2", "--sliding-layers", "1"],
    "anchors64": ["--gamma-schedule", "fixed", "--max-anchors", "64"],
    "anchors256": ["--gamma-schedule", "fixed", "--max-anchors", "256"],
    "anchors512": ["--gamma-schedule", "fixed", "--max-anchors", "512"],
    "lr1.2e-3": ["--gamma-schedule", "fixed", "--lr", "1.2e-3"],
    "lr3e-4": ["--gamma-schedule", "fixed", "--lr", "3e-4"],
}


def step_seconds(metrics: Path) -> float:
    """Seconds per optimizer step, from the run's own clock (step 1 to the last): loading the target
    and the data is not part of the budget."""
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    steps = [x for x in lines if "elapsed" in x and "step" in x]
    first, last = steps[0], steps[-1]
    if last["step"] == first["step"]:
        return first["elapsed"]
    return (last["elapsed"] - first["elapsed"]) / (last["step"] - first["step"])


def train(flags: list[str], out: Path, threads: int) -> tuple[float, dict]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "blockdraft", "train", *flags, "--out", str(out),
                           "--threads", str(threads)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"training failed ({' '.join(flags)}):\n{proc.stderr[-3000:]}")
    return wall, json.loads((out / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-min", type=float, default=6.0, help="wall-clock minutes per configuration")
    p.add_argument("--base", default=" ".join(BASE), help="flags every run shares")
    p.add_argument("--only", default=None, help="comma-separated configuration names")
    p.add_argument("--extra", default="", help="flags added to every run (e.g. --data FILE)")
    p.add_argument("--out", default="runs/ablations")
    p.add_argument("--json", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calibration-steps", type=int, default=4)
    a = p.parse_args()
    names = a.only.split(",") if a.only else list(CONFIGS)
    base = a.base.split() + a.extra.split()
    results = {}
    for name in names:
        flags = base + CONFIGS[name]
        out = Path(a.out) / name
        train(flags + ["--steps", str(a.calibration_steps)], out, a.threads)
        per_step = step_seconds(out / "metrics.jsonl")
        steps = max(a.calibration_steps, int(a.budget_min * 60 / per_step))
        wall, summary = train(flags + ["--steps", str(steps), "--eval-every", str(steps)], out, a.threads)
        train_s = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
                   if '"elapsed"' in x][-1]["elapsed"]
        results[name] = {"flags": CONFIGS[name], "steps": steps, "tokens": summary.get("tokens"),
                         "calibrated_step_s": round(per_step, 2), "train_s": round(train_s), "wall_s": round(wall),
                         "eval_tau": summary.get("eval_tau"), "eval_loss": summary.get("eval_loss"),
                         "tau_gain_per_cpu_hour": (summary.get("eval_tau", 1.0) - 1.0) / (train_s * a.threads / 3600)}
        print(f"{name:18} steps={steps:5d} train={train_s:6.0f}s eval_tau={summary.get('eval_tau', float('nan')):.3f} "
              f"eval_loss={summary.get('eval_loss', float('nan')):.3f}", flush=True)
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(out / "metrics.jsonl", Path(a.json).with_name(f"{Path(a.json).stem}-{name}-metrics.jsonl"))
            Path(a.json).write_text(json.dumps({"base": base, "budget_min": a.budget_min, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
