"""The one interface every consumer module of `blockdraft.engines` fills in: a `Consumer`.

A consumer is a program that loads blockdraft's exported files and runs the drafter (vLLM, SGLang,
llama.cpp) or a library that does (z-lab's dflash, speculators). Each says, from its own source as
read in the release named in `release`:

- which export formats it reads (`formats`: names of `checkpoint.formats`, or "gguf");
- which drafter kinds it serves and how (`kinds`), and why not the others (`refused_kinds`);
- which target architectures it can capture hidden states from (`capture`: a reader of an installed
  copy's source that falls back on a committed table; None when it runs the target with
  transformers, which hands out any layer's hidden states);
- what it does with a given drafter config, read from the files of a format, that the drafter's
  function does not say (`quirks(format, config)`: its `Difference` records; `refuse` ones would be
  another function, and `engines.exports` refuses to write those files unless told to go on).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..config import DrafterConfig

Capture = Callable[[], "tuple[frozenset[str], str]"]


@dataclass(frozen=True)
class Difference:
    """What a consumer does with the exported files that the drafter's own function does not say:
    `refuse` when a serving engine would compute another function (export stops unless told to
    go on), otherwise a warning (a training framework's rule, a setting the engine needs)."""

    consumer: str
    refuse: bool
    what: str

    def __str__(self) -> str:
        return f"{self.consumer}: {self.what}"


# what an engine that windows each query from its own position does with an anchor-rule drafter
ANCHOR_RULE_SERVED = ("windows each query from its own position (rule 'query'); this drafter was trained with the "
                      "anchor rule, so its drafts differ once an anchor passes W - B + 1")


def ignores_draft_vocab(cfg: DrafterConfig) -> str:
    """What an engine that scores the target's full head does with a draft vocabulary (dflash, SGLang)."""
    return (f"ignores d2t and lm_head.weight and scores the target's full head, not this drafter's "
            f"{cfg.draft_vocab_size}-token draft vocabulary (output stays lossless; drafts may differ)")


def _no_refusal(kind: str) -> str | None:
    return None


def _no_quirks(fmt: str, cfg: DrafterConfig) -> list[Difference]:
    return []


@dataclass(frozen=True)
class Consumer:
    """What reads blockdraft's exported files (a server or a library); what runs the target for a command is
    a `runners.Runner` instead."""

    name: str  # as the formats' Difference records name the consumer
    release: str  # the release whose source the tables below were read from
    formats: tuple[str, ...]
    kinds: dict[str, str]  # kind -> how it is served ("" when nothing needs saying)
    refused_kinds: dict[str, str] = field(default_factory=dict)  # kind -> why the engine does not serve it
    capture: Capture | None = None  # () -> (architectures it captures, where that list comes from)
    capture_rule: tuple[str, str] = ("", "")  # (what a capturing target has, what a refused one lacks)
    capture_check: str = ""  # doctor's name for the capture check
    capture_refused: str = ""  # what follows for a target it cannot capture
    capture_fix: str = ""
    installed_kind_refusal: Callable[[str], str | None] = _no_refusal  # what an installed copy says of a kind
    quirks: Callable[[str, DrafterConfig], list[Difference]] = _no_quirks  # (format, config) -> its records

    def serves(self, kind: str) -> bool:
        return kind in self.kinds

    def reads(self, fmt: str) -> bool:
        return fmt in self.formats

    def differences(self, cfg: DrafterConfig) -> list[Difference]:
        """Its records for `cfg`, in the formats it reads (each once)."""
        out: list[Difference] = []
        for name in self.formats:
            out += [d for d in self.quirks(name, cfg) if d not in out]
        return out

    def captures(self, architectures: list[str]) -> tuple[bool, str]:
        """(whether it can capture a target of these HF architectures, where that answer comes from)."""
        if self.capture is None:
            return True, "it runs the target with transformers"
        known, source = self.capture()
        return any(a in known for a in architectures), source


def architectures(target) -> list[str]:
    """The HF architecture names a target's config gives (its class name when it gives none): what
    an engine's registry is keyed by."""
    return list(getattr(target.model.config, "architectures", None) or [type(target.model).__name__])


def installed_tree(package: str, marker: str) -> Path | None:
    """The source folder of an installed package holding `marker` (found without importing it), or None."""
    spec = importlib.util.find_spec(package)
    root = Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
    return root if root is not None and (root / marker).exists() else None


def installed_version(*dists: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "(version unknown)"
