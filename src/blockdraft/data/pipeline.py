"""Conversations to packed rows: `build_rows` (file or dataset -> conversations -> rendered examples
-> packed rows), and the data side of a training run (DataOptions, the held-out split)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..options import existing, opt

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
                if getattr(messages, "where", None):  # render named the record (file:line)
                    raise
                raise ValueError(f"conversation {i} (counting kept ones only) of {path_or_dataset!s:.200}: {e}") from e

    rows, pack_stats = pack(examples(), max_length, pad, return_stats=True)
    return (rows, load_stats, pack_stats) if return_stats else rows


# ------------------------------------------------------------------------- training runs

DATA_DIR = Path(__file__).resolve().parent.parent / "assets" / "data"


def default_data_file() -> Path:
    """The bundled conversations (gzip JSONL; the plain JSONL of older releases where that is all there is).

    The committed file is SmolLM2's greedy answers to the bundled prompt set, rebuilt with
        blockdraft regenerate --engine vllm --prompts default --out answers.jsonl --batch-size 512 \\
            --bundle src/blockdraft/assets/data/default.jsonl.gz
    """
    gz = DATA_DIR / "default.jsonl.gz"
    return gz if gz.exists() else DATA_DIR / "default.jsonl"


@dataclass
class DataOptions:
    """Which conversations a run trains and evaluates on, and how they are packed."""

    data: str = opt("default", "conversations: a JSONL, JSONL.gz, JSON or parquet file, a `datasets` directory "
                               "(save_to_disk), hf:NAME[:CONFIG][:SPLIT] from the local datasets cache, or 'default' "
                               "(the bundled set)", check=existing(names=("default",), prefixes=("hf:",)))
    eval_data: str | None = opt(None, "held-out conversations, as --data (default: a split of --data)",
                                check=existing(names=("default",), prefixes=("hf:",)))
    max_length: int = opt(1024, "packed row length in tokens (train --features-cache C: C's row length)", min=2)
    max_rows: int = opt(128, "train on at most this many packed rows (0: all; held-out rows are bounded to an "
                             "eighth of it); the default keeps a 2-core CPU run under 15 minutes")
    eval_fraction: float = opt(0.05, "share of the conversations held out, chosen by a hash of each one", below=1)
    max_eval_rows: int = opt(256, "evaluate on at most this many held-out packed rows (0: all); every rank "
                                  "evaluates its share of them")
    skip_bad_lines: bool = opt(False, "skip and count malformed records instead of stopping at the first")
    features_cache: str | None = opt(None, "train from `blockdraft extract` shards instead of running the target",
                                     metavar="DIR", check=existing("dir"))
    eval_features_cache: str | None = opt(None, "with --features-cache: evaluate on this cache's rows (`blockdraft "
                                                "extract` of the held-out conversations) and train on every row of "
                                                "--features-cache (default: a split of its rows)", metavar="DIR",
                                        check=existing("dir"))
    memo_features: str = opt("auto", "keep the target's outputs in memory after the first epoch (auto: if "
                                     "under 4 GiB)", choices=("auto", "on", "off"))


def check_cache_options(opts: DataOptions) -> None:
    """A held-out set given the way the run cannot use is refused, not silently replaced by a split."""
    if opts.eval_features_cache and not opts.features_cache:
        raise ValueError("--eval-features-cache needs --features-cache (without a cache, use --eval-data)")
    if opts.features_cache and opts.eval_data:
        raise ValueError("--eval-data is read by the target, which a --features-cache run does not run: extract the "
                         "held-out conversations with `blockdraft extract` and pass --eval-features-cache DIR")


def resolve_data(data: str) -> str:
    if data == "default":
        path = default_data_file()
        if not path.exists():
            raise ValueError("the bundled default dataset is missing from this installation; pass --data FILE")
        return str(path)
    if not data.startswith("hf:") and not Path(data).exists():
        raise ValueError(f"--data {data}: no such file")
    return data


def split_conversations(convs: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Held-out split by conversation (never inside one). A conversation is held out when a hash
    of its content (and the seed) falls below the fraction, so the split does not move when the
    data grows or is reordered: continuing a drafter on a larger file never trains on what was
    held out before."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction == 0:
        return list(convs), []

    def u(c) -> float:
        key = f"{seed}\n{json.dumps(c, sort_keys=True, default=str)}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64

    us = [u(c) for c in convs]
    ev = {i for i, x in enumerate(us) if x < eval_fraction}
    if not ev and convs:
        ev = {min(range(len(convs)), key=us.__getitem__)}  # at least one held out
    if len(ev) >= len(convs):
        raise ValueError(f"only {len(convs)} conversations: too few to hold any out; lower --eval-fraction")
    return [c for i, c in enumerate(convs) if i not in ev], [c for i, c in enumerate(convs) if i in ev]


def first_rows(rows: dict, max_rows: int, what: str = "training") -> dict:
    """The first `max_rows` packed rows (all when max_rows is 0); stored-output indices stay valid."""
    if max_rows and rows["input_ids"].shape[0] > max_rows:
        print(f"data: {what} on the first {max_rows} of {rows['input_ids'].shape[0]} packed rows "
              "(--max-rows 0 for all)")
        return {k: v[:max_rows] for k, v in rows.items()}
    return rows


def bound_rows(train: dict, held_out: dict | None, max_rows: int, max_eval_rows: int = 0) -> tuple[dict, dict | None]:
    """--max-rows bounds the training rows, and the held-out rows to an eighth of it (a small run is
    not mostly evaluation); --max-eval-rows bounds the held-out rows in any case (an evaluation
    every --eval-every steps of 5% of a large data set would cost more than the training)."""
    train = first_rows(train, max_rows)
    if held_out is not None:
        caps = [c for c in (max(1, max_rows // 8) if max_rows else 0, max_eval_rows) if c]
        if caps:
            held_out = first_rows(held_out, min(caps), what="held-out evaluation")
    return train, held_out


def conversation_rows(tokenizer, opts: DataOptions, seed: int) -> tuple[dict, dict | None]:
    """Render and pack --data (and --eval-data or a held-out split of it) into rows."""
    path = resolve_data(opts.data)
    convs, stats = load_conversations(path, skip_bad_lines=opts.skip_bad_lines)
    if not convs:
        raise ValueError(f"{path}: no conversation has an assistant turn ({stats.no_assistant} without one, "
                         f"{stats.bad_lines} bad lines); a drafter learns the target's answers: write them with "
                         f"`blockdraft regenerate --prompts {path} --out answers.jsonl`, then --data answers.jsonl")
    if stats.bad_lines or stats.no_assistant:
        print(f"data: skipped {stats.bad_lines} bad lines and {stats.no_assistant} conversations without an "
              f"assistant turn")
    if opts.eval_data:
        train_c, eval_c = convs, load_conversations(resolve_data(opts.eval_data))[0]
    else:
        train_c, eval_c = split_conversations(convs, opts.eval_fraction, seed)
    pad = _pad_id(tokenizer)

    def rows(cs):
        return pack([render(tokenizer, c) for c in cs], opts.max_length, pad) if cs else None

    return rows(train_c), rows(eval_c)
