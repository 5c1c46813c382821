"""The spool: a directory through which engine processes hand the target's hidden states to the
processes that read them (training ranks, `extract`), bounded in bytes.

Clients (readers) ask; engines (writers) answer, in the order the clients will read:

    requests/KEY~CLIENT~BYTES.json   a client's request: the documents (token ids) of one item it will
                                     read, written atomically; KEY sorts in reading order (`item_key`)
    claimed/KEY~CLIENT~BYTES.json    moved here by the engine replica that captures it (under
                                     `claims.lock`); removed by the client once it has read the item
    ready/CLIENT/KEY/NAME.safetensors  one file per document, as vLLM's hidden-states connector writes it
    ready/CLIENT/KEY.done            written last: every document of the item is there

The bound: an engine claims the lowest-keyed request waiting, and only while the bytes of every claimed
item (captured, being captured or not yet read) stay within `budget`; it then waits for clients to
read. One exception keeps the readers from waiting on each other: a request whose key is not above
any claimed one is claimed whatever the bytes (some reader needs it before anything the spool holds;
ranks that meet in a collective ask for items of equal keys), so the spool peaks at the budget plus one
item per reader. Keys follow the order in which ranks read (and meet in collectives), so the lowest
request is always one that a reader can read next.

Nothing here imports vLLM or blockdraft's training code: an engine process in vLLM's own environment
imports this module (and `feed`) only.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

REQUESTS, CLAIMED, READY = "requests", "claimed", "ready"
LOCK = "claims.lock"
STOP = "stop"
IDENTITY = "spool.json"
_CLIENT = re.compile(r"^[A-Za-z0-9_.-]+$")


def item_key(step: int, phase: int, k: int) -> str:
    """The key of an item a client reads: step, then phase (0: read before the step trains, e.g. the
    feature scale and held-out rows; 1: the step's own micro-batches), then its place in that phase.
    Keys sort as strings in the order every rank reads."""
    return f"{int(step):010d}.{int(phase)}.{int(k):010d}"


def state_bytes(tokens: int, n_states: int, hidden: int, itemsize: int, fp8: bool = False) -> int:
    """The size of one document's file: [T, k, H] states, [T] int64 token ids and a header (`fp8`: the
    states one byte each, with a float32 scale per token)."""
    per_token = n_states * hidden + 4 if fp8 else n_states * hidden * itemsize
    return tokens * (per_token + 8) + 256


@dataclass(frozen=True)
class Request:
    key: str
    client: str
    nbytes: int

    @property
    def name(self) -> str:
        return f"{self.key}~{self.client}~{self.nbytes}.json"

    @classmethod
    def parse(cls, name: str) -> "Request | None":
        if not name.endswith(".json") or name.count("~") != 2:
            return None
        key, client, nbytes = name[:-5].split("~")
        return cls(key, client, int(nbytes)) if nbytes.isdigit() else None


class Spool:
    """A spool directory, from either side."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def make(self) -> "Spool":
        for sub in (REQUESTS, CLAIMED, READY):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        return self

    # ------------------------------------------------------------------ clients
    def ask(self, client: str, key: str, documents: list[tuple[str, list[int]]], nbytes: int) -> Request:
        """Ask for an item: its documents, by name (unique within the item) and token ids."""
        if not _CLIENT.match(client):
            raise ValueError(f"spool client name {client!r}: letters, digits, '-', '_' and '.' only")
        req = Request(key, client, int(nbytes))
        path = self.root / REQUESTS / req.name
        tmp = path.with_name(f".{req.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"documents": documents}))
        os.replace(tmp, path)
        return req

    def item_dir(self, req: Request) -> Path:
        return self.root / READY / req.client / req.key

    def done(self, req: Request) -> bool:
        return (self.root / READY / req.client / f"{req.key}.done").exists()

    def release(self, req: Request) -> None:
        """The item has been read: its files go, and its bytes stop counting against the budget."""
        d = self.item_dir(req)
        if d.exists():
            for p in d.iterdir():
                p.unlink(missing_ok=True)
            d.rmdir()
        (self.root / READY / req.client / f"{req.key}.done").unlink(missing_ok=True)
        (self.root / CLAIMED / req.name).unlink(missing_ok=True)
        (self.root / REQUESTS / req.name).unlink(missing_ok=True)

    def forget_client(self, client: str) -> None:
        """Everything a client asked for and did not read (a restarted or killed run's leftovers)."""
        for sub in (REQUESTS, CLAIMED):
            for p in (self.root / sub).glob(f"*~{client}~*.json"):
                p.unlink(missing_ok=True)
        d = self.root / READY / client
        if d.exists():
            for item in sorted(d.iterdir(), reverse=True):
                if item.is_dir():
                    for p in item.iterdir():
                        p.unlink(missing_ok=True)
                    item.rmdir()
                else:
                    item.unlink(missing_ok=True)

    # ------------------------------------------------------------------ engines
    def claim(self, budget: int, max_documents: int, max_tokens: int, replicas: int = 1) -> list[tuple[Request, list]]:
        """Claim the next requests to capture, lowest key first, within the budget (and the
        exception above), at most `max_documents` documents and `max_tokens` tokens in all, and at most
        a `replicas`-th of the bytes waiting, so that every replica feeding the spool gets a share (the
        first request is taken whatever its size). Returns each with its documents."""
        got: list[tuple[Request, list]] = []
        with open(self.root / LOCK, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held = [r for r in map(Request.parse, os.listdir(self.root / CLAIMED)) if r is not None]
            stored = sum(r.nbytes for r in held)
            lowest = min((r.key for r in held), default=None)
            waiting = sorted((r for r in map(Request.parse, os.listdir(self.root / REQUESTS)) if r is not None),
                             key=lambda r: (r.key, r.client))
            share = -(-sum(r.nbytes for r in waiting) // max(1, replicas))
            docs = tokens = taken = 0
            for req in waiting:
                first = lowest is None or req.key <= lowest
                if stored + req.nbytes > budget and not first:
                    break  # strictly in key order: a later request never passes an earlier one
                if got and taken + req.nbytes > share:
                    break
                src = self.root / REQUESTS / req.name
                try:
                    documents = json.loads(src.read_text())["documents"]
                except FileNotFoundError:  # its client took it back meanwhile
                    continue
                n_tok = sum(len(ids) for _, ids in documents)
                if got and (docs + len(documents) > max_documents or tokens + n_tok > max_tokens):
                    break
                os.replace(src, self.root / CLAIMED / req.name)
                got.append((req, documents))
                stored, taken = stored + req.nbytes, taken + req.nbytes
                lowest = req.key if lowest is None else min(lowest, req.key)
                docs, tokens = docs + len(documents), tokens + n_tok
        return got

    def deliver(self, req: Request, files: dict[str, str]) -> None:
        """An engine hands over an item: each document's file moved into place, then the marker."""
        if not (self.root / CLAIMED / req.name).exists():  # its client took it back (a restart)
            for path in files.values():
                Path(path).unlink(missing_ok=True)
            return
        d = self.item_dir(req)
        d.mkdir(parents=True, exist_ok=True)
        for name, path in files.items():
            os.replace(path, d / f"{name}.safetensors")
        marker = self.root / READY / req.client / f"{req.key}.done"
        marker.write_text("")

    def stored_bytes(self) -> int:
        """The bytes the claimed items hold or will hold (what the budget bounds)."""
        return sum(r.nbytes for r in map(Request.parse, os.listdir(self.root / CLAIMED)) if r is not None)

    def ready_bytes(self) -> int:
        """The bytes of the files waiting to be read (what is on disk now)."""
        total = 0
        for dirpath, _, names in os.walk(self.root / READY):
            for n in names:
                try:
                    total += os.stat(os.path.join(dirpath, n)).st_size
                except FileNotFoundError:
                    pass
        return total

    def stopping(self) -> bool:
        return (self.root / STOP).exists()
