"""`speculative_generate(verify_chunk=N)` against one target forward per block (N = 0): SmolLM2 and the
shipped drafter on held-out prompts (MT-Bench, GSM8K, HumanEval), the settings run in turn on each
prompt in one process, with the tokens and each step's accepted length held equal.

    python benchmarks/verify_chunk.py --threads 1 --json benchmarks/results/verify-chunk-1thread.json

On a CPU a verify forward costs about its rows (the linear layers' products), so a block checked a few
rows at a time, stopping at the first rejected draft, skips the rows after it; each extra forward costs
a pass over the weights. Every draft of the block is verified (no threshold, no lookup): the setting the
reference suite computes blockdraft's tau in.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    import torch

    from blockdraft.checkpoint import load_drafter
    from blockdraft.data.chat import encode_prompt
    from blockdraft.data.eval_prompts import load_prompt_set
    from blockdraft.generate import speculative_generate
    from blockdraft.target import TargetModel, stop_token_ids

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--per-set", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chunks", default="0,2,3,4,6")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    chunks = [int(c) for c in a.chunks.split(",")]
    if chunks[0] != 0:
        raise SystemExit("--chunks must start with 0 (the one-forward reference)")
    drafter = load_drafter("default")
    target = TargetModel.from_pretrained("smollm2", layer_ids=drafter.config.target_layer_ids)
    stops = stop_token_ids(target.tokenizer)
    prompts = [encode_prompt(target.tokenizer, m) for s in ("mtbench", "gsm8k", "humaneval")
               for m in load_prompt_set(s, a.per_set)]
    seconds = {c: 0.0 for c in chunks}
    steps = accepted = tokens = 0
    for i, ids in enumerate(prompts):
        ref = None
        for c in chunks:
            t0 = time.perf_counter()
            res = speculative_generate(target, drafter, ids, max_new_tokens=a.max_new_tokens, stop_token_ids=stops,
                                       verify_chunk=c)
            seconds[c] += time.perf_counter() - t0
            if ref is None:
                ref = res
                steps += len(res.accepted)
                accepted += sum(res.accepted)
                tokens += len(res.tokens)
            elif (res.tokens, res.accepted) != (ref.tokens, ref.accepted):
                raise SystemExit(f"prompt {i}: verify_chunk={c} departs from one forward per block")
        print(f"prompt {i + 1}/{len(prompts)}: " + "  ".join(f"{c}: {seconds[c]:.1f} s" for c in chunks), flush=True)
    out = {"threads": a.threads, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "tokens": tokens,
           "verify_steps": steps, "tau": round(accepted / steps, 4), "identical": True,
           "seconds": {str(c): round(s, 1) for c, s in seconds.items()},
           "ratio_to_one_forward": {str(c): round(s / seconds[0], 3) for c, s in seconds.items()}}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
