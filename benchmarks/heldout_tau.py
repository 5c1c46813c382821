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

    from blockdraft.checkpoint.native import read_config, resolve_drafter
    from blockdraft.data.pipeline import DataOptions
    from blockdraft.target import TargetModel
    from blockdraft.train.build import continue_drafter
    from blockdraft.train.run import RunConfig, training_data
    from blockdraft.train.trainer import evaluate, rows_per_batch

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
    layer_ids = read_config(resolve_drafter(a.drafter))[1].target_layer_ids
    target = TargetModel.from_pretrained(a.target, layer_ids=layer_ids)
    drafter = continue_drafter(a.drafter, target, "cpu", a.window_rule)
    run = RunConfig(data=DataOptions(data=a.data, eval_data=a.eval_data, max_rows=a.max_rows,
                                     max_length=a.max_length, memo_features="off"))
    from blockdraft.engines import runner

    train_rows, eval_rows, _ = training_data(run, target, runner(run.engine.engine))  # the rows train builds
    m = evaluate(target, drafter, eval_rows, run.train, rows_per_batch(run.train, train_rows))
    out = {"drafter": a.drafter, "window_rule": drafter.config.sliding_window_rule,
           "held_out_rows": int(eval_rows["input_ids"].shape[0]), **m}
    print(f"held-out tau {m['eval_tau']:.4f} on {out['held_out_rows']} rows ({m['eval_blocks']} blocks)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
