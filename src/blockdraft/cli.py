"""`blockdraft` command line: argparse subcommands, glue only (the algorithms live in the package)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_DATA = "default"


def _threads(args) -> None:
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def cmd_regenerate(args) -> int:
    from .data import load_conversations
    from .data.prompt_set import DEFAULT_PROMPTS, read_prompts
    from .data.regenerate import regenerate
    from .target import TargetFiles, TargetModel
    from .train.run import spread_kwargs

    _threads(args)
    if args.prompts == "default":
        prompts = read_prompts(DEFAULT_PROMPTS)
    elif args.prompts.endswith((".jsonl", ".jsonl.gz")) and _is_prompt_file(args.prompts):
        prompts = read_prompts(args.prompts)
    else:
        convs, stats = load_conversations(args.prompts, skip_bad_lines=args.skip_bad_lines, require_assistant=False)
        prompts = list(enumerate(convs))
    prompts = prompts[: args.n] if args.n else prompts
    if args.engine == "vllm":
        target = TargetFiles.resolve(args.target)  # vLLM loads the weights itself
    else:
        target = TargetModel.from_pretrained(args.target, device=args.device, **spread_kwargs(args))
    res = regenerate(target, prompts, args.out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                     engine=args.engine, progress=not args.no_progress)
    print(f"regenerated {res['written']} answers ({res['skipped']} already done) -> {args.out}")
    return 0


def _is_prompt_file(path: str) -> bool:
    """A file of {"id", "messages"} prompt records (what `blockdraft prompts` writes)."""
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            first = json.loads(f.readline() or "{}")
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and "id" in first and "messages" in first


def cmd_prompts(args) -> int:
    from .data.prompt_set import build_prompt_set, write_prompts

    _threads(args)
    records = build_prompt_set(args.target, args.magpie, args.builtin, engine=args.engine, seed=args.seed)
    out = write_prompts(records, args.out)
    kinds = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print(f"wrote {len(records)} prompts ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}) -> {out}")
    return 0


def cmd_train(args) -> int:
    from .train.run import run_training

    _threads(args)
    summary = run_training(args)
    from .train.distributed import world

    if world()[0] != 0:  # under torchrun, rank 0 reports
        return 0
    print(json.dumps({k: v for k, v in summary.items() if k != "eval_slot_accuracy"}))
    tau = summary.get("eval_tau")
    if tau is not None:
        print(f"held-out accepted length (tau, block {args.block_size}, greedy, teacher-forced): {tau:.3f}")
    return 0


def _load_pair(args):
    from .checkpoint import load_drafter
    from .target import TargetModel, target_num_layers
    from .train.run import pick_device, spread_kwargs

    device = pick_device(args.device)
    drafter = load_drafter(args.drafter, device=device, num_target_layers=target_num_layers(args.target))
    target = TargetModel.from_pretrained(args.target, layer_ids=drafter.config.target_layer_ids, device=device,
                                         **spread_kwargs(args))
    return target, drafter


def cmd_generate(args) -> int:
    from .data.chat import encode_prompt as encode
    from .target import stop_token_ids
    from .generate import speculative_generate

    _threads(args)
    target, drafter = _load_pair(args)
    tok = target.tokenizer
    if args.chat:
        ids = encode(tok, [{"role": "user", "content": args.prompt}])
    else:
        ids = tok(args.prompt, return_tensors="pt")["input_ids"]
    shown: list[int] = []
    printed = [""]

    def stream(new):
        shown.extend(new)
        text = tok.decode(shown, skip_special_tokens=True)
        sys.stdout.write(text[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = text

    res = speculative_generate(target, drafter, ids, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_p=args.top_p, block_size=args.block_size,
                               stop_token_ids=stop_token_ids(tok), seed=args.seed, on_tokens=stream,
                               draft_threshold=args.draft_threshold, lookup=args.lookup)
    dt = res.time_total - res.time_prefill
    print(f"\n\n[tau {res.tau:.2f} | {len(res.tokens)} tokens | {(len(res.tokens) - 1) / max(dt, 1e-9):.1f} tok/s "
          f"after a {res.time_prefill:.2f}s prefill]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .bench.runner import run_bench

    _threads(args)
    target, drafter = _load_pair(args)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    results = run_bench(target, drafter, sets, args.n, max_new_tokens=args.max_new_tokens,
                        block_size=args.block_size, json_path=args.json, plot_path=args.plot,
                        progress=not args.no_progress, draft_threshold=args.draft_threshold,
                        lookup=args.lookup)
    print(f"{'set':10} {'n':>3} {'tau':>5} {'target t/s':>10} {'spec t/s':>9} {'speedup':>7} {'ceiling':>7} "
          f"{'hf lookup':>9} identical")  # transformers' own prompt-lookup decoding
    for r in results:
        print(f"{r['set']:10} {r['n_prompts']:>3} {r['tau']:>5.2f} {r['target_tok_s']:>10.1f} {r['spec_tok_s']:>9.1f} "
              f"{r['speedup']:>6.2f}x {r['ceiling']:>6.2f}x {r['lookup_speedup']:>8.2f}x {r['identical']}")
    return 0 if all(r["identical"] for r in results) else 1


def cmd_extract(args) -> int:
    from .train.run import run_extract

    _threads(args)
    print(f"feature cache written to {run_extract(args)}")
    return 0


def cmd_convert(args) -> int:
    from .checkpoint.native import convert

    path, found = convert(args.src, args.dst, args.to, verifier=args.verifier, allow_mismatch=args.allow_mismatch)
    for d in found:
        print(f"blockdraft convert: warning: {d}", file=sys.stderr)
    print(f"wrote {path} ({args.to} format)")
    return 0


def cmd_doctor(args) -> int:
    from .doctor import FAIL, doctor_main, report

    _threads(args)
    checks = doctor_main(args.target, args.drafter, args.data, args.device, vllm=args.vllm, debug=args.debug)
    print(report(checks, as_json=args.json))
    return 1 if any(c.status == FAIL for c in checks) else 0


def _target_args(p) -> None:
    """--target, --device, --threads: every command that runs the target."""
    p.add_argument("--target", default="smollm2", help="embedded name, local transformers dir or .gguf")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (one per process on a busy machine)")
    p.add_argument("--target-device-map", default=None, metavar="MAP",
                   help="spread a target too big for one device: auto, balanced, sequential, or a JSON object "
                        "(inline or a file) of module -> device, as transformers' device_map")
    p.add_argument("--offload-folder", default=None, help="where 'disk' entries of --target-device-map live")


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train a drafter (defaults: embedded SmolLM2 target, bundled data)")
    _target_args(t)
    t.add_argument("--data", default=DEFAULT_DATA, help="conversations (JSONL/JSON/parquet) or 'default'")
    t.add_argument("--eval-data", default=None, help="held-out conversations (default: a split of --data)")
    t.add_argument("--out", default="runs/default")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--draft-layers", type=int, default=1)
    t.add_argument("--num-features", type=int, default=5)
    t.add_argument("--layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None)
    t.add_argument("--max-anchors", type=int, default=128, help="anchors per packed row")
    t.add_argument("--max-length", type=int, default=1024, help="packed row length in tokens")
    t.add_argument("--max-rows", type=int, default=128,
                   help="train on at most this many packed rows (default keeps a 2-core CPU run under 15 "
                        "minutes; 0 = all)")
    _add_train_schedule(t)
    t.set_defaults(fn=cmd_train)


def _add_train_schedule(t) -> None:
    """Optimisation, evaluation and run-control flags of `train`."""
    t.add_argument("--epochs", type=float, default=3.0)
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.05, help="steps, or a fraction of all steps if < 1")
    t.add_argument("--batch-tokens", type=int, default=2048, help="tokens per micro-batch")
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--sliding-window", type=int, default=32,
                   help="make the first --sliding-layers drafter layers sliding-window layers of this width "
                        "(0: full attention only)")
    t.add_argument("--sliding-layers", type=int, default=1)
    t.add_argument("--bidirectional-sliding", action="store_true",
                   help="sliding layers bidirectional inside the block (default: causal, as vLLM serves them)")
    t.add_argument("--window-rule", choices=["query", "anchor"], default="query",
                   help="how a sliding window is counted: from each query's own position, as dflash, vLLM and "
                        "SGLang serve it (query), or from the block's anchor, as speculators trains (anchor)")
    t.add_argument("--draft-vocab", default="auto",
                   help="draft vocabulary size (most frequent training tokens), 'full', or 'auto' (8192 on CPU)")
    t.add_argument("--loss", choices=["kl", "soft", "hard"], default="kl")
    t.add_argument("--gamma", type=float, default=None)
    t.add_argument("--eval-fraction", type=float, default=0.05)
    t.add_argument("--eval-every", type=int, default=50)
    t.add_argument("--save-every", type=int, default=25)
    t.add_argument("--resume", action="store_true", help="continue the run in --out exactly")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--features-cache", default=None, help="train from `blockdraft extract` shards")
    t.add_argument("--init-drafter", default=None, metavar="DIR",
                   help="go on training a saved drafter (a directory or 'default') with a fresh schedule")
    t.add_argument("--init-from-target", action=argparse.BooleanOptionalAction, default=True,
                   help="start the drafter layers from the target's top decoder layers (same shapes)")
    t.add_argument("--final-norm-init", choices=["small", "target"], default="target",
                   help="drafter output norm: 0.1 (near-uniform first guesses) or the target's final norm scale")
    t.add_argument("--context-init", choices=["random", "top-feature"], default="random",
                   help="fc/hidden_norm start: random, or passing the last captured target layer through with the "
                        "target top layer's input-norm scale")
    t.add_argument("--memo-features", choices=["auto", "on", "off"], default="auto",
                   help="keep the target's outputs in memory after the first epoch (auto: if under 4 GiB)")
    t.add_argument("--gradient-checkpointing", action="store_true")
    t.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the drafter's parameters, gradients and optimizer state over the "
                        "ranks (FSDP2) instead of replicating them (DDP)")
    t.add_argument("--skip-bad-lines", action="store_true")
    t.add_argument("--no-progress", action="store_true")


def _add_regenerate(sub) -> None:
    r = sub.add_parser("regenerate", help="let the target write the assistant turns of a prompt set")
    _target_args(r)
    r.add_argument("--prompts", default="default",
                   help="prompt records or conversations file, or 'default' (the bundled prompt set)")
    r.add_argument("--out", required=True)
    r.add_argument("--n", type=int, default=0, help="answer only the first N prompts (0: all)")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (vLLM: 64-256)")
    r.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="transformers' generate, or vLLM's batched generation (pip install -e '.[vllm]')")
    r.add_argument("--skip-bad-lines", action="store_true")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(fn=cmd_regenerate)
    p = sub.add_parser("prompts", help="build a prompt set: user turns the target writes (Magpie) + built-in ones")
    _target_args(p)
    p.add_argument("--out", required=True, help="prompt records, JSONL (gzip if it ends .gz)")
    p.add_argument("--magpie", type=int, default=1000, help="user turns sampled from the target")
    p.add_argument("--builtin", type=int, default=0, help="prompts built from the Python stdlib and man pages")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_prompts)


def _add_extract(sub) -> None:
    x = sub.add_parser("extract", help="store the target's features and final states for training (sharded)")
    _target_args(x)
    x.add_argument("--data", default=DEFAULT_DATA)
    x.add_argument("--out", required=True)
    x.add_argument("--max-length", type=int, default=1024)
    x.add_argument("--num-features", type=int, default=5)
    x.add_argument("--layer-ids", type=lambda s: [int(v) for v in s.split(",")], default=None)
    x.add_argument("--shard-rows", type=int, default=64)
    x.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    x.add_argument("--seed", type=int, default=0)
    x.add_argument("--skip-bad-lines", action="store_true")
    x.set_defaults(fn=cmd_extract)


def _add_convert(sub) -> None:
    from .checkpoint.formats import FORMATS

    c = sub.add_parser("convert", help="write a drafter checkpoint for a consumer: " +
                       "; ".join(f"{f.name} ({f.description})" for f in FORMATS.values()))
    c.add_argument("--to", choices=list(FORMATS), required=True)
    c.add_argument("--verifier", default=None, metavar="DIR",
                   help="the target's local directory, named in the files and the source of a draft vocabulary's "
                        "head rows (default: the directory of the target the drafter was trained for)")
    c.add_argument("--allow-mismatch", action="store_true",
                   help="write the files even where a serving engine would compute another function from them")
    c.add_argument("src", help="drafter directory (any format), or 'default'")
    c.add_argument("dst", help="a new or empty directory (one holding other files is refused)")
    c.set_defaults(fn=cmd_convert)


def _add_doctor(sub) -> None:
    d = sub.add_parser("doctor", help="check the DFlash contract on your target, data and checkpoint")
    _target_args(d)
    d.add_argument("--drafter", default=None,
                   help="drafter directory or 'default' (without one, the checks that need no checkpoint run on "
                        "the target alone, before training)")
    d.add_argument("--data", default=None, help="conversations to check the loss masks on")
    d.add_argument("--vllm", action="store_true",
                   help="also serve the drafter with vLLM (installed beside blockdraft) and compare its acceptance")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_doctor)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="speculative generation; streams the text, then prints tau and tok/s")
    _target_args(g)
    g.add_argument("prompt")
    g.add_argument("--drafter", default="default", help="drafter directory, or 'default'")
    g.add_argument("--chat", action="store_true", help="apply the chat template")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--draft-threshold", type=float, default=0.0,
                   help="verify only the drafts up to the first slot whose top draft probability is below this "
                        "(0: the whole block); cheaper verification, same output")
    _lookup_arg(g)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(fn=cmd_generate)


def _lookup_arg(p) -> None:
    p.add_argument("--lookup", type=int, default=0, metavar="K",
                   help="prompt lookup beside the drafter: when the last tokens occurred earlier, verify up to K "
                        "tokens that followed them instead of the drafter's block (0: off; 3 suits a CPU)")


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="target vs speculative vs prompt-lookup decoding on MT-Bench/GSM8K/HumanEval")
    _target_args(b)
    b.add_argument("--drafter", default="default")
    b.add_argument("--sets", default="mtbench,gsm8k,humaneval")
    b.add_argument("--n", type=int, default=20)
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--block-size", type=int, default=None)
    b.add_argument("--draft-threshold", type=float, default=0.0,
                   help="verify only the drafts up to the first slot whose top draft probability is below this "
                        "(0: the whole block); cheaper verification, same output")
    _lookup_arg(b)
    b.add_argument("--json", default=None)
    b.add_argument("--plot", default=None)
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(fn=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blockdraft", description="Train, check and run DFlash drafters.")
    sub = p.add_subparsers(dest="cmd")
    _add_train(sub)
    _add_regenerate(sub)
    _add_extract(sub)
    _add_convert(sub)
    _add_doctor(sub)
    _add_generate(sub)
    _add_bench(sub)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return p


# Token-by-token generation keeps OpenMP's default spin-waiting: a decode step is ~200 small
# parallel products, and waking sleeping threads for each one doubled its time on 2 threads
# (SmolLM2: 24 -> 50 ms; `benchmarks/verify_step.py`).
LATENCY_COMMANDS = ("generate", "bench")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd not in LATENCY_COMMANDS:
        # Spin-waiting OpenMP threads stall every small parallel region when another process
        # shares the cores (up to ~8x measured on a busy 2-core machine); passive waiting costs
        # little to throughput jobs. Must be set before torch starts its thread pool, hence here.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    try:
        return int(args.fn(args) or 0)
    except ValueError as e:
        if args.debug:
            raise
        print(f"blockdraft {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"blockdraft {args.cmd}: interrupted; rerun the same command (with --resume for train) to continue",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
