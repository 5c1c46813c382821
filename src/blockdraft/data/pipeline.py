"""`build_rows`: file (or dataset) -> conversations -> rendered examples -> packed rows."""

from __future__ import annotations

import os

from .chat import render
from .packing import pack
from .sources import load_conversations


def _tokenizer(tokenizer_or_path):
    if isinstance(tokenizer_or_path, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_or_path)
    return tokenizer_or_path


def _pad_id(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise ValueError("the tokenizer has neither a pad nor an eos token; pass pad_token_id=... to build_rows")


def build_rows(tokenizer, path_or_dataset, max_length: int, *, skip_bad_lines: bool = False,
               pad_token_id: int | None = None, return_stats: bool = False):
    """Load, render with the tokenizer's chat template and pack into [R, max_length] rows.

    `tokenizer` is a (fast) tokenizer or a path to load one from. Padding uses
    `pad_token_id`, else the tokenizer's pad token, else its eos token. Returns the dict
    of LongTensors of `pack`, or (rows, LoadStats, PackStats) with return_stats=True.
    """
    tok = _tokenizer(tokenizer)
    pad = _pad_id(tok) if pad_token_id is None else pad_token_id
    conversations, load_stats = load_conversations(path_or_dataset, skip_bad_lines=skip_bad_lines)

    def examples():
        for i, messages in enumerate(conversations):
            try:
                yield render(tok, messages)
            except ValueError as e:
                raise ValueError(f"conversation {i} (counting kept ones only) of {path_or_dataset!s:.200}: {e}") from e

    rows, pack_stats = pack(examples(), max_length, pad, return_stats=True)
    return (rows, load_stats, pack_stats) if return_stats else rows
