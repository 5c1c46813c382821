"""`blockdraft doctor --data F --show N`: records as the target's chat template renders them, with what
trains marked. ⟦...⟧ wraps the tokens that carry loss; ⟨reasoning⟩, ⟨tool call⟩ and ⟨tool result⟩
open (and ⟨/...⟩ close) where the record's reasoning, tool calls and tool results appear in the text."""

from __future__ import annotations

import json

from .chat import TemplateRefused, assistant_spans, render, render_text
from .sources import load_conversations

LEARNED = ("⟦", "⟧")


def _find(text: str, piece: str, cursor: int) -> tuple[int, int] | None:
    piece = piece.strip()
    k = text.find(piece, cursor) if piece else -1
    return (k, k + len(piece)) if k >= 0 else None


def regions(text: str, messages) -> list[tuple[str, int, int]]:
    """(kind, start, end) of each reasoning, tool call and tool result found in the rendered text, in
    order (reasoning a template hides is not there, and is not listed)."""
    out, cursor = [], 0
    for m in messages:
        pieces = []
        if m["role"] in ("system", "user"):  # what follows is searched after it (not in a tool declaration)
            found = _find(text, m["content"], cursor)
            cursor = found[1] if found else cursor
        elif m["role"] == "assistant":
            if m.get("reasoning_content"):
                pieces.append(("reasoning", m["reasoning_content"]))
            for c in m.get("tool_calls") or []:
                f = c.get("function") or c
                args = f.get("arguments", "")
                pieces.append(("tool call", str(f.get("name", ""))))
                pieces.append(("tool call", args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        elif m["role"] == "tool":
            pieces.append(("tool result", m["content"]))
        for kind, piece in pieces:
            found = _find(text, piece, cursor)
            if found is None and kind == "tool call":  # arguments re-serialised by the template: the name alone
                continue
            if found:
                out.append((kind, *found))
                cursor = max(cursor, found[0])
    return sorted(out, key=lambda r: r[1])


def _runs(offsets, mask) -> list[tuple[int, int]]:
    """Character ranges of consecutive learned tokens."""
    runs: list[list[int]] = []
    for (a, b), m in zip(offsets, mask):
        if not m:
            continue
        if runs and runs[-1][1] >= a:
            runs[-1][1] = max(runs[-1][1], b)
        else:
            runs.append([a, b])
    return [(a, b) for a, b in runs]


def mark(text: str, learned: list[tuple[int, int]], found: list[tuple[str, int, int]]) -> str:
    """The text with the markers inserted (closing markers before opening ones at one position)."""
    events = [(a, 1, LEARNED[0]) for a, _ in learned] + [(b, 0, LEARNED[1]) for _, b in learned]
    events += [(s, 1, f"⟨{kind}⟩") for kind, s, _ in found] + [(e, 0, f"⟨/{kind}⟩") for kind, _, e in found]
    out, at = [], 0
    for pos, _, tag in sorted(events, key=lambda e: (e[0], e[1])):
        out.append(text[at:pos] + tag)
        at = pos
    return "".join(out) + text[at:]


def show(tokenizer, path: str, n: int) -> str:
    """The first `n` conversations of `path`, rendered and marked, each with its token counts."""
    convs, _ = load_conversations(path, skip_bad_lines=True)
    blocks = [f"{LEARNED[0]}...{LEARNED[1]} marks the tokens that carry loss"]
    for k, conv in enumerate(convs[:n]):
        text = None
        try:
            text = render_text(tokenizer, conv)
            r = render(tokenizer, conv)
        except TemplateRefused:  # the template or a setting, not this record: every record alike
            raise
        except ValueError as e:  # this record: shown with why train refuses it, and the others still shown
            blocks.append(f"--- record {k + 1} of {path}: train refuses it: {e}" + (f"\n{text}" if text else ""))
            continue
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets, mask = enc["offset_mapping"], r["loss_mask"]
        found = regions(text, conv)
        counts = {}
        for kind, s, e in found:
            toks = [m for (a, b), m in zip(offsets, mask) if a < e and max(b, a + 1) > s]
            got = counts.setdefault(kind, [0, 0])
            got[0] += len(toks)
            got[1] += sum(toks)
        parts = ", ".join(f"{kind} {t} tokens ({l} learned)" for kind, (t, l) in counts.items())
        left_out: list[tuple[int, str]] = []
        assistant_spans(tokenizer, conv, text, left_out)
        left = "".join(f"\n    message {i} carries no loss: {why}" for i, why in left_out)
        blocks.append(f"--- record {k + 1} of {path}: {len(mask)} tokens, {sum(mask)} learned"
                      + (f"; {parts}" if parts else "") + left + "\n" + mark(text, _runs(offsets, mask), found))
    return "\n".join(blocks)
