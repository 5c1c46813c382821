"""The ecosystem's drafter formats (DESIGN.md section 2), one module each, registered by name.

`convert` and the CLI's `--to` choices come from FORMATS. Each format is tested by loading its
output with its consumers' own code (`reference/`), not only by blockdraft's reader.
"""

from __future__ import annotations

from ...config import DrafterConfig
from . import speculators, zlab
from .base import Export, Format, native_weights

FORMATS: dict[str, Format] = {f.name: f for f in (zlab.FORMAT, speculators.FORMAT)}
GGUF = "gguf"  # llama.cpp's one-file drafter (formats/gguf.py): written by `convert`, never read back
EXPORTS = {**{f.name: f.description for f in FORMATS.values()}, GGUF: "llama.cpp's DFlash GGUF (one file)"}
NATIVE = "zlab"  # save_drafter writes this layout, config and weights (d2t + head rows): engines load it as is


def get(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown drafter format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def detect(d: dict) -> str:
    for f in FORMATS.values():
        if f.matches(d):
            return f.name
    if "format_version" in d and "target_layer_ids" in d:
        return "blockdraft-v0"
    raise ValueError("unknown drafter config: neither z-lab (dflash_config) nor speculators (speculators_model_type)")


def config_from_json(d: dict, num_target_layers: int | None = None) -> DrafterConfig:
    kind = detect(d)
    if kind == "blockdraft-v0":  # the earliest checkpoints: DrafterConfig.to_dict()
        return DrafterConfig.from_dict({**{"sliding_window_rule": "anchor"}, **{k: v for k, v in d.items()
                                                                                if k != "extra"}})
    return FORMATS[kind].read_config(d, num_target_layers)


__all__ = ["EXPORTS", "FORMATS", "GGUF", "NATIVE", "Export", "Format", "config_from_json", "detect", "get",
           "native_weights"]
