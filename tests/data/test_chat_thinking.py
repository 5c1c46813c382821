"""Reasoning, tool calls and every assistant turn, rendered by the target's chat template: the loss covers
exactly what the target writes, for templates in the styles of four thinking, tool-calling targets
(tests/data/templates.py: each with a reference renderer written apart from the template)."""

from __future__ import annotations

import copy
import json

import pytest

from blockdraft.data.chat import configure_template, encode_prompt, render, render_text
from blockdraft.data.sources import Conversation, parse_record
from tests.data.templates import REFERENCE, TEMPLATES

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def conversations(style: str) -> dict:
    args = {"city": "Oslo"} if style in ("glm", "chatml-think") else json.dumps({"city": "Oslo"})
    call = {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": args}}
    return {
        "one turn": {"messages": [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "What is 2+2?"},
                                  {"role": "assistant", "reasoning_content": "Two and two make four.",
                                   "content": "4"}]},
        "several turns": {"messages": [{"role": "user", "content": "Name a prime."},
                                       {"role": "assistant", "reasoning": "Small ones first.", "content": "2"},
                                       {"role": "user", "content": "Another?"},
                                       {"role": "assistant", "thinking": "Next after 2.", "content": "3"}]},
        "tools": {"tools": TOOLS,
                  "messages": [{"role": "user", "content": "Weather in Oslo, then say hi."},
                               {"role": "assistant", "reasoning_content": "I need the tool.", "content": "",
                                "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": "call_0", "name": "weather", "content": "rain, 4 C"},
                               {"role": "assistant", "reasoning_content": "Report it.", "content": "Rain, 4 C."},
                               {"role": "user", "content": "Thanks!"},
                               {"role": "assistant", "reasoning_content": "Be kind.", "content": "Hi!"}]},
    }


def expected_mask(offsets, spans) -> list[int]:
    """A token is learned when one of its characters lies in a span the target writes."""
    out = []
    for a, b in offsets:
        b = max(b, a + 1)
        out.append(int(any(a < e and b > s for s, e in spans)))
    return out


@pytest.fixture()
def tok(smollm2_tokenizer):
    return copy.deepcopy(smollm2_tokenizer)


@pytest.mark.parametrize("style", sorted(TEMPLATES))
@pytest.mark.parametrize("case", ["one turn", "several turns", "tools"])
def test_the_loss_covers_exactly_what_the_target_writes(tok, style, case):
    tok.chat_template = TEMPLATES[style]
    conv = parse_record(conversations(style)[case])
    ref = REFERENCE[style](conv, conv.tools)
    assert render_text(tok, conv) == ref.text  # the reference renders what the template renders
    got = render(tok, conv)
    enc = tok(ref.text, add_special_tokens=False, return_offsets_mapping=True)
    assert got["input_ids"] == enc["input_ids"]
    want = expected_mask(enc["offset_mapping"], ref.spans)
    assert got["loss_mask"] == want, [tok.decode([t]) for t, a, b in zip(got["input_ids"], got["loss_mask"], want)
                                      if a != b]
    learned = tok.decode([t for t, m in zip(got["input_ids"], got["loss_mask"]) if m])
    assert "Weather in Oslo" not in learned and "rain, 4 C" not in learned  # user text and tool results never


def test_reasoning_and_tool_calls_are_learned_and_earlier_reasoning_follows_the_template(tok):
    tok.chat_template = TEMPLATES["chatml-think"]
    conv = parse_record(conversations("chatml-think")["tools"])
    loop = Conversation(conv[:4], conv.tools)  # a tool loop after the last user turn: each turn as it was written
    got = render(tok, loop)
    learned = tok.decode([t for t, m in zip(got["input_ids"], got["loss_mask"]) if m])
    assert "I need the tool." in learned and "<tool_call>" in learned and '"city": "Oslo"' in learned
    assert "Report it." in learned
    got = render(tok, conv)  # a later user turn: the template hides the earlier reasoning, so those turns carry no loss
    learned = tok.decode([t for t, m in zip(got["input_ids"], got["loss_mask"]) if m])
    assert "I need the tool." not in tok.decode(got["input_ids"]) and "<tool_call>" not in learned
    assert "Be kind." in learned and "Rain, 4 C." not in learned


def test_records_keep_reasoning_tool_calls_and_tools():
    conv = parse_record(conversations("kimi")["tools"])
    assert isinstance(conv, Conversation) and conv.tools == TOOLS
    assert conv[1]["reasoning_content"] == "I need the tool." and conv[1]["tool_calls"][0]["id"] == "call_0"
    assert conv[2]["tool_call_id"] == "call_0" and conv[2]["name"] == "weather"
    spelled = parse_record(conversations("glm")["several turns"])
    assert [m.get("reasoning_content") for m in spelled] == [None, "Small ones first.", None, "Next after 2."]


def test_thinking_off_and_a_template_file_change_what_is_rendered(tok, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATES["chatml-think"])
    configure_template(tok, str(path), "off")
    prompt = tok.decode(encode_prompt(tok, [{"role": "user", "content": "hi"}])[0])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    configure_template(tok, None, "on")
    assert tok.decode(encode_prompt(tok, [{"role": "user", "content": "hi"}])[0]).endswith("assistant\n")
    with pytest.raises(ValueError, match="no such file"):
        configure_template(tok, str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="on or off"):
        configure_template(tok, None, "maybe")


def test_show_marks_what_trains_and_where_reasoning_tool_calls_and_results_are(tok, tmp_path):
    from blockdraft.data.show import show

    tok.chat_template = TEMPLATES["chatml-think"]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(conversations("chatml-think")["tools"]) + "\n")
    out = show(tok, str(path), 1)
    # the first answer: its reasoning hidden by the later user turn, so not learned as shown; its call marked
    assert "<|im_start|>assistant\n\n<tool_call>\n{\"name\": \"⟨tool call⟩weather⟨/tool call⟩\"" in out
    assert "⟨tool result⟩rain, 4 C⟨/tool result⟩" in out and "⟦<|im_start|>user" not in out
    assert "⟨reasoning⟩Be kind.⟨/reasoning⟩" in out and "I need the tool." not in out
    head = out.splitlines()[1]
    assert "tool result 5 tokens (0 learned)" in head and "reasoning" in head
    # the turns whose reasoning the history hides are named, as is why (turns 1 and 3 of the record)
    said = [line.strip() for line in out.splitlines()[2:4]]
    assert [line.split(":")[0] for line in said] == ["message 1 carries no loss", "message 3 carries no loss"]
    assert all("history shows it otherwise" in line for line in said)
    learned = "".join(part.split("⟧")[0] for part in out.split("⟦")[1:])
    assert "Weather in Oslo" not in learned and "rain, 4 C" not in learned
