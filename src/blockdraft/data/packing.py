"""Pack rendered examples into fixed-length rows for `blockdraft.train.step.Batch`.

Each row is exactly `max_length` tokens and holds whole documents (examples) one after
another, then padding:

* ``input_ids``: the documents' tokens, then `pad_token_id`;
* ``loss_mask``: the documents' masks, 0 on padding;
* ``position_ids``: 0, 1, 2, ... restarting at 0 for every document and for the padding;
* ``document_ids``: 0, 1, 2, ... per document in row order; the padding is one more
  document of its own (loss_mask 0, so no anchor can land there).

Over-long examples are truncated to their first `max_length` tokens. Examples with no
loss token (before or after truncation) are dropped and counted. Rows are filled greedily
in input order by best fit: each example goes into the open row with the least room that
still fits it, or starts a new row; documents are never split across rows.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass

import torch

KEYS = ("input_ids", "loss_mask", "position_ids", "document_ids")


@dataclass
class PackStats:
    """Counts of one `pack` call (tokens are counted after truncation)."""

    examples: int = 0  # examples given
    packed: int = 0  # examples placed in rows
    truncated: int = 0  # examples cut to max_length (whether kept or dropped)
    dropped_no_loss: int = 0  # examples with no loss token left, not packed
    rows: int = 0
    tokens: int = 0  # non-padding tokens in the rows
    loss_tokens: int = 0
    padding: int = 0  # padding tokens in the rows


def _as_list(values, name: str, index: int) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"example {index}: '{name}' must be a sequence of integers") from None


def _example(ex, index: int) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one example, validated."""
    if not isinstance(ex, dict) or "input_ids" not in ex or "loss_mask" not in ex:
        raise ValueError(f"example {index} must be a dict with 'input_ids' and 'loss_mask' (as render() returns)")
    ids = _as_list(ex["input_ids"], "input_ids", index)
    mask = _as_list(ex["loss_mask"], "loss_mask", index)
    if len(ids) != len(mask):
        raise ValueError(f"example {index}: input_ids has {len(ids)} tokens but loss_mask {len(mask)}; "
                         f"they must have the same length")
    if any(m not in (0, 1) for m in mask):
        raise ValueError(f"example {index}: loss_mask must hold only 0 and 1")
    return ids, mask


def best_fit(lengths: list[int], max_length: int) -> list[list[int]]:
    """Assign items (in order) to bins of capacity max_length; returns item indices per bin."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free space, bin index), sorted
    for item, n in enumerate(lengths):
        k = bisect_left(room, (n, -1))
        if k < len(room):
            free, b = room.pop(k)
        else:
            free, b = max_length, len(bins)
            bins.append([])
        bins[b].append(item)
        if free - n > 0:
            insort(room, (free - n, b))
    return bins


def _fill_row(row: dict, r: int, docs: list[tuple[list[int], list[int]]], max_length: int) -> int:
    """Write documents into row r (padding already in place); returns the tokens written."""
    col = 0
    for d, (ids, mask) in enumerate(docs):
        n = len(ids)
        row["input_ids"][r, col:col + n] = torch.tensor(ids, dtype=torch.long)
        row["loss_mask"][r, col:col + n] = torch.tensor(mask, dtype=torch.long)
        row["position_ids"][r, col:col + n] = torch.arange(n)
        row["document_ids"][r, col:col + n] = d
        col += n
    row["position_ids"][r, col:] = torch.arange(max_length - col)
    row["document_ids"][r, col:] = len(docs)
    return col


def padding(rows: dict) -> torch.Tensor:
    """[R, L] True at each row's padding: the positions after its last document. Every packed document
    holds a loss token (`pack` drops the others), so the padding is whatever follows the document of a
    row's last loss token (a full row has none)."""
    mask, doc = rows["loss_mask"].bool(), rows["document_ids"]
    L = mask.shape[1]
    none = torch.full_like(mask[:, 0], -1, dtype=torch.long)
    last = torch.where(mask.any(1), L - 1 - mask.flip(1).int().argmax(1), none)  # each row's last loss token
    last_doc = doc.gather(1, last.clamp(min=0)[:, None])
    return (doc > last_doc) & (last[:, None] >= 0)


def pack(examples: Iterable[dict], max_length: int, pad_token_id: int, *, return_stats: bool = False):
    """Pack examples ({"input_ids", "loss_mask"}) into LongTensors [R, max_length].

    Returns {"input_ids", "loss_mask", "position_ids", "document_ids"}, or (that dict,
    PackStats) with return_stats=True. Raises ValueError when nothing is left to pack.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative integer token id, got {pad_token_id!r}; "
                         f"use the tokenizer's pad_token_id or eos_token_id")
    stats = PackStats()
    docs: list[tuple[list[int], list[int]]] = []
    for index, ex in enumerate(examples):
        ids, mask = _example(ex, index)
        stats.examples += 1
        if len(ids) > max_length:
            ids, mask = ids[:max_length], mask[:max_length]
            stats.truncated += 1
        if not any(mask):
            stats.dropped_no_loss += 1
            continue
        docs.append((ids, mask))
    if not docs:
        raise ValueError(f"nothing to pack: {stats.examples} examples given, {stats.dropped_no_loss} have no "
                         f"loss token in their first {max_length} tokens; give examples with assistant turns "
                         f"or raise max_length")
    bins = best_fit([len(ids) for ids, _ in docs], max_length)
    R = len(bins)
    rows = {k: torch.zeros(R, max_length, dtype=torch.long) for k in KEYS}
    rows["input_ids"].fill_(pad_token_id)
    for r, items in enumerate(bins):
        stats.tokens += _fill_row(rows, r, [docs[i] for i in items], max_length)
    stats.packed, stats.rows = len(docs), R
    stats.loss_tokens = int(rows["loss_mask"].sum())
    stats.padding = R * max_length - stats.tokens
    return (rows, stats) if return_stats else rows
