"""Regeneration: the target writes the assistant turns of a prompt set.

Drafters trained on the target's own (greedy) outputs accept more tokens. Output is JSONL,
one record per prompt ({"id", "hash", "messages"}), appended chunk by chunk and fsync'ed, so
a killed run resumes where it stopped. A record is keyed by a hash of its prompt messages,
never by its position: a changed prompt file or another `--n` only adds the answers still
missing, and never pairs an answer with another prompt. A half-written last line is dropped.

Two engines write the same records: transformers' `generate` (the default, always there) and
vLLM's offline batched generation (`engine="vllm"`, the `[vllm]` extra), several times faster
on the same CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..target import stop_token_ids
from .chat import encode_prompt
from .prompt_set import token_bytes

ENGINES = ("transformers", "vllm")


def prompt_hash(messages: list[dict]) -> str:
    """The key of a prompt: a hash of its role/content turns."""
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    return hashlib.sha256(json.dumps(turns, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:20]


def record_hash(rec: dict) -> str:
    """The prompt hash of an answer record (older files carry no "hash" field: computed)."""
    return rec.get("hash") or prompt_hash(prompt_messages(rec["messages"]))


def done_hashes(path: Path) -> set:
    """Prompt hashes already answered in `path`; truncates a torn last line left by a kill."""
    if not path.exists():
        return set()
    raw = path.read_bytes()
    cut = raw.rfind(b"\n") + 1
    if cut != len(raw):
        with open(path, "r+b") as f:
            f.truncate(cut)
    done = set()
    for line in raw[:cut].decode("utf-8").splitlines():
        if line.strip():
            done.add(record_hash(json.loads(line)))
    return done


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation up to its last user turn (a trailing assistant turn is dropped and rewritten)."""
    msgs = list(messages)
    while msgs and msgs[-1]["role"] == "assistant":
        msgs.pop()
    if not msgs or msgs[-1]["role"] != "user":
        raise ValueError("a prompt must end with a user turn")
    return msgs


def _append(out: Path, records: list[dict]) -> None:
    with open(out, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def answers_bytes(tokenizer, todo: list[tuple], max_new_tokens: int) -> int:
    """What `_append` will write for `todo` ((id, hash, messages) each): every record as it writes it,
    with an answer of `max_new_tokens` tokens of `token_bytes`."""
    answer = int(max_new_tokens * token_bytes(tokenizer)) + 1
    return sum(len(json.dumps({"id": pid, "hash": h, "messages": msgs + [{"role": "assistant", "content": ""}]},
                              ensure_ascii=False).encode()) + answer for pid, h, msgs in todo)


def _until_stop(row: list[int], stop: list[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in stop:
            return row[:i]
    return row


@torch.no_grad()
def _answers_transformers(model, tokenizer, chunk: list[list[dict]], max_new_tokens: int, stop) -> list[list[int]]:
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=stop)
        return gen[:, enc["input_ids"].shape[1]:].tolist()
    finally:
        tokenizer.padding_side = side


def regenerate(target, prompts: list[tuple[object, list[dict]]], out: str | os.PathLike, *,
               max_new_tokens: int = 256, batch_size: int = 8, engine: str = "transformers",
               progress: bool = True, engine_options: dict | None = None) -> dict:
    """prompts: (id, messages) pairs. Greedy answers appended to `out`; returns counts. `target` is a
    TargetModel (transformers engine) or, for vLLM, `target.TargetFiles` (tokenizer and directory).
    One regenerate writes `out` at a time: a second is refused, naming the first (`locks`)."""
    from ..locks import locked

    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out, "regenerate", lead=True):
        return _answer(target, prompts, out, max_new_tokens=max_new_tokens, batch_size=batch_size, engine=engine,
                       progress=progress, engine_options=engine_options)


def _answer(target, prompts: list[tuple[object, list[dict]]], out: Path, *, max_new_tokens: int, batch_size: int,
            engine: str, progress: bool, engine_options: dict | None) -> dict:
    from tqdm.auto import tqdm

    tok = target.tokenizer
    done = done_hashes(out)
    todo, seen, skipped = [], set(), 0
    for pid, m in prompts:
        msgs = prompt_messages(m)
        h = prompt_hash(msgs)
        if h in seen:  # duplicates in the prompt set are answered once
            continue
        seen.add(h)
        if h in done:
            skipped += 1
        else:
            todo.append((pid, h, msgs))
    if todo:  # found before the first answer, not at the thousandth
        from ..atomic import check_free_space

        check_free_space(out.parent, answers_bytes(tok, todo, max_new_tokens), f"the answers to {len(todo)} prompts")
    stop = stop_token_ids(tok)
    vllm = None
    if engine == "vllm" and todo:
        from ..engines.vllm.job import Engine

        vllm = Engine(target.local_dir, **(engine_options or {}))  # tensor_parallel_size, memory
    written = 0
    bar = tqdm(total=skipped + len(todo), initial=skipped, desc=f"regenerate ({engine})", disable=not progress)
    try:
        for s in range(0, len(todo), batch_size):
            chunk = todo[s:s + batch_size]
            if vllm is not None:
                ids = [encode_prompt(tok, msgs)[0].tolist() for _, _, msgs in chunk]
                rows = [r for r, _ in vllm.generate(ids, max_tokens=max_new_tokens, stop_token_ids=stop)]
            else:
                rows = _answers_transformers(target.model, tok, [msgs for _, _, msgs in chunk], max_new_tokens, stop)
            records = []
            for (pid, h, msgs), row in zip(chunk, rows):
                text = tok.decode(_until_stop(row, stop), skip_special_tokens=True).strip()
                records.append({"id": pid, "hash": h, "messages": msgs + [{"role": "assistant", "content": text}]})
            _append(out, records)
            written += len(records)
            bar.update(len(records))
    finally:
        bar.close()
    return {"written": written, "skipped": skipped, "total": skipped + len(todo)}


def bundle_answers(answers: str | os.PathLike, out: str | os.PathLike, prompts: list[tuple[object, list[dict]]]) -> int:
    """Write the answers to `prompts` (and nothing else `answers` may hold) ordered by prompt hash, so
    the file does not depend on the order they were written in; gzip with a fixed timestamp for
    .gz (the same bytes on every rebuild). Every prompt must be answered. Returns the count."""
    from .prompt_set import write_prompts

    want = {prompt_hash(prompt_messages(m)) for _, m in prompts}
    got = {}
    with open(answers, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                h = record_hash(rec)
                if h in want:
                    got[h] = rec
    if len(got) < len(want):
        raise ValueError(f"{answers}: {len(want) - len(got)} of {len(want)} prompts have no answer yet; run "
                         "regenerate to completion before bundling")
    write_prompts([got[h] for h in sorted(got)], out)
    return len(got)
