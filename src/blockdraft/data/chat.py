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

Reasoning, tool calls and tool turns go to the template as the OpenAI / Hugging Face message fields
it reads (``reasoning_content``, ``tool_calls``, ``tool_call_id``), with the record's ``tools`` and
the template options `configure_template` set (a ``--chat-template`` file, ``--thinking``). An
assistant span holds everything the template writes for the turn after its header: reasoning,
content, tool-call markup and the end-of-turn marker. What a later turn shows of an earlier turn's
reasoning is the template's choice: the spans are found in the full rendering, as it shows them.

Spans are found template-agnostically by rendering prefixes of the conversation:

* ``P = render(messages[:i], add_generation_prompt=True)`` (text up to the turn's content),
* ``U = render(messages[:i + 1])`` (text through the end of the turn),

and, when ``P`` is a prefix of ``U`` and ``U`` a prefix of the full rendering, the span is
``[len(P), len(U.rstrip()))``. Templates that render earlier turns differently from the
last one (e.g. ones that drop reasoning from past turns) fail that check; there the turn is
found by difference: the full conversation rendered again with that turn's written fields
replaced by a marker shares its text before and after the turn with the full rendering, and the
span runs from the turn's header (the generation prompt, found before the difference) through
the end-of-turn text the template writes after a last turn. Where even that fails, the content
is searched in the full text after the previous span.

Character spans become token masks through the offsets of a fast tokenizer. A tokenizer
without a chat template gets a plain fallback ("System: ...\\nUser: ...\\nAssistant: ...<eos>\\n")
and a warning.
"""

from __future__ import annotations

import warnings

FALLBACK_PREFIX = {"system": "System: ", "user": "User: ", "assistant": "Assistant: ", "tool": "Tool: "}


_PROCESS = {"chat_template": None, "kwargs": {}}  # what --chat-template and --thinking set (use_template)


def _template(tokenizer) -> str | None:
    return _PROCESS["chat_template"] or getattr(tokenizer, "chat_template", None)


def has_chat_template(tokenizer) -> bool:
    return bool(_template(tokenizer))


def _fallback_text(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    eos = getattr(tokenizer, "eos_token", None) or ""
    out = []
    for m in messages:
        end = eos if m["role"] == "assistant" else ""
        out.append(f"{FALLBACK_PREFIX[m['role']]}{m['content']}{end}\n")
    if add_generation_prompt:
        out.append(FALLBACK_PREFIX["assistant"])
    return "".join(out)


FIELDS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")
THINKING = ("on", "off")


def template_kwargs() -> dict:
    """The keyword arguments every rendering of this process passes its template (--thinking's)."""
    return dict(_PROCESS["kwargs"])


def _read_template(chat_template: str) -> str:
    from pathlib import Path

    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise ValueError(f"--chat-template {chat_template}: no such file (give a Jinja chat template file)")
    return path.read_text(encoding="utf-8")


def _thinking_kwargs(thinking: str | None) -> dict:
    if thinking is None:
        return {}
    if thinking not in THINKING:
        raise ValueError(f"--thinking must be on or off, got {thinking!r}")
    return {"enable_thinking": thinking == "on"}


def configure_template(tokenizer, chat_template: str | None = None, thinking: str | None = None) -> None:
    """Render with `chat_template` (a Jinja file) instead of the tokenizer's own, and with thinking on
    or off (the `enable_thinking` flag templates of thinking models read; None: the template's default)."""
    if chat_template is not None:
        tokenizer.chat_template = _read_template(chat_template)
    if thinking is not None:
        tokenizer.blockdraft_template_kwargs = _thinking_kwargs(thinking)


def use_template(chat_template: str | None = None, thinking: str | None = None) -> None:
    """Every rendering of this process (the commands' --chat-template and --thinking) uses this template
    and thinking setting, whatever the tokenizer; None leaves the tokenizer's own."""
    _PROCESS["chat_template"] = _read_template(chat_template) if chat_template else None
    _PROCESS["kwargs"] = _thinking_kwargs(thinking)


def render_text(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False,
                tools: list | None = None) -> str:
    """The conversation as text: the tokenizer's chat template, or the plain fallback. `tools`:
    the tools offered (default: the conversation's own, `sources.Conversation`)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in FALLBACK_PREFIX or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be {{'role': 'system'|'user'|'assistant'|'tool', 'content': str}}, "
                             f"got {m!r:.100}; load data with load_conversations to normalise it")
    if not has_chat_template(tokenizer):
        return _fallback_text(tokenizer, messages, add_generation_prompt)
    tools = tools if tools is not None else getattr(messages, "tools", None)
    plain = [{k: m[k] for k in FIELDS if k in m} for m in messages]
    kw = {**_PROCESS["kwargs"], **(getattr(tokenizer, "blockdraft_template_kwargs", None) or {}),
          "chat_template": _template(tokenizer)}
    if tools:
        kw["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
    except Exception as e:  # jinja TemplateError, raise_exception() in templates, ...
        raise ValueError(f"the chat template refused this conversation ({type(e).__name__}: {e}); "
                         f"check the role order it expects (e.g. alternating user/assistant)") from e
    if not isinstance(text, str):
        raise ValueError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def try_render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools=None) -> str | None:
    """render_text, or None where the template cannot render this prefix (e.g. no messages)."""
    if not messages and has_chat_template(tokenizer):
        return None  # apply_chat_template refuses an empty conversation
    try:
        return render_text(tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except ValueError:
        return None


MARK = "\ue000blockdraft-turn\ue001"  # private-use characters: no template writes them


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # the longest k with a[:k] == b[:k]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _diff_span(tokenizer, messages: list[dict], tools, text: str, i: int, cursor: int,
               own: str) -> tuple[int, int] | None:
    """Span of assistant turn i found by difference against the conversation with that turn's written
    fields replaced by MARK (None where the template does not allow it); `own` the conversation through
    turn i rendered with it last."""
    marked = list(messages[:i]) + [{"role": "assistant", "content": MARK}] + list(messages[i + 1:])
    alt = try_render(tokenizer, marked, False, tools)
    last = try_render(tokenizer, marked[:i + 1], False, tools)
    if alt is None or last is None or alt.count(MARK) != 1 or last.count(MARK) != 1:
        return None
    k = alt.index(MARK)
    start = _common_prefix(text, alt[:k])
    tail = alt[k + len(MARK):]
    end = len(text) - _common_prefix(text[::-1], tail[::-1])
    if start < cursor or end < start:
        return None
    header = _generation_prompt(tokenizer, messages[:i], tools)
    if header:  # the turn starts after its header, even where the marked turn's own text began alike
        h = text.rfind(header, cursor, start + len(header))
        if h >= 0 and h + len(header) <= end:
            start = min(start, h + len(header))
    end += len(_end_marker(text, start, end, own, last))
    return start, end


def _end_marker(text: str, start: int, end: int, own: str, last: str) -> str:
    """The end-of-turn text that follows the turn at `end` in `text`: what the template writes after
    this turn's last piece when the turn is the conversation's last (`own`: the turn itself rendered
    last; else `last`: the marked turn rendered last). A past turn whose marker differs from a last
    turn's (gpt-oss ends a past answer with <|end|>, the model writes <|return|>) keeps it out."""
    own = own.rstrip()
    probe = text[max(start, end - 32):end]
    j = own.rfind(probe) if probe else -1
    candidates = [own[j + len(probe):]] if j >= 0 else []
    candidates.append(last[last.index(MARK) + len(MARK):].rstrip())
    for eot in candidates:
        if eot and text.startswith(eot, end):
            return eot
    return ""


def _generation_prompt(tokenizer, messages: list[dict], tools) -> str:
    """What the template writes to open an assistant turn after `messages` (its header)."""
    with_prompt = try_render(tokenizer, messages, True, tools)
    without = try_render(tokenizer, messages, False, tools)
    if with_prompt is None or without is None or not with_prompt.startswith(without):
        return ""
    return with_prompt[len(without):]


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
    tools = getattr(messages, "tools", None)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = try_render(tokenizer, messages[:i], True, tools)
        upto = render_text(tokenizer, messages[: i + 1], tools=tools)
        if prompt is not None and upto.startswith(prompt) and text.startswith(upto) and len(prompt) >= cursor:
            start, end = len(prompt), max(len(prompt), len(upto.rstrip()))
        else:
            found = _diff_span(tokenizer, messages, tools, text, i, cursor, upto) if has_chat_template(tokenizer) \
                else None
            start, end = found or _search_span(text, upto, m["content"], cursor, i)
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


def encode_prompt(tokenizer, messages: list[dict], tools: list | None = None):
    """A chat prompt for generation: the template with the assistant turn opened, as ids [1, P]
    (the fallback format for a tokenizer without a template)."""
    import torch

    text = render_text(tokenizer, messages, add_generation_prompt=True, tools=tools)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
