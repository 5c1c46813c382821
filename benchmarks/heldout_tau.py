"""Held-out tau of a saved drafter on a training run's held-out rows, before any step.

The point at zero training of a stage that goes on from an earlier drafter: the same rows,
the same fixed anchors and the same `evaluate` call that `blockdraft train` logs as `eval_tau`
every `--eval-every` steps, so the number sits on that run's curve. The data flags mean what
they mean to `blockdraft train` (the held-out rows are bounded by `--max-rows` the same way).

    python benchmarks/heldout_tau.py --drafter DIR --window-rule query \\
        --data runs/stage4-data/train.jsonl --eval-data runs/stage4-data/eval.jsonl --max-rows 384
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main() -> None:
    import torch

    from blockdraft.checkpoint import load_drafter
    from blockdraft.data.pipeline import DataOptions, bound_rows, conversation_rows
    from blockdraft.target import TargetModel
    from blockdraft.train.build import continue_drafter
    from blockdraft.train.options import TrainConfig
    from blockdraft.train.trainer import evaluate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default="default", help="a saved drafter directory or 'default'")
    p.add_argument("--window-rule", default=None, choices=["query", "anchor"],
                   help="evaluate the weights under this sliding-window rule (as train --window-rule)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--data", required=True)
    p.add_argument("--eval-data", required=True)
    p.add_argument("--max-rows", type=int, default=128)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = TrainConfig()
    target = TargetModel.from_pretrained(a.target, layer_ids=load_drafter(a.drafter).config.target_layer_ids)
    drafter = continue_drafter(a.drafter, target, "cpu", a.window_rule)
    d = DataOptions(data=a.data, eval_data=a.eval_data, max_rows=a.max_rows, max_length=a.max_length)
    train_rows, eval_rows = bound_rows(*conversation_rows(target.tokenizer, d, cfg.seed), d.max_rows)
    rows_per_batch = max(1, cfg.batch_tokens // train_rows["input_ids"].shape[1])
    m = evaluate(target, drafter, eval_rows, cfg, rows_per_batch)
    out = {"drafter": a.drafter, "window_rule": drafter.config.sliding_window_rule,
           "held_out_rows": int(eval_rows["input_ids"].shape[0]), **m}
    print(f"held-out tau {m['eval_tau']:.4f} on {out['held_out_rows']} rows ({m['eval_blocks']} blocks)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
