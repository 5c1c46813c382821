"""Conversation sources: JSONL / JSON / parquet files, `datasets` datasets (a save_to_disk directory,
hf:NAME[:CONFIG][:SPLIT] from the local cache, never the network) and in-memory datasets.

Two record schemas are understood and normalised to one form, a list of
``{"role": "system" | "user" | "assistant", "content": str}`` dicts:

* OpenAI ``{"messages": [{"role": ..., "content": ...}, ...]}``
* ShareGPT ``{"conversations": [{"from": ..., "value": ...}, ...]}``

Role names are matched case-insensitively through `ROLES` (ShareGPT's human/gpt/chatgpt/
bard/bing included). Content may be a string, ``None`` (read as "") or a list of OpenAI
text parts (``{"type": "text", "text": ...}``), which are joined. A part of another type (an image,
audio, video) makes the record bad input: drafters are trained for a target's text decoder, on text.

What thinking, tool-calling models write is kept as the OpenAI and Hugging Face conventions write
it, for the target's chat template to render: an assistant turn's reasoning (``reasoning_content``,
or the ``reasoning`` / ``thinking`` spellings, kept as ``reasoning_content``) and its ``tool_calls``
(a list of objects); a tool turn's ``tool_call_id`` and ``name``; and a record's ``tools`` list
(the conversation's `tools` attribute: `Conversation`).

Bad input (malformed JSON, a record without either schema, an unknown role, content that
is not text) raises ValueError naming the file and line (JSONL), record index (JSON array,
in-memory dataset) or row (parquet); with ``skip_bad_lines=True`` such records are skipped
and counted instead. Conversations without an assistant turn are always skipped and counted.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "tool": "tool",  # OpenAI-format tool results: context, never learned
    "function": "tool",
    "ipython": "tool",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}

Message = dict  # {"role": str, "content": str} (+ reasoning_content, tool_calls, tool_call_id, name)
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


class Conversation(list):
    """A conversation's messages, and the tools its record offers the model (None: none given)."""

    def __init__(self, messages=(), tools: list | None = None, where: str | None = None):
        super().__init__(messages)
        self.tools = tools
        self.where = where  # the record's place (file:line), where it was read from one


def tools_of(messages) -> list | None:
    return getattr(messages, "tools", None)


@dataclass
class LoadStats:
    """Counts of one `load_conversations` call.

    read: non-blank lines / records seen; kept: conversations returned;
    bad_lines: records skipped as malformed (only with skip_bad_lines=True);
    no_assistant: well-formed conversations skipped for having no assistant turn.
    """

    read: int = 0
    kept: int = 0
    bad_lines: int = 0
    no_assistant: int = 0


class BadRecord(Exception):
    """Internal: a record that cannot be used; the message says why."""


def _fix_hint() -> str:
    return "fix or remove it, or skip and count such records with --skip-bad-lines (skip_bad_lines=True in Python)"


def _text(content, index: int) -> str:
    """Message content as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") != "text":  # image_url, input_audio, video...
                raise BadRecord(f"message {index} holds a {str(part['type'])[:40]!r} part: blockdraft trains on text "
                                "alone (a drafter for the target's text decoder)")
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise BadRecord(f"message {index} has a content part that is not text: {part!r:.80}")
        return "".join(parts)
    raise BadRecord(f"message {index} has content of type {type(content).__name__}; expected a string")


def _pick(turn: dict, *keys: str):
    """The first of `keys` whose value is not None (pyarrow fills absent struct fields with None)."""
    for k in keys:
        if turn.get(k) is not None:
            return turn[k]
    return None


def parse_record(record) -> list[Message]:
    """Normalise one record of either schema; raises BadRecord."""
    if not isinstance(record, dict):
        raise BadRecord(f"expected an object with a 'messages' or 'conversations' list, got {type(record).__name__}")
    turns = _pick(record, "messages", "conversations")
    if turns is None:
        raise BadRecord(f"no 'messages' (OpenAI) or 'conversations' (ShareGPT) key; keys are {sorted(record)[:10]}")
    if not isinstance(turns, list):
        raise BadRecord(f"'messages'/'conversations' must be a list, got {type(turns).__name__}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRecord(f"message {i} is a {type(turn).__name__}, expected an object")
        role = _pick(turn, "role", "from")
        if role is None:
            raise BadRecord(f"message {i} has no 'role' (OpenAI) or 'from' (ShareGPT) key")
        mapped = ROLES.get(str(role).strip().lower())
        if mapped is None:
            raise BadRecord(f"message {i} has unknown role {role!r}; expected one of {sorted(ROLES)}")
        msg = {"role": mapped, "content": _text(_pick(turn, "content", "value"), i)}
        msg.update(_written(turn, mapped, i))
        out.append(msg)
    tools = record.get("tools")
    if isinstance(tools, str):  # some exports store the list as JSON text
        tools = _json_field(tools, "the record's 'tools'")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRecord(f"'tools' must be a list of objects, got {tools!r:.80}")
    return Conversation(out, tools or None)


def _json_field(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecord(f"{what} is a string but not JSON ({e.msg})") from None


def _check_call(call: dict, what: str) -> None:
    """A tool call as the OpenAI API writes it: {"function": {"name": str, "arguments": JSON object text or
    an object}} (servers parse the text into the mapping templates read; text that is no JSON object has
    no such mapping)."""
    f = call.get("function")
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"].strip():
        raise BadRecord(f"{what} has no 'function' object with a 'name' (OpenAI's tool_calls: "
                        f'{{"type": "function", "function": {{"name": ..., "arguments": ...}}}}), got {call!r:.80}')
    args = f.get("arguments", {})
    if isinstance(args, str) and args.strip():
        args = _json_field(args, f"{what}'s 'arguments'")
    elif isinstance(args, str):
        args = {}
    if not isinstance(args, dict):
        raise BadRecord(f"{what}'s 'arguments' must be a JSON object (or its text), got {args!r:.80}")


def _written(turn: dict, role: str, i: int) -> dict:
    """The fields beside the content a chat template reads: an assistant turn's reasoning and tool
    calls, a tool turn's call id and name."""
    out = {}
    if role == "assistant":
        reasoning = _pick(turn, *REASONING_KEYS)
        if reasoning is not None:
            out["reasoning_content"] = _text(reasoning, i)
        calls = turn.get("tool_calls")
        if isinstance(calls, str):
            calls = _json_field(calls, f"message {i}'s 'tool_calls'")
        if calls:
            if not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
                raise BadRecord(f"message {i} has 'tool_calls' that is not a list of objects: {calls!r:.80}")
            for k, call in enumerate(calls):
                _check_call(call, f"message {i}'s tool call {k}")
            out["tool_calls"] = calls
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if turn.get(key) is not None:
                out[key] = str(turn[key])
    return out


# A source yields (where, record, error): `where` names the place for messages, `error`
# is None or why the raw record could not even be decoded.
Located = tuple[str, object, "str | None"]


def _jsonl(path: Path) -> Iterator[Located]:
    with open(path, "rb") as f:
        yield from _jsonl_lines(path, f)


def _jsonl_lines(path: Path, f) -> Iterator[Located]:
    for lineno, raw in enumerate(f, 1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            yield where, None, f"not valid UTF-8 ({e.reason} at byte {e.start})"
            continue
        if not line.strip():
            continue
        try:
            yield where, json.loads(line), None
        except json.JSONDecodeError as e:
            yield where, None, f"malformed JSON ({e.msg} at column {e.colno})"


def _json_array(path: Path, text: str) -> Iterator[Located]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno}); the whole "
                         f"file must be one JSON list of records (or use JSONL, one record per line)") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of records, got a {type(data).__name__}; "
                         f"wrap the records in [...] or write one record per line (JSONL)")
    for i, rec in enumerate(data):
        yield f"{path}: record {i}", rec, None


def _json(path: Path) -> Iterator[Located]:
    """A .json file: a JSON list of records, or JSON lines under a .json name."""
    with open(path, encoding="utf-8-sig") as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):
        with open(path, encoding="utf-8-sig") as f:
            yield from _json_array(path, f.read())
    else:
        yield from _jsonl(path)


def _parquet(path: Path) -> Iterator[Located]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow "
                         f"(or convert the file to JSONL)") from None
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            yield f"{path}: row {row}", rec, None
            row += 1


def _jsonl_gz(path: Path) -> Iterator[Located]:
    """Gzip-compressed JSON lines (how the bundled dataset is stored)."""
    import gzip

    try:
        with gzip.open(path, "rb") as f:
            yield from _jsonl_lines(path, f)
    except (OSError, EOFError) as e:  # not gzip, or cut short
        raise ValueError(f"{path}: the gzip stream is damaged or truncated ({e}); copy the file again") from None


READERS = {".jsonl": _jsonl, ".json": _json, ".parquet": _parquet, ".jsonl.gz": _jsonl_gz}


def _suffix(path: Path) -> str:
    name = path.name.lower()
    return ".jsonl.gz" if name.endswith(".jsonl.gz") else path.suffix.lower()


def _file(path: Path) -> Iterator[Located]:
    if not path.is_file():
        raise ValueError(f"{path}: no such file; give a .jsonl, .jsonl.gz, .json or .parquet file or a dataset object")
    reader = READERS.get(_suffix(path))
    if reader is None:
        raise ValueError(f"{path}: unknown file type '{path.suffix}'; use one of {sorted(READERS)}")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty; it needs at least one conversation")
    return reader(path)


def _dataset(data: Iterable, name: str | None = None) -> Iterator[Located]:
    for i, rec in enumerate(data):
        yield (f"{name}: record {i}" if name else f"record {i}"), rec, None


def _datasets():
    """The `datasets` library, never reaching the network (its offline switches set before import)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub = sys.modules.get("huggingface_hub.constants")  # read its switch at import: transformers imported it first
    if hub is not None:
        hub.HF_HUB_OFFLINE = True
    try:
        import datasets
    except ImportError:
        raise ValueError("reading a `datasets` dataset needs the datasets library: pip install 'blockdraft[datasets]'"
                         ) from None
    return datasets


def _hf(spec: str) -> Iterator[Located]:
    """hf:NAME[:CONFIG][:SPLIT] from the local datasets cache (split default: train)."""
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"{spec}: expected hf:NAME[:CONFIG][:SPLIT]")
    name, config, split = parts[0], (parts[1] or None) if len(parts) > 1 else None, parts[2] if len(parts) > 2 else "train"
    ds = _datasets()
    try:
        data = ds.load_dataset(name, config, split=split)
    except Exception as e:  # offline and not cached: ConnectionError, FileNotFoundError, DatasetNotFoundError...
        raise ValueError(f"{spec}: not in the local datasets cache ({type(e).__name__}); load it once where the "
                         "network is (datasets.load_dataset), or give a file") from None
    return _dataset(data, spec)


def _disk(path: Path) -> Iterator[Located]:
    """A directory `datasets` saved (save_to_disk): a Dataset, or a DatasetDict's train split."""
    ds = _datasets()
    try:
        data = ds.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{path}: a directory, but not one datasets' save_to_disk wrote ({e})") from None
    if isinstance(data, ds.DatasetDict):
        if "train" not in data:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split (it has {sorted(data)}); save the "
                             "split to train on alone")
        data = data["train"]
    return _dataset(data, str(path))


def _source(path_or_dataset) -> tuple[str, Iterator[Located]]:
    if isinstance(path_or_dataset, str) and path_or_dataset.startswith("hf:"):
        return path_or_dataset, _hf(path_or_dataset)
    if isinstance(path_or_dataset, (str, os.PathLike)):
        path = Path(path_or_dataset).expanduser()
        if path.is_dir():
            return str(path), _disk(path)
        return str(path), _file(path)
    if isinstance(path_or_dataset, (dict, bytes)) or not isinstance(path_or_dataset, Iterable):
        raise ValueError(f"expected a file path or an iterable of records (e.g. a datasets.Dataset), "
                         f"got {type(path_or_dataset).__name__}")
    return "the dataset", _dataset(path_or_dataset)


def load_conversations(path_or_dataset, *, skip_bad_lines: bool = False,
                       require_assistant: bool = True) -> tuple[list[list[Message]], LoadStats]:
    """Read conversations from a .jsonl/.json/.parquet file or an iterable of records.

    Returns (conversations, stats); each conversation is a list of {"role", "content"}
    dicts with roles system/user/assistant, in their original order. Conversations with
    no assistant turn are skipped and counted unless `require_assistant` is False (prompt
    sets for regeneration).
    """
    name, records = _source(path_or_dataset)
    stats = LoadStats()
    out: list[list[Message]] = []
    for where, record, error in records:
        stats.read += 1
        try:
            if error is not None:
                raise BadRecord(error)
            messages = parse_record(record)
        except BadRecord as e:
            if not skip_bad_lines:
                raise ValueError(f"{where}: {e}; {_fix_hint()}") from None
            stats.bad_lines += 1
            continue
        if require_assistant and not any(m["role"] == "assistant" for m in messages):
            stats.no_assistant += 1
            continue
        messages.where = where  # named when a later step (the loss mask) refuses the record
        out.append(messages)
    if stats.read == 0:
        raise ValueError(f"{name} holds no records; it needs at least one conversation")
    stats.kept = len(out)
    return out, stats
