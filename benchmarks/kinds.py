"""DFlash, DSpark, DFlash2, Domino and LiLiCorr on SmolLM2 at equal CPU time, from the same start and data.

Each kind starts from the shipped drafter (`--init-drafter default`; every kind begins as its exact
function, `train --kind`; Domino and LiLiCorr, which score the full vocabulary, from the shipped
weights with the whole head, its full-vocabulary twin, and so does `dflash-full`, their DFlash baseline),
is calibrated on a few steps (seconds per step on the run's own clock, target forwards included, loading excluded; all kinds first, one after another, so their step costs
are taken under one load) and then trains for as many steps as fit the budget, on the same rows,
with the same held-out split. Then, per kind: the held-out tau `train` reports (teacher-forced), and
speculative generation against the target's own decoding, interleaved prompt by prompt in one process
(the drafter alone: no threshold, no lookup; outputs checked identical to the target's) on unseen
MT-Bench, GSM8K and HumanEval prompts; with `--llamacpp`, llama-server's speed with the kind's GGUF
against the target alone (`benchmarks/llamacpp_speed.py`).

    python benchmarks/kinds.py --budget-min 8 --out runs/kinds --json benchmarks/results/kinds.json

Writes the JSON, a PNG beside it (held-out tau and bench speedup per kind) and each run's
metrics.jsonl (`kinds-<kind>-metrics.jsonl`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ablations import step_seconds, train  # noqa: E402  (the same calibrated-budget runs)

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
BASE = ["--max-rows", "256", "--eval-every", "100000", "--save-every", "100000", "--no-progress"]
KINDS = {"dflash": [], "dspark": ["--kind", "dspark"], "dflash2": ["--kind", "dflash2"], "domino": ["--kind", "domino"],
         "lilicorr": ["--kind", "lilicorr"], "dflash-full": []}
# the drafter each kind starts from: the shipped one, or (FULL) its full-vocabulary twin: Domino's embedding
# projection has a row per target token (SpecForge's layout) and LiLiCorr's candidates come from the whole
# vocabulary (vLLM's rule), so both and their DFlash baseline start from the same weights drafting from all
# 49,152 tokens instead of the shipped 8,192
FULL = {"domino", "lilicorr", "dflash-full"}


def full_vocab_twin(path: Path) -> Path:
    """The shipped drafter's weights without its draft vocabulary (the target's whole head), written once."""
    import dataclasses

    from blockdraft.checkpoint.native import load_drafter, save_drafter
    from blockdraft.model.drafter import DFlashDrafter

    if (path / "config.json").exists():
        return path
    d = load_drafter("default")
    twin = DFlashDrafter(dataclasses.replace(d.config, draft_vocab_size=None), initialize=False)
    twin.load_state_dict({k: v for k, v in d.state_dict().items() if k != "draft_vocab"})
    return save_drafter(twin, path)


def init_flags(kind: str, out: Path) -> list[str]:
    return ["--init-drafter", str(full_vocab_twin(out / "full-vocab-init")) if kind in FULL else "default"]


def bench(drafters: dict, sets: list[str], n: int, max_new: int, threads: int, cut: float = 0.0) -> dict:
    """Target greedy and every kind's `speculative_generate` (no lookup; no threshold, and with `cut`
    also each kind with `--draft-threshold cut` as `<kind>@cut`: DFlash and DFlash2 cut on a slot's top
    probability, DSpark on its confidence head), interleaved prompt by prompt in this process: per
    drafter and set, decode tokens/s over the target's (the speedup), tau, and whether every output is
    the target's own."""
    import torch

    from blockdraft.data.eval_prompts import load_prompt_set
    from blockdraft.checkpoint.native import load_drafter, read_config, resolve_drafter
    from blockdraft.data.chat import encode_prompt
    from blockdraft.generate.baseline import target_greedy
    from blockdraft.generate.speculative import speculative_generate
    from blockdraft.target import TargetModel, stop_token_ids

    torch.set_num_threads(threads)
    layer_ids = read_config(resolve_drafter(next(iter(drafters.values()))))[1].target_layer_ids
    target = TargetModel.from_pretrained("smollm2", layer_ids=layer_ids)
    models = {k: (load_drafter(d), 0.0) for k, d in drafters.items()}
    if cut > 0:
        models.update({f"{k}@{cut:g}": (m, cut) for k, (m, _) in list(models.items())})
    stops = stop_token_ids(target.tokenizer)
    out = {k: {} for k in models}
    for name in sets:
        agg = {k: [0, 0.0, 0, 0, True] for k in models}  # decode tokens, seconds, committed, verify steps, same
        base_tok = base_s = 0.0
        for msgs in load_prompt_set(name, n):
            ids = encode_prompt(target.tokenizer, msgs)
            base = target_greedy(target, ids, max_new_tokens=max_new, stop_token_ids=stops)
            base_tok += len(base.tokens) - 1  # decode phase only: the prefill is common
            base_s += base.time_total - base.time_prefill
            for k, (d, threshold) in models.items():
                r = speculative_generate(target, d, ids, max_new_tokens=max_new, stop_token_ids=stops,
                                         draft_threshold=threshold)
                a = agg[k]
                a[0] += len(r.tokens) - 1
                a[1] += r.time_total - r.time_prefill
                a[2] += sum(r.accepted)
                a[3] += len(r.accepted)
                a[4] &= r.tokens == base.tokens
        for k, (tok, sec, committed, steps, same) in agg.items():
            out[k][name] = {"speedup": (tok / sec) / (base_tok / base_s), "tau": committed / max(1, steps),
                            "identical": bool(same)}
        print(name, {k: round(v[name]["speedup"], 3) for k, v in out.items()}, flush=True)
    return out


def llamacpp(drafters: dict, out: Path, n: int, threads: int) -> dict:
    """llama-server's speed with each kind's GGUF against the target alone, the kinds back to back
    within each setting (one llamacpp_speed.py run: the ratios share the machine's state)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    cmd = [sys.executable, str(Path(__file__).with_name("llamacpp_speed.py")), "--n", str(n), "--threads",
           str(threads), "--settings", "15:0,3:0.3", "--json", str(out), "--work", str(out.parent / "llama")]
    for d in drafters.values():
        cmd += ["--drafter", str(d)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(out.read_text())


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    ax[0].bar(names, [results[k]["eval_tau"] for k in names], color="#4a7")
    ax[0].set_ylim(1.0, max(results[k]["eval_tau"] for k in names) * 1.05)
    ax[0].set_title("held-out tau (teacher-forced)")
    speed = [results[k].get("bench_speedup") or 0 for k in names]
    ax[1].bar(names, speed, color="#47a")
    ax[1].axhline(1.0, color="grey", lw=0.8)
    ax[1].set_title("blockdraft generate speedup")
    fig.suptitle("the five kinds on SmolLM2 at equal CPU time from the shipped drafter", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def mean(xs):
    return sum(xs) / len(xs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-min", type=float, default=8.0, help="training minutes per kind (on the run's clock)")
    p.add_argument("--only", default=None, help="comma-separated kinds")
    p.add_argument("--extra", default="", help="flags added to every training run")
    p.add_argument("--out", default="runs/kinds")
    p.add_argument("--json", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calibration-steps", type=int, default=4)
    p.add_argument("--bench-n", type=int, default=5, help="prompts per set for bench (0: no bench)")
    p.add_argument("--bench-max-new-tokens", type=int, default=128)
    p.add_argument("--llamacpp", action="store_true", help="also llama-server's speed with each kind's GGUF (after training, the kinds in one run)")
    p.add_argument("--cut", type=float, default=0.3, help="also bench each kind with this --draft-threshold (0: not)")
    a = p.parse_args()
    kinds = a.only.split(",") if a.only else list(KINDS)
    results, per_step = {}, {}
    for kind in kinds:  # calibrated back to back, under one load: the step costs compare
        out = Path(a.out) / kind
        # the last step's evaluation is the run's only one: on one held-out row, it is not what is measured
        train(BASE + init_flags(kind, Path(a.out)) + KINDS[kind] + a.extra.split() + [
            "--steps", str(a.calibration_steps), "--max-eval-rows", "1"], out, a.threads)
        per_step[kind] = step_seconds(out / "metrics.jsonl")
        print(f"{kind:8} calibrated {per_step[kind]:.2f} s/step", flush=True)
    for kind in kinds:
        flags = BASE + init_flags(kind, Path(a.out)) + KINDS[kind] + a.extra.split()
        out = Path(a.out) / kind
        steps = max(a.calibration_steps, int(a.budget_min * 60 / per_step[kind]))
        wall, summary = train(flags + ["--steps", str(steps), "--eval-every", str(steps)], out, a.threads)
        train_s = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"elapsed"' in x][-1]
        r = {"flags": KINDS[kind], "steps": steps, "calibrated_step_s": round(per_step[kind], 2),
             "train_s": round(train_s["elapsed"]), "wall_s": round(wall), "eval_tau": summary.get("eval_tau"),
             "eval_loss": summary.get("eval_loss"), "eval_slot_accuracy": summary.get("eval_slot_accuracy")}
        print(f"{kind:8} steps={steps:5d} train={r['train_s']:5d}s eval_tau={r['eval_tau']:.4f}", flush=True)
        results[kind] = r
        if a.json:
            j = Path(a.json)
            j.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(out / "metrics.jsonl", j.with_name(f"{j.stem}-{kind}-metrics.jsonl"))
            j.write_text(json.dumps({"base": BASE, "extra": a.extra, "budget_min": a.budget_min, "threads": a.threads,
                                     "runs": results}, indent=1) + "\n")
    if a.bench_n:
        sets = ["mtbench", "gsm8k", "humaneval"]
        b = bench({k: Path(a.out) / k / "drafter" for k in results}, sets, a.bench_n, a.bench_max_new_tokens,
                  a.threads, a.cut)
        for k, per_set in b.items():
            entry = {"bench_sets": per_set, "bench_speedup": mean([v["speedup"] for v in per_set.values()]),
                     "bench_tau": mean([v["tau"] for v in per_set.values()])}
            if k in results:
                results[k].update(entry)
            else:  # <kind>@cut: the same drafter with a draft threshold
                kind, _ = k.split("@")
                results[kind].setdefault("with_threshold", {})[k] = entry
    more = {}
    if a.llamacpp:
        more["llamacpp"] = llamacpp({k: Path(a.out) / k / "drafter" for k in results}, Path(a.out) / "llamacpp.json",
                                     a.bench_n or 5, a.threads)
    if a.json:
        Path(a.json).write_text(json.dumps({"base": BASE, "extra": a.extra, "budget_min": a.budget_min,
                                            "threads": a.threads, "bench_n": a.bench_n, "cut": a.cut,
                                            "bench_max_new_tokens": a.bench_max_new_tokens, "runs": results,
                                            **more}, indent=1) + "\n")
        plot(results, Path(a.json).with_suffix(".png"))


if __name__ == "__main__":
    main()
