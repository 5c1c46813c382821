"""Everything that runs or serves a model, one module or package per engine, and the interface commands
ask of them.

* As consumers of blockdraft's drafters (`base.Engine`: the formats each reads, the kinds it serves or
  refuses and why, the target classes it can capture): vLLM (`vllm.consumer`), SGLang (`sglang`),
  llama.cpp (`llamacpp.consumer`), z-lab's dflash (`dflash`) and speculators (`speculators`), each with
  its quirks (what it does with a format's files that the drafter's function does not say). `doctor`
  and `convert` ask `ENGINES`, `servers`, `differences` and `capturing` (the registry, `consumers`), and
  `exports` writes a drafter once its consumers have had their say. Adding a consumer is one module and
  one entry in `consumers._engines`, adding a drafter kind one entry in each engine's `kinds` or
  `refused_kinds`.
* As what runs the target for blockdraft's own commands: transformers in this process, or vLLM in
  engine processes (`vllm/`); llama.cpp's server for the serving checks (`llamacpp.server`).

Nothing is imported until asked for: an engine's own process (vLLM's, which imports `vllm.feed`) loads
none of the rest.
"""

from __future__ import annotations

from .consumers import LISTED, capturing, differences, engine, format_differences, servers


def __getattr__(name: str):
    if name == "ENGINES":
        from .consumers import all_engines

        return all_engines()
    if name in ("Engine", "installed_tree"):
        from . import base

        return getattr(base, name)
    raise AttributeError(name)


RUNNERS = ("transformers", "vllm")  # what may run the target (--engine)


def runner(name: str):
    """What runs the target for `--engine name` (a `runners.Runner`)."""
    if name == "transformers":
        from .transformers import RUNNER
    elif name == "vllm":
        from .vllm.runner import RUNNER
    else:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(RUNNERS)}")
    return RUNNER


__all__ = ["ENGINES", "Engine", "RUNNERS", "capturing", "differences", "engine", "format_differences",
           "installed_tree", "runner", "servers"]
