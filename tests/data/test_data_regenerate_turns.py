"""regenerate at length: a cut answer is marked, counted and not kept as whole; the engine's context is
the target's; tool calls the target makes are compared with the data's; a kill loses no finished turn.

A scripted stand-in engine writes known answers (the text a table gives for the last user turn), so each
expectation is written out by hand, not computed by the code under test."""

from __future__ import annotations

import json

import pytest

from blockdraft.data.regenerate import regenerate, turns_path
from blockdraft.target import stop_token_ids


class Scripted:
    """An engine that answers the last user or tool turn of its prompt from `answers` (its tokens, then a stop
    token), at most `max_tokens` of them, as vLLM does; `calls` logs what it was asked."""

    name = "scripted"

    def __init__(self, tok, answers: dict, context=None, fail_after: int | None = None):
        self.tokenizer, self.answers, self.context, self.fail_after = tok, answers, context, fail_after
        self.calls = []

    def check_sampling(self, sampling):
        return None

    def generate(self, prompts, *, max_tokens, stop_token_ids=None, **_):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt  # a kill between two generate calls
        rows = []
        for p, n in zip(prompts, max_tokens):
            text = self.tokenizer.decode(p)
            key = max(self.answers, key=lambda k: text.rfind(f"{k}<|im_end|>"))  # the last turn's
            self.calls.append(key)
            ids = self.tokenizer.encode(self.answers[key], add_special_tokens=False) + [stop_token_ids[0]]
            rows.append((ids[:n], "stop" if len(ids) <= n else "length"))
        return rows


def conv(*turns):
    out = []
    for k, t in enumerate(turns):
        out.append(t if isinstance(t, dict) else {"role": "user" if k % 2 == 0 else "assistant", "content": t})
    return out


def records(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


ANSWERS = {"short": "Yes.", "long": " ".join(["word"] * 40), "again": "Sure, here.", "more": "Done."}


def test_an_answer_cut_at_max_new_tokens_ends_its_conversation_unless_kept(tmp_path, tok):
    convs = [("a", conv("short", "x", "long", "y", "more", "z")), ("b", conv("long", "x")),
             ("c", conv("short", "x", "again"))]
    res = regenerate(Scripted(tok, ANSWERS), convs, tmp_path / "drop.jsonl", max_new_tokens=10, progress=False)
    assert (res["written"], res["cut"]) == (3, 2)
    got = records(tmp_path / "drop.jsonl")
    # a: its second answer is cut: the conversation ends before it (its first answer and the user turn kept)
    assert got["a"]["messages"] == conv("short", "Yes.", "long")
    assert got["a"]["finish"] == ["stop", "length"]
    assert got["a"]["ended"] == {"turn": 1, "why": "cut at --max-new-tokens"}
    assert got["b"]["messages"] == conv("long") and got["b"]["finish"] == ["length"]  # nothing to train on
    assert got["c"]["messages"] == conv("short", "Yes.", "again", "Sure, here.") and "ended" not in got["c"]
    assert got["c"]["finish"] == ["stop", "stop"]

    res = regenerate(Scripted(tok, ANSWERS), convs, tmp_path / "keep.jsonl", max_new_tokens=10, keep_cut=True,
                     progress=False)
    assert res["cut"] == 2
    kept = records(tmp_path / "keep.jsonl")
    cut = tok.decode(tok.encode(ANSWERS["long"], add_special_tokens=False)[:10]).strip()
    assert kept["a"]["messages"] == conv("short", "Yes.", "long", cut, "more", "Done.")
    assert kept["a"]["finish"] == ["stop", "length", "stop"] and "ended" not in kept["a"]


def test_the_context_is_the_targets_and_a_turn_past_it_ends_the_conversation(tmp_path, tok):
    from blockdraft.engines.transformers import TransformersGenerator, context_length
    from blockdraft.target import TargetModel
    from blockdraft.target.tiny import tiny_causal_lm

    model = tiny_causal_lm("llama", vocab=len(tok), layers=2, max_positions=96)
    target = TargetModel(model, tok, [0], name="tiny")
    assert TransformersGenerator(target).context == 96  # the config's max_position_embeddings
    assert TransformersGenerator(target, max_length=40).context == 40
    with pytest.raises(ValueError, match=r"--max-length 97 is longer than the target's context \(96"):
        context_length(model.config, 97)

    prompt = conv("short")
    n = len(tok.apply_chat_template(prompt, add_generation_prompt=True))
    # room for 2 answer tokens: "Yes." and its stop do not fit (cut by the context); no room at all
    res = regenerate(Scripted(tok, ANSWERS, context=n + 2), [("a", prompt)], tmp_path / "a.jsonl",
                     max_new_tokens=50, progress=False)
    assert (res["over_context"], res["cut"]) == (1, 0)
    assert records(tmp_path / "a.jsonl")["a"]["finish"] == ["context"]
    engine = Scripted(tok, ANSWERS, context=n)
    res = regenerate(engine, [("a", prompt)], tmp_path / "b.jsonl", max_new_tokens=50, progress=False)
    assert res["over_context"] == 1 and engine.calls == []  # never sent to the engine


def call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def scripted_parser(text, tools):
    """A stand-in for vLLM's parsers (tests/reference hold vLLM's own): 'CALL name {json}' is a call."""
    if text.startswith("CALL "):
        name, args = text[5:].split(" ", 1)
        return {"role": "assistant", "content": "", "tool_calls": [call(name, **json.loads(args))]}
    return {"role": "assistant", "content": text, "tool_calls": []}


@pytest.mark.parametrize("target_says,kept", [('CALL weather {"city": "Oslo"}', True),
                                              ('CALL weather {"city": "Rome"}', False),
                                              ("It is sunny.", False)])
def test_where_the_targets_tool_call_differs_from_the_data_the_conversation_ends_there(tmp_path, tok,
                                                                                        target_says, kept):
    data = [{"role": "user", "content": "weather"},
            {"role": "assistant", "content": "", "tool_calls": [{**call("weather", city="Oslo"), "id": "d1"}]},
            {"role": "tool", "content": "sunny, 20 C"}, {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "old"}]
    answers = {"weather": target_says, "sunny, 20 C": "It is sunny.", "more": "Done."}
    res = regenerate(Scripted(tok, answers), [("t", data)], tmp_path / "a.jsonl", max_new_tokens=40,
                     parse=scripted_parser, progress=False)
    got = records(tmp_path / "a.jsonl")["t"]
    first = scripted_parser(target_says, None)
    if not first["tool_calls"]:
        del first["tool_calls"]
    else:  # the data's id where the calls are the data's (its tool turn names it), else one of the prompt's
        first["tool_calls"][0]["id"] = "d1" if kept else f"call-{got['hash'][:8]}-0-0"
    if kept:  # the same call: the data's tool result follows it, and the conversation goes on
        assert res["tool_calls_differ"] == 0 and "ended" not in got
        assert [m["role"] for m in got["messages"]] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
        assert got["messages"][1] == first and got["messages"][-1]["content"] == "Done."
    else:  # another call, or none: the target's turn is the last; the tool result it did not ask for is gone
        assert res["tool_calls_differ"] == 1 and got["ended"] == {"turn": 0, "why": "tool calls differ"}
        assert got["messages"] == [data[0], first]


def test_a_kill_keeps_every_finished_turn_and_the_rerun_writes_what_one_run_does(tmp_path, tok):
    convs = [(k, conv(*[w for t in turns for w in (t, "-")])) for k, turns in
             enumerate([["short", "again", "more"], ["again", "short"], ["more"], ["short", "more"]])]
    whole = tmp_path / "whole.jsonl"
    regenerate(Scripted(tok, ANSWERS), convs, whole, max_new_tokens=20, batch_size=2, progress=False)

    out = tmp_path / "killed.jsonl"
    # killed at its 4th generate call: turn 0 of all four written, turn 1 of conversations 0 and 1
    with pytest.raises(KeyboardInterrupt):
        regenerate(Scripted(tok, ANSWERS, fail_after=5), convs, out, max_new_tokens=20, batch_size=2,
                   progress=False)
    journal = [json.loads(ln) for ln in turns_path(out).read_text().splitlines()]
    assert len(journal) == 6 and records(out).keys() == {1, 2}  # 6 turns kept; two conversations whole
    with open(turns_path(out), "a") as f:
        f.write('{"hash": "torn')  # a kill inside a journal line
    again = Scripted(tok, ANSWERS)
    res = regenerate(again, convs, out, max_new_tokens=20, batch_size=2, progress=False)
    assert len(again.calls) == 8 - 6 and res["written"] == 2  # only the turns not yet finished
    assert records(out) == records(whole) and not turns_path(out).exists()


def _refused(capsys, argv) -> str:
    from blockdraft.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and "error:" in err[-1], err
    return err[-1]


def test_a_conversations_file_is_never_taken_for_regenerates_own_answers(tmp_path, tok, tiny_target_dir, capsys,
                                                                         monkeypatch):
    """The probe: --prompts conv.jsonl --out conv.jsonl appended answers to the user's file; a file of
    conversations (role/content messages, none of regenerate's fields) as --out or as --bundle is refused,
    byte for byte unchanged."""
    convs = tmp_path / "conv.jsonl"
    convs.write_text("".join(json.dumps({"messages": conv(f"Count to {k}.", "1 2 3")}) + "\n" for k in range(20)))
    before = convs.read_bytes()
    base = ["regenerate", "--target", tiny_target_dir, "--threads", "1", "--no-progress", "--max-new-tokens", "2"]
    line = _refused(capsys, base + ["--prompts", str(convs), "--out", str(convs)])
    assert "--out" in line and "is also --prompts" in line
    other = tmp_path / "other.jsonl"
    other.write_bytes(before)
    line = _refused(capsys, base + ["--prompts", str(convs), "--out", str(other), "--n", "2"])
    assert "not an answers file" in line
    line = _refused(capsys, base + ["--prompts", str(convs), "--out", str(tmp_path / "a.jsonl"), "--bundle",
                                    str(tmp_path / "a.jsonl")])
    assert "--bundle" in line and "is also --out" in line
    assert convs.read_bytes() == before and other.read_bytes() == before and not (tmp_path / "a.jsonl").exists()

    from blockdraft.cli import main

    assert main(base + ["--prompts", str(convs), "--out", str(tmp_path / "b.jsonl"), "--n", "2"]) == 0
    out = capsys.readouterr()
    assert "cut at --max-new-tokens 2: 2;" in out.out  # two cut answers, counted and said
    assert "note:" not in out.err  # the CPU default is named only where it was the one that cut
    assert len(records(tmp_path / "b.jsonl")) == 2
    monkeypatch.setattr("blockdraft.cli.commands._has_gpu", lambda: False)
    monkeypatch.setattr("blockdraft.cli.commands.CPU_NEW_TOKENS", 3)  # the default's logic, at a test's length
    assert main(base[:-2] + ["--prompts", str(convs), "--out", str(tmp_path / "c.jsonl"), "--n", "1"]) == 0
    err = capsys.readouterr().err
    assert "note: 1 answers were cut at 3 tokens, the default without a GPU" in err, err


def test_a_parser_without_vllm_is_refused_in_one_line_before_any_work(tmp_path, tiny_target_dir, capsys,
                                                                      monkeypatch):
    import builtins

    real = builtins.__import__

    def no_vllm(name, *a, **k):  # vLLM's own package, not a relative import of blockdraft's engines.vllm
        level = a[3] if len(a) > 3 else k.get("level", 0)
        if level == 0 and (name == "vllm" or name.startswith("vllm.")):
            raise ImportError("No module named 'vllm'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    line = _refused(capsys, ["regenerate", "--target", tiny_target_dir, "--out", str(tmp_path / "a.jsonl"),
                             "--tool-call-parser", "hermes"])
    assert "--tool-call-parser" in line and "[vllm]" in line
    assert not (tmp_path / "a.jsonl").exists()


def test_without_a_reasoning_parser_the_templates_markers_split_a_parsed_turn(tmp_path, tok):
    import copy

    from tests.data.templates import TEMPLATES

    t = copy.deepcopy(tok)
    t.chat_template = TEMPLATES["chatml-think"]
    data = conv("weather", "old")
    answers = {"weather": "<think>\nLook it up.\n</think>\n\nCALL weather {\"city\": \"Oslo\"}"}

    def tool_parser_only(text, tools):  # the calls after the reasoning, the rest left as content
        head, _, tail = text.partition("CALL ")
        m = scripted_parser("CALL " + tail, tools) if tail else scripted_parser(text, tools)
        return {**m, "content": head.strip()}

    regenerate(Scripted(t, answers), [("t", data)], tmp_path / "a.jsonl", max_new_tokens=40,
               parse=tool_parser_only, progress=False)
    got = records(tmp_path / "a.jsonl")["t"]["messages"][1]
    assert got["reasoning_content"] == "Look it up." and got["content"] == ""
    assert [c["function"]["name"] for c in got["tool_calls"]] == ["weather"]


def test_vllms_engine_gets_the_targets_context_and_each_prompt_its_own_room(tiny_target_dir):
    """No engine starts: the options VllmGenerator would start vLLM with, and the SamplingParams its
    generate hands vLLM (a recording stand-in for the LLM)."""
    from types import SimpleNamespace

    from blockdraft.engines.vllm.job import Generator
    from blockdraft.engines.vllm.runner import VllmRunner

    gen = VllmRunner().generator(tiny_target_dir)
    assert gen.context == 1024 and gen.options["max_model_len"] == 1024  # the config's, not vLLM's old 2048
    gen = VllmRunner().generator(tiny_target_dir, max_length=300)
    assert gen.context == 300 and gen.options["max_model_len"] == 300
    with pytest.raises(ValueError, match="--max-length 2000 is longer than the target's context"):
        VllmRunner().generator(tiny_target_dir, max_length=2000)

    seen = []
    engine = Generator.__new__(Generator)
    engine._params = lambda **kw: kw

    def generate(prompts, params, use_tqdm):
        seen.append(params)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7], finish_reason="stop")]) for _ in prompts]

    engine.llm = SimpleNamespace(generate=generate)
    assert engine.generate([[1], [2, 3]], max_tokens=[5, 9], stop_token_ids=[0]) == [([7], "stop")] * 2
    assert [(p["max_tokens"], p["seed"]) for p in seen[0]] == [(5, None), (9, None)]
    engine.generate([[1], [2]], max_tokens=[4, 6], seeds=[11, 12], temperature=0.5)
    assert [(p["max_tokens"], p["seed"], p["temperature"]) for p in seen[1]] == [(4, 11, 0.5), (6, 12, 0.5)]
