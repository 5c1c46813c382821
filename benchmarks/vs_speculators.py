"""blockdraft's recipe against speculators' at equal CPU time: held-out tau per training second.

Both trainers read the same packed rows of the bundled data from one feature cache (the target's
features and final states, extracted once, so neither side pays target forwards), and both are
scored by one evaluator: train's own `evaluate` on the same held-out rows and anchors, run on
speculators' checkpoint after `convert` has read it. The clock counts optimizer steps only
(forward, backward, clipping, optimizer); evaluation and checkpoints are not in it. blockdraft's
clock (the Trainer's step_s) also holds its read of the cached features; speculators' does not.

Sides (each at drafter sizes of 1 and 5 layers):

- `speculators`: vllm-project/speculators 0.9.0's own `DFlashDraftModel` (built by its
  `from_training_args` with its `create_transformer_layer_config`), its loss (`compute_metrics`
  with D-PACE, alpha 0.5, and cross-entropy), its optimizers (`build_optimizers`: Muon on the 2D
  matrices, AdamW on the rest, lr 1e-3) and its linear schedule with 1% warmup, at its data
  defaults, with the sequence scaled down: 2048-token packed sequences (2 of our 1024-token rows;
  its default is 8192, whose dense sdpa mask does not fit here) with its anchor density, 128
  anchors each (512 per 8192), block 16, sliding window 2048 on every layer (wider than a row,
  so both window rules agree), the full
  verifier vocabulary, gradient clipping at 1.0. Its full trainer (`speculators.train`) needs a
  GPU data pipeline of vLLM-generated hidden-state files and torch.distributed; its loop body is
  small and is repeated here step for step, calling its functions. It runs in the reference
  environment (torch 2.14.1), importing blockdraft from `src/` only to read the cache.
- `blockdraft`: `blockdraft train`'s defaults (RunConfig()), through the same Trainer.
- `blockdraft-dpace`: the same with `--gamma-schedule dpace` (speculators' slot weighting), to
  separate the weighting from the rest of the recipe and from step speed.

Each run is given a budget of training seconds; it calibrates its step time on a few steps, fits
its schedule to the steps that fill the budget, and is scored at 1/3, 2/3 and all of it.

    python benchmarks/vs_speculators.py prepare --out runs/vs-spec                 # the cache, once
    python benchmarks/vs_speculators.py run --out runs/vs-spec --budget-min 6 --seeds 0,1 --layers 1,5 \\
        --json benchmarks/results/vs-speculators.json --plot benchmarks/results/vs-speculators.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
SPEC_PYTHON = ROOT / ".venv-ref-spec" / "bin" / "python"
SIDES = ("speculators", "blockdraft", "blockdraft-dpace")
FRACTIONS = (1 / 3, 2 / 3, 1.0)


def prepare(a) -> None:
    """The train and held-out caches: the first --train-rows packed rows of the bundled data's
    training split and the first --eval-rows of its held-out split (the split `blockdraft train`
    makes, seed 0)."""
    import torch

    from blockdraft.data.features import extract
    from blockdraft.data.pipeline import DataOptions, bound_rows, conversation_rows
    from blockdraft.target import TargetModel

    torch.set_num_threads(a.threads)
    target = TargetModel.from_pretrained("smollm2")
    train, held = conversation_rows(target.tokenizer, DataOptions(), 0)
    train, _ = bound_rows(train, None, a.train_rows)
    held = {k: v[:a.eval_rows] for k, v in held.items()}
    for name, rows in (("train", train), ("eval", held)):
        t0 = time.perf_counter()
        extract(target, rows, Path(a.out) / f"cache-{name}", shard_rows=16, dtype=torch.float32, batch_tokens=2048)
        print(f"{name}: {rows['input_ids'].shape[0]} rows in {time.perf_counter() - t0:.0f} s", flush=True)


def caches(out: Path):
    """(train rows, train outputs, held-out rows, held-out outputs) from the prepared caches."""
    from blockdraft.data.features import DiskFeatures

    tr, ev = DiskFeatures(out / "cache-train"), DiskFeatures(out / "cache-eval")
    return tr.rows, tr, ev.rows, ev


def eval_config():
    """The evaluation settings every side is scored with: `blockdraft train`'s (256 anchors per
    held-out row, fixed seeds per batch)."""
    from blockdraft.train.train_options import TrainConfig

    return TrainConfig(progress=False)


def score(target, drafter, ev_rows, ev_feats) -> dict:
    """train's own `evaluate` on the held-out rows (2 rows per batch, as in training)."""
    from blockdraft.train.evaluate import evaluate

    return evaluate(target, drafter, ev_rows, eval_config(), 2, ev_feats)


# ---------------------------------------------------------------------------------- blockdraft
def train_blockdraft(a) -> None:
    """One blockdraft run: `blockdraft train`'s defaults (RunConfig()) at a drafter size, through
    the Trainer run_training builds, on the cached rows; scored at the budget's thirds."""
    import torch

    from blockdraft.target import TargetModel
    from blockdraft.train.build import build_drafter
    from blockdraft.train.run import RunConfig
    from blockdraft.train.trainer import Trainer

    torch.set_num_threads(a.threads)
    out = Path(a.run)
    tr_rows, tr_feats, ev_rows, ev_feats = caches(Path(a.cache))
    # the whole target, for the drafter's start from its top layer (part of the recipe; a head-only
    # target has no layers to start from); with the cache's outputs given, it never runs in the loop
    target = TargetModel.from_pretrained("smollm2", device="cpu")

    def trainer(steps: int, where: Path, evaluate_every: int | None):
        cfg = RunConfig()
        cfg.drafter.draft_layers = a.layers
        cfg.train.seed, cfg.train.gamma_schedule, cfg.train.progress = a.seed, a.schedule, False
        cfg.train.steps, cfg.train.out = steps, str(where)
        cfg.train.eval_every = evaluate_every or 10**9
        cfg.train.save_every = 10**9
        torch.manual_seed(a.seed)  # as run_training: the same initial drafter for a seed
        drafter = build_drafter(cfg.drafter, target, tr_rows, "cpu")
        keep = cfg.drafter.context_init == "top-feature"
        return Trainer(target, drafter, tr_rows, ev_rows if evaluate_every else None, cfg.train, keep_function=keep,
                       train_features=tr_feats, eval_features=ev_feats if evaluate_every else None)

    calib = trainer(a.calibration_steps, out / "calibration", None)
    calib.train()
    per_step = sorted(r["step_s"] for r in records(out / "calibration"))[len(records(out / "calibration")) // 2]
    thirds = max(1, round(a.budget_s / per_step / 3))
    run = trainer(3 * thirds, out / "run", thirds)
    run.train()
    recs = records(out / "run")
    clock, points = 0.0, []
    for r in recs:
        clock += r["step_s"]
        if "eval_tau" in r:
            points.append({"step": r["step"], "train_s": round(clock, 1), "eval_tau": r["eval_tau"],
                           "eval_loss": r["eval_loss"]})
    final = score(target, __import__("blockdraft.checkpoint", fromlist=["load_drafter"]).load_drafter(
        out / "run" / "drafter"), ev_rows, ev_feats)
    write_json(out / "result.json", {"calibrated_step_s": per_step, "steps": 3 * thirds, "points": points,
                                     "saved_drafter_eval_tau": final["eval_tau"]})


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------- speculators
def spec_defaults(layers: int) -> dict:
    """speculators 0.9.0's resolved DFlash training defaults (its own schema), at a drafter size."""
    from speculators.train.config.schema import TrainConfig as SpecConfig

    d = SpecConfig(speculator_type="dflash", verifier_name_or_path="-").flatten()
    d["num_layers"] = layers  # --num-layers (its default for dflash is 5)
    return d


def train_speculators(a) -> None:
    """One speculators run, in the reference environment: its model, loss, optimizers and
    schedule, the loop of its Trainer (forward, zero_grad, backward, clip 1.0, optimizers, schedulers)
    on packed sequences of the cached rows. Checkpoints at the budget's thirds, in its own format."""
    import types

    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.optimizers import build_optimizers
    from transformers import get_linear_schedule_with_warmup

    from blockdraft.checkpoint.native import default_verifier
    from blockdraft.target import TargetModel

    torch.set_num_threads(a.threads)
    out = Path(a.run)
    out.mkdir(parents=True, exist_ok=True)
    d = spec_defaults(a.layers)
    tr_rows, tr_feats, _, _ = caches(Path(a.cache))
    head = TargetModel.head_only("smollm2", device="cpu")  # only for the layer ids and the MASK token
    verifier = default_verifier("smollm2")
    layer_cfg = create_transformer_layer_config(verifier, d["num_layers"], d["draft_arch"], d["draft_hidden_act"],
                                                d["sliding_window"], d["full_attention_indices"])
    torch.manual_seed(a.seed)
    model = DFlashDraftModel.from_training_args(
        layer_cfg, draft_vocab_size=head.vocab_size, block_size=d["block_size"], verifier_name_or_path=verifier,
        mask_token_id=head.mask_token_id, target_layer_ids=[i + 1 for i in head.layer_ids],  # their ids: +1
        sliding_window_non_causal=d["sliding_window_non_causal"], sample_from_anchor=d["sample_from_anchor"],
        draft_attn_impl="sdpa")  # flex attention has no CPU path
    # the cache holds the final state after the target's own norm (clause 3); speculators applies
    # the verifier's norm itself, so it gets the identity here: the same labels, one norm
    model.verifier_norm = torch.nn.Identity()
    model.float().train()
    opt_cfg = types.SimpleNamespace(**d)
    optimizers = build_optimizers(model, opt_cfg)
    rows_per_seq = a.seq_tokens // tr_rows["input_ids"].shape[1]
    # their anchor density: max_anchors per total_seq_len tokens, here over a.seq_tokens
    anchors = max(1, round(d["max_anchors"] * a.seq_tokens / d["total_seq_len"]))
    loss_config = resolve_loss_config(d["loss_fn"], "eager")  # the fused kernels need Triton

    def step_time() -> float:
        return float(json.loads((out / "calibration.json").read_text())["step_s"])

    def batch(k: int, order):
        idx = order[(k * rows_per_seq) % len(order):][:rows_per_seq]
        if len(idx) < rows_per_seq:
            idx = order[:rows_per_seq]
        got = tr_feats(idx)
        n, L = idx.numel(), tr_rows["input_ids"].shape[1]
        doc = tr_rows["document_ids"][idx] + (torch.arange(n) * 10**6)[:, None]  # rows are other documents
        flat = lambda t: t.reshape(1, n * L, *t.shape[2:])  # noqa: E731
        return dict(hidden_states=flat(got.features.float()), input_ids=flat(tr_rows["input_ids"][idx]),
                    loss_mask=flat(tr_rows["loss_mask"][idx]), verifier_last_hidden_states=flat(got.final_hidden.float()),
                    document_ids=flat(doc), position_ids=flat(tr_rows["position_ids"][idx]))

    g = torch.Generator().manual_seed(a.seed)
    R = tr_rows["input_ids"].shape[0]
    orders = {}

    def order_of(k):
        epoch = (k * rows_per_seq) // R
        if epoch not in orders:
            orders[epoch] = torch.randperm(R, generator=torch.Generator().manual_seed(a.seed * 7919 + epoch))
        return orders[epoch]

    def one_step(k, schedulers) -> tuple[float, float]:
        b = batch(k, order_of(k))
        t0 = time.perf_counter()
        _, loss, _ = model(**b, loss_config=loss_config, gamma=d["dflash_decay_gamma"], max_anchors=anchors,
                           per_position_loss_weight=d["per_position_loss_weight"], dpace_alpha=d["dpace_alpha"])
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in optimizers:
            o.step()
        for s_ in schedulers:
            s_.step()
        return time.perf_counter() - t0, float(loss.detach())

    del g
    # calibration on a copy of the state: a few steps without a schedule, then start over
    init = {k: v.clone() for k, v in model.state_dict().items()}
    times = [one_step(k, [])[0] for k in range(a.calibration_steps)]
    per_step = sorted(times)[len(times) // 2]
    model.load_state_dict(init)
    optimizers[:] = build_optimizers(model, opt_cfg)
    thirds = max(1, round(a.budget_s / per_step / 3))
    total = 3 * thirds
    warm = total // 100  # their default warmup: 1% of the scheduler's steps
    schedulers = [get_linear_schedule_with_warmup(o, num_warmup_steps=warm, num_training_steps=total)
                  for o in optimizers]
    torch.manual_seed(a.seed)
    orders.clear()
    clock, points, log = 0.0, [], []
    for k in range(total):
        dt, loss = one_step(k, schedulers)
        clock += dt
        log.append({"step": k + 1, "step_s": dt, "loss": loss})
        if (k + 1) % thirds == 0:
            ck = out / f"step-{k + 1}"
            model.save_pretrained(str(ck))
            points.append({"step": k + 1, "train_s": round(clock, 1), "checkpoint": str(ck)})
            print(f"speculators step {k + 1}/{total}: loss {loss:.3f}, {clock:.0f} s", flush=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    write_json(out / "result.json", {"calibrated_step_s": per_step, "steps": total, "points": points,
                                     "anchors_per_sequence": anchors, "sequence_tokens": rows_per_seq *
                                     tr_rows["input_ids"].shape[1], "defaults": {k: d[k] for k in SPEC_KEYS}})


SPEC_KEYS = ("num_layers", "block_size", "loss_fn", "per_position_loss_weight", "dpace_alpha", "max_anchors",
             "total_seq_len", "sliding_window", "sliding_window_non_causal", "optimizer", "lr", "muon_lr",
             "weight_decay", "muon_weight_decay", "scheduler_type", "draft_arch")


def score_speculators(a, result: dict) -> None:
    """Each speculators checkpoint through `convert` (to the native z-lab layout), then `evaluate`."""
    from blockdraft.checkpoint import load_drafter
    from blockdraft.engines.exports import convert
    from blockdraft.target import TargetModel

    tr_rows, _, ev_rows, ev_feats = caches(Path(a.out))
    target = TargetModel.head_only("smollm2", device="cpu")
    for pt in result["points"]:
        native = Path(pt["checkpoint"] + "-native")
        if not native.exists():
            # allow_mismatch: speculators counts windows from the anchor (the rule engines do not
            # serve); at W 2048 over 1024-token rows both rules see the same keys
            convert(pt["checkpoint"], native, "zlab", allow_mismatch=True, num_target_layers=target.num_layers)
        m = score(target, load_drafter(native), ev_rows, ev_feats)
        pt.update(eval_tau=m["eval_tau"], eval_loss=m["eval_loss"])


# -------------------------------------------------------------------------------------- driver
def run(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    out = Path(a.out)
    path = Path(a.json) if a.json else out / "vs-speculators.json"
    done = json.loads(path.read_text()) if path.exists() else {"runs": []}
    done.update(budget_s=a.budget_min * 60, threads=a.threads, command=" ".join(sys.argv))
    have = {(r["side"], r["layers"], r["seed"]) for r in done["runs"]}
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for layers in [int(x) for x in a.layers.split(",")]:
        for seed in [int(x) for x in a.seeds.split(",")]:
            for side in a.sides.split(","):
                if (side, layers, seed) in have:
                    continue
                rdir = out / f"{side}-L{layers}-s{seed}"
                py = str(SPEC_PYTHON) if side == "speculators" else sys.executable
                cmd = [py, __file__, "train-speculators" if side == "speculators" else "train-blockdraft",
                       "--cache", str(out), "--run", str(rdir), "--layers", str(layers), "--seed", str(seed),
                       "--budget-s", str(a.budget_min * 60), "--threads", str(a.threads)]
                if side != "speculators":
                    cmd += ["--schedule", "dpace" if side == "blockdraft-dpace" else "acceptance"]
                t0 = time.perf_counter()
                if not (rdir / "result.json").exists():  # a finished training is scored, not run again
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    if proc.returncode != 0:
                        raise SystemExit(f"{side} L{layers} seed {seed} failed:\n{proc.stderr[-3000:]}")
                result = json.loads((rdir / "result.json").read_text())
                if side == "speculators":
                    score_speculators(a, result)
                result.update(side=side, layers=layers, seed=seed, wall_s=round(time.perf_counter() - t0))
                done["runs"].append(result)
                write_json(path, done)
                print(f"{side:17} L{layers} seed {seed}: " + ", ".join(
                    f"{p['train_s']:.0f}s tau {p['eval_tau']:.3f}" for p in result["points"]), flush=True)
    summarise(done)
    write_json(path, done)
    if a.plot:
        plot(done, a.plot)


def summarise(done: dict) -> None:
    """Held-out tau gained per CPU-hour at the full budget, mean over seeds, and each side's ratio to
    speculators' at the same drafter size."""
    threads = done["threads"]
    table: dict = {}
    for r in done["runs"]:
        last = r["points"][-1]
        gain = (last["eval_tau"] - 1.0) / (last["train_s"] * threads / 3600)
        table.setdefault(f"L{r['layers']}", {}).setdefault(r["side"], []).append(
            {"seed": r["seed"], "eval_tau": last["eval_tau"], "train_s": last["train_s"], "tau_gain_per_cpu_hour": gain})
    for size, sides in table.items():
        for side, runs in sides.items():
            sides[side] = {"runs": runs, "mean_eval_tau": sum(x["eval_tau"] for x in runs) / len(runs),
                           "mean_tau_gain_per_cpu_hour": sum(x["tau_gain_per_cpu_hour"] for x in runs) / len(runs)}
        # the calibrations miss by up to a third, so the runs end at different seconds: every curve is
        # also read at one time, the earliest end among this size's runs (linear between its points)
        runs_here = [r for r in done["runs"] if f"L{r['layers']}" == size]
        common = min(r["points"][-1]["train_s"] for r in runs_here)
        for side, entry in sides.items():
            at = [tau_at([p for p in r["points"]], common) for r in runs_here if r["side"] == side]
            entry.update(common_train_s=common, mean_eval_tau_at_common_s=sum(at) / len(at),
                         tau_gain_per_cpu_hour_at_common_s=(sum(at) / len(at) - 1.0) / (common * threads / 3600))
        ref = sides.get("speculators")
        if ref:
            for side in sides.values():
                side["ratio_to_speculators"] = side["mean_tau_gain_per_cpu_hour"] / ref["mean_tau_gain_per_cpu_hour"]
                side["ratio_to_speculators_at_common_s"] = (side["tau_gain_per_cpu_hour_at_common_s"]
                                                            / ref["tau_gain_per_cpu_hour_at_common_s"])
    done["summary"] = table


def tau_at(points: list[dict], t: float) -> float:
    """A run's held-out tau at t training seconds, linear between its scored points (t at or after
    its first point)."""
    for a, b in zip(points, points[1:]):
        if a["train_s"] <= t <= b["train_s"]:
            return a["eval_tau"] + (b["eval_tau"] - a["eval_tau"]) * (t - a["train_s"]) / (b["train_s"] - a["train_s"])
    if t >= points[-1]["train_s"]:
        return points[-1]["eval_tau"]
    raise ValueError(f"{t} s is before the run's first scored point ({points[0]['train_s']} s)")


def plot(done: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["layers"] for r in done["runs"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.2), squeeze=False)
    colors = {"speculators": "tab:red", "blockdraft": "tab:blue", "blockdraft-dpace": "tab:green"}
    for ax, L in zip(axes[0], sizes):
        for r in (x for x in done["runs"] if x["layers"] == L):
            xs = [0] + [p["train_s"] / 60 for p in r["points"]]
            ys = [None] + [p["eval_tau"] for p in r["points"]]
            ax.plot(xs[1:], ys[1:], "o-" if r["seed"] == 0 else "s--", color=colors.get(r["side"]),
                    label=f"{r['side']} (seed {r['seed']})")
        ax.set_title(f"{L}-layer drafter, SmolLM2-135M target, {done['threads']} CPU threads")
        ax.set_xlabel("training minutes (optimizer steps only)")
        ax.set_ylabel("held-out tau (train's evaluate)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare")
    pr.add_argument("--out", default="runs/vs-spec")
    pr.add_argument("--train-rows", type=int, default=256)
    pr.add_argument("--eval-rows", type=int, default=32)
    pr.add_argument("--threads", type=int, default=2)
    r = sub.add_parser("run")
    r.add_argument("--out", default="runs/vs-spec")
    r.add_argument("--budget-min", type=float, default=6.0, help="training minutes per run")
    r.add_argument("--layers", default="1,5")
    r.add_argument("--seeds", default="0,1")
    r.add_argument("--sides", default=",".join(SIDES))
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--json", default=None)
    r.add_argument("--plot", default=None)
    for name in ("train-blockdraft", "train-speculators"):
        t = sub.add_parser(name)
        t.add_argument("--cache", required=True)
        t.add_argument("--run", required=True)
        t.add_argument("--layers", type=int, default=1)
        t.add_argument("--seed", type=int, default=0)
        t.add_argument("--budget-s", type=float, required=True)
        t.add_argument("--threads", type=int, default=2)
        t.add_argument("--calibration-steps", type=int, default=4)
        t.add_argument("--schedule", default="acceptance")
        t.add_argument("--seq-tokens", type=int, default=2048, help="speculators: tokens per packed sequence")
    a = p.parse_args()
    if a.cmd == "prepare":
        prepare(a)
    elif a.cmd == "run":
        run(a)
    elif a.cmd == "train-blockdraft":
        train_blockdraft(a)
    else:
        train_speculators(a)


if __name__ == "__main__":
    main()
