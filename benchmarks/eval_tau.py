"""Held-out accepted length of a drafter on MT-Bench, GSM8K and HumanEval prompts.

Teacher-forced and greedy: the target answers each prompt (greedy, cached on disk so later
runs reuse them), then the drafter is scored on those answers with the exact accepted length
(`blockdraft.train.trainer.evaluate`: 1 + leading slots whose argmax equals the target's).
None of these prompts is ever used in training.

    python benchmarks/eval_tau.py --drafter src/blockdraft/assets/default-drafter --n 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main() -> None:
    import torch

    from blockdraft.data.eval_prompts import load_prompt_set
    from blockdraft.checkpoint import load_drafter
    from blockdraft.data import build_rows
    from blockdraft.data.regenerate import regenerate
    from blockdraft.engines.transformers import TransformersGenerator
    from blockdraft.target import TargetModel
    from blockdraft.train.trainer import TrainConfig, evaluate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default="default")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--sets", default="mtbench,gsm8k,humaneval")
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--answers", default="runs/eval-answers", help="where the target's answers are cached")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    drafter = load_drafter(args.drafter)
    target = TargetModel.from_pretrained(args.target, layer_ids=drafter.config.target_layer_ids)
    results = []
    for name in args.sets.split(","):
        path = Path(args.answers) / f"{name}-{args.n}-{args.max_new_tokens}.jsonl"
        prompts = list(enumerate(load_prompt_set(name, args.n)))
        regenerate(TransformersGenerator(target), prompts, path, max_new_tokens=args.max_new_tokens, batch_size=args.n,
                   progress=False)
        # the rows training builds, through the same path
        rows, stats, _ = build_rows(target.tokenizer, path, 1024, return_stats=True)
        convs = stats.kept
        cfg = TrainConfig(eval_anchors=1024, loss="kl")
        m = evaluate(target, drafter, rows, cfg, rows_per_batch=1)
        results.append({"set": name, "n_prompts": int(convs), "tau": m["eval_tau"], "blocks": m["eval_blocks"],
                        "slot_accuracy": [round(a, 4) for a in m["eval_slot_accuracy"]]})
        print(f"{name:10} n={int(convs):3d} tau={m['eval_tau']:.3f} blocks={m['eval_blocks']} "
              f"slot1 acc={m['eval_slot_accuracy'][1]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
