"""How templates are run and what is refused: the renderer against transformers' own, a setting the template
cannot apply (--thinking), a template that is not Jinja, tool calls that are not OpenAI's, a template that
drops what a turn holds, a turn that cannot be located, and the answer key's template."""

from __future__ import annotations

import copy
import json

import pytest

from blockdraft.data.chat import configure_template, encode_prompt, render, render_text, use_template
from blockdraft.data.sources import load_conversations, parse_record
from tests.data.templates import TEMPLATES
from tests.data.test_chat_thinking import conversations


@pytest.fixture()
def tok(smollm2_tokenizer):
    return copy.deepcopy(smollm2_tokenizer)


@pytest.fixture()
def process_template():
    """use_template set by a test, and put back to none after it."""
    yield use_template
    use_template(None, None)


def as_server_sends(conv) -> list[dict]:
    """The messages with tool-call arguments parsed into mappings (what transformers is handed here)."""
    out = copy.deepcopy([dict(m) for m in conv])
    for m in out:
        for c in m.get("tool_calls") or []:
            if isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


# blocks on lines of their own (trim_blocks, lstrip_blocks), reasoning read as `thinking` (gpt-oss's name), arguments
# through tojson (a mapping's JSON, not the record's text), a special token, transformers' {% generation %} tag
PROBE = """{{ bos_token }}{% for m in messages %}
  {% if m.thinking %}[{{ m.thinking }}]{% endif %}
{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %} {{ c.function.name }}{{ c.function.arguments | tojson }}
{% endfor %}
{% endfor %}
{% if add_generation_prompt %}assistant:{% endif %}"""


@pytest.mark.parametrize("style", sorted(TEMPLATES) + ["smollm2", "probe"])
@pytest.mark.parametrize("case", ["one turn", "several turns", "tools"])
def test_the_renderer_writes_what_transformers_writes(tok, style, case):
    if style != "smollm2":
        tok.chat_template = PROBE if style == "probe" else TEMPLATES[style]
    conv = parse_record(conversations("harmony")[case])  # arguments as the JSON text records hold
    for gen in (False, True):
        msgs = conv if not gen else conv[:-1]
        want = tok.apply_chat_template(as_server_sends(msgs), tools=conv.tools, tokenize=False,
                                       add_generation_prompt=gen)
        assert render_text(tok, msgs, add_generation_prompt=gen, tools=conv.tools) == want


def test_a_template_may_append_to_its_own_lists_but_stays_sandboxed(tok):
    conv = parse_record(conversations("chatml-think")["tools"])
    before = json.dumps(conv)
    tok.chat_template = ("{% set ns = namespace(ids=[]) %}{% for m in messages %}{% for c in m.tool_calls or [] %}"
                         "{% set _ = ns.ids.append(c.id) %}{% set _ = c.function.update({'name': 'x'}) %}"
                         "{% endfor %}{% endfor %}ids={{ ns.ids | join(',') }}")
    assert render_text(tok, conv) == "ids=call_0"
    assert json.dumps(conv) == before  # the template's edits reach a copy, never the record
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ValueError, match="SecurityError"):
        render_text(tok, conv)


def test_thinking_that_the_template_cannot_apply_is_refused(tok, tmp_path, process_template):
    hi = [{"role": "user", "content": "hi"}]
    assert "enable_thinking" not in tok.chat_template  # SmolLM2's own template has no switch
    process_template(None, "on")
    with pytest.raises(ValueError, match="--thinking on cannot apply: the chat template does not read enable_thinking"):
        encode_prompt(tok, hi)  # regenerate's path
    with pytest.raises(ValueError, match="--thinking on cannot apply"):
        render(tok, hi + [{"role": "assistant", "content": "hello"}])  # train's and extract's path
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="--thinking off cannot apply"):  # refused before any target loads
        process_template(str(plain), "off")
    thinking = tmp_path / "think.jinja"
    thinking.write_text(TEMPLATES["chatml-think"])
    process_template(str(thinking), "off")  # one that reads it: applied
    assert tok.decode(encode_prompt(tok, hi)[0]).endswith("<think>\n\n</think>\n\n")
    process_template(None, None)
    with pytest.raises(ValueError, match="--thinking on cannot apply"):  # the library's per-tokenizer setting
        configure_template(copy.deepcopy(tok), str(plain), "on")


def test_a_template_that_is_not_jinja_is_named_so_not_blamed_on_the_roles(tok, tmp_path, process_template):
    tok.chat_template = "{% for m in messages %}{{ m.content }}"
    with pytest.raises(ValueError, match="not valid Jinja") as e:
        render_text(tok, [{"role": "user", "content": "hi"}])
    assert "role" not in str(e.value)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ messages[0].content }\n")
    with pytest.raises(ValueError, match=r"not valid Jinja \(line 1"):
        process_template(str(bad), None)
    tok.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    with pytest.raises(ValueError, match="check the role order"):  # the template's own complaint about roles
        render_text(tok, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("call, why", [
    ({"id": "c", "type": "function", "name": "weather", "arguments": "{}"}, "no 'function' object"),
    ({"id": "c", "type": "function", "function": {"arguments": "{}"}}, "no 'function' object"),
    ({"id": "c", "type": "function", "function": {"name": "weather", "arguments": "city=Oslo"}}, "not JSON"),
    ({"id": "c", "type": "function", "function": {"name": "weather", "arguments": "[1, 2]"}}, "must be a JSON object"),
])
def test_tool_calls_that_are_not_openai_s_are_refused_naming_the_record(tmp_path, call, why):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": "", "tool_calls": [call]}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=why) as e:
        load_conversations(str(path))
    assert f"{path}:2" in str(e.value) and "tool call 0" in str(e.value)
    ok = copy.deepcopy(bad)
    ok["messages"][1]["tool_calls"] = [{"id": "c", "type": "function",
                                        "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]
    path.write_text(json.dumps(ok) + "\n")
    assert load_conversations(str(path))[0][0][1]["tool_calls"][0]["function"]["name"] == "weather"


def test_a_template_that_drops_what_a_turn_holds_is_refused_and_doctor_fails(tok, tmp_path):
    """SmolLM2's own template writes a tool-call turn as an empty answer and drops reasoning."""
    from blockdraft import doctor
    from blockdraft.target import TargetModel
    from conftest import tiny_causal_lm

    tools = conversations("chatml-think")["tools"]
    for m in tools["messages"]:
        m.pop("reasoning_content", None)
    reasoning = conversations("chatml-think")["one turn"]
    t = TargetModel(tiny_causal_lm("llama", vocab=len(tok)), tok, num_features=3)
    for record, what in ((tools, "tool call"), (reasoning, "reasoning")):
        path = tmp_path / f"{what}.jsonl"
        path.write_text(json.dumps(record) + "\n")
        convs, _ = load_conversations(str(path))
        got = doctor.check_data(t, str(path))
        assert got.status == "FAIL" and f"{path}:1: the chat template leaves out assistant turn" in got.message
        assert f"'s {what}" in got.message
        if what == "reasoning":  # its only turn: nothing would be learned
            with pytest.raises(ValueError, match=f"^{path}:1: the chat template leaves out assistant turn 2's reasoning"):
                render(tok, convs[0])
            continue
        # the tool-call turn (written as an empty answer) carries no loss; the answers after it do
        ex = render(tok, convs[0])
        learned = tok.decode([x for x, k in zip(ex["input_ids"], ex["loss_mask"]) if k])
        assert learned == "Rain, 4 C.<|im_end|>Hi!<|im_end|>"


def test_a_turn_that_cannot_be_located_is_refused_never_half_learned(tok, tmp_path):
    """A history written backwards: no rendering isolates the past answer, nor bounds it, so no mask is guessed."""
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                         "{% if loop.last %}{{ m.content }}{% else %}{{ m.content[::-1] }}{% endif %}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Name a prime."},
                                             {"role": "assistant", "content": "Seven."},
                                             {"role": "user", "content": "Another?"},
                                             {"role": "assistant", "content": "Eleven."}]}) + "\n")
    convs, _ = load_conversations(str(path))
    with pytest.raises(ValueError, match=f"^{path}:1: cannot locate assistant turn 1 .*partial loss mask"):
        render(tok, convs[0])


def test_the_template_keys_the_answers(tmp_path, process_template):
    from blockdraft.data.regenerate import _settings, prompt_key

    prompt = [{"role": "user", "content": "Name a prime."}]
    a, b, a2 = tmp_path / "a.jinja", tmp_path / "b.jinja", tmp_path / "a2.jinja"
    a.write_text(TEMPLATES["chatml-think"])
    a2.write_text(TEMPLATES["chatml-think"])
    b.write_text(TEMPLATES["glm"])
    keys = {}
    for name, path in (("own", None), ("a", a), ("b", b), ("a2", a2)):
        process_template(str(path) if path else None, None)
        keys[name] = prompt_key(prompt, _settings({}))
    assert keys["own"] == prompt_key(prompt)  # the tokenizer's own template keeps earlier releases' keys
    assert len({keys["own"], keys["a"], keys["b"]}) == 3
    assert keys["a"] == keys["a2"]  # the template's text, not its file name


def test_every_command_refuses_thinking_its_template_cannot_apply(tiny_target_dir, chat_data, tmp_path, capsys,
                                                                   process_template):
    """SmolLM2's own template has no enable_thinking: train, regenerate, extract and doctor each stop in one line."""
    from blockdraft.cli import main

    runs = {"train": ["--data", chat_data, "--steps", "1", "--max-rows", "2", "--max-length", "128", "--out",
                      str(tmp_path / "run"), "--no-progress", "--threads", "1"],
            "regenerate": ["--n", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "a.jsonl"), "--no-progress",
                           "--threads", "1"],
            "extract": ["--data", chat_data, "--out", str(tmp_path / "cache"), "--max-length", "128", "--threads", "1"],
            "doctor": ["--data", chat_data, "--show", "1", "--threads", "1"]}
    for cmd, flags in runs.items():
        capsys.readouterr()
        assert main([cmd, "--target", tiny_target_dir, "--thinking", "on", *flags]) == 2, cmd
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after the weights' loading bar
        assert err.startswith(f"blockdraft {cmd}: error: --thinking on cannot apply: the chat template does not "
                              f"read enable_thinking"), (cmd, err)


def test_a_refused_record_is_named_once_by_train_s_loaders(tok, tmp_path):
    """build_rows and a run's rows name the record (file:line) that the loss mask refuses."""
    from blockdraft.data.pipeline import DataOptions, build_rows, conversation_rows

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(conversations("chatml-think")["one turn"]) + "\n")
    want = f"^{path}:2: the chat template leaves out assistant turn 2's reasoning"
    with pytest.raises(ValueError, match=want):
        build_rows(tok, str(path), 64)
    with pytest.raises(ValueError, match=want):
        conversation_rows(tok, DataOptions(data=str(path), eval_fraction=0), 0)


def test_doctor_passes_turns_the_history_hides_and_says_so(tok, tmp_path):
    """An earlier answer whose reasoning the template hides carries no loss by design: not a FAIL."""
    from blockdraft import doctor
    from blockdraft.target import TargetModel
    from conftest import tiny_causal_lm

    tok.chat_template = TEMPLATES["chatml-think"]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "reasoning_content": "Small ones first.", "content": "Seventeen."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "reasoning_content": "Next one.", "content": "Nineteen."}]}) + "\n")
    got = doctor.check_data(TargetModel(tiny_causal_lm("llama", vocab=len(tok)), tok, num_features=3), str(path))
    assert got.status == "PASS" and "(1 earlier turns the template's history shows otherwise carry no loss" in got.message


def test_show_gives_a_refused_record_with_why_and_goes_on(tok, tmp_path):
    from blockdraft.data.show import show

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there."}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(conversations("chatml-think")["one turn"]) + "\n" + json.dumps(good) + "\n")
    out = show(tok, str(path), 2)
    with pytest.raises(ValueError) as refused:  # what train says of the first record
        render(tok, load_conversations(str(path))[0][0])
    assert f"--- record 1 of {path}: train refuses it: {refused.value}\n<|im_start|>system\nBe brief." in out
    assert f"--- record 2 of {path}:" in out and "⟦Hello there.<|im_end|>⟧" in out
