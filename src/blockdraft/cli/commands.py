"""The commands, glue only: each reads its flags and calls the library (the algorithms live in the
package)."""

from __future__ import annotations

import json
import sys

from .parsers import train_config

DEFAULT_DATA = "default"
GPU_NEW_TOKENS = 16384  # regenerate's default answer length on a GPU: room for a thinking model's answers
CPU_NEW_TOKENS = 256  # and without one, where a CPU writes a few tokens a second


def _threads(args) -> None:
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def cmd_regenerate(args) -> int:
    from ..data import load_conversations
    from ..data.prompt_set import DEFAULT_PROMPTS, read_prompts
    from ..data.regenerate import regenerate
    from ..engines import runner
    from ..target import spread_kwargs

    _threads(args)
    _distinct_files(args)
    parse = None
    if args.tool_call_parser or args.reasoning_parser:
        from ..engines import server_parser

        parse = server_parser(args.tool_call_parser, args.reasoning_parser)  # refused before any work
    if args.prompts == "default":
        prompts = read_prompts(DEFAULT_PROMPTS)
    elif args.prompts.endswith((".jsonl", ".jsonl.gz")) and _is_prompt_file(args.prompts):
        prompts = read_prompts(args.prompts)
    else:
        convs, stats = load_conversations(args.prompts, skip_bad_lines=args.skip_bad_lines, require_assistant=False)
        prompts = list(enumerate(convs))
    prompts = prompts[: args.n] if args.n else prompts
    generator = runner(args.engine).generator(args.target, device=args.device, spread=spread_kwargs(args),
                                              tensor_parallel_size=args.tensor_parallel_size, memory=args.engine_memory,
                                              max_length=args.max_length)
    if parse is not None:
        parse = parse.bind(generator.tokenizer)
    gpu = _has_gpu()
    new_tokens = args.max_new_tokens or (GPU_NEW_TOKENS if gpu else CPU_NEW_TOKENS)
    seed = 0 if args.seed is None else args.seed  # None: not given (refused at --temperature 0: cli.unused_sampling)
    res = regenerate(generator, prompts, args.out, max_new_tokens=new_tokens, batch_size=args.batch_size,
                     progress=not args.no_progress, temperature=args.temperature, top_p=args.top_p, seed=seed,
                     keep_cut=args.keep_cut, parse=parse)
    print(f"regenerated {res['written']} answers ({res['skipped']} already done) -> {args.out}")
    print(f"cut at --max-new-tokens {new_tokens}: {res['cut']}; prompt fills the context: {res['over_context']}; "
          f"tool calls differ from the data's: {res['tool_calls_differ']}"
          + ("" if args.keep_cut else " (each ends its conversation before that turn; --keep-cut keeps cut answers)"))
    if res["cut"] and args.max_new_tokens is None and not gpu:
        print(f"note: {res['cut']} answers were cut at {new_tokens} tokens, the default without a GPU; pass "
              f"--max-new-tokens ({GPU_NEW_TOKENS} on a GPU) to let them finish", file=sys.stderr)
    if args.bundle:
        from ..data.regenerate import bundle_answers, sampling_of

        n = bundle_answers(args.out, args.bundle, prompts, sampling_of(args.temperature, args.top_p, seed))
        print(f"bundled {n} conversations in prompt-hash order -> {args.bundle}")
    return 0


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _distinct_files(args) -> None:
    """--prompts, --out and --bundle are three files: one given twice would be appended to or replaced."""
    from pathlib import Path

    def same(a, b):
        try:
            return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()
        except OSError:
            return False

    for (fa, a), (fb, b) in [(("--out", args.out), ("--prompts", args.prompts)),
                             (("--bundle", args.bundle), ("--prompts", args.prompts)),
                             (("--bundle", args.bundle), ("--out", args.out))]:
        if b != "default" or fb != "--prompts":
            if same(a, b):
                raise ValueError(f"{fa} {a} is also {fb}: regenerate would write over it; pass another {fa}")


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
    from ..data.prompt_set import build_prompt_set, check_prompts_out, samples_path, write_prompts

    _threads(args)
    check_prompts_out(args.out)  # a user's file is never replaced, nothing is written through a link
    samples = samples_path(args.out)  # kept across a restart
    from ..engines import runner

    records = build_prompt_set(lambda: runner(args.engine).sampler(args.target), args.magpie, args.builtin,
                               seed=args.seed, oversample=args.oversample, samples_path=samples)
    out = write_prompts(records, args.out)
    kinds = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print(f"wrote {len(records)} prompts ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}) -> {out}")
    return 0


def cmd_train(args) -> int:
    from ..train.distributed import world
    from ..train.run import run_training

    _threads(args)
    cfg = train_config(args, args.argv)
    summary = run_training(cfg)
    if world()[0] != 0:  # under torchrun, rank 0 reports
        return 0
    print(json.dumps({k: v for k, v in summary.items() if k != "eval_slot_accuracy"}))
    tau = summary.get("eval_tau")
    if tau is not None:
        print(f"held-out accepted length (tau, block {cfg.drafter.block_size}, greedy, teacher-forced): {tau:.3f}")
    return 0


def _load_pair(args):
    from ..checkpoint import load_drafter
    from ..target import TargetModel, pick_device, spread_kwargs, target_num_layers

    device = pick_device(args.device)
    drafter = load_drafter(args.drafter, device=device, num_target_layers=target_num_layers(args.target))
    target = TargetModel.from_pretrained(args.target, layer_ids=drafter.config.target_layer_ids, device=device,
                                         **spread_kwargs(args, device))
    return target, drafter


def speed_settings(args, drafter) -> dict:
    """--draft-threshold / --lookup, else what the drafter's config records as its fastest measured setting;
    --verify-chunk."""
    best = drafter.config.generate_defaults or {}
    return {"draft_threshold": args.draft_threshold if args.draft_threshold is not None
            else float(best.get("draft_threshold", 0.0)),
            "lookup": args.lookup if args.lookup is not None else int(best.get("lookup", 0)),
            "verify_chunk": args.verify_chunk}


def cmd_generate(args) -> int:
    from ..data.chat import encode_prompt as encode
    from ..target import stop_token_ids
    from ..generate import speculative_generate

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
                               **speed_settings(args, drafter))
    dt = res.time_total - res.time_prefill
    print(f"\n\n[tau {res.tau:.2f} | {len(res.tokens)} tokens | {(len(res.tokens) - 1) / max(dt, 1e-9):.1f} tok/s "
          f"after a {res.time_prefill:.2f}s prefill]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from ..bench.runner import check_outputs, run_bench

    _threads(args)
    check_outputs(args.json, args.plot)  # before the target loads and the bench runs
    target, drafter = _load_pair(args)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    results = run_bench(target, drafter, sets, args.n, max_new_tokens=args.max_new_tokens,
                        block_size=args.block_size, json_path=args.json, plot_path=args.plot,
                        progress=not args.no_progress, **speed_settings(args, drafter))
    print(f"{'set':10} {'n':>3} {'tau':>5} {'target t/s':>10} {'spec t/s':>9} {'speedup':>7} {'ceiling':>7} "
          f"{'hf lookup':>9} identical")  # transformers' own prompt-lookup decoding
    for r in results:
        print(f"{r['set']:10} {r['n_prompts']:>3} {r['tau']:>5.2f} {r['target_tok_s']:>10.1f} {r['spec_tok_s']:>9.1f} "
              f"{r['speedup']:>6.2f}x {r['ceiling']:>6.2f}x {r['hf_lookup_speedup']:>8.2f}x {r['identical']}")
    return 0 if all(r["identical"] for r in results) else 1


def cmd_extract(args) -> int:
    from ..data.pipeline import DataOptions
    from ..engines import options_from_args
    from ..options import from_args
    from ..target import TargetOptions
    from ..extract import ExtractOptions, run_extract

    _threads(args)
    out = run_extract(from_args(TargetOptions, args), from_args(DataOptions, args), from_args(ExtractOptions, args),
                      options_from_args(args, "extract"))
    print(f"feature cache written to {out}")
    return 0


def cmd_engine(args) -> int:
    from ..engines import server
    from ..options import from_args
    from ..target import TargetOptions

    return server().serve(from_args(TargetOptions, args), args)


def cmd_convert(args) -> int:
    from ..checkpoint.native import read_config, resolve_drafter
    from ..engines.exports import convert
    from ..engines import servers

    path, found = convert(args.src, args.dst, args.to, verifier=args.verifier, allow_mismatch=args.allow_mismatch,
                          target_gguf=args.target_gguf, overwrite=args.overwrite)
    for d in found:
        print(f"blockdraft convert: warning: {d}", file=sys.stderr)
    print(f"wrote {path} ({args.to} format)")
    print(f"served by {servers(read_config(resolve_drafter(args.src))[1].kind, args.to)}")
    return 0


def cmd_doctor(args) -> int:
    from ..doctor import FAIL, doctor_main, report

    _threads(args)
    if args.show:
        if not args.data:
            raise ValueError("--show N prints records of --data FILE: pass --data")
        from ..data.show import show
        from ..target.files import TargetFiles, is_random, random_target_tokenizer

        tok = random_target_tokenizer() if is_random(args.target) else TargetFiles.resolve(args.target).tokenizer
        print(show(tok, args.data, args.show), flush=True)
    checks = doctor_main(args.target, args.drafter, args.data, args.device, vllm=args.vllm,
                         llama_cpp=args.llama_cpp, target_gguf=args.target_gguf, debug=args.debug)
    print(report(checks, as_json=args.json))
    return 1 if any(c.status == FAIL for c in checks) else 0

