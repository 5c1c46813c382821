"""Cost of a target forward of n tokens on top of a KV cache (n = 1: a decode step, n > 1: a
verify step), with transformers' stock `nn.Linear` layers against blockdraft's `FewRowsLinear`
(every linear layer of the target, head included), measured alternately in one process.

    python benchmarks/verify_step.py --threads 2 --json benchmarks/results/verify-step-2threads.json

OMP_WAIT_POLICY is left as the environment has it, as `blockdraft generate` and `bench` do: with
PASSIVE, waking the threads for each of a step's ~200 small products doubles a step on 2 threads.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    import torch
    import torch.nn as nn

    from blockdraft.model.linear import FewRowsLinear
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
    linears = [m for m in t.model.modules() if isinstance(m, nn.Linear)]
    variants = {"stock": nn.Linear, "few_rows": FewRowsLinear}

    def use(cls):
        for m in linears:
            m.__class__ = cls

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (1, a.context), generator=gen)
    res = {}
    for n in (1, 2, 3, 4, 6, 8, 16):
        times = {k: [] for k in variants}
        caches = {}
        for name, cls in variants.items():
            use(cls)
            caches[name] = t.new_cache()
            t(ids, position_ids=torch.arange(a.context)[None], cache=caches[name])
        for _ in range(a.repeats):
            blk = torch.randint(100, 20000, (1, n), generator=gen)
            for name, cls in variants.items():
                use(cls)
                t0 = time.perf_counter()
                t(blk, position_ids=torch.arange(a.context, a.context + n)[None], cache=caches[name])
                times[name].append(time.perf_counter() - t0)
                t.crop_cache(caches[name], a.context)
        res[n] = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()}
        print(f"{n:2d} tokens: " + "  ".join(f"{k} {v:.1f} ms" for k, v in res[n].items())
              + f"  ratio {res[n]['few_rows'] / res[n]['stock']:.2f}")
    use(FewRowsLinear)
    res["threads"] = torch.get_num_threads()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
