"""The train / held-out files of a stage of the bundled drafter that goes on from an earlier one.

A held-out conversation must be one no earlier stage saw: its user prompt is not in `--seen`
(the data the earlier stages trained and evaluated on). The held-out file is the hash split
(`split_conversations`, seed 0) of the unseen conversations at `--eval-fraction`; everything
else is training data.

Stage 4 (the 10,629 bundled conversations, going on from stage 3, which saw the 1,158 of the
earlier bundled file, `git show 6a1b8bf:src/blockdraft/assets/data/default.jsonl`):

    python benchmarks/default_drafter_split.py --seen runs/stage3-data.jsonl --out runs/stage4-data
    blockdraft train --data runs/stage4-data/train.jsonl --eval-data runs/stage4-data/eval.jsonl \\
        --init-drafter default --window-rule query --max-rows 0 ...

(Stage 2 used an earlier version of this script, in the history beside its data.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    from blockdraft.data import load_conversations
    from blockdraft.data.pipeline import default_data_file, split_conversations

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(default_data_file()))
    p.add_argument("--seen", required=True, help="conversations earlier stages trained or evaluated on")
    p.add_argument("--eval-fraction", type=float, default=0.01)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    convs, _ = load_conversations(a.data)
    seen = {c[0]["content"] for c in load_conversations(a.seen)[0]}
    unseen = [c for c in convs if c[0]["content"] not in seen]
    _, held = split_conversations(unseen, a.eval_fraction, 0)
    held_keys = {json.dumps(c, sort_keys=True) for c in held}
    train = [c for c in convs if json.dumps(c, sort_keys=True) not in held_keys]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("eval", held)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in part))
    print(f"{len(train)} training and {len(held)} held-out conversations ({len(convs) - len(unseen)} with a prompt "
          f"an earlier stage saw, never held out) -> {out}")


if __name__ == "__main__":
    main()
