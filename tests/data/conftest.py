"""Fixtures for the data-layer tests: the real SmolLM2 tokenizer and file writers."""

from __future__ import annotations

import copy
import json

import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    from blockdraft.target import resolve_target

    path, _ = resolve_target("smollm2")  # converts the embedded GGUF on first use (~20 s)
    return path


@pytest.fixture(scope="session")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def plain_tok(tok):
    """The same tokenizer without a chat template (exercises the fallback)."""
    t = copy.deepcopy(tok)
    t.chat_template = None
    return t


@pytest.fixture
def write_jsonl(tmp_path):
    """write_jsonl(lines, name) -> path; dict items are JSON-encoded, str items written raw."""

    def write(lines, name="data.jsonl"):
        path = tmp_path / name
        text = "".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines)
        path.write_text(text, encoding="utf-8")
        return path

    return write
