"""Render a conversation with the target tokenizer's chat template, with a loss mask.

Loss-mask convention: a token has loss_mask 1 when its characters overlap an assistant
span. An assistant span starts right after the text the template writes for
``add_generation_prompt=True`` (so the turn header, e.g. ``<|im_start|>assistant\\n``, is 0)
and ends at the end of that turn's text with trailing whitespace removed (so it holds the
content and the end-of-turn marker, e.g. ``<|im_end|>``, but not the newline after it).
Every other token (system, user, default system prompts injected by the template, headers)
is 0. A token that straddles a span boundary (e.g. " Hello" after a generation prompt
ending in a space) carries assistant text and is 1; ChatML-style headers end in their own
"\n" token, so there the header is exactly the 0 part.

Spans are found template-agnostically by rendering prefixes of the conversation:

* ``P = render(messages[:i], add_generation_prompt=True)`` (text up to the turn's content),
* ``U = render(messages[:i + 1])`` (text through the end of the turn),

and, when ``P`` is a prefix of ``U`` and ``U`` a prefix of the full rendering, the span is
``[len(P), len(U.rstrip()))``. Templates that render earlier turns differently from the
last one (e.g. ones that drop reasoning from past turns) fail that check; there the
content is searched in the full text after the previous span, and the end-of-turn text
that ``U`` writes after the content is added when it follows in the full text too.

Character spans become token masks through the offsets of a fast tokenizer. A tokenizer
without a chat template gets a plain fallback ("System: ...\\nUser: ...\\nAssistant: ...<eos>\\n")
and a warning.
"""

from __future__ import annotations

import warnings

FALLBACK_PREFIX = {"system": "System: ", "user": "User: ", "assistant": "Assistant: ", "tool": "Tool: "}


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _fallback_text(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    eos = getattr(tokenizer, "eos_token", None) or ""
    out = []
    for m in messages:
        end = eos if m["role"] == "assistant" else ""
        out.append(f"{FALLBACK_PREFIX[m['role']]}{m['content']}{end}\n")
    if add_generation_prompt:
        out.append(FALLBACK_PREFIX["assistant"])
    return "".join(out)


def render_text(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
    """The conversation as text: the tokenizer's chat template, or the plain fallback."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in FALLBACK_PREFIX or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be {{'role': 'system'|'user'|'assistant'|'tool', 'content': str}}, "
                             f"got {m!r:.100}; load data with load_conversations to normalise it")
    if not has_chat_template(tokenizer):
        return _fallback_text(tokenizer, messages, add_generation_prompt)
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja TemplateError, raise_exception() in templates, ...
        raise ValueError(f"the chat template refused this conversation ({type(e).__name__}: {e}); "
                         f"check the role order it expects (e.g. alternating user/assistant)") from e
    if not isinstance(text, str):
        raise ValueError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def _try_render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str | None:
    """render_text, or None where the template cannot render this prefix (e.g. no messages)."""
    if not messages and has_chat_template(tokenizer):
        return None  # apply_chat_template refuses an empty conversation
    try:
        return render_text(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    except ValueError:
        return None


def _search_span(text: str, upto: str, content: str, cursor: int, index: int) -> tuple[int, int]:
    """Span of assistant message `index` found by searching its content after `cursor`."""
    body = content.strip()
    start = text.find(body, cursor) if body else -1
    if start < 0:
        raise ValueError(f"cannot locate assistant message {index} in the rendered conversation: the chat "
                         f"template renders prefixes inconsistently and the content is empty or altered")
    end = start + len(body)
    k = upto.rfind(body)
    tail = upto[k + len(body):].rstrip() if k >= 0 else ""
    if tail and text.startswith(tail, end):
        end += len(tail)
    return start, end


def assistant_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of the assistant turns in `text` (the full rendering)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _try_render(tokenizer, messages[:i], True)
        upto = render_text(tokenizer, messages[: i + 1])
        if prompt is not None and upto.startswith(prompt) and text.startswith(upto) and len(prompt) >= cursor:
            start, end = len(prompt), max(len(prompt), len(upto.rstrip()))
        else:
            start, end = _search_span(text, upto, m["content"], cursor, i)
        spans.append((start, end))
        cursor = end
    return spans


def mask_from_offsets(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span (spans sorted and disjoint).

    A token that straddles a span's start (e.g. " Hello" after a prompt ending in a space)
    carries assistant text, so it counts; a zero-width token counts when it sits inside one.
    """
    mask = []
    j = 0
    for start, end in offsets:
        end = max(end, start + 1)
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        mask.append(1 if j < len(spans) and end > spans[j][0] else 0)
    return mask


def render(tokenizer, messages: list[dict]) -> dict:
    """Tokenise a conversation with its chat template; loss_mask 1 on assistant tokens only.

    Returns {"input_ids": list[int], "loss_mask": list[int]} (see the module docstring for
    which tokens count as assistant tokens).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("render needs a fast tokenizer (for character offsets); load it with "
                         "AutoTokenizer.from_pretrained(..., use_fast=True)")
    if not has_chat_template(tokenizer):
        warnings.warn("the tokenizer has no chat template; using the plain fallback "
                      "'System: ...\\nUser: ...\\nAssistant: ...<eos>'. The drafter will then learn a "
                      "format the target may not use at inference; set tokenizer.chat_template to fix",
                      UserWarning, stacklevel=2)
    text = render_text(tokenizer, messages)
    spans = assistant_spans(tokenizer, messages, text)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    return {"input_ids": ids, "loss_mask": mask_from_offsets(enc["offset_mapping"], spans)}


def encode_prompt(tokenizer, messages: list[dict]):
    """A chat prompt for generation: the template with the assistant turn opened, as ids [1, P]
    (the fallback format for a tokenizer without a template)."""
    import torch

    text = render_text(tokenizer, messages, add_generation_prompt=True)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
