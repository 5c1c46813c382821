"""Cost of the labels in a memoised training step: full-vocabulary head vs draft rows only.

With a FeatureMemo the target does not run, but the labels still need its head on the final
normed state. Without the memo's stored argmax that is the full head (49k rows for SmolLM2) at
every distinct label position; with it, only the draft vocabulary's rows. Both variants run the
same step (SmolLM2 target, bundled data, default drafter layout, 2 rows x 1024 tokens, 128
anchors per row) alternately in one process; the ratio is what counts.

    python benchmarks/train_step_labels.py --threads 1 --repeats 4
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main() -> None:
    import torch

    import dataclasses

    from blockdraft.data.features import FeatureMemo
    from blockdraft.train import compute_loss
    from blockdraft.data.pipeline import DataOptions, conversation_rows
    from blockdraft.train.build import DrafterOptions, build_drafter
    from blockdraft.train.trainer import rows_batch
    from blockdraft.target import TargetModel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    target = TargetModel.from_pretrained("smollm2")
    rows, _ = conversation_rows(target.tokenizer, DataOptions(eval_fraction=0.0), seed=0)
    drafter = build_drafter(DrafterOptions(), target, rows, "cpu")  # `blockdraft train`'s drafter
    idx = torch.tensor([0, 1])
    memo = FeatureMemo(target, rows)
    full3 = memo(idx)
    variants = {"full head (features, final)": dataclasses.replace(full3, top=None),
                "draft rows (features, final, argmax)": full3}
    times = {k: [] for k in variants}
    losses = {}
    for _ in range(a.repeats):
        for name, cached in variants.items():
            t0 = time.perf_counter()
            loss, _m = compute_loss(target, drafter, rows_batch(rows, idx), max_anchors=128, loss="kl",
                                    generator=torch.Generator().manual_seed(0), cached=cached)
            loss.backward()
            times[name].append(time.perf_counter() - t0)
            losses[name] = loss.item()
            drafter.zero_grad(set_to_none=True)
    best = {k: min(v) for k, v in times.items()}
    names = list(variants)
    res = {"step_s": best, "ratio_draft_rows_over_full": best[names[1]] / best[names[0]], "losses": losses}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
