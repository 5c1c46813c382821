"""The train / held-out files the bundled drafter's second stage used.

The first stage trained on the first 416 bundled conversations with a seeded-shuffle split
(21 held out). The second stage went on from that drafter on all 1158, so its held-out file must
hold nothing the first stage trained on: the first stage's 21 held-out conversations plus the
hash-split 5 % of the 742 added ones; everything else is training data.

    python benchmarks/default_drafter_split.py --out runs/stage2-data
    blockdraft train --data runs/stage2-data/train.jsonl --eval-data runs/stage2-data/eval.jsonl \\
        --init-drafter <stage-1 drafter> --max-rows 0 --epochs 3 --lr 1.5e-3 --warmup 20 --eval-every 50
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    from blockdraft.data.pipeline import default_data_file, split_conversations

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(default_data_file()))
    p.add_argument("--first", type=int, default=416, help="conversations the first stage had")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    recs = [json.loads(line) for line in Path(a.data).read_text().splitlines() if line.strip()]
    old, new = recs[:a.first], recs[a.first:]
    order = list(range(len(old)))
    random.Random(0).shuffle(order)  # the first stage's split (seed 0, 5 %)
    old_held = set(order[:round(0.05 * len(old))])
    _, new_held_msgs = split_conversations([r["messages"] for r in new], 0.05, 0)
    new_held = {i for i, r in enumerate(new) if r["messages"] in new_held_msgs}
    held = [r for i, r in enumerate(old) if i in old_held] + [r for i, r in enumerate(new) if i in new_held]
    train = [r for i, r in enumerate(old) if i not in old_held] + [r for i, r in enumerate(new) if i not in new_held]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("eval", held)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    print(f"{len(train)} training and {len(held)} held-out conversations -> {out}")


if __name__ == "__main__":
    main()
