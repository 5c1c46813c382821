"""build_rows end to end: a JSONL file through the SmolLM2 chat template into packed rows."""

from __future__ import annotations

import pytest
import torch

from blockdraft.data import build_rows, load_conversations, render
from blockdraft.train.step import Batch

RECORDS = [
    {"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}
    for i in range(5)
] + [
    {"conversations": [{"from": "system", "value": "Terse."}, {"from": "human", "value": "Hi"},
                       {"from": "gpt", "value": "Hey."}, {"from": "human", "value": "Long one?"},
                       {"from": "gpt", "value": "word " * 40}]},
    {"messages": [{"role": "user", "content": "no reply"}]},
    "{not json",
]


def documents(rows):
    """Real documents (with a loss token) of packed rows, as (ids, mask) tuples."""
    out = []
    for r in range(rows["input_ids"].shape[0]):
        doc = rows["document_ids"][r]
        for d in doc.unique().tolist():
            sel = doc == d
            ids, mask = rows["input_ids"][r][sel].tolist(), rows["loss_mask"][r][sel].tolist()
            if any(mask):
                out.append((tuple(ids), tuple(mask)))
    return out


def test_build_rows_from_jsonl(tok, write_jsonl):
    path = write_jsonl(RECORDS)
    rows, load_stats, pack_stats = build_rows(tok, path, 64, skip_bad_lines=True, return_stats=True)
    assert (load_stats.read, load_stats.kept, load_stats.bad_lines, load_stats.no_assistant) == (8, 6, 1, 1)
    convs, _ = load_conversations(path, skip_bad_lines=True)
    expected = [render(tok, c) for c in convs]
    assert len(expected[-1]["input_ids"]) > 64 and pack_stats.truncated == 1
    want = sorted((tuple(e["input_ids"][:64]), tuple(e["loss_mask"][:64])) for e in expected)
    assert sorted(documents(rows)) == want
    assert rows["input_ids"].shape[1] == 64
    n_tokens = sum(min(64, len(e["input_ids"])) for e in expected)
    assert int((rows["input_ids"] == tok.pad_token_id).sum()) >= rows["input_ids"].numel() - n_tokens
    batch = Batch(**rows)
    assert batch.input_ids.shape == rows["input_ids"].shape and bool(batch.loss_mask.any())


def test_build_rows_errors_and_tokenizer_path(smollm2_dir, write_jsonl):
    path = write_jsonl(RECORDS)
    with pytest.raises(ValueError, match=r":8: malformed JSON"):
        build_rows(smollm2_dir, path, 64)
    rows = build_rows(str(smollm2_dir), RECORDS[:2], 48)
    assert rows["input_ids"].dtype == torch.long and rows["input_ids"].shape[1] == 48
    with pytest.raises(ValueError, match="raise max_length"):
        build_rows(str(smollm2_dir), RECORDS[:2], 16)  # the default system prompt alone fills 16
