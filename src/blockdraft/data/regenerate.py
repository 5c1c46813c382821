"""Regeneration: the target writes the assistant turns of a prompt set.

Drafters trained on the target's own (greedy) outputs accept more tokens. Output is JSONL,
one record per prompt ({"id", "messages"}), appended batch by batch and fsync'ed, so a
killed run resumes where it stopped: ids already written are skipped, and a half-written
last line is dropped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..target import stop_token_ids


def done_ids(path: Path) -> set:
    """Ids already regenerated; truncates a torn last line left by a kill."""
    if not path.exists():
        return set()
    raw = path.read_bytes()
    cut = raw.rfind(b"\n") + 1
    if cut != len(raw):
        with open(path, "r+b") as f:
            f.truncate(cut)
    ids = set()
    for line in raw[:cut].decode("utf-8").splitlines():
        if line.strip():
            ids.add(json.loads(line)["id"])
    return ids


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation up to its last user turn (a trailing assistant turn is dropped and rewritten)."""
    msgs = list(messages)
    while msgs and msgs[-1]["role"] == "assistant":
        msgs.pop()
    if not msgs or msgs[-1]["role"] != "user":
        raise ValueError("a prompt must end with a user turn")
    return msgs


@torch.no_grad()
def regenerate(model, tokenizer, prompts: list[tuple[str, list[dict]]], out: str | os.PathLike, *,
               max_new_tokens: int = 256, batch_size: int = 8, progress: bool = True) -> dict:
    """prompts: (id, messages) pairs. Greedy answers appended to `out`; returns counts."""
    from tqdm.auto import tqdm

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    skip = done_ids(out)
    todo = [(i, prompt_messages(m)) for i, m in prompts if i not in skip]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop = stop_token_ids(tokenizer)
    written = 0
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="regenerate", disable=not progress)
    try:
        for s in range(0, len(todo), batch_size):
            chunk = todo[s:s + batch_size]
            texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for _, m in chunk]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                 eos_token_id=stop)
            new = gen[:, enc["input_ids"].shape[1]:]
            lines = []
            for (pid, msgs), row in zip(chunk, new.tolist()):
                text = tokenizer.decode(_until_stop(row, stop), skip_special_tokens=True).strip()
                lines.append(json.dumps({"id": pid, "messages": msgs + [{"role": "assistant", "content": text}]}))
            with open(out, "a", encoding="utf-8") as f:
                f.write("".join(ln + "\n" for ln in lines))
                f.flush()
                os.fsync(f.fileno())
            written += len(lines)
            bar.update(len(lines))
    finally:
        tokenizer.padding_side = side
        bar.close()
    return {"written": written, "skipped": len(skip), "total": len(prompts)}


def _until_stop(row: list[int], stop: list[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in stop:
            return row[:i]
    return row
