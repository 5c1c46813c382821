"""One engine replica feeding a spool (`spool.py`): vLLM runs the target under its `extract_hidden_states`
method, and every document a client asks for gets its states file, in the order the clients read.

    python -m blockdraft.engines.vllm.feed JOB.json      (started by `launch.start_engines`)

JOB: the engine's arguments (`engine_kwargs`), the spool, its byte budget, where to write the status,
and how much to capture at once. The status file (JSON, rewritten atomically) says `state` (starting,
ready, stopped, failed), the engine's pid, a heartbeat, the dtype and quantization vLLM serves, the
tokens and items captured and the peak of the spool's claimed bytes. The process stops when a client
writes the spool's stop file, or when the process that started it is gone (a killed trainer leaves no
engine holding its GPUs).

Runs in vLLM's own environment: it imports the spool protocol and vLLM, nothing of blockdraft's
training code.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from .spool import Spool

CONNECTOR_MODULE = "blockdraft.engines.vllm.connector"


def engine_kwargs(job: dict) -> dict:
    """vLLM's `LLM(...)` arguments for a capture engine (also what the tests and the README name).

    Prefix caching is off: a cached prefix's states would not be written; no tokenizer is loaded (the
    requests are token ids). On a CPU the KV space is given in bytes (`kv_bytes`), so vLLM does not ask
    for a share of the node's memory up front."""
    connector = {"kv_connector": "BlockdraftHiddenStatesConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                 "kv_role": "kv_producer", "kv_connector_extra_config": {
                     "shared_storage_path": job["tmp_dir"], "blockdraft_states": job.get("states", "engine")}}
    kw = dict(model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              skip_tokenizer_init=True,  # requests are token ids: no tokenizer is loaded, none is needed
              enable_prefix_caching=False, tensor_parallel_size=job.get("tensor_parallel_size", 1),
              pipeline_parallel_size=job.get("pipeline_parallel_size", 1),
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
                                                                       job["aux_ids"]}}},
              kv_transfer_config=connector)
    if job.get("kv_bytes"):
        kw["kv_cache_memory_bytes"] = int(job["kv_bytes"])
    else:
        kw["gpu_memory_utilization"] = job.get("memory", 0.9)
    if job.get("quantization"):
        kw["quantization"] = job["quantization"]
    if job.get("enforce_eager"):
        kw["enforce_eager"] = True
    if job.get("expert_parallel"):
        kw["enable_expert_parallel"] = True
    return kw


def wait_written(path: str) -> None:
    """vLLM's connector writes on a thread and holds a lock file until the file is complete."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as fh:
            fcntl.flock(fh, fcntl.LOCK_SH)
        os.remove(lock)


def layout(parallel) -> dict:
    """A replica's layout as vLLM's parallel config holds it."""
    return {"tensor_parallel": int(parallel.tensor_parallel_size),
            "pipeline_parallel": int(parallel.pipeline_parallel_size),
            "expert_parallel": bool(parallel.enable_expert_parallel)}


class VllmCapturer:
    """vLLM under `extract_hidden_states`, fed one document at a time: `submit` queues a document in the
    engine (its core process runs whatever is queued, batch after batch), `finished` takes one engine step
    and returns the documents it completed, each with its states file."""

    def __init__(self, job: dict):
        from vllm import LLM, SamplingParams

        self.llm = LLM(**engine_kwargs(job))
        self.engine = self.llm.llm_engine
        self.params = SamplingParams(temperature=0.0, max_tokens=1)
        sched = self.engine.vllm_config.scheduler_config
        self.batch_tokens = int(getattr(sched, "max_num_batched_tokens", 0) or 8192)  # one scheduler step's
        self._n = 0

    def describe(self) -> dict:
        """What vLLM says it runs: the dtype, the quantization and the layout (`layout`)."""
        mc = self.engine.model_config
        return {"dtype": str(mc.dtype).replace("torch.", ""), "quantization": getattr(mc, "quantization", None),
                "layout": layout(self.engine.vllm_config.parallel_config)}

    def submit(self, ids: list[int]) -> str:
        self._n += 1
        rid = f"d{self._n}"
        self.engine.add_request(rid, {"prompt_token_ids": ids}, self.params)
        return rid

    def finished(self) -> list[tuple[str, str]]:
        out = []
        for o in self.engine.step():
            if o.finished:
                path = (o.kv_transfer_params or {}).get("hidden_states_path")
                if path is None:
                    raise RuntimeError("vLLM returned no hidden-states file: is the connector configured?")
                wait_written(path)
                out.append((o.request_id, path))
        return out

    def capture(self, documents: list[list[int]]) -> list[str]:
        """Every document's states file, in order (all submitted at once)."""
        return drain(self, documents)


def drain(capturer, documents: list[list[int]]) -> list[str]:
    """Submit the documents and step until all are done: their files, in order."""
    rids = [capturer.submit(ids) for ids in documents]
    got: dict = {}
    while len(got) < len(rids):
        got.update(capturer.finished())
    return [got[r] for r in rids]


STAND_IN = "BLOCKDRAFT_ENGINE_STAND_IN"  # `module:name` of a capturer that stands in for vLLM (tests, benchmarks)


def make_capturer(job: dict):
    """vLLM's; or, where the environment names one in `STAND_IN`, that callable, called with the job
    (the CPU tests run the spool, the trainer and extract against transformers this way)."""
    name = os.environ.get(STAND_IN)
    if not name:
        return VllmCapturer(job)
    import importlib

    module, attr = name.split(":")
    return getattr(importlib.import_module(module), attr)(job)


class Status:
    def __init__(self, path: str | os.PathLike):
        self.path, self.fields = Path(path), {"pid": os.getpid(), "started": time.time()}
        self._last = 0.0

    def write(self, **fields) -> None:
        self.fields.update(fields, beat=time.time())
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.fields))
        os.replace(tmp, self.path)
        self._last = time.monotonic()

    def beat(self, **fields) -> None:
        if fields or time.monotonic() - self._last > 1.0:
            self.write(**fields)


def serve(job: dict) -> None:
    """The engine's loop: documents of claimed items are queued in the engine while it holds under two of its
    scheduler steps' worth (so it always has the next batch while the last is handed over), one engine step
    is taken, and every item whose documents are all done is delivered."""
    spool = Spool(job["spool"]).make()
    status = Status(job["status"])
    status.write(state="starting")
    parent = os.getppid()
    Path(job["tmp_dir"]).mkdir(parents=True, exist_ok=True)
    capturer = make_capturer(job)
    status.write(state="ready", **capturer.describe(), tokens=0, items=0, peak_bytes=0)
    budget, docs_max = int(job["budget"]), int(job.get("max_documents", 256))
    ahead = min(int(job.get("max_tokens", 65536)), 2 * int(getattr(capturer, "batch_tokens", 8192)))
    inflight: dict[str, tuple] = {}  # request id -> (item, document name, tokens)
    items_open: dict[str, dict] = {}  # item name -> its request and the files done so far
    tokens = items = peak = 0
    busy = 0.0  # seconds with documents in the engine (the capture's own rate: tokens / busy)
    idle = 0.01
    while not spool.stopping():
        if os.getppid() != parent:
            status.write(state="stopped", reason="the process that started it is gone")
            return
        held = sum(n for _, _, n in inflight.values())
        if held < ahead:
            for req, documents in spool.claim(budget, docs_max, ahead - held, int(job.get("replicas", 1))):
                items_open[req.name] = {"req": req, "left": len(documents), "files": {}}
                for name, ids in documents:
                    inflight[capturer.submit(ids)] = (req, name, len(ids))
                if not documents:  # nothing to compute (padding alone)
                    spool.deliver(req, {})
                    del items_open[req.name]
            peak = max(peak, spool.stored_bytes())
        if not inflight:
            status.beat(peak_bytes=peak) if peak > status.fields.get("peak_bytes", 0) else status.beat()
            time.sleep(idle)
            idle = min(0.05, idle * 1.5)  # a reader waiting on an item waits this long at most
            continue
        idle = 0.01
        t0 = time.perf_counter()
        done = capturer.finished()
        busy += time.perf_counter() - t0
        for rid, path in done:
            req, name, n = inflight.pop(rid)
            item = items_open[req.name]
            item["files"][name] = path
            item["left"] -= 1
            tokens += n
            if item["left"] == 0:
                spool.deliver(req, item["files"])
                del items_open[req.name]
                items += 1
        status.beat(tokens=tokens, items=items, peak_bytes=peak, busy_s=round(busy, 3))
    status.write(state="stopped", reason="asked to stop", tokens=tokens, items=items, peak_bytes=peak,
                 busy_s=round(busy, 3))


STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class Signalled(BaseException):
    """A stop signal reached the engine process (a scheduler preempting the job)."""


def _signalled(signum, frame):
    raise Signalled(signal.Signals(signum).name)


def main(path: str) -> int:
    job = json.loads(Path(path).read_text())
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), _signalled)
    try:
        serve(job)
    except Signalled as e:  # not a fault: the readers stop as preempted (launch.Replica.signalled)
        Status(job["status"]).write(state="stopped", reason=f"{e.args[0]} (a stop signal)", signal=e.args[0])
        return 128 + int(getattr(signal, e.args[0]))
    except BaseException as e:  # the status says why, in one line; the traceback goes to the log
        traceback.print_exc()
        Status(job["status"]).write(state="failed", error=f"{type(e).__name__}: {' '.join(str(e).split())[:500]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
