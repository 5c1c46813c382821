"""Who consumes blockdraft's drafters: the registry of consumers (`base.Consumer`), and what commands
ask of it (`consumer`, `capturing`, `servers`, and each format's records from every consumer's quirks,
`format_differences`). It imports an engine's module only when first asked; nothing here runs a model.
"""

from __future__ import annotations

_CONSUMERS: dict = {}


def _consumers() -> dict:
    from . import dflash, sglang, speculators
    from .llamacpp import consumer as llamacpp
    from .vllm import consumer as vllm

    return {e.CONSUMER.name: e.CONSUMER for e in (vllm, sglang, llamacpp, dflash, speculators)}


def all_consumers() -> dict:
    """name -> Consumer, every consumer blockdraft knows (built once)."""
    if not _CONSUMERS:
        _CONSUMERS.update(_consumers())
    return _CONSUMERS


def consumer(name: str):
    """The consumer `name` (a `base.Consumer`)."""
    engines = all_consumers()
    if name not in engines:
        raise ValueError(f"unknown consumer {name!r}; blockdraft knows {', '.join(engines)}")
    return engines[name]


def capturing() -> list:
    """The engines that capture the target's hidden states themselves (and may not know its class)."""
    return [e for e in all_consumers().values() if e.capture is not None]


# the order a format's records are listed in: the trainers and libraries, then the servers
LISTED = ("speculators", "dflash", "SGLang", "llama.cpp", "vLLM")


def format_differences(fmt: str, cfg) -> list:
    """Every consumer's records for `cfg` written as `fmt`: where one computes another function from
    those files (`refuse`) or needs something the drafter does not say."""
    engines = all_consumers()
    order = [n for n in LISTED if n in engines] + [n for n in engines if n not in LISTED]
    return [d for n in order for d in engines[n].quirks(fmt, cfg)]  # a converter may speak of a format it does not serve


def differences(cfg) -> list:
    """(format, record) for every export format (`format_differences`)."""
    from ..checkpoint.formats import FORMATS, GGUF

    return [(fmt, d) for fmt in (*FORMATS, GGUF) for d in format_differences(fmt, cfg)]


def _named(e, how: str) -> str:
    return f"{e.name} ({how})" if how else e.name


def servers(kind: str, fmt: str | None = None) -> str:
    """Who serves a drafter of `kind` (from files of `fmt`, or of any format), and who does not."""
    engines = [e for e in all_consumers().values() if fmt is None or e.reads(fmt)]
    yes = [_named(e, e.kinds[kind]) for e in engines if e.serves(kind)]
    no = [f"{e.release} ({e.refused_kinds[kind]})" if kind in e.refused_kinds else e.release for e in engines
          if not e.serves(kind)]
    return ", ".join(yes or ["no engine"]) + (f"; not {' or '.join(no)}" if no else "")
