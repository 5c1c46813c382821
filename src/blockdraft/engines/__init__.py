"""Everything that runs or serves a model, one module or package per engine, and the interface commands
ask of them. Two roles, two names:

* A **consumer** reads blockdraft's exported drafters (`base.Consumer`: the formats each reads, the kinds
  it serves or refuses and why, the target classes it can capture): vLLM (`vllm.consumer`), SGLang
  (`sglang`), llama.cpp (`llamacpp.consumer`), z-lab's dflash (`dflash`) and speculators (`speculators`),
  each with its quirks (what it does with a format's files that the drafter's function does not say).
  `doctor` and `convert` ask `CONSUMERS`, `consumer`, `servers`, `differences` and `capturing` (the
  registry, `consumers`), and `exports` writes a drafter once its consumers have had their say. Adding a
  consumer is one module and one entry in `consumers._consumers`, adding a drafter kind one entry in each
  consumer's `kinds` or `refused_kinds`.
* A **runner** runs the target for blockdraft's own commands (`runners.Runner`, `runner(name)` for
  `--engine name`): transformers in this process (`transformers`), or vLLM in engine processes
  (`vllm.runner`). Its options are `options.RunnerOptions` and its own subclass of them.

Beside them: the checks doctor runs on an engine (`doctor_checks`), vLLM's tool-call and reasoning parsers
(`server_parser`), llama.cpp's server for the serving checks (`llamacpp.server`).

Nothing is imported until asked for: an engine's own process (vLLM's, which imports `vllm.feed`) loads
none of the rest.
"""

from __future__ import annotations

from .consumers import LISTED, capturing, consumer, differences, format_differences, servers
import dataclasses

from .options import RUNNERS, RunnerOptions, flag, own_fields


def __getattr__(name: str):
    if name == "CONSUMERS":
        from .consumers import all_consumers

        return all_consumers()
    if name in ("Consumer", "installed_tree"):
        from . import base

        return getattr(base, name)
    if name == "EngineFailed":
        from .runners import EngineFailed

        return EngineFailed
    raise AttributeError(name)


def runner(name: str):
    """What runs the target for `--engine name` (a `runners.Runner`)."""
    if name == "transformers":
        from .transformers import RUNNER
    elif name == "vllm":
        from .vllm.runner import RUNNER
    else:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(RUNNERS)}")
    return RUNNER


def all_runners() -> list:
    """Every runner, in `RUNNERS`' order."""
    return [runner(name) for name in RUNNERS]


def server():
    """The runner whose servers feed `train --engine-endpoints` from other nodes (`blockdraft engine`)."""
    return next(r for r in all_runners() if r.serves)


def server_parser(tool_call_parser: str | None, reasoning_parser: str | None):
    """vLLM's own tool-call and reasoning parsers on a regenerated turn, as `vllm serve` calls them (with
    either runner): `vllm.parsers.server_parser`."""
    from .vllm.parsers import server_parser as parser

    return parser(tool_call_parser, reasoning_parser)


def doctor_checks() -> dict:
    """The checks doctor runs on an engine, by name: `engine_features(target)` and `acceptance(target,
    drafter, ids)` (vLLM's), `llama_cpp(target, drafter, target_gguf)` (llama.cpp's)."""
    from .llamacpp.doctor import check_llamacpp
    from .vllm.doctor import check_acceptance, check_engine_features

    return {"engine_features": check_engine_features, "acceptance": check_acceptance, "llama_cpp": check_llamacpp}


def runner_options(values: dict, command: str) -> RunnerOptions:
    """The options of the runner `values["engine"]` names (default: transformers), from `values` (a
    command's flags or a saved `engine` section): another runner's settings are refused in one line where
    set, and dropped at their defaults (a run configuration written before each runner had its own)."""
    name = values.get("engine", RunnerOptions.engine)
    chosen = runner(name)
    mine = {f.name for f in dataclasses.fields(chosen.options)}
    owners = {k: r for r in all_runners() for k in own_fields(r.options)}
    unknown = sorted(k for k in values if k not in mine and k not in owners)
    if unknown:
        raise ValueError(f"unknown engine settings {unknown}")
    defaults = {f.name: f.default for r in all_runners() for f in dataclasses.fields(r.options)}
    moot = [k for k, v in values.items() if k not in mine and v != defaults[k]]
    if moot:
        owner = owners[moot[0]]
        raise ValueError(f"{', '.join(flag(k) for k in moot)} set how {owner.title} runs the target, and this "
                         f"{command} runs it with --engine {name}: add --engine {owner.name}, or drop them")
    return chosen.options(**{k: v for k, v in values.items() if k in mine})


def options_from_args(args, command: str) -> RunnerOptions:
    """A command's runner options from its parsed flags (each runner's own that the command has)."""
    names = {f.name for r in all_runners() for f in dataclasses.fields(r.options)}
    return runner_options({k: getattr(args, k) for k in names if hasattr(args, k)}, command)


__all__ = ["CONSUMERS", "Consumer", "EngineFailed", "LISTED", "RUNNERS", "RunnerOptions", "capturing", "consumer",
           "differences", "doctor_checks", "format_differences", "installed_tree", "options_from_args", "runner",
           "all_runners", "runner_options", "server", "server_parser", "servers"]
