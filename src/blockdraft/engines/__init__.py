"""Everything that runs or serves a model, one module or package per engine, and the interface commands
ask of them.

* As consumers of blockdraft's drafters (`base.Engine`: the formats each reads, the kinds it serves or
  refuses and why, the target classes it can capture): vLLM (`vllm.consumer`), SGLang (`sglang`),
  llama.cpp (`llamacpp.consumer`), z-lab's dflash (`dflash`) and speculators (`speculators`). `doctor` and
  `convert` ask `ENGINES`, `servers`, `differences` and `capturing`; adding a consumer is one module and
  one entry in `_engines`, adding a drafter kind one entry in each engine's `kinds` or `refused_kinds`.
* As what runs the target for blockdraft's own commands: transformers in this process, or vLLM in
  engine processes (`vllm/`); llama.cpp's server for the serving checks (`llamacpp.server`).

Nothing is imported until asked for: an engine's own process (vLLM's, which imports `vllm.feed`) loads
none of the rest.
"""

from __future__ import annotations


def _engines() -> dict:
    from . import dflash, sglang, speculators
    from .llamacpp import consumer as llamacpp
    from .vllm import consumer as vllm

    return {e.ENGINE.name: e.ENGINE for e in (vllm, sglang, llamacpp, dflash, speculators)}


def _all() -> dict:
    if "ENGINES" not in globals():
        globals()["ENGINES"] = _engines()
    return globals()["ENGINES"]


def __getattr__(name: str):
    if name == "ENGINES":
        return _all()
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


def engine(name: str):
    """The consumer `name` (a `base.Engine`)."""
    engines = _all()
    if name not in engines:
        raise ValueError(f"unknown engine {name!r}; blockdraft knows {', '.join(engines)}")
    return engines[name]


def capturing() -> list:
    """The engines that capture the target's hidden states themselves (and may not know its class)."""
    return [e for e in _all().values() if e.capture is not None]


def differences(cfg) -> list:
    """(format, record) for every export format: where a consumer of those files computes another
    function from them (`refuse`) or needs something the drafter does not say."""
    from ..checkpoint.formats import FORMATS, GGUF
    from .base import format_differences

    return [(fmt, d) for fmt in (*FORMATS, GGUF) for d in format_differences(fmt, cfg)]


def _named(e, how: str) -> str:
    return f"{e.name} ({how})" if how else e.name


def servers(kind: str, fmt: str | None = None) -> str:
    """Who serves a drafter of `kind` (from files of `fmt`, or of any format), and who does not."""
    engines = [e for e in _all().values() if fmt is None or e.reads(fmt)]
    yes = [_named(e, e.kinds[kind]) for e in engines if e.serves(kind)]
    no = [f"{e.release} ({e.refused_kinds[kind]})" if kind in e.refused_kinds else e.release for e in engines
          if not e.serves(kind)]
    return ", ".join(yes or ["no engine"]) + (f"; not {' or '.join(no)}" if no else "")


__all__ = ["ENGINES", "Engine", "RUNNERS", "capturing", "differences", "engine", "installed_tree", "runner", "servers"]
