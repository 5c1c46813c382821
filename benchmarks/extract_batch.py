"""Tokens per second of the target forward `extract` runs, by rows per forward and precision.

`extract --batch-tokens 0` runs 2,048 tokens (2 rows of 1,024) per forward on a CPU and 16,384
on a GPU; this measures why, on the embedded SmolLM2 and packed rows of the bundled data, in one
process (ratios, not absolute speeds, carry over between machines):

    python benchmarks/extract_batch.py --threads 2 --json benchmarks/results/extract-batch.json

For each precision and each rows-per-forward, the same 16 rows run once (after a warm-up); the
full-vocabulary argmax that extract stores is timed apart.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    import torch

    from blockdraft.data import build_rows
    from blockdraft.data.features import full_argmax
    from blockdraft.data.pipeline import default_data_file
    from blockdraft.target import TargetModel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--per-forward", default="1,2,4,16")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    results = []
    for name in a.dtypes.split(","):
        t = TargetModel.from_pretrained("smollm2", dtype=getattr(torch, name))
        rows, _, _ = build_rows(t.tokenizer, default_data_file(), 1024, return_stats=True)
        ids, pos = rows["input_ids"][:a.rows], rows["position_ids"][:a.rows]
        with torch.no_grad():
            t(ids[:1, :256], position_ids=pos[:1, :256])  # warm-up
            for per in (int(x) for x in a.per_forward.split(",")):
                t0 = time.perf_counter()
                for i in range(0, a.rows, per):
                    out = t(ids[i:i + per], position_ids=pos[i:i + per], return_final_hidden=True)
                t1 = time.perf_counter()
                full_argmax(t, out.final_hidden)
                t2 = time.perf_counter()
                row = {"dtype": name, "rows_per_forward": per, "forward_tok_s": round(ids.numel() / (t1 - t0)),
                       "argmax_tok_s": round(out.final_hidden.shape[0] * ids.shape[1] / (t2 - t1))}
                results.append(row)
                print(json.dumps(row), flush=True)
        best = {r["rows_per_forward"]: r["forward_tok_s"] for r in results if r["dtype"] == name}
        print(f"{name}: 2 rows per forward / 16: {best.get(2, 0) / max(best.get(16, 1), 1):.2f}x", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": a.threads, "rows": a.rows, "results": results}, indent=1))


if __name__ == "__main__":
    main()
