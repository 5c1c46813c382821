"""Peak memory of one training step minus the weights, at Qwen's, GLM's and DeepSeek's vocabularies,
before and after the loss made its label logits chunk by chunk (issue 50, item 6).

    python benchmarks/loss_vocab.py --json benchmarks/results/loss-vocab.json

Each configuration (vocabulary, loss, code) runs in a fresh process on one CPU thread: a random
Qwen3-shaped target with a small hidden size (128) and the given vocabulary, a 1-layer drafter, one
packed row of 2048 tokens (two documents) with 128 blocks of 16 (1,920 supervised slots at most; the
labels' rows are the distinct label positions, fewer where blocks overlap). The figure is the rise of the peak
resident set (VmHWM, glibc told to hand freed memory back at once) over the resident set once the
models are loaded: the step's activations, labels, loss chunks and the drafter's gradients and
AdamW state, none of which holds the vocabulary but the labels and the chunks.

`before` is the step of another commit (`--before`, default the main branch before this change),
its src/ unpacked by `git archive` into a temporary directory and put first on the subprocess's
path; `after` is this tree's. Two chunk rules: `cpu`, the CPU's fixed 256 slots per chunk (a
chunk's rows grow with the vocabulary, as they do on a CPU run), and `budget`, the CUDA rule
(`blockdraft.plan.chunk_slots`) given a fixed free memory, so that a chunk holds about the same
number of vocabulary entries at every vocabulary, as it does on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCABS = (49_152, 151_552, 163_840)  # Qwen2.5-Coder/SmolLM2-class 49k, GLM-4.5's 151,552, DeepSeek-V3's-class 163,840
SPEC = dict(H=128, I=384, hd=32, layers=1, rows=1, L=2048, A=128, B=16)
BUDGET = 32 * 12 * 256 * 163_840  # the free memory the `budget` rule sizes chunks from (256 slots at 163,840)
BEFORE = "404c76e"  # main before the label side was chunked


def measure(spec: dict) -> dict:
    """In this (fresh) process: the peak resident set of one optimizer step over the loaded models."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_plan

    import blockdraft.train.step as step_mod
    from blockdraft.plan import chunk_slots
    from blockdraft.train import train_step

    torch.set_num_threads(1)
    if spec["chunks"] == "budget":
        step_mod.loss_chunk_slots = lambda device, width: chunk_slots(BUDGET, width)
    t, d, batch = memory_plan._build(spec)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-4)
    base = memory_plan._rss()
    start = time.perf_counter()
    m = train_step(t, d, opt, batch, max_anchors=spec["A"], generator=torch.Generator().manual_seed(0),
                   backend="chunked", loss=spec["loss"])
    seconds = time.perf_counter() - start
    peak = memory_plan._peak_rss()
    return {"base": base, "peak": peak, "rise": peak - base, "seconds": seconds, "loss": m["loss"],
            "slots": m["supervised_slots"]}


def before_tree(rev: str, where: str) -> tuple[str, str]:
    """`rev`'s src/ unpacked into the directory `where`: (its path, the full commit hash)."""
    full = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True,
                          text=True).stdout.strip()
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", full, "src"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(where, filter="data")
    return str(Path(where) / "src"), full


def run(spec: dict, src: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", PYTHONPATH=src)
    out = subprocess.run([sys.executable, __file__, "--measure", json.dumps(spec)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE, help=f"the commit to compare with (default {BEFORE})")
    ap.add_argument("--losses", default="kl,hard")
    ap.add_argument("--chunks", default="cpu,budget", help="chunk rules: cpu (256 slots), budget (the CUDA rule)")
    ap.add_argument("--vocabs", default=",".join(map(str, VOCABS)))
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.measure:
        print(json.dumps(measure(json.loads(a.measure))))
        return None
    with tempfile.TemporaryDirectory(prefix="loss-vocab-before-") as where:
        return compare(a, argv, *before_tree(a.before, where))


def compare(a, argv, old_src: str, old_rev: str) -> dict:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    rows = []
    for chunks in a.chunks.split(","):
        for loss in a.losses.split(","):
            for V in map(int, a.vocabs.split(",")):
                for code, src in (("before", old_src), ("after", str(ROOT / "src"))):
                    spec = dict(SPEC, V=V, loss=loss, chunks=chunks)
                    got = run(spec, src)
                    rows.append({"code": code, "vocab": V, "loss": loss, "chunks": chunks,
                                 "rise_mib": round(got["rise"] / 2**20, 1), "base_mib": round(got["base"] / 2**20, 1),
                                 "step_s": round(got["seconds"], 2), "loss_value": got["loss"], "slots": got["slots"]})
                    print(f"{chunks:>6} {loss:>4} V={V:>7} {code:>6}: peak - weights {rows[-1]['rise_mib']:8.1f} MiB, "
                          f"step {got['seconds']:.2f} s, loss {got['loss']:.6f}", flush=True)
    res = {"command": "python benchmarks/loss_vocab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "before": old_rev, "after": head, "spec": SPEC, "budget_bytes": BUDGET, "threads": 1, "rows": rows}
    if a.json:  # whole or not at all: a crash or a full disk leaves the last file as it was
        tmp = Path(a.json).with_name(Path(a.json).name + ".tmp")
        tmp.write_text(json.dumps(res, indent=1) + "\n")
        os.replace(tmp, a.json)
    return res


if __name__ == "__main__":
    main()
