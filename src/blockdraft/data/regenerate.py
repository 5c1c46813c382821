"""Regeneration: the target writes the assistant turns of a prompt set.

Drafters trained on the target's own outputs accept more tokens. Every assistant turn is written
again, in order: turn k is generated from the conversation before it with turns 1..k-1 already
regenerated (a conversation that ends with a user or tool turn gets one more); the user turns, tool
results and the record's tools stay the data's own. Greedy by default; with a temperature, sampled
with a seed per prompt and turn, so the same seed writes the same answers whatever the batching.
Reasoning the target writes is split into `reasoning_content` where its template marks it.

Output is JSONL, one record per prompt ({"id", "hash", "messages"}), appended chunk by chunk and
fsync'ed, so a killed run resumes where it stopped. A record is keyed by a hash of its prompt (the
turns that are not the assistant's, and where the assistant's are) and the sampling settings, never
by its position: a changed prompt file or another `--n` only adds the answers still missing, and
never pairs an answer with another prompt. A half-written last line is dropped.

The engine that writes them is the caller's (`engines.runner(name).generator`): transformers' `generate`
(the default, always there) or vLLM's offline batched generation (the `[vllm]` extra), several times
faster on the same CPU; both write the same records.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..target import stop_token_ids
from .chat import encode_prompt
from .prompt_set import token_bytes


def prompt_hash(messages: list[dict], settings: dict | None = None) -> str:
    """The key of a prompt: a hash of its role/content turns (and of the sampling settings, where
    they are not greedy's defaults)."""
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    key = json.dumps(turns, sort_keys=True, ensure_ascii=False)
    if settings:
        key += "\n" + json.dumps(settings, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def record_hash(rec: dict) -> str:
    """The prompt hash of an answer record (older files carry no "hash" field: computed)."""
    return rec.get("hash") or prompt_hash(prompt_messages(rec["messages"]))


def turn_slots(messages: list[dict]) -> tuple[list[dict], list[int]]:
    """The conversation with every assistant turn emptied (and one more after a final user or tool
    turn), and where those turns are. Its key (`prompt_key`) ignores the data's own answers."""
    hist = [{"role": "assistant", "content": ""} if m["role"] == "assistant" else dict(m) for m in messages]
    while hist and hist[-1]["role"] == "assistant" and len(hist) > 1 and hist[-2]["role"] == "assistant":
        hist.pop()  # answers in a row are one turn
    if hist and hist[-1]["role"] in ("user", "tool"):
        hist.append({"role": "assistant", "content": ""})
    slots = [k for k, m in enumerate(hist) if m["role"] == "assistant"]
    if not slots or not any(m["role"] == "user" for m in hist[:slots[0]]):
        raise ValueError("a prompt needs a user turn before its first assistant turn")
    return hist, slots


def prompt_key(messages: list[dict], settings: dict | None = None) -> str:
    """A single-turn prompt keeps the key of earlier releases (its turns up to the last user turn)."""
    hist, _ = turn_slots(messages)
    return prompt_hash(hist[:-1], settings)


def answer_records(raw: bytes, where: str) -> list[dict]:
    """The records of an answers file's complete lines; a file regenerate did not write (a line that is
    not an answer record) is refused with one line, before anything is changed."""
    out = []
    for k, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        msgs = rec.get("messages") if isinstance(rec, dict) else None
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in msgs)
                and "id" in rec and ("hash" in rec or msgs[-1]["role"] == "assistant")):
            raise ValueError(f"{where}:{k}: not an answer record (regenerate writes {{\"id\", \"hash\", \"messages\"}} "
                             "lines): this is not an answers file; pass another --out")
        out.append(rec)
    return out


def done_hashes(path: Path) -> set:
    """Prompt hashes already answered in `path`; truncates a torn last line left by a kill (only in a
    file whose every complete line is an answer record and whose torn tail starts as one)."""
    if not path.exists():
        return set()
    if path.is_symlink() or not path.is_file():
        raise ValueError(f"{path}: not a regular file; regenerate writes its answers only to a file of its own")
    raw = path.read_bytes()
    cut = raw.rfind(b"\n") + 1
    recs = answer_records(raw[:cut], str(path))
    if cut != len(raw):
        if not raw[cut:].lstrip().startswith(b'{"id"'):
            raise ValueError(f"{path}: its last line is not an answer record: this is not an answers file; "
                             "pass another --out")
        with open(path, "r+b") as f:
            f.truncate(cut)
    return {record_hash(r) for r in recs}


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


def reasoning_markers(tokenizer, tools=None) -> tuple[str, str] | None:
    """(opener, closer) the chat template writes around an answer's reasoning (e.g. "<think>",
    "</think>"), read from a rendering of a probe turn; None where the template writes no reasoning."""
    from .chat import try_render

    user = [{"role": "user", "content": "\ue000q"}]
    turn = {"role": "assistant", "reasoning_content": "\ue000r", "content": "\ue000c"}
    gen, full = try_render(tokenizer, user, True, tools), try_render(tokenizer, user + [turn], False, tools)
    if not gen or not full or "\ue000r" not in full or "\ue000c" not in full:
        return None
    head = full[:full.index("\ue000r")]
    k = 0  # the opener: what precedes the reasoning after the common part with the generation prompt
    while k < min(len(head), len(gen)) and head[k] == gen[k]:
        k += 1
    opener = head[k:].strip()
    closer = full[full.index("\ue000r") + 2:full.index("\ue000c")].strip()
    return (opener, closer) if closer else None


def split_answer(text: str, markers: tuple[str, str] | None) -> dict:
    """An answer's message: its reasoning split out where the template's closer follows it."""
    if markers is None or markers[1] not in text:
        return {"role": "assistant", "content": text.strip()}
    opener, closer = markers
    reasoning, content = text.split(closer, 1)
    reasoning = reasoning.strip()
    if opener and reasoning.startswith(opener):
        reasoning = reasoning[len(opener):]
    return {"role": "assistant", "content": content.strip(), "reasoning_content": reasoning.strip()}


def regenerate(generator, prompts: list[tuple[object, list[dict]]], out: str | os.PathLike, *,
               max_new_tokens: int = 256, batch_size: int = 8, progress: bool = True, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, keep_cut: bool = False, parse=None) -> dict:
    """prompts: (id, messages) pairs. Every assistant turn written again (greedy at temperature 0, else
    sampled); each finished turn is journaled (`turns_path`) and each conversation appended to `out` once
    it ends. `generator` is what an engine runs the target with (`engines.runner(name).generator(...)`:
    its `tokenizer`, `name`, `context` (prompt and answer tokens it holds), `check_sampling` and
    `generate(prompt ids, ...) -> [(ids, finish reason)]`). An answer cut at `max_new_tokens` (or the
    context) ends its conversation before it unless `keep_cut`. `parse(text, tools) -> message`: the
    server's tool-call and reasoning parsers (`engines.vllm.parsers`); where the target's tool calls
    differ from the data's, the conversation ends with that turn. Returns counts. One regenerate writes
    `out` at a time: a second is refused, naming the first (`locks`)."""
    from ..rundir.directory import RunDir

    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"--temperature must be >= 0 and --top-p in (0, 1], got {temperature} and {top_p}")
    sampling = sampling_of(temperature, top_p, seed)
    generator.check_sampling(sampling)
    with RunDir(out, "regenerate").lock() as run:
        return _answer(generator, prompts, run, max_new_tokens=max_new_tokens, batch_size=batch_size,
                       progress=progress, sampling=sampling, keep_cut=keep_cut, parse=parse)


def sampling_of(temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> dict:
    """The sampling settings an answer is keyed with (none for greedy)."""
    return {"temperature": float(temperature), "top_p": float(top_p), "seed": int(seed)} if temperature > 0 else {}


def _settings(sampling: dict) -> dict:
    """What keys an answer beside its prompt: the sampling, the template's thinking setting and the
    --chat-template file's text (another template writes other prompts, so other answers)."""
    from .chat import template_kwargs, template_override

    template = template_override()
    return {**sampling, **template_kwargs(),
            **({"chat_template": hashlib.sha256(template.encode()).hexdigest()[:16]} if template else {})}


class _Conv:
    """One conversation being regenerated: its slots, the turns written so far, how it ended."""

    def __init__(self, pid, h, messages, tools):
        self.pid, self.h, self.tools, self.data = pid, h, tools, list(messages)
        self.hist, self.slots = turn_slots(messages)
        self.next, self.finish, self.ended = 0, [], None

    def record(self) -> dict:
        keep = self.hist
        if self.ended is not None:
            turn, why = self.ended["turn"], self.ended["why"]
            keep = self.hist[:self.slots[turn] + (1 if why == "tool calls differ" else 0)]
        keep = [{k: v for k, v in m.items() if not (k == "tool_calls" and v == [])} for m in keep]  # none found
        return {"id": self.pid, "hash": self.h, "messages": keep, "finish": self.finish,
                **({"ended": self.ended} if self.ended else {}), **({"tools": self.tools} if self.tools else {})}

    def take(self, turn: int, message: dict, reason: str, keep_cut: bool) -> bool:
        """Turn `turn` written: whether the conversation is over."""
        if message.get("tool_calls"):  # the data's call ids where the calls are the data's (its tool turns
            data = self._data_calls(turn) or []  # name them), else ids of the prompt and turn (not random)
            same = _calls(data) == _calls(message["tool_calls"])
            message["tool_calls"] = [{**c, "id": (data[i].get("id") if same else None) or f"call-{self.h[:8]}-{turn}-{i}"}
                                     for i, c in enumerate(message["tool_calls"])]
        self.hist[self.slots[turn]] = message
        self.finish.append(reason)
        self.next = turn + 1
        if reason in ("length", "context") and not keep_cut:
            self.ended = {"turn": turn, "why": "cut at --max-new-tokens" if reason == "length" else
                          "prompt fills the context"}
        elif self.slots[turn] + 1 < len(self.hist) and _calls_differ(self._data_calls(turn), message):
            self.ended = {"turn": turn, "why": "tool calls differ"}
        return self.ended is not None or self.next == len(self.slots)

    def _data_calls(self, turn: int):
        k = self.slots[turn]
        return self.data[k].get("tool_calls") if k < len(self.data) and self.data[k]["role"] == "assistant" else None


def _calls(calls) -> list:
    """Tool calls as (name, arguments) pairs, arguments parsed where they are JSON text."""
    out = []
    for c in calls or ():
        f = c.get("function", c)
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append((f.get("name"), args))
    return out


def _calls_differ(data_calls, message: dict) -> bool:
    """Whether the target's turn calls other tools (or other arguments) than the data's next tool turns
    answer. Without a parser (no "tool_calls" in the message) nothing is compared."""
    if "tool_calls" not in message:
        return False
    return _calls(data_calls) != _calls(message["tool_calls"])


def turns_path(out: str | os.PathLike) -> Path:
    """The journal of finished turns beside an answers file: one line per turn, fsync'ed, so a kill
    loses no finished turn; removed once every conversation of a run is in the answers file."""
    out = Path(out)
    return out.with_name(out.name + ".turns")


def _journal(path: Path, todo: dict, keep_cut: bool, counts: dict) -> None:
    """Replays the journal's turns into the conversations still to write (a torn last line dropped)."""
    if not path.exists():
        return
    raw = path.read_bytes()
    cut = raw.rfind(b"\n") + 1
    for k, line in enumerate(raw[:cut].decode("utf-8", errors="replace").splitlines(), 1):
        try:
            j = json.loads(line)
            conv, turn = todo.get(j["hash"]), int(j["turn"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path}:{k}: not a regenerate journal line; move the file away") from None
        if conv is not None and turn == conv.next and conv.ended is None and turn < len(conv.slots):
            _count(counts, conv, conv.take(turn, j["message"], j["finish"], keep_cut))
    if cut != len(raw):
        with open(path, "r+b") as f:
            f.truncate(cut)


def _todo(prompts, done: set, settings: dict) -> tuple[list, int]:
    todo, seen, skipped = [], set(), 0
    for pid, m in prompts:
        h = prompt_key(m, settings)
        if h in seen:  # duplicates in the prompt set are answered once
            continue
        seen.add(h)
        if h in done:
            skipped += 1
        else:
            todo.append(_Conv(pid, h, m, getattr(m, "tools", None)))
    return todo, skipped


def _answer(generator, prompts: list[tuple[object, list[dict]]], run, *, max_new_tokens: int,
            batch_size: int, progress: bool, sampling: dict, keep_cut: bool = False, parse=None) -> dict:
    """`run`: the answers file's `RunDir`, locked."""
    from tqdm.auto import tqdm

    out = run.path
    journal = turns_path(out)
    tok = generator.tokenizer
    context = getattr(generator, "context", None)
    todo, skipped = _todo(prompts, done_hashes(out), _settings(sampling))
    counts = {"cut": 0, "tool_calls_differ": 0, "over_context": 0}
    if todo:  # found before the first answer, not at the thousandth
        run.check_space(2 * answers_bytes(tok, [(c.pid, c.h, c.hist) for c in todo],
                                          max_new_tokens * max(len(c.slots) for c in todo)),
                        f"the answers to {len(todo)} prompts (and their journal)")
    _journal(journal, {c.h: c for c in todo}, keep_cut, counts)
    stop = stop_token_ids(tok)
    markers = {}
    written = 0
    bar = tqdm(total=skipped + len(todo), initial=skipped, desc=f"regenerate ({generator.name})",
               disable=not progress)
    try:
        over = [c for c in todo if c.ended is not None or c.next == len(c.slots)]
        _append(out, [c.record() for c in over])  # finished in the journal before a kill: only written
        written += len(over)
        bar.update(len(over))
        for turn in range(max((len(c.slots) for c in todo), default=0)):  # every prompt's k-th answer, then the next
            active = [c for c in todo if c.ended is None and c.next == turn < len(c.slots)]
            for s in range(0, len(active), batch_size):
                chunk = active[s:s + batch_size]
                ids = [encode_prompt(tok, c.hist[:c.slots[turn]], tools=c.tools)[0].tolist() for c in chunk]
                room = [max_new_tokens if context is None else min(max_new_tokens, context - len(r)) for r in ids]
                go = [k for k, r in enumerate(room) if r > 0]
                rows = {}
                if go:
                    seeds = [_seed(sampling, chunk[k].h, turn) for k in go]
                    got = generator.generate([ids[k] for k in go], max_tokens=[room[k] for k in go],
                                             stop_token_ids=stop, temperature=sampling.get("temperature", 0.0),
                                             top_p=sampling.get("top_p", 1.0), seeds=seeds if sampling else None)
                    rows = dict(zip(go, got))
                lines, ended = [], []
                for k, c in enumerate(chunk):
                    row, reason = rows.get(k, ([], "context"))
                    row, reason = _finished(row, reason, stop, room[k], max_new_tokens)
                    message = _message(tok, row, c.tools, markers, parse)
                    if _count(counts, c, c.take(turn, message, reason, keep_cut)):
                        ended.append(c)
                    lines.append({"hash": c.h, "turn": turn, "message": message, "finish": reason})
                _append(journal, lines)  # the turns first: a kill after it loses nothing
                _append(out, [c.record() for c in ended])
                written += len(ended)
                bar.update(len(ended))
    finally:
        bar.close()
    if journal.exists():  # every conversation of the run is in the answers file now
        journal.unlink()
    return {"written": written, "skipped": skipped, "total": skipped + len(todo), **counts}


def _finished(row: list[int], reason: str, stop: list[int], room: int, max_new_tokens: int) -> tuple[list, str]:
    """An answer's tokens (up to its stop token, within its room) and why it ended: 'stop', 'length' (cut at
    --max-new-tokens) or 'context' (cut where its prompt and it fill the engine's context)."""
    if room <= 0:
        return [], "context"
    head = row[:room]
    cut = _until_stop(head, stop)
    if len(cut) < len(head) or (reason == "stop" and len(row) <= room):  # a stop token, or vLLM's stop
        return cut, "stop"
    return head, "length" if room >= max_new_tokens else "context"


def _count(counts: dict, c: "_Conv", over: bool) -> bool:
    """Counts the turn `c` just took (an answer cut, kept or not; a conversation its turn ended)."""
    counts["cut"] += c.finish[-1] == "length"
    counts["over_context"] += c.finish[-1] == "context"
    counts["tool_calls_differ"] += (c.ended or {}).get("why") == "tool calls differ"
    return over


def _message(tok, row: list[int], tools, markers: dict, parse) -> dict:
    """A generated turn as a message: through the server's parsers where given, else its reasoning
    split where the template marks it."""
    key = json.dumps(tools, sort_keys=True) if tools else ""
    if key not in markers:
        markers[key] = reasoning_markers(tok, tools)
    if parse is None:
        return split_answer(_decode(tok, row, markers[key]), markers[key])
    message = parse(tok.decode(row, skip_special_tokens=False), tools)
    if "reasoning_content" not in message:  # no reasoning parser: the template's markers split it
        split = split_answer(message["content"], markers[key])
        message = {**message, **split, **({"tool_calls": message["tool_calls"]} if "tool_calls" in message else {})}
    return message


def _seed(sampling: dict, key: str, turn: int) -> int:
    """A sampled answer's own seed: the run's seed, its prompt and its turn (not its batch)."""
    if not sampling:
        return 0
    digest = hashlib.sha256(f"{sampling['seed']}/{key}/{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def _decode(tok, row: list[int], markers) -> str:
    """The answer's text; with reasoning markers, special tokens kept (a marker may be one)."""
    return tok.decode(row, skip_special_tokens=markers is None)


def bundle_answers(answers: str | os.PathLike, out: str | os.PathLike, prompts: list[tuple[object, list[dict]]],
                   sampling: dict | None = None) -> int:
    """Write the answers to `prompts` (and nothing else `answers` may hold) ordered by prompt hash, so
    the file does not depend on the order they were written in; gzip with a fixed timestamp for
    .gz (the same bytes on every rebuild). Every prompt must be answered, with the settings
    `sampling` (`sampling_of`) they were written with. Returns the count."""
    from .prompt_set import write_prompts

    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise ValueError(f"--bundle {out}: not a regular file; give a new file or a bundle regenerate wrote")
    if out.exists():  # replaced only when it is a bundle of answers (what --bundle writes)
        import gzip

        raw = out.read_bytes()
        try:
            raw = gzip.decompress(raw) if out.name.endswith(".gz") else raw
        except (OSError, EOFError):
            raise ValueError(f"--bundle {out}: exists and is not a bundle of answers; pass another file") from None
        answer_records(raw, f"--bundle {out}")
    settings = _settings(sampling or {})
    want = {prompt_key(m, settings) for _, m in prompts}
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
