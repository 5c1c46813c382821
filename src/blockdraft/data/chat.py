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

Reasoning, tool calls and tool turns go to the template as an OpenAI-compatible server hands them
over: the message fields it reads (``reasoning_content``, also as ``thinking``; ``tool_calls`` with
their arguments parsed into mappings; ``tool_call_id``), the record's ``tools`` and the template
options `configure_template` / `use_template` set (a ``--chat-template`` file, ``--thinking``,
refused where the template does not read ``enable_thinking``). Templates run in transformers'
Jinja setup, in a sandbox that lets them append to lists they build (`_environment`).

What a turn learns is what the target wrote in it: the turn as the template writes it when it is
the conversation's last turn, ``W_i`` below. Where the full rendering shows the turn otherwise
(a template that hides past reasoning), or the template cannot write what the turn holds (its
reasoning, a tool call, its content), the turn carries no loss: it is never learned as the
history shows it. One exception keeps the seed's Kimi-K2-Thinking trainable: its template writes a
plain answer's reasoning block empty even when the answer is last (`<think></think>answer`), where the
model writes its reasoning between the tags; the conversation's last turn is then trained with the
reasoning put in that one empty tag pair (`_last_turn_as_written`), and the text trained on holds it so.
A conversation left with nothing learned is refused, naming the record.

Spans are found template-agnostically by rendering prefixes of the conversation:

* ``P = render(messages[:i], add_generation_prompt=True)`` (text up to the turn's content),
* ``U = render(messages[:i + 1])`` (text through the end of the turn), ``W_i = U[len(P):].rstrip()``,

and, when ``P`` is a prefix of ``U`` and ``U`` a prefix of the full rendering, the span is
``[len(P), len(U.rstrip()))``. Templates that render earlier turns differently from the
last one fail that check; there the turn is found by difference: the full conversation rendered
again with that turn's written fields replaced by a marker shares its text before and after the
turn with the full rendering, and the turn runs from its header (the generation prompt, found
before the difference) through the end-of-turn text the template writes after a last turn. It is
learned where that text is ``W_i``, or ``W_i`` short of its end-of-turn marker while holding all the
turn wrote (gpt-oss ends a past answer with ``<|end|>`` where the model wrote ``<|return|>``).
Where no difference isolates the turn, it carries no loss if the next message bounds it, and the
conversation is refused if nothing does, rather than trained with a guessed mask.

Character spans become token masks through the offsets of a fast tokenizer. A tokenizer
without a chat template gets a plain fallback ("System: ...\\nUser: ...\\nAssistant: ...<eos>\\n")
and a warning.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from datetime import datetime

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


def template_override() -> str | None:
    """The --chat-template file's text this process renders with (None: the tokenizer's own)."""
    return _PROCESS["chat_template"]


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
        _check_thinking(_template(tokenizer), _thinking_kwargs(thinking))
        tokenizer.blockdraft_template_kwargs = _thinking_kwargs(thinking)


def use_template(chat_template: str | None = None, thinking: str | None = None) -> None:
    """Every rendering of this process (the commands' --chat-template and --thinking) uses this template
    and thinking setting, whatever the tokenizer; None leaves the tokenizer's own."""
    template = _read_template(chat_template) if chat_template else None
    kwargs = _thinking_kwargs(thinking)
    if template:  # refused before the target loads; the tokenizer's own template is checked at its first use
        _check_thinking(template, kwargs)
        _compiled(template)
    _PROCESS["chat_template"], _PROCESS["kwargs"] = template, kwargs


def _environment():
    """The Jinja environment chat templates run in: as transformers' (trimmed blocks, loop controls, its
    `tojson`, `raise_exception`, `strftime_now`, the `{% generation %}` tag), but with jinja2's plain
    sandbox rather than the immutable one, so a template may append to a list it built (Kimi-K2's do, as
    llama.cpp's renderer allows). Messages are handed over as fresh copies, so a template's edits
    never reach the caller's records; attribute access stays sandboxed."""
    if _ENV:
        return _ENV[0]
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import SandboxedEnvironment

    class Generation(jinja2.ext.Extension):  # {% generation %}...{% endgeneration %}: the body as it is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def refuse(message):
        raise jinja2.exceptions.TemplateError(message)

    def as_json(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = as_json
    env.globals.update(raise_exception=refuse, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    _ENV.append(env)
    return env


_ENV: list = []
_COMPILED: dict = {}


class TemplateRefused(ValueError):
    """A setting the template cannot apply, or a template that is not Jinja: every rendering fails alike,
    so it is not one conversation's fault (try_render passes it on)."""


def _compiled(template: str):
    got = _COMPILED.get(template)
    if got is None:
        import jinja2

        try:
            got = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateRefused(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
        if len(_COMPILED) > 8:  # a process renders with one or two templates
            _COMPILED.clear()
        _COMPILED[template] = got
    return got


def _server_message(m: dict) -> dict:
    """A message as an OpenAI-compatible server hands it to the template: its own fields only, reasoning
    also under `thinking` (gpt-oss's templates read that), tool-call arguments parsed into a mapping."""
    out = {k: copy.deepcopy(m[k]) for k in FIELDS if k in m}
    if "reasoning_content" in out:
        out.setdefault("thinking", out["reasoning_content"])
    for call in out.get("tool_calls") or []:
        f = call.get("function") if isinstance(call, dict) else None
        if isinstance(f, dict) and isinstance(f.get("arguments"), str):
            f["arguments"] = json.loads(f["arguments"]) if f["arguments"].strip() else {}
    return out


def _check_thinking(template: str | None, kw: dict) -> None:
    if "enable_thinking" in kw and (not template or "enable_thinking" not in template):
        which = "the plain fallback (the tokenizer has no chat template)" if not template else \
            "the chat template does not read enable_thinking"
        raise TemplateRefused(f"--thinking {'on' if kw['enable_thinking'] else 'off'} cannot apply: {which}; "
                              f"drop --thinking, or pass a --chat-template that reads it")


def render_text(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False,
                tools: list | None = None) -> str:
    """The conversation as text: the tokenizer's chat template, or the plain fallback. `tools`:
    the tools offered (default: the conversation's own, `sources.Conversation`)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in FALLBACK_PREFIX or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be {{'role': 'system'|'user'|'assistant'|'tool', 'content': str}}, "
                             f"got {m!r:.100}; load data with load_conversations to normalise it")
    kw = {**_PROCESS["kwargs"], **(getattr(tokenizer, "blockdraft_template_kwargs", None) or {})}
    template = _template(tokenizer)
    _check_thinking(template, kw)
    if not template:
        return _fallback_text(tokenizer, messages, add_generation_prompt)
    tools = tools if tools is not None else getattr(messages, "tools", None)
    compiled = _compiled(template)
    try:
        plain = [_server_message(m) for m in messages]
    except json.JSONDecodeError as e:
        raise ValueError(f"a tool call's arguments are not JSON ({e.msg}); load data with load_conversations, "
                         f"which refuses them naming the record") from None
    special = {k: v for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items() if isinstance(v, str)}
    try:
        text = compiled.render(**special, **kw, messages=plain, tools=copy.deepcopy(tools) or None, documents=None,
                               add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja TemplateError, raise_exception() in templates, ...
        hint = "; check the role order it expects (e.g. alternating user/assistant)" \
            if any(w in str(e).lower() for w in ("role", "alternat", "order")) else ""
        raise ValueError(f"the chat template refused this conversation ({type(e).__name__}: {e}){hint}") from e
    return text


def try_render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools=None) -> str | None:
    """render_text, or None where the template cannot render this prefix (e.g. one that reads messages[0])."""
    try:
        return render_text(tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except TemplateRefused:
        raise
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


def _pieces(m: dict) -> list[tuple[str, str]]:
    """What an assistant turn holds, as (what, text): its reasoning, content and tool calls' names."""
    held = [("reasoning", m.get("reasoning_content") or ""), ("content", m["content"])]
    held += [("tool call", str((c.get("function") or {}).get("name", ""))) for c in m.get("tool_calls") or []]
    return [(what, piece.strip()) for what, piece in held if piece.strip()]


def _shows(text: str, m: dict, what: str, piece: str) -> bool:
    """Whether `text` shows the piece (a tool call: its name, or its id where the template writes that)."""
    if piece in text:
        return True
    return what == "tool call" and any(str(c.get("id") or "\ue000") in text for c in m.get("tool_calls") or []
                                       if (c.get("function") or {}).get("name", "").strip() == piece)


def _holds(text: str, m: dict) -> bool:
    return all(_shows(text, m, what, piece) for what, piece in _pieces(m))


def _written_text(tokenizer, messages: list[dict], i: int, tools) -> tuple[int, str, str, str | None]:
    """Assistant turn i as the template renders it when it is the last turn: (where it starts in
    `own`, `own` the conversation through turn i, the turn's text from after its header through its
    end-of-turn marker: what the target writes in that turn, and why that text is not what the target
    wrote where the template leaves out something the turn holds: its reasoning, a tool call, its
    content; else None)."""
    m = messages[i]
    prompt = try_render(tokenizer, messages[:i], True, tools)
    own = render_text(tokenizer, messages[: i + 1], tools=tools)
    if prompt is not None and own.startswith(prompt):
        start, end = len(prompt), len(own.rstrip())
    else:  # e.g. a default system prompt written before a first turn, or a pending tool call's reasoning
        found = _diff_span(tokenizer, messages[:i + 1], tools, own, i, 0, own)
        if found is None:
            raise ValueError(f"cannot locate assistant turn {i}: the chat template does not open it with the text "
                             f"it writes for add_generation_prompt=True")
        start, end = found
    want = own[start:end]
    for what, piece in _pieces(m):
        if not _shows(want, m, what, piece):
            return start, own, want, f"the chat template leaves out assistant turn {i}'s {what} ({piece!r:.60})"
    return start, own, want, None


def _next_place(text: str, messages: list[dict], i: int, cursor: int) -> int | None:
    """Where the next message that is not the assistant's shows its content after `cursor` (None: none
    follows, or the rendering does not show it)."""
    for m in messages[i + 1:]:
        if m["role"] != "assistant" and m["content"].strip():
            k = text.find(m["content"].strip(), cursor)
            return k if k >= 0 else None
    return None


def assistant_spans(tokenizer, messages: list[dict], text: str,
                    left_out: list[tuple[int, str]] | None = None) -> list[tuple[int, int]]:
    """Character spans [start, end) of the assistant turns in `text` (the full rendering) that carry
    loss. Each span holds what the target wrote in its turn: the turn as the template renders it
    when it is the last one. A turn the full rendering shows otherwise (an earlier turn whose
    reasoning the template hides) has no span, and neither has a turn the template renders without
    something it holds: such turns are left out of the loss (appended to `left_out` as (turn, why)),
    never learned as shown. A turn that cannot be located is refused, never trained with a partial mask."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    tools = getattr(messages, "tools", None)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, own, want, dropped = _written_text(tokenizer, messages, i, tools)
        if start >= cursor and text.startswith(own[:start + len(want)]):
            span = (start, start + len(want))
        else:
            found = _diff_span(tokenizer, messages, tools, text, i, cursor, own) if has_chat_template(tokenizer) \
                else None
            if found is not None:
                shown = text[found[0]:found[1]]  # gpt-oss: a past answer ends <|end|> where it wrote <|return|>
                span = found if shown == want or (want.startswith(shown) and _holds(shown, m)) else None
                why = "the history shows it otherwise than the target wrote it (e.g. its reasoning hidden)"
                end = found[1]
            else:  # no rendering isolates it: passed over only where the next message bounds it
                span, why, end = None, "the history renders it apart from how the target wrote it", \
                    _next_place(text, messages, i, cursor)
                if end is None:
                    raise ValueError(f"cannot locate assistant turn {i} in the rendered conversation (the chat "
                                     f"template renders it differently when later turns follow, and no difference "
                                     f"of renderings isolates it); refused rather than trained with a partial loss "
                                     f"mask")
            if span is None:
                if left_out is not None:
                    left_out.append((i, dropped or why))
                bound = _next_place(text, messages, i, cursor)  # a difference may run past the next messages
                cursor = max(cursor, end if bound is None else min(end, bound))
                continue
        if dropped is not None:  # found, but not as the target wrote it
            if left_out is not None:
                left_out.append((i, dropped))
        else:
            spans.append(span)
        cursor = max(cursor, span[1])
    return spans


_EMPTY_PAIR = re.compile(r"<([A-Za-z][\w-]*)></\1>")


def _last_turn_as_written(tokenizer, messages: list[dict], text: str,
                          left_out: list[tuple[int, str]]) -> tuple[str, tuple[int, int]] | None:
    """The conversation's last turn as the target wrote it, where the template writes its reasoning
    block empty even there (Kimi-K2-Thinking renders every plain answer `<think></think>answer`; the
    model writes its reasoning between the two tags): (the text with the reasoning put in that one empty
    tag pair before the content, the turn's span). None unless the last message is an assistant turn
    left out only for its reasoning, with exactly one empty pair before its content, and the rebuilt
    turn holds all it wrote. Earlier turns stay left out: text after them would be rendered anew."""
    last = len(messages) - 1
    if not messages or messages[-1]["role"] != "assistant" or not left_out or left_out[-1][0] != last \
            or "'s reasoning" not in left_out[-1][1]:
        return None
    m = messages[-1]
    start, own, want, _ = _written_text(tokenizer, messages, last, getattr(messages, "tools", None))
    content = m["content"].strip()
    head = want[:want.find(content)] if content and content in want else want
    pairs = list(_EMPTY_PAIR.finditer(head))
    if len(pairs) != 1 or own != text:
        return None
    cut = pairs[0].start() + len(pairs[0].group(1)) + 2
    turn = want[:cut] + str(m.get("reasoning_content") or "") + want[cut:]
    if not _holds(turn, m):
        return None
    return text[:start] + turn + text[start + len(want):], (start, start + len(turn))


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
    try:
        text = render_text(tokenizer, messages)
        left_out: list[tuple[int, str]] = []
        spans = assistant_spans(tokenizer, messages, text, left_out)
        rebuilt = _last_turn_as_written(tokenizer, messages, text, left_out)
        if rebuilt is not None:
            text, span = rebuilt
            spans.append(span)
            left_out = left_out[:-1]
        dropped = [why for _, why in left_out if "leaves out" in why]
        if not spans and dropped:  # nothing the target wrote would be learned
            raise ValueError(f"{dropped[0]}: a drafter would learn nothing the target wrote in this conversation; "
                             f"pass --chat-template FILE with the target's own template, one that renders it")
    except TemplateRefused:
        raise
    except ValueError as e:
        where = getattr(messages, "where", None)
        raise ValueError(f"{where}: {e}" if where else str(e)) from e
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    return {"input_ids": ids, "loss_mask": mask_from_offsets(enc["offset_mapping"], spans)}


def encode_prompt(tokenizer, messages: list[dict], tools: list | None = None):
    """A chat prompt for generation: the template with the assistant turn opened, as ids [1, P]
    (the fallback format for a tokenizer without a template)."""
    import torch

    text = render_text(tokenizer, messages, add_generation_prompt=True, tools=tools)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
