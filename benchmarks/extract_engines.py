"""Feature extraction throughput: `blockdraft extract --engine vllm` against `blockdraft extract`
(transformers) on the same packed rows of the bundled conversations, in one run, as a ratio.

Each side is its own CLI run in its own environment (vLLM's pins another torch); each prints the
tokens it wrote per second of extraction, not counting model loading or the engine's start
(reported beside it).

    python benchmarks/extract_engines.py [--n 64] [--max-length 2048] [--dtype float32] \
        [--vllm-python .venv-ref-vllm/bin/python] [--json benchmarks/results/extract-engines.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"extract: ([\d,]+) tokens \(([^)]*)\) in ([\d.]+) s: ([\d,]+) tokens/s(?:; engine start (\d+) s)?")


def run(python: str, args: list[str], log: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run([python, "-m", "blockdraft", "extract", *args], env=env, stdout=fh,
                            stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    if rc != 0:
        sys.exit(f"extract {' '.join(args)} exited {rc}:\n{text[-3000:]}")
    m = LINE.findall(text)
    if not m:
        sys.exit(f"no throughput line in {log}")
    tokens, what, seconds, _, start = m[-1]
    parts = re.findall(r"([\d.]+) s", what)  # vLLM: the engine's capture, then the shards made here
    split = {"engine_capture_s": float(parts[0]), "shards_s": float(parts[1])} if len(parts) == 2 else {}
    return {"tokens": int(tokens.replace(",", "")), "extract_s": float(seconds), **split,
            "tokens_per_s": int(tokens.replace(",", "")) / float(seconds),
            "engine_start_s": float(start) if start else None, "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=64, help="bundled conversations")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-ref-vllm" / "bin" / "python"))
    ap.add_argument("--main-python", default=sys.executable)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with gzip.open(ROOT / "src" / "blockdraft" / "assets" / "data" / "default.jsonl.gz", "rt") as fh:
            (tmp / "d.jsonl").write_text("".join(next(fh) for _ in range(a.n)))
        common = ["--data", str(tmp / "d.jsonl"), "--max-length", str(a.max_length), "--threads", str(a.threads)]
        hf = run(a.main_python, [*common, "--dtype", a.dtype, "--out", str(tmp / "hf")], tmp / "hf.log")
        vl = run(a.vllm_python, [*common, "--dtype", a.dtype, "--engine", "vllm", "--engine-memory", "0.2",
                                 "--out", str(tmp / "vllm")], tmp / "vllm.log")
    out = {"command": "python benchmarks/extract_engines.py " + " ".join(sys.argv[1:]), "conversations": a.n,
           "max_length": a.max_length, "dtype": a.dtype, "threads": a.threads, "machine": platform.processor() or
           platform.machine(), "transformers": hf, "vllm": vl,
           "ratio_vllm_over_transformers": round(vl["tokens_per_s"] / hf["tokens_per_s"], 2)}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
