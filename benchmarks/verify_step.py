"""Cost of a target forward of n tokens on top of a KV cache (a verify step), with the stock
linear head against `few_rows_linear`, both measured alternately in one process.

    python benchmarks/verify_step.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main() -> None:
    import torch
    import torch.nn as nn

    from blockdraft.target import TargetModel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    t = TargetModel.from_pretrained("smollm2")
    head = t.model.get_output_embeddings()
    variants = {"stock": lambda x: nn.functional.linear(x, head.weight, head.bias), "few_rows": head.forward}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (1, a.context), generator=gen)
    res = {}
    for n in (1, 2, 3, 4, 8, 16):
        times = {k: [] for k in variants}
        caches = {}
        for name, fwd in variants.items():
            head.forward = fwd
            caches[name] = t.new_cache()
            t(ids, position_ids=torch.arange(a.context)[None], cache=caches[name])
        for _ in range(a.repeats):
            blk = torch.randint(100, 20000, (1, n), generator=gen)
            for name, fwd in variants.items():
                head.forward = fwd
                t0 = time.perf_counter()
                t(blk, position_ids=torch.arange(a.context, a.context + n)[None], cache=caches[name])
                times[name].append(time.perf_counter() - t0)
                t.crop_cache(caches[name], a.context)
        res[n] = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()}
        print(f"{n:2d} tokens: " + "  ".join(f"{k} {v:.1f} ms" for k, v in res[n].items())
              + f"  ratio {res[n]['few_rows'] / res[n]['stock']:.2f}")
    head.forward = variants["few_rows"]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
