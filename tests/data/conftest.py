"""Fixtures for the data-layer tests: the real SmolLM2 tokenizer and file writers."""

from __future__ import annotations

import copy
import json

import pytest


@pytest.fixture(scope="session")
def tok(smollm2_tokenizer):
    """The real SmolLM2 tokenizer (fixture of tests/conftest.py)."""
    return smollm2_tokenizer


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
