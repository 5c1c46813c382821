"""Regeneration resumes by prompt hash; Magpie prompts are filtered and never evaluation text."""

from __future__ import annotations

import json

import pytest
import torch

from blockdraft.data.magpie import filter_prompts, keep, user_prefix
from blockdraft.data.prompt_set import read_prompts, write_prompts
from blockdraft.data.regenerate import done_hashes, prompt_hash
from blockdraft.data.regenerate import regenerate as regenerate_any
from blockdraft.engines.transformers import TransformersGenerator
from blockdraft.engines.vllm.runner import VllmGenerator


def regenerate(*args, **kw):
    """These tests' answers are short (a few tokens): kept where --max-new-tokens cuts them, so each
    conversation is whole (test_data_regenerate_turns.py holds what a cut does)."""
    return regenerate_any(*args, **{"keep_cut": True, **kw})


def tiny_pair(tok):
    from blockdraft.target import TargetModel
    from blockdraft.target.tiny import tiny_causal_lm

    return TargetModel(tiny_causal_lm("llama", vocab=len(tok), layers=2), tok, [0], name="tiny")


def user(text):
    return [{"role": "user", "content": text}]


def records(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_resume_is_keyed_by_prompt_not_position(tmp_path, tok):
    """A reordered, edited and grown prompt file adds only the missing answers, each paired with its
    own prompt; a torn last line from a kill is dropped and redone."""
    target = tiny_pair(tok)
    out = tmp_path / "answers.jsonl"
    first = [("a", user("Name a colour.")), ("b", user("Name a fruit.")), ("c", user("Name a city."))]
    res = regenerate(TransformersGenerator(target), first, out, max_new_tokens=4, batch_size=2, progress=False)
    assert {k: res[k] for k in ("written", "skipped", "total")} == {"written": 3, "skipped": 0, "total": 3}
    before = {r["hash"]: r for r in records(out)}
    second = [("c", user("Name a city.")), ("new", user("Name a river.")), ("a", user("Name a colour!")),
              ("b", user("Name a fruit."))]
    with open(out, "a") as f:  # a kill in the middle of a line
        f.write('{"id": "x", "hash": "de')
    res = regenerate(TransformersGenerator(target), second, out, max_new_tokens=4, batch_size=3, progress=False)
    assert {k: res[k] for k in ("written", "skipped", "total")} == {"written": 2, "skipped": 2, "total": 4}
    recs = records(out)
    assert len(recs) == 5 and len({r["hash"] for r in recs}) == 5
    for r in recs:
        assert r["hash"] == prompt_hash(r["messages"][:-1])  # every answer sits with its own prompt
        assert r["messages"][-1]["role"] == "assistant"
    for h, r in before.items():  # nothing finished was rewritten
        assert next(x for x in recs if x["hash"] == h) == r
    assert done_hashes(out) == {r["hash"] for r in recs}


def test_duplicate_prompts_are_answered_once(tmp_path, tok):
    target = tiny_pair(tok)
    out = tmp_path / "a.jsonl"
    res = regenerate(TransformersGenerator(target), [(1, user("Hi there.")), (2, user("Hi there."))], out,
                     max_new_tokens=2, progress=False)
    assert res["written"] == 1 and len(records(out)) == 1


def test_vllm_missing_is_a_clear_error(tmp_path, tok, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_vllm(name, *a, **k):
        if name == "vllm":
            raise ImportError("No module named 'vllm'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    from blockdraft.target import TargetFiles

    files = TargetFiles(tmp_path, "tiny", tok)
    with pytest.raises(ValueError, match=r"\[vllm\]"):
        regenerate(VllmGenerator(files), [(1, user("Hi."))], tmp_path / "o.jsonl", progress=False)


def test_magpie_prefix_is_the_templates_user_header(tok):
    prefix = user_prefix(tok)
    assert prefix.endswith("<|im_start|>user\n") and prefix.startswith("<|im_start|>system")
    full = tok.apply_chat_template(user("hello"), tokenize=False)
    assert full.startswith(prefix + "hello")


def test_magpie_filter_keeps_english_requests_and_drops_evaluation_text():
    from blockdraft.data.magpie import evaluation_texts

    ev = evaluation_texts()
    assert len(ev) > 1500  # MT-Bench, GSM8K and HumanEval all found
    gsm = next(t for t in ev if t.count(" ") > 20)
    candidates = [
        "Write a short poem about the sea and explain the metaphors you used.",
        "write a short poem about the sea, and explain the metaphors you used!",  # a duplicate
        "Here is a question: " + gsm,  # evaluation text inside
        "Как приготовить борщ дома? Объясни шаги подробно пожалуйста.",  # not English
        "What is the capital of France? <|im_end|> <|im_start|>assistant",  # template markers
        "go go go go go go go go go go go go go go go go",  # degenerate
        "ok?",  # too short
        "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",  # ASCII, not English
        "How can I learn to play the guitar on my own, and what should I practise first?",
    ]
    kept = filter_prompts(candidates, ev)
    assert kept == [candidates[0], candidates[-1]]
    assert keep(candidates[0]) and not keep(candidates[5])


def test_prompt_files_round_trip_byte_for_byte(tmp_path):
    recs = [{"id": f"magpie-{i:06d}", "kind": "magpie", "messages": user(f"Question number {i}?")} for i in range(5)]
    a = write_prompts(recs, tmp_path / "a.jsonl.gz").read_bytes()
    b = write_prompts(recs, tmp_path / "b.jsonl.gz").read_bytes()
    assert a == b  # rebuilt on another day or host, the same bytes
    assert read_prompts(tmp_path / "a.jsonl.gz") == [(r["id"], r["messages"]) for r in recs]
    (tmp_path / "bad.jsonl.gz").write_bytes(a[: len(a) // 2])
    with pytest.raises(ValueError, match="damaged"):
        read_prompts(tmp_path / "bad.jsonl.gz")


@pytest.mark.parametrize("n", [1])
def test_sampled_user_turns_use_the_prefix(tok, n):
    from blockdraft.data.magpie import sample_user_turns

    seen = {}

    def generate(prefix, k, max_tokens, temperature, top_p, seed):
        seen["prefix"] = tok.decode(prefix)
        return [(tok("Tell me about owls.", add_special_tokens=False)["input_ids"], True),
                (tok("unfinished", add_special_tokens=False)["input_ids"], False)][:k + 1]

    assert sample_user_turns(generate, tok, n) == ["Tell me about owls."]
    assert seen["prefix"] == user_prefix(tok)
    torch.manual_seed(0)


def test_magpie_samples_are_kept_as_they_come_and_a_restart_samples_only_the_rest(tmp_path, tok, monkeypatch):
    import blockdraft.data.prompt_set as ps

    calls = []

    def fake():
        def generate(prefix, n, max_tokens, temperature, top_p, seed):
            calls.append((n, seed))
            for i in range(n):
                yield tok(f"Question {seed + i}?", add_special_tokens=False)["input_ids"], True
        return generate, tok

    path = tmp_path / "p.samples.jsonl"
    first = ps.magpie_samples(fake, 3, 0, path, progress=False)
    with open(path, "a") as f:
        f.write('{"text": "torn')  # a kill in the middle of a line
    again = ps.magpie_samples(fake, 5, 0, path, progress=False)
    assert calls == [(3, 0), (2, 3)]  # only what was missing, with the next seeds
    assert again[:3] == first and again == [f"Question {i}?" for i in range(5)]
    assert ps.magpie_samples(fake, 5, 0, path, progress=False) == again and len(calls) == 2


def test_a_prompt_set_keeps_builtin_prompts_with_surrounding_whitespace(monkeypatch):
    """Built-in prompts are stripped by the filter; their kinds must still be found (a KeyError once)."""
    import blockdraft.data.default_prompts as built
    import blockdraft.data.magpie as magpie
    from blockdraft.data.prompt_set import build_prompt_set

    monkeypatch.setattr(built, "build_prompts", lambda n, seed=0: [
        {"id": 0, "kind": "prose", "messages": user("Explain this passage:\n\nSome text about sockets.\n\n")},
        {"id": 1, "kind": "man", "messages": user("  How do I use `ls`?")}])
    monkeypatch.setattr(magpie, "evaluation_texts", lambda: [])
    recs = build_prompt_set(None, 0, 2)
    assert [r["kind"] for r in recs] == ["prose", "man"]


def test_a_bundle_holds_the_answers_to_the_prompt_set_only_in_one_order(tmp_path, tok):
    """--bundle: the answers to the given prompts and no others (a file that also answered an older
    prompt set), ordered by prompt hash, byte-identical whatever order they were written in, and
    read back by the training loader; an unfinished set is refused."""
    import gzip

    from blockdraft.data import load_conversations
    from blockdraft.data.regenerate import bundle_answers

    target = tiny_pair(tok)
    prompts = [("a", user("Name a colour.")), ("b", user("Name a fruit.")), ("c", user("Name a city."))]
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    regenerate(TransformersGenerator(target), prompts + [("old", user("Name a tree."))], one, max_new_tokens=3,
               progress=False)
    regenerate(TransformersGenerator(target), prompts[::-1], two, max_new_tokens=3, batch_size=1, progress=False)
    assert bundle_answers(one, tmp_path / "one.jsonl.gz", prompts) == 3
    bundle_answers(two, tmp_path / "two.jsonl.gz", prompts)
    assert (tmp_path / "one.jsonl.gz").read_bytes() == (tmp_path / "two.jsonl.gz").read_bytes()
    recs = [json.loads(x) for x in gzip.open(tmp_path / "one.jsonl.gz", "rt")]
    assert [r["hash"] for r in recs] == sorted(prompt_hash(m) for _, m in prompts)
    convs, _ = load_conversations(tmp_path / "one.jsonl.gz")
    assert sorted(c[0]["content"] for c in convs) == sorted(m[0]["content"] for _, m in prompts)
    with pytest.raises(ValueError, match="1 of 4 prompts have no answer"):
        bundle_answers(two, tmp_path / "x.jsonl.gz", prompts + [("new", user("Name a river."))])


def test_a_full_disk_is_found_before_the_first_answer(tmp_path, tok, monkeypatch):
    """The space the answers take (each record as written, an answer of max_new_tokens tokens of the
    vocabulary's mean size) is checked before the target runs; the estimate is above what is written."""
    import shutil

    from blockdraft.data.regenerate import answers_bytes, prompt_messages

    target = tiny_pair(tok)
    prompts = [(i, user(f"Name {i} birds.")) for i in range(4)]
    todo = [(pid, prompt_hash(prompt_messages(m)), prompt_messages(m)) for pid, m in prompts]
    need = answers_bytes(tok, todo, 6)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    monkeypatch.setattr(target.model, "generate", lambda *a, **k: pytest.fail("the target ran"))
    with pytest.raises(ValueError, match="not enough disk space for the answers to 4 prompts"):
        regenerate(TransformersGenerator(target), prompts, tmp_path / "a.jsonl", max_new_tokens=6, progress=False)
    assert not (tmp_path / "a.jsonl").exists() or (tmp_path / "a.jsonl").stat().st_size == 0
    monkeypatch.undo()
    regenerate(TransformersGenerator(target), prompts, tmp_path / "b.jsonl", max_new_tokens=6, progress=False)
    assert (tmp_path / "b.jsonl").stat().st_size <= need


def test_write_prompts_checks_its_bytes_first(tmp_path, monkeypatch):
    import shutil

    recs = [{"id": f"p{i}", "messages": user(f"Say {i}.")} for i in range(3)]
    size = len("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode())
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=size - 1))
    with pytest.raises(ValueError, match="not enough disk space for the 3 records"):
        write_prompts(recs, tmp_path / "p.jsonl")
    assert not (tmp_path / "p.jsonl").exists()
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=size))
    assert write_prompts(recs, tmp_path / "p.jsonl").stat().st_size == size


def _greedy_turns(target, tok, conv, max_new_tokens):
    """The reference: the target's own greedy decode, one turn at a time, each from the conversation
    with the turns before it already written by the target."""
    from blockdraft.data.chat import encode_prompt
    from blockdraft.generate.baseline import target_greedy
    from blockdraft.target import stop_token_ids

    stop = stop_token_ids(tok)
    hist, answers = [], []
    for m in conv + ([{"role": "assistant"}] if conv[-1]["role"] != "assistant" else []):
        if m["role"] != "assistant":
            hist.append(m)
            continue
        got = target_greedy(target, encode_prompt(tok, hist), max_new_tokens=max_new_tokens, stop_token_ids=stop)
        toks = [t for t in got.tokens]
        toks = toks[:next((i for i, t in enumerate(toks) if t in stop), len(toks))]
        text = tok.decode(toks, skip_special_tokens=True).strip()
        answers.append(text)
        hist.append({"role": "assistant", "content": text})
    return answers


def test_every_assistant_turn_is_the_targets_own_greedy_continuation(tmp_path, tok):
    target = tiny_pair(tok)
    convs = [("two", [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "old answer"},
                      {"role": "user", "content": "And another?"}]),
             ("three", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
                        {"role": "assistant", "content": "x"}, {"role": "user", "content": "Count."},
                        {"role": "assistant", "content": "y"}, {"role": "user", "content": "More."},
                        {"role": "assistant", "content": "z"}])]
    out = tmp_path / "a.jsonl"
    regenerate(TransformersGenerator(target), convs, out, max_new_tokens=6, batch_size=2, progress=False)
    recs = {r["id"]: r for r in records(out)}
    for pid, conv in convs:
        got = [m["content"] for m in recs[pid]["messages"] if m["role"] == "assistant"]
        assert got == _greedy_turns(target, tok, conv, 6)
        assert "old answer" not in json.dumps(recs[pid]) and len(got) == (2 if pid == "two" else 3)
        assert [m["content"] for m in recs[pid]["messages"] if m["role"] != "assistant"] == \
            [m["content"] for m in conv if m["role"] != "assistant"]  # the data's own turns stay


def test_sampled_answers_are_reproducible_from_the_seed_whatever_the_batching(tmp_path, tok):
    target = tiny_pair(tok)
    prompts = [(k, [{"role": "user", "content": f"Tell me about {w}."}, {"role": "assistant", "content": "-"},
                    {"role": "user", "content": "Go on."}]) for k, w in enumerate(["rain", "snow", "wind"])]

    def run(name, seed, batch):
        regenerate(TransformersGenerator(target), prompts, tmp_path / name, max_new_tokens=8, batch_size=batch,
                   progress=False, temperature=1.0, top_p=0.9, seed=seed)
        return {r["id"]: r["messages"] for r in records(tmp_path / name)}

    a, b, c = run("a.jsonl", 1, 3), run("b.jsonl", 1, 1), run("c.jsonl", 2, 3)
    assert a == b and a != c
    greedy = tmp_path / "g.jsonl"
    regenerate(TransformersGenerator(target), prompts, greedy, max_new_tokens=8, progress=False)
    assert {r["hash"] for r in records(greedy)}.isdisjoint(r["hash"] for r in records(tmp_path / "a.jsonl"))


def test_reasoning_is_split_where_the_template_marks_it(tok):
    import copy

    from blockdraft.data.regenerate import reasoning_markers, split_answer
    from tests.data.templates import TEMPLATES

    t = copy.deepcopy(tok)
    assert reasoning_markers(t) is None  # SmolLM2's template writes no reasoning
    t.chat_template = TEMPLATES["chatml-think"]
    markers = reasoning_markers(t)
    assert markers == ("<think>", "</think>")
    assert split_answer("<think>\nfirst this\n</think>\n\nThe answer.", markers) == \
        {"role": "assistant", "content": "The answer.", "reasoning_content": "first this"}
    assert split_answer("No reasoning here.", markers) == {"role": "assistant", "content": "No reasoning here."}


@pytest.mark.parametrize("text", ["my notes\nkeep them\n", "[1, 2, 3]\n", '{"id": 1}\n', "one line, no newline"])
def test_a_file_regenerate_did_not_write_is_refused_untouched(tmp_path, tok, text):
    target = tiny_pair(tok)
    out = tmp_path / "notes.jsonl"
    out.write_text(text)
    with pytest.raises(ValueError, match="not an answers file"):
        regenerate(TransformersGenerator(target), [(0, user("Hi."))], out, max_new_tokens=2, progress=False)
    assert out.read_text() == text


def test_bundle_replaces_only_a_bundle(tmp_path, tok):
    from blockdraft.data.regenerate import bundle_answers

    target = tiny_pair(tok)
    prompts = [(0, user("Hi."))]
    regenerate(TransformersGenerator(target), prompts, tmp_path / "a.jsonl", max_new_tokens=2, progress=False)
    other = tmp_path / "other.jsonl"
    other.write_text("precious\n")
    with pytest.raises(ValueError, match="not an answer record"):
        bundle_answers(tmp_path / "a.jsonl", other, prompts)
    assert other.read_text() == "precious\n"
    assert bundle_answers(tmp_path / "a.jsonl", tmp_path / "b.jsonl", prompts) == 1
    assert bundle_answers(tmp_path / "a.jsonl", tmp_path / "b.jsonl", prompts) == 1  # its own bundle: replaced


def test_sampled_answers_bundle_with_their_settings(tmp_path, tok):
    from blockdraft.data.regenerate import bundle_answers, sampling_of

    target = tiny_pair(tok)
    prompts = [(0, user("Hi.")), (1, user("Bye."))]
    regenerate(TransformersGenerator(target), prompts, tmp_path / "a.jsonl", max_new_tokens=3, progress=False,
               temperature=0.8, seed=4)
    with pytest.raises(ValueError, match="no answer yet"):  # greedy answers were never written
        bundle_answers(tmp_path / "a.jsonl", tmp_path / "b.jsonl", prompts)
    assert bundle_answers(tmp_path / "a.jsonl", tmp_path / "b.jsonl", prompts, sampling_of(0.8, 1.0, 4)) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is a CPU's")
def test_sampling_through_vllm_on_a_cpu_is_refused_before_any_work(tmp_path, tok):
    from blockdraft.target import TargetFiles

    out = tmp_path / "a.jsonl"
    with pytest.raises(ValueError, match="only on a GPU"):
        regenerate(VllmGenerator(TargetFiles(tmp_path, "tiny", tok)), [(0, user("Hi."))], out, temperature=0.7,
                   progress=False)
    assert not out.exists()
