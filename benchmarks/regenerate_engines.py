"""Regeneration speed of the two engines on the same prompts: answers per minute, and how many
greedy answers are identical (vLLM's fp32 kernels may flip a near-tie now and then).

Run in an environment with vLLM (reference/setup.sh builds one; blockdraft from the tree):

    PYTHONPATH=src .venv-ref-vllm/bin/python benchmarks/regenerate_engines.py --n 64 --json out.json

Both engines write through `blockdraft.data.regenerate.regenerate` (same prompts, same template,
same stop tokens), one after the other in one run, so the ratio is taken under the same load.
vLLM's engine start (about 1.5-3 minutes here, paid once per `regenerate` call) is timed apart:
`answers_per_min` counts only generation, `answers_per_min_with_start` the whole call.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def time_engine_start() -> list:
    """Seconds each vLLM engine construction took, appended as they happen (its first generation
    starts it; the transformers engine's model is loaded before its timing starts)."""
    from blockdraft.engines.vllm import job as engines

    taken, build = [], engines.Generator.__init__

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        build(self, *args, **kwargs)
        taken.append(time.perf_counter() - t)

    engines.Generator.__init__ = timed
    return taken


def main() -> None:
    import torch

    from blockdraft.data.prompt_set import DEFAULT_PROMPTS, read_prompts
    from blockdraft.data.regenerate import regenerate
    from blockdraft.engines import runner

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{a.threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    prompts = read_prompts(a.prompts)[: a.n]
    started = time_engine_start()
    out, answers = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        # transformers first: a vLLM engine's processes outlive its call until this one exits, and
        # must not share the cores with the other engine's timing
        for engine in ("transformers", "vllm"):
            generator = runner(engine).generator("smollm2")
            path = Path(tmp) / f"{engine}.jsonl"
            t0 = time.perf_counter()
            regenerate(generator, prompts, path, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size,
                       progress=False, keep_cut=True)  # every answer compared, cut ones too
            dt = time.perf_counter() - t0
            start = started.pop() if engine == "vllm" else 0.0
            recs = [json.loads(ln) for ln in path.read_text().splitlines()]
            answers[engine] = {r["hash"]: r["messages"][-1]["content"] for r in recs}
            out[engine] = {"answers": len(recs), "seconds": round(dt, 1), "engine_start_s": round(start, 1),
                           "answers_per_min": round(60 * len(recs) / (dt - start), 1),
                           "answers_per_min_with_start": round(60 * len(recs) / dt, 1)}
    same = sum(answers["vllm"][h] == answers["transformers"].get(h) for h in answers["vllm"])
    out["identical_answers"] = f"{same}/{len(answers['vllm'])}"
    out["ratio_vllm_over_transformers"] = round(out["vllm"]["answers_per_min"] / out["transformers"]["answers_per_min"], 2)
    out["setup"] = {"n": a.n, "max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size, "threads": a.threads}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
