"""render: chat-template tokens and the assistant-only loss mask, against hand-built ChatML.

The reference writes SmolLM2's ChatML by hand, segment by segment, and tokenises each
segment on its own: header + content + "<|im_end|>" + "\\n" per turn, with the assistant
segments `content + "<|im_end|>"` marked 1 and everything else (headers, the newline after
"<|im_end|>", system/user turns, the injected default system prompt) marked 0.
"""

from __future__ import annotations

import copy
import warnings

import pytest

from blockdraft.data import load_conversations, render

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
END = "<|im_end|>"


def chatml_reference(tok, messages):
    segments = []  # (text, loss)
    if messages[0]["role"] != "system":
        segments.append((f"<|im_start|>system\n{DEFAULT_SYSTEM}{END}\n", 0))
    for m in messages:
        if m["role"] == "assistant":
            segments += [("<|im_start|>assistant\n", 0), (m["content"] + END, 1), ("\n", 0)]
        else:
            segments.append((f"<|im_start|>{m['role']}\n{m['content']}{END}\n", 0))
    ids, mask = [], []
    for text, loss in segments:
        part = tok(text, add_special_tokens=False)["input_ids"]
        ids += part
        mask += [loss] * len(part)
    return ids, mask


def loss_runs(tok, example):
    """Decoded text of each maximal run of loss_mask == 1."""
    runs, cur = [], []
    for t, m in zip(example["input_ids"], example["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def masked_out_text(tok, example):
    return tok.decode([t for t, m in zip(example["input_ids"], example["loss_mask"]) if not m])


MULTI = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven is prime."},
    {"role": "user", "content": "Another, with emoji?"},
    {"role": "assistant", "content": "Eleven 🎉 — ça marche.\nDone"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome!"},
]


def test_multi_turn_with_system_matches_reference(tok):
    ex = render(tok, MULTI)
    ids, mask = chatml_reference(tok, MULTI)
    assert ex["input_ids"] == ids
    assert ex["loss_mask"] == mask
    assert loss_runs(tok, ex) == [m["content"] + END for m in MULTI if m["role"] == "assistant"]
    assert ex["input_ids"] == tok.apply_chat_template(MULTI, tokenize=True, return_dict=False)


def test_no_system_or_user_text_in_loss(tok):
    ex = render(tok, MULTI)
    learned = tok.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m])
    for m in MULTI:
        if m["role"] != "assistant":
            assert m["content"] not in learned
    assert "<|im_start|>" not in learned and "assistant\n" not in learned and "user" not in learned


def test_header_and_trailing_newline_are_not_learned(tok):
    ex = render(tok, MULTI)
    ids, mask = ex["input_ids"], ex["loss_mask"]
    starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
    ends = [i for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
    assert len(starts) == 3
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for s, e in zip(starts, ends):
        assert ids[s - len(header):s] == header and not any(mask[s - len(header):s])
        assert tok.decode([ids[e]]) == END  # the end-of-turn token is learned
        assert tok.decode([ids[e + 1]]) == "\n" and mask[e + 1] == 0


def test_injected_default_system_prompt_is_not_learned(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    ex = render(tok, msgs)
    ids, mask = chatml_reference(tok, msgs)
    assert (ex["input_ids"], ex["loss_mask"]) == (ids, mask)
    assert DEFAULT_SYSTEM in masked_out_text(tok, ex)
    assert loss_runs(tok, ex) == ["Hello there." + END]


def test_both_schemas_give_identical_examples(tok, write_jsonl):
    openai = {"messages": MULTI}
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    share = {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in MULTI]}
    convs, _ = load_conversations(write_jsonl([openai, share]))
    a, b = (render(tok, c) for c in convs)
    assert a == b == render(tok, MULTI)


def test_assistant_first_and_empty_assistant(tok):
    msgs = [{"role": "assistant", "content": "Welcome!"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": ""}]
    ex = render(tok, msgs)
    assert (ex["input_ids"], ex["loss_mask"]) == chatml_reference(tok, msgs)
    assert loss_runs(tok, ex) == ["Welcome!" + END, END]  # the empty turn keeps its end-of-turn token
    assert sum(ex["loss_mask"]) == len(tok("Welcome!", add_special_tokens=False)["input_ids"]) + 2


def test_fallback_without_chat_template(plain_tok):
    msgs = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye now."}]
    with pytest.warns(UserWarning, match="no chat template"):
        ex = render(plain_tok, msgs)
    text = "System: Be kind.\nUser: Hi there\nAssistant: Hello!<|im_end|>\nUser: Bye\nAssistant: Bye now.<|im_end|>\n"
    assert plain_tok.decode(ex["input_ids"]) == text
    # " Hello" is one token straddling "Assistant:" and the content, so the space comes along
    assert loss_runs(plain_tok, ex) == [" Hello!" + END, " Bye now." + END]
    assert "Assistant:" in masked_out_text(plain_tok, ex) and "User" not in loss_runs(plain_tok, ex)[1]


def test_template_that_renders_past_turns_differently(tok):
    """Like reasoning templates: only the last assistant turn gets an (empty) think block."""
    t = copy.deepcopy(tok)
    t.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = MULTI[1:5]
    ex = render(t, msgs)
    # the first answer as the target wrote it (its think block) is not in the history: it carries no loss
    assert loss_runs(t, ex) == ["<think>\n\n</think>\n\n" + msgs[3]["content"] + END]
    assert "Name a prime." in masked_out_text(t, ex)


def test_template_that_refuses(tok):
    t = copy.deepcopy(tok)
    t.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        render(t, MULTI)


def test_rejects_unnormalised_messages_and_slow_tokenizers(tok):
    with pytest.raises(ValueError, match="load_conversations"):
        render(tok, [{"from": "human", "value": "hi"}])

    class Slow:
        is_fast = False
        chat_template = "x"

    with pytest.raises(ValueError, match="fast tokenizer"):
        render(Slow(), MULTI)


def test_no_warning_with_a_template(tok):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        render(tok, MULTI)
