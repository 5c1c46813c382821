"""pack: fixed-length rows, per-document positions, no token lost or duplicated."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from blockdraft.data import PackStats, pack
from blockdraft.data.packing import best_fit
from blockdraft.train.step import Batch, documents_from_positions, positions_from_documents

PAD = 0


def example(ids, mask):
    return {"input_ids": list(ids), "loss_mask": list(mask)}


def unpack(rows, pad=PAD):
    """Independent inverse: per row, split at document-id changes and check each piece."""
    docs = []
    R, T = rows["input_ids"].shape
    for r in range(R):
        ids, mask, pos, doc = (rows[k][r].tolist() for k in ("input_ids", "loss_mask", "position_ids", "document_ids"))
        pieces = []
        for t in range(T):
            if t == 0 or doc[t] != doc[t - 1]:
                assert doc[t] == (0 if t == 0 else doc[t - 1] + 1), "documents must be contiguous and numbered in order"
                pieces.append([])
            assert pos[t] == len(pieces[-1]), "positions restart at 0 per document"
            pieces[-1].append((ids[t], mask[t]))
        for k, piece in enumerate(pieces):
            if not any(m for _, m in piece):  # padding: only last, all pad tokens
                assert k == len(pieces) - 1 and all(i == pad for i, _ in piece)
                continue
            docs.append((tuple(i for i, _ in piece), tuple(m for _, m in piece)))
    return docs


def test_rows_shape_dtype_and_padding():
    exs = [example([5, 6, 7], [0, 1, 1]), example([8, 9], [1, 1]), example([10, 11, 12, 13], [0, 0, 1, 1])]
    rows, stats = pack(exs, 6, PAD, return_stats=True)
    assert set(rows) == {"input_ids", "loss_mask", "position_ids", "document_ids"}
    for t in rows.values():
        assert t.dtype == torch.long and t.shape == (2, 6)
    # best fit in order: [5,6,7] row 0; [8,9] fits row 0 (room 3); [10..13] opens row 1
    assert rows["input_ids"].tolist() == [[5, 6, 7, 8, 9, PAD], [10, 11, 12, 13, PAD, PAD]]
    assert rows["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    assert rows["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
    assert stats == PackStats(examples=3, packed=3, truncated=0, dropped_no_loss=0, rows=2, tokens=9,
                              loss_tokens=6, padding=3)


def test_full_row_has_no_padding_document():
    rows = pack([example([1, 2], [1, 1]), example([3, 4], [0, 1])], 4, PAD)
    assert rows["document_ids"].tolist() == [[0, 0, 1, 1]]
    assert rows["position_ids"].tolist() == [[0, 1, 0, 1]]


def test_best_fit_assignment():
    assert best_fit([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]
    assert best_fit([10, 1, 10], 10) == [[0], [1], [2]]


def test_random_examples_round_trip():
    rng = random.Random(0)
    exs = []
    for _ in range(200):
        n = rng.randint(1, 40)
        mask = [rng.random() < 0.5 for _ in range(n)]
        mask[rng.randrange(n)] = True
        exs.append(example([rng.randint(1, 999) for _ in range(n)], [int(m) for m in mask]))
    rows, stats = pack(exs, 64, PAD, return_stats=True)
    docs = unpack(rows)
    assert Counter(docs) == Counter((tuple(e["input_ids"]), tuple(e["loss_mask"])) for e in exs)
    assert stats.tokens == sum(len(e["input_ids"]) for e in exs) == stats.rows * 64 - stats.padding
    assert stats.rows == rows["input_ids"].shape[0] and stats.packed == 200
    # documents of a row keep their input order
    order = {(tuple(e["input_ids"]), tuple(e["loss_mask"])): i for i, e in enumerate(exs)}
    for r in range(stats.rows):
        idx = [order[d] for d in unpack({k: v[r:r + 1] for k, v in rows.items()})]
        assert idx == sorted(idx)


def test_truncation_keeps_the_first_tokens():
    long = example(range(1, 13), [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    rows, stats = pack([long, example([50, 51], [1, 1])], 8, PAD, return_stats=True)
    assert unpack(rows) == [(tuple(range(1, 9)), (0, 0, 1, 1, 1, 1, 1, 1)), ((50, 51), (1, 1))]
    assert stats.truncated == 1 and stats.dropped_no_loss == 0


def test_examples_without_loss_tokens_are_dropped_and_counted():
    late = example(range(1, 11), [0] * 8 + [1, 1])  # loss only after the cut
    none = example([3, 4, 5], [0, 0, 0])
    keep = example([7, 8], [0, 1])
    rows, stats = pack([late, none, keep], 8, PAD, return_stats=True)
    assert unpack(rows) == [((7, 8), (0, 1))]
    assert (stats.examples, stats.packed, stats.truncated, stats.dropped_no_loss) == (3, 1, 1, 2)
    with pytest.raises(ValueError, match="nothing to pack.*raise max_length"):
        pack([late, none], 8, PAD)


def test_tensor_inputs_and_validation():
    rows = pack([{"input_ids": torch.tensor([4, 5]), "loss_mask": torch.tensor([1, 1])}], 3, 9)
    assert rows["input_ids"].tolist() == [[4, 5, 9]]
    with pytest.raises(ValueError, match="same length"):
        pack([example([1, 2], [1])], 4, PAD)
    with pytest.raises(ValueError, match="only 0 and 1"):
        pack([example([1, 2], [1, 2])], 4, PAD)
    with pytest.raises(ValueError, match="must be a dict"):
        pack([[1, 2]], 4, PAD)
    with pytest.raises(ValueError, match="max_length"):
        pack([example([1], [1])], 0, PAD)
    with pytest.raises(ValueError, match="pad_token_id"):
        pack([example([1], [1])], 4, None)


def test_rows_feed_the_trainer_batch():
    exs = [example([1, 2, 3], [0, 1, 1]), example([4, 5, 6, 7], [0, 0, 1, 1]), example([8], [1])]
    rows = pack(exs, 5, PAD)
    batch = Batch(**rows)
    assert torch.equal(batch.document_ids, rows["document_ids"])
    # the trainer's own derivations agree with what pack wrote
    assert torch.equal(documents_from_positions(rows["position_ids"]), rows["document_ids"])
    assert torch.equal(positions_from_documents(rows["document_ids"]), rows["position_ids"])
    assert int((rows["loss_mask"] * (rows["input_ids"] == PAD)).sum()) == 0
