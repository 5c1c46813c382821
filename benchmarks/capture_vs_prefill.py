"""vLLM's own prefill rate and blockdraft's capture rate on the same documents, the same engine settings
and the same cores, in one process of vLLM's environment (run by `benchmarks/online.py`; PYTHONPATH=src):

    python benchmarks/capture_vs_prefill.py DOCS.json JOB.json OUT.json

DOCS: {"documents": [[token ids], ...]}; JOB: the capture job (feed.engine_kwargs' fields). Each engine
first runs a few documents to warm up (compilation), then all of them once, timed: vLLM's prefill with
`generate(max_tokens=1)` and no capture; blockdraft's `VllmCapturer.capture` (vLLM's extract_hidden_states
method and blockdraft's connector, every document's states written). The two engines run one after the
other, never together."""

from __future__ import annotations

import gc
import json
import shutil
import sys
import time
from pathlib import Path


def timed(fn, docs, warm):
    fn(docs[:warm])
    t0 = time.perf_counter()
    fn(docs)
    return time.perf_counter() - t0


def main(docs_path: str, job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from blockdraft.engines.vllm.feed import VllmCapturer, engine_kwargs

    docs = json.loads(Path(docs_path).read_text())["documents"]
    job = json.loads(Path(job_path).read_text())
    tokens, warm = sum(map(len, docs)), min(4, len(docs))
    plain = {k: v for k, v in engine_kwargs(job).items() if k not in ("speculative_config", "kv_transfer_config")}
    llm = LLM(**plain)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prefill_s = timed(lambda d: llm.generate([{"prompt_token_ids": x} for x in d], params, use_tqdm=False), docs, warm)
    del llm
    gc.collect()
    cap = VllmCapturer(job)

    def capture(d):
        for p in cap.capture(d):
            Path(p).unlink()

    capture_s = timed(capture, docs, warm)
    shutil.rmtree(job["tmp_dir"], ignore_errors=True)
    Path(out_path).write_text(json.dumps({"documents": len(docs), "tokens": tokens, "prefill_s": prefill_s,
                                          "capture_s": capture_s, "prefill_tokens_per_s": tokens / prefill_s,
                                          "capture_tokens_per_s": tokens / capture_s,
                                          "capture_over_prefill": prefill_s / capture_s}, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
