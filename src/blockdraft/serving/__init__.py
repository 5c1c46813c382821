"""Who serves a blockdraft drafter, one module per consumer behind one interface (`base.Engine`):
vLLM, SGLang and llama.cpp (serving engines), z-lab's dflash and speculators (libraries that load
the same files). vLLM's and llama.cpp's live in their engine's own package (`engines.vllm.consumer`,
`engines.llamacpp.consumer`), beside the code that runs them. `doctor` and `convert` ask this
package; adding an engine is one module and one entry in ENGINES, adding a drafter kind one entry in
each engine's `kinds` or `refused_kinds`. ENGINES is made on first use: the consumer modules import
`serving.base`, so they cannot be imported while this package is.
"""

from __future__ import annotations

from ..checkpoint.formats import FORMATS, GGUF, Difference
from ..config import DrafterConfig
from .base import Engine, format_differences, installed_tree


def _engines() -> dict[str, Engine]:
    from ..engines.llamacpp import consumer as llamacpp
    from ..engines.vllm import consumer as vllm
    from . import dflash, sglang, speculators

    return {e.ENGINE.name: e.ENGINE for e in (vllm, sglang, llamacpp, dflash, speculators)}


def _all() -> dict[str, Engine]:
    if "ENGINES" not in globals():
        globals()["ENGINES"] = _engines()
    return globals()["ENGINES"]


def __getattr__(name: str):
    if name == "ENGINES":
        return _all()
    raise AttributeError(name)


def engine(name: str) -> Engine:
    engines = _all()
    if name not in engines:
        raise ValueError(f"unknown engine {name!r}; blockdraft knows {', '.join(engines)}")
    return engines[name]


def capturing() -> list[Engine]:
    """The engines that capture the target's hidden states themselves (and may not know its class)."""
    return [e for e in _all().values() if e.capture is not None]


def differences(cfg: DrafterConfig) -> list[tuple[str, Difference]]:
    """(format, record) for every export format: where a consumer of those files computes another
    function from them (`refuse`) or needs something the drafter does not say."""
    return [(fmt, d) for fmt in (*FORMATS, GGUF) for d in format_differences(fmt, cfg)]


def _named(e: Engine, how: str) -> str:
    return f"{e.name} ({how})" if how else e.name


def servers(kind: str, fmt: str | None = None) -> str:
    """Who serves a drafter of `kind` (from files of `fmt`, or of any format), and who does not."""
    engines = [e for e in _all().values() if fmt is None or e.reads(fmt)]
    yes = [_named(e, e.kinds[kind]) for e in engines if e.serves(kind)]
    no = [f"{e.release} ({e.refused_kinds[kind]})" if kind in e.refused_kinds else e.release for e in engines
          if not e.serves(kind)]
    return ", ".join(yes or ["no engine"]) + (f"; not {' or '.join(no)}" if no else "")


__all__ = ["ENGINES", "Engine", "capturing", "differences", "engine", "installed_tree", "servers"]
