"""`train --engine vllm --engine-endpoints URL,...`: the target's states from vLLM servers on other nodes,
carried by a Mooncake store (speculators' transport: hs-connectors' store and manifest).

Each document a rank needs is one request to a server's OpenAI endpoint (`/v1/completions`, its token ids,
one token out). The server's connector (`mooncake_connector.py`) puts the document's states into the store
and answers with their manifest; the rank gets them and deletes them at once. So the servers may sit
behind a router or be vLLM's own data parallel: any server that answers is as good as any other.

* **Bounded.** A rank asks only while the bytes it has asked for and not yet read stay within its share
  of `--store-gib` (the item it reads next is always asked): the store holds at most that, and nothing
  is ever evicted that a rank still needs, as long as the store's segments hold `--store-gib` below
  Mooncake's eviction watermark. A server whose put fails (a full store) writes an error marker: the
  rank waits and asks again, up to `--engine-stall-min`.
* **Exact.** The states are the ones a local engine gives (the same connector code finds them), checked
  on arrival: the tokens the server echoes, the layers it captured (`blockdraft_aux_ids`), the shapes.
* **Failures.** A server that refuses or drops a request is taken out and its documents go to another;
  with none left, one line names each and why. A store that fails (its master or the host of the
  segment holding a document gone) is one line naming the master, never a hang: every wait has a limit.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .job import EngineFailed

KEY_PREFIX = "bd-"  # request ids this trainer sends start so (vLLM prefixes "cmpl-"; the store keys follow)
SAY_EVERY_S = 60.0  # a wait longer than this says what it waits for, once each such span
MASTER_PROBE_S = 10.0  # how long the master's port may take to accept a connection before it is reported


def result_saying(future, what: str, every_s: float = SAY_EVERY_S):
    """`future.result()`, with a line every `every_s` while it is not done, naming `what` it waits for."""
    t0 = time.monotonic()
    while True:
        try:
            return future.result(timeout=every_s)
        except TimeoutError:
            if future.done():  # the work itself timed out: its own error
                raise
            print(f"engine: still waiting for {what} after {time.monotonic() - t0:.0f} s", flush=True)


def probe_master(master: str, timeout_s: float = MASTER_PROBE_S) -> None:
    """One line, at once, when nothing accepts a connection at the Mooncake master's HOST:PORT (Mooncake's
    own client would retry for minutes, logging each try)."""
    import socket

    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise EngineFailed(f"the Mooncake store's master at {master} could not be reached ({e}): start it "
                           "(mooncake_master --rpc_port=PORT) or correct --mooncake-master") from None


@contextlib.contextmanager
def output_to(log: Path | None):
    """This process's stdout and stderr, at the file descriptors (a C++ library's own log), appended to
    `log` while inside (None: left as they are)."""
    if log is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log, "ab") as fh:
            os.dup2(fh.fileno(), 1)
            os.dup2(fh.fileno(), 2)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def _post(url: str, body: dict, headers: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _get(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Servers:
    """The engine servers of a run: each one's model name, what it answered, and which are out."""

    def __init__(self, urls: list[str], timeout_s: float):
        self.urls, self.timeout_s = urls, timeout_s
        self.model: dict[str, str] = {}
        self.out: dict[str, str] = {}  # url -> why it was taken out
        self.served = {u: {"items": 0, "tokens": 0} for u in urls}
        self._next, self._lock = 0, threading.Lock()

    def connect(self, wait_s: float, grace_s: float = 60.0, every_s: float = SAY_EVERY_S) -> None:
        """Each server's model, waiting up to `wait_s` for servers still starting. Once one answers, the
        others get `grace_s` more, then are taken out (a warning each): a dead server in the list never
        holds the run back. One line naming each when none answers; while waiting, a line every `every_s`
        naming the servers waited for and why."""
        t0, why = time.monotonic(), {}
        deadline, said = t0 + wait_s, t0
        while True:
            for u in self.urls:
                if u in self.model:
                    continue
                try:
                    self.model[u] = _get(f"{u}/v1/models", timeout=min(self.timeout_s, 30.0))["data"][0]["id"]
                except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException) as e:
                    why[u] = str(getattr(e, "reason", None) or e) or type(e).__name__
            if len(self.model) == len(self.urls) or time.monotonic() > deadline:
                break
            if self.model:
                deadline = min(deadline, time.monotonic() + grace_s)
            if time.monotonic() - said >= every_s:
                said = time.monotonic()
                waiting = "; ".join(f"{u} ({why.get(u)})" for u in self.urls if u not in self.model)
                print(f"engine: waited {said - t0:.0f} s of at most {wait_s:.0f} s (--engine-stall-min) for the "
                      f"engine servers to answer: {waiting}", flush=True)
            time.sleep(min(1.0, every_s))
        if not self.model:
            raise EngineFailed("the engine servers did not answer: " + "; ".join(f"{u} ({why[u]})" for u in self.urls))
        for u in self.urls:
            if u not in self.model:
                self.take_out(u, f"it did not answer at the start: {why[u]}")

    def pick(self) -> str:
        with self._lock:
            alive = [u for u in self.urls if u not in self.out]
            if not alive:
                raise EngineFailed("every engine server failed: " + "; ".join(f"{u} ({w})" for u, w in self.out.items()))
            self._next += 1
            return alive[self._next % len(alive)]

    def take_out(self, url: str, why: str) -> None:
        with self._lock:
            if url not in self.out:
                self.out[url] = why
                print(f"engine: warning: {url} failed ({why}); its documents go to the other servers", flush=True)

    def capture(self, request_id: str, ids: list[int]) -> tuple[str, dict]:
        """(the server, one document's manifest), from whichever server answers (each failing one taken
        out)."""
        while True:
            url = self.pick()
            try:
                got = _post(f"{url}/v1/completions", {"model": self.model[url], "prompt": ids, "max_tokens": 1,
                                                      "temperature": 0.0}, {"X-Request-Id": request_id},
                            self.timeout_s)
            except urllib.error.HTTPError as e:
                if e.code < 500:  # the request itself is wrong: another server would refuse it too
                    raise EngineFailed(f"{url} refused a document of {len(ids)} tokens: HTTP {e.code} "
                                       f"{e.read()[:300].decode(errors='replace')}") from None
                self.take_out(url, f"HTTP {e.code}")
                continue
            except (OSError, ValueError, http.client.HTTPException) as e:  # refused, reset, cut, timed out, not JSON
                self.take_out(url, str(getattr(e, "reason", None) or e) or type(e).__name__)
                continue
            manifest = got.get("kv_transfer_params")
            if not isinstance(manifest, dict) or "handle" not in manifest:
                raise EngineFailed(f"{url} answered without the states' manifest: it runs without blockdraft's "
                                   "Mooncake connector (see docs/scale.md, engines on other nodes)")
            with self._lock:
                self.served[url]["items"] += 1
                self.served[url]["tokens"] += len(ids)
            return url, manifest


class Store:
    """This rank's client of the Mooncake store (hs-connectors' `MooncakeHiddenStatesStore`), every
    failure one line naming the master; Mooncake's own log of its setup goes to `log` (None: the terminal)."""

    def __init__(self, master: str, timeout_s: float, log: Path | None = None):
        from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

        probe_master(master)
        self.log = log
        host = os.environ.get("BLOCKDRAFT_MOONCAKE_HOST") or "127.0.0.1"
        # how long states a server answered for may take to appear (vLLM answers before its put ends)
        self.master, self.timeout_s = master, min(60.0, timeout_s)
        # a reader gives the store no memory of its own (global segment 0): the states live on the servers
        self.store = MooncakeHiddenStatesStore(MooncakeStoreConfig(
            local_hostname=host, master_server_address=master, global_segment_size=0,
            local_buffer_size=16 << 20, protocol=os.environ.get("BLOCKDRAFT_MOONCAKE_PROTOCOL", "tcp")))
        try:
            with output_to(log):
                self.store.setup()
        except (RuntimeError, OSError) as e:
            where = f"; Mooncake's own log: {log}" if log is not None else ""
            raise EngineFailed(f"the Mooncake store's master at {master} could not be reached ({e}){where}") from None

    def close(self) -> None:
        """The client's connections closed (its threads would otherwise go on calling a master)."""
        if self.store.is_setup:
            with output_to(self.log):
                self.store._require_store().close()
            self.store._store = None

    def clear(self, prefix: str) -> None:
        """States an earlier run of this reader asked for and never read (a killed trainer's)."""
        import re

        self.store._require_store().remove_by_regex("^" + re.escape(prefix))

    def check_master(self) -> None:
        """One line when the master no longer answers (a lookup of a key no one writes)."""
        got = self.store._require_store().is_exist("blockdraft-probe")
        if got not in (0, 1):
            raise EngineFailed(f"the Mooncake store's master at {self.master} stopped answering (status {got}); "
                               "restart it and rerun with --resume")

    def take(self, manifest: dict) -> dict[str, torch.Tensor]:
        """The document's states, then deleted from the store. StoreRefused: the server could not put
        them (its error marker); SampleLost: put, and gone or unreadable since."""
        from hs_connectors.mooncake_store import MooncakeIntegrityError

        try:
            got = self.store.get_sample(manifest, timeout=self.timeout_s)
        except MooncakeIntegrityError as e:
            first = str(e).splitlines()[0]
            raise (StoreRefused if "producer error" in first else SampleLost)(first) from None
        except TimeoutError:
            raise SampleLost(f"they never reached the store within {self.timeout_s:.0f} s") from None
        except RuntimeError as e:
            raise SampleLost(str(e)) from None
        try:
            self.drop(manifest["handle"])
        except RuntimeError as e:
            raise SampleLost(str(e)) from None
        return got

    def drop(self, handle: str) -> None:
        """A document's states and its error marker removed (a missing one is not an error)."""
        self.store.delete_sample(handle)


class LocalPuts:
    """A store client (Mooncake's `MooncakeDistributedStore`) whose puts go to this node's own segment: a
    server's states wait in its own node's memory, so another engine node that dies takes none of them
    with it (Mooncake would otherwise place them on any node's segment, a dead one included, until its
    master drops it). The servers' connector wraps its client so (`local_puts`)."""

    def __init__(self, client):
        from mooncake.store import ReplicateConfig

        self._client, self._config = client, ReplicateConfig()
        self._config.preferred_segment = client.get_hostname()

    def put_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._client.put_from(key, buffer_ptr, size, self._config)

    def put(self, key: str, value: bytes) -> int:
        return self._client.put(key, value, self._config)

    def __getattr__(self, name):
        return getattr(self._client, name)


def local_puts(store) -> None:
    """hs-connectors' `MooncakeHiddenStatesStore`, once set up, made to put into this node's segment."""
    if not isinstance(store._store, LocalPuts):
        store._store = LocalPuts(store._store)


class StoreRefused(RuntimeError):
    """The server's put failed (its error marker): a full store, most often."""


class SampleLost(RuntimeError):
    """States a server put and the store no longer gives: the host of their segment gone, an eviction,
    or a master that stopped."""


class Asked:
    """One item a rank asked for: its documents' futures once sent."""

    def __init__(self, key: str, idx: torch.Tensor, docs: list, nbytes: int):
        self.key, self.idx, self.docs, self.nbytes = key, idx, docs, nbytes
        self.futures: list | None = None


class RemoteReader:
    """One reader (a rank) of remote engines, with SpoolReader's interface: `ask`, `read`, `release`."""

    def __init__(self, reader, servers: Servers, store: Store, client: str, budget: int, stall_s: float,
                 workers: int = 8):
        self.reader, self.servers, self.store, self.client = reader, servers, store, client
        self.budget, self.stall_s = budget, stall_s
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="blockdraft-remote")
        self.pending: deque[Asked] = deque()
        self.in_flight = self.peak = 0  # bytes asked of the servers and not yet read
        self._ids = itertools.count(1)  # each request's own id (the worker threads share it)
        store.clear(f"cmpl-{KEY_PREFIX}{client}-")

    def ask(self, key: str, idx: torch.Tensor) -> Asked:
        nbytes = self.reader.nbytes(idx)
        if nbytes > self.budget:
            raise ValueError(f"{len(idx)} rows of a micro-batch need {nbytes / 2**30:.3f} GiB of states at once, more "
                             f"than this rank's {self.budget / 2**30:.3f} GiB of the store: raise --store-gib, or lower "
                             "--batch-tokens")
        a = Asked(key, idx, self.reader.documents(idx), nbytes)
        self.pending.append(a)
        self._pump()
        return a

    def _pump(self) -> None:
        """Send the waiting items in order while the bytes in flight stay within the budget."""
        while self.pending and (self.in_flight == 0 or self.in_flight + self.pending[0].nbytes <= self.budget):
            a = self.pending.popleft()
            self.in_flight += a.nbytes
            self.peak = max(self.peak, self.in_flight)
            a.futures = [self.pool.submit(self._fetch, name, ids) for name, ids in a.docs]

    def _fetch(self, name: str, ids: list[int]) -> dict:
        deadline = time.monotonic() + self.stall_s
        while True:
            try:
                url, manifest = self.servers.capture(f"{KEY_PREFIX}{self.client}-{name}-{next(self._ids)}", ids)
            except EngineFailed:
                self.store.check_master()  # servers that fail because the store did: the store is named
                raise
            check_manifest(manifest, self.reader.ids, len(ids))
            try:
                return self.store.take(manifest)
            except StoreRefused as e:
                self.store.drop(manifest["handle"])
                if time.monotonic() > deadline:
                    raise EngineFailed(f"the engine servers could not store states for {self.stall_s / 60:.0f} "
                                       f"minutes ({e}); the Mooncake store is full or failing") from None
                time.sleep(1.0)  # a full store: the servers wait until the readers free it
            except SampleLost as e:
                self.store.check_master()  # a master gone is the run's end, in one line
                if time.monotonic() > deadline:
                    raise EngineFailed(f"the states of a document were lost for {self.stall_s / 60:.0f} minutes "
                                       f"({e}): the store's segments are failing") from None
                # the host of the segment they went to died (a server that answered may be fine): ask again

    def read(self, a: Asked, idx: torch.Tensor):
        self._pump()
        if a.futures is None:
            raise RuntimeError(f"item {a.key} was read before it was asked of the servers")
        t0 = time.monotonic()
        got = {name: result_saying(f, f"the states of document {name} (item {a.key}) from the engine servers")
               for (name, _), f in zip(a.docs, a.futures)}
        self.waited = getattr(self, "waited", 0.0) + time.monotonic() - t0
        from .capture import segment_name

        out = self.reader.assemble(idx, lambda seg: (got[segment_name(seg)], f"{a.key}/{segment_name(seg)}"))
        self.in_flight -= a.nbytes
        self._pump()
        return out

    def release(self, a: Asked) -> None:
        """An item asked for and no longer wanted: its states, once they come, dropped."""
        if a in self.pending:
            self.pending.remove(a)
            return
        if a.futures is not None:
            for f in a.futures:
                f.cancel()
            self.in_flight -= a.nbytes
            a.futures = None
            self._pump()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def check_manifest(manifest: dict, aux_ids: list[int], tokens: int) -> None:
    """A server's answer describes the states asked for: the layers (when its connector names them), the
    token count, the tensors."""
    from hs_connectors.mooncake_store import VERSION

    meta = manifest.get("metadata") or {}
    if manifest.get("version") != VERSION:
        raise EngineFailed(f"an engine server sent a manifest of version {manifest.get('version')}, this reader "
                           f"reads {VERSION}: the server's hs-connectors differs from this one's")
    from .states import AUX_KEY

    served = meta.get(AUX_KEY)
    if served is None:
        raise EngineFailed("an engine server does not say which layers it captures: start it with blockdraft's "
                           "Mooncake connector (blockdraft engine --print)")
    if list(served) != list(aux_ids):
        raise EngineFailed(f"an engine server captures hidden_states {list(served)}, this run reads {list(aux_ids)}: "
                           "start the servers for this run's --layer-ids (blockdraft engine --print)")
    if meta.get("num_tokens") != tokens:
        raise EngineFailed(f"an engine server captured {meta.get('num_tokens')} tokens of a {tokens}-token document")


class RemoteEngines:
    """What `Online` stops and reports for remote servers: nothing to stop; each server's share."""

    def __init__(self, servers: Servers, readers: list, store: Store):
        self.servers, self.readers, self.store = servers, readers, store

    def stop(self, remove: bool = False, timeout: float = 0.0) -> list[dict]:
        peak = max((r.peak for r in self.readers), default=0)
        self.store.close()
        return [{**self.servers.served[u], "busy_s": None, "peak_bytes": peak, "endpoint": u}
                for u in self.servers.urls]
