"""Target features from vLLM (`blockdraft extract --engine vllm`).

vLLM runs the target with its own kernels and parallelism (tensor, pipeline; data parallel as
independent engine replicas) under its `extract_hidden_states` speculative method, which stores
the states entering chosen layers of every prompt token; a hidden-states connector writes them
to one safetensors file per request (`hidden_states` [T, k, Ht], `token_ids` [T]). blockdraft
asks for:

* the ids `hidden_states_index(L)` of its feature layers L (clause 1: vLLM's aux id k is the
  input of layer k, transformers' `hidden_states[k]`, which is the output of layer k - 1), and
* id n (n decoder layers): the last layer's output *before* the final norm, to which the parent
  applies the target's own final-norm module (transformers', loaded from the checkpoint: never a
  re-implemented norm, never twice) for the final state that the labels come from (clause 3).

A packed row holds several documents (positions restart at 0 for each, and for the padding);
transformers keeps attention inside each, so each is its own vLLM request, and the row is put
back together from them. Each request's file is renamed to its segment's name once written, so a
run that stops is resumed from the segments still missing.

    python -m blockdraft.engines.vllm.capture JOB.json   (run by `capture`, in its own process)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from ...data.features import ENGINE_STATES as STATES  # the segment files' folder inside the cache directory
from ...target import hidden_states_index


def capture_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """The aux ids vLLM is asked for: the feature layers' (through clause 1's one owner function),
    then the last layer's output (id n), ascending and each once, as vLLM returns them."""
    return sorted({hidden_states_index(L) for L in layer_ids} | {num_layers})


def segments(rows: dict, idx) -> list[tuple[int, int, int]]:
    """(row, start, end) of each document (and of the padding) in the given rows: the spans that
    start where the position ids restart at 0."""
    out = []
    for r in [int(i) for i in idx]:
        pos = rows["position_ids"][r]
        starts = (pos == 0).nonzero()[:, 0].tolist()
        if not starts or starts[0] != 0:
            raise ValueError(f"row {r}: positions must start at 0 (packed rows restart them per document)")
        ends = starts[1:] + [pos.numel()]
        out.extend((r, s, e) for s, e in zip(starts, ends))
    return out


def segment_name(seg: tuple[int, int, int]) -> str:
    return f"r{seg[0]:07d}-{seg[1]:05d}-{seg[2]:05d}"


def engine_kwargs(job: dict) -> dict:
    """vLLM's `LLM(...)` arguments for a capture job (also what the tests and the README name)."""
    connector = {"kv_connector": job.get("connector", "HostHiddenStatesConnector"), "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": job["tmp_dir"]}}
    if connector["kv_connector"] == "HostHiddenStatesConnector":
        connector["kv_connector_module_path"] = "blockdraft.engines.vllm.connector"
    return dict(model=job["target"], dtype=job["dtype"], gpu_memory_utilization=job.get("memory", 0.9),
                max_model_len=job["max_model_len"], seed=0, enable_prefix_caching=False,  # a cached prefix
                tensor_parallel_size=job.get("tensor_parallel_size", 1),  # would be skipped, its states unwritten
                pipeline_parallel_size=job.get("pipeline_parallel_size", 1),
                speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
                                                                         job["aux_ids"]}}},
                kv_transfer_config=connector)


def _wait_written(path: str) -> None:
    """vLLM's connector writes on a thread and holds a lock file until the file is complete."""
    import fcntl

    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as fh:
            fcntl.flock(fh, fcntl.LOCK_SH)
        os.remove(lock)


def serve_capture(job: dict) -> dict:
    """Run in the engine's process: every segment of the job gets its file, a chunk at a time."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(job))
    t1 = time.perf_counter()
    out_dir, todo = Path(job["out_dir"]), job["segments"]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    chunk, tokens = int(job.get("chunk", 256)), 0
    for i in range(0, len(todo), chunk):
        part = todo[i:i + chunk]
        outs = llm.generate([{"prompt_token_ids": ids} for _, ids in part], params, use_tqdm=False)
        for (name, ids), o in zip(part, outs):
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError("vLLM returned no hidden-states file: is the connector configured?")
            _wait_written(path)
            os.replace(path, out_dir / f"{name}.safetensors")
            tokens += len(ids)
        print(f"blockdraft capture: {min(i + chunk, len(todo))}/{len(todo)} segments", flush=True)
    return {"load_s": t1 - t0, "capture_s": time.perf_counter() - t1, "tokens": tokens}


def capture(job: dict, *, replicas: int = 1, gpus_per_replica: int = 0, timeout: float | None = None) -> list[dict]:
    """Write the job's segment files with `replicas` engine processes, each on its own
    `gpus_per_replica` GPUs (data parallel over disjoint segments); returns each one's figures."""
    out_dir = Path(job["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for k in range(replicas):
        part = job["segments"][k::replicas]
        if not part:
            continue
        tmp = out_dir / f".engine-{k}"
        shutil.rmtree(tmp, ignore_errors=True)  # a killed engine's files (extract holds the cache's lock)
        tmp.mkdir()
        sub = dict(job, segments=part, tmp_dir=str(tmp))
        path = out_dir / f".job-{k}.json"
        path.write_text(json.dumps(sub))
        env = dict(os.environ)
        if gpus_per_replica:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(k * gpus_per_replica + g) for g in range(gpus_per_replica))
        procs.append((path, subprocess.Popen([sys.executable, "-m", "blockdraft.engines.vllm.capture", str(path)],
                                             env=env)))
    results, failed = [], []
    for path, p in procs:
        rc = p.wait(timeout=timeout)
        if rc != 0:
            failed.append(f"{path.name}: exit {rc}")
        else:
            results.append(json.loads(path.with_suffix(".out.json").read_text()))
    if failed:
        raise RuntimeError("vLLM capture failed (" + "; ".join(failed) + "); its log is above. Rerun the same "
                           "command: the segments already written are kept")
    return results


class EngineOutputs:
    """A shard's target outputs, put together from the engine's segment files: features of the
    chosen layers, the final state from the target's own final norm, and the argmax."""

    def __init__(self, target, rows: dict, states_dir: str | os.PathLike, final_norm):
        self.target, self.rows, self.dir, self.norm = target, rows, Path(states_dir), final_norm
        self.ids = capture_ids(target.layer_ids, target.num_layers)
        self.pick = [self.ids.index(hidden_states_index(L)) for L in target.layer_ids]  # config order

    def path(self, seg) -> Path:
        return self.dir / f"{segment_name(seg)}.safetensors"

    def missing(self, idx) -> list[tuple[int, int, int]]:
        return [s for s in segments(self.rows, idx) if not self.path(s).exists()]

    @torch.no_grad()
    def __call__(self, idx):
        from safetensors.torch import load_file

        from ...data.features import StoredOutputs, full_argmax

        n, L, H = len(idx), self.rows["input_ids"].shape[1], self.target.hidden_size
        dev, dt = self.target.device, self.target.dtype
        feats = torch.empty(n, L, len(self.pick) * H, dtype=dt)
        last = torch.empty(n, L, H, dtype=dt)
        where = {int(r): i for i, r in enumerate(idx)}
        for seg in segments(self.rows, idx):
            r, s, e = seg
            got = load_file(str(self.path(seg)))
            want = self.rows["input_ids"][r, s:e]
            if not torch.equal(got["token_ids"].to(want.dtype), want):
                raise ValueError(f"{self.path(seg)} holds other tokens than row {r} [{s}:{e}]; delete "
                                 f"{self.dir} and rerun")
            hs = got["hidden_states"]  # [T, k, Ht] in `self.ids` order
            if hs.shape[1:] != (len(self.ids), H):
                raise ValueError(f"{self.path(seg)} has states {tuple(hs.shape)}, expected [T, {len(self.ids)}, {H}]")
            feats[where[r], s:e] = hs[:, self.pick].reshape(e - s, -1).to(dt)
            last[where[r], s:e] = hs[:, -1].to(dt)
        final = torch.cat([self.norm(last[i:i + 1].to(dev)).cpu() for i in range(n)])
        return StoredOutputs(feats, final, full_argmax(self.target, final.to(dev)).cpu())

    def done(self, idx) -> None:
        """Delete the segment files a written shard no longer needs."""
        for seg in segments(self.rows, idx):
            self.path(seg).unlink(missing_ok=True)


if __name__ == "__main__":
    job_path = Path(sys.argv[1])
    result = serve_capture(json.loads(job_path.read_text()))
    job_path.with_suffix(".out.json").write_text(json.dumps(result))
