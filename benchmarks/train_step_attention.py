"""Benchmark: one drafter training step with the chunked attention path vs. a dense-mask baseline.

The claim under test (from the project's issue): attention over the context must not cost
the full Q x T rectangle when most of it is masked (a block sees at most its anchor's
document prefix), and padded anchors must cost nothing. Goal: the fast step is at least
1.5x faster and uses at most 0.6x the peak memory of the dense step.

Workload (no real target model is loaded; everything is random but seeded)
--------------------------------------------------------------------------
* DrafterConfig with SmolLM2-135M-like geometry: hidden 576, 9 query / 3 key-value heads,
  head_dim 64, intermediate 1536, vocab 49152, target of 30 layers with feature layers
  [1, 8, 14, 21, 27] (so features are [T, 5*576 = 2880]), `--layers` drafter layers
  (default 2), block size `--block` (default 16).
* A frozen random `lm_head` nn.Linear(576, 49152) stands in for the target's head, random
  features [T, 2880] for the captured target layers, random block embeddings [N, B, 576]
  for the target's (frozen) embedding of the block tokens, and random target logits
  [S, 49152] as labels of the S supervised slots. None of these require grad; only the
  drafter's parameters do.
* Layout: one packed sequence of T = `--seq` positions holding `--docs` documents of
  unequal lengths (weights n-i+1/2, e.g. 1152/896/640/384 for T=3072, 4 docs). Each
  document is a conversation: alternating user turns (loss_mask 0, 30-150 tokens) and
  assistant turns (loss_mask 1, 80-400 tokens). Anchors come from
  `sample_anchors(document_ids, loss_mask, B, max_anchors=V)` with V = `--valid-anchors`
  (default: `--anchors`); if fewer positions are eligible, fewer are returned.
  `supervised_slots` gives the [N, B] slots that carry loss.

What the two sides compute (same weights, same inputs, same loss)
-----------------------------------------------------------------
* fast  ("chunked" backend): the drafter runs on the N valid anchors only (sorted), with
  BlockLayout(max_chunk_blocks=`--chunk-blocks`): consecutive blocks of one document are
  grouped into chunks and each chunk's SDPA reads only its context range
  [document start, last anchor) plus its own block rows.
* dense (baseline, "dense" backend): the anchor list is padded up to `--anchors` slots
  (the maximum) with dummy anchors at position 0, whose block embeddings are random and
  whose slots are all unsupervised (zero loss weight). Every layer runs one SDPA over all
  Q = anchors*B queries and T + Q keys with the reference boolean mask
  `anchor_block_mask` [Q, T+Q] (rebuilt by the backend on every layer call, as the
  library does).
* Both sides then take the final hidden states of the supervised slots only (row-major,
  so the padded rows contribute nothing and the order is identical), apply the frozen
  lm_head and `dflash_loss(kind=--loss, gamma=default_gamma(B))` (slot-weighted soft
  cross-entropy by default), and call backward() into the drafter's parameters.
  The BlockLayout is built inside the timed step on both sides (chunk planning is part of
  the fast path's cost); anchor sampling and random inputs are set-up, not timed.
* Equivalence: the script asserts that both sides give the same loss (relative 1e-4) and
  the same gradient norm of the drafter parameters (relative 1e-3), so the benchmark also
  proves that the padded anchors and the chunking change nothing in the result.

How time and memory are measured
--------------------------------
Each side runs in its own fresh Python subprocess (this file re-invoked with `--worker`),
one after the other, with torch.set_num_threads(`--threads`). In the subprocess:
set-up, one warm-up step (its loss and grad norm are the values compared), then
`gc.collect()` and glibc `malloc_trim(0)` so that freed heap pages go back to the OS, then
the resident set size RSS0 is read from /proc/self/status, the kernel's peak-RSS
high-water mark is reset (`echo 5 > /proc/self/clear_refs`), `--repeats` steps are timed
with time.perf_counter (gradients are set to None before each step), and the peak memory
of a step is VmHWM - RSS0: the largest amount of extra physical memory the training step
needed above everything that existed before it (weights, inputs, labels). It is what the
OS sees, so it includes allocator overhead and SDPA scratch buffers that tensor-level
accounting would miss. If the high-water mark cannot be reset (non-Linux, no permission)
ru_maxrss - RSS0 is reported instead and flagged as an upper bound (it then also contains
the set-up peak). The reported time is the median of the repeats. Ratios (fast / dense)
come from one invocation of the script; absolute numbers depend on the machine.

Usage
-----
    python benchmarks/train_step_attention.py                 # seq 3072, 512 anchors, block 16
    python benchmarks/train_step_attention.py --valid-anchors 384   # dense pads 128 anchor slots
    python benchmarks/train_step_attention.py --chunk-sweep 8,16,64 # extra fast-side timings
    python benchmarks/train_step_attention.py --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

LOSS_RTOL = 1e-4
GRAD_RTOL = 1e-3
GOAL_SPEEDUP = 1.5
GOAL_MEMORY = 0.6


# ----------------------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=3072, help="packed sequence length T")
    p.add_argument("--anchors", type=int, default=512, help="anchor slots (the maximum; dense pads to this)")
    p.add_argument("--valid-anchors", type=int, default=None,
                   help="max_anchors passed to sample_anchors (default: --anchors); the fast side uses "
                        "what is sampled, the dense side pads it up to --anchors")
    p.add_argument("--block", type=int, default=16, help="block size B")
    p.add_argument("--layers", type=int, default=2, help="drafter layers")
    p.add_argument("--docs", type=int, default=4, help="documents packed into the sequence")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per side (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--chunk-blocks", type=int, default=32, help="BlockLayout.max_chunk_blocks of the fast side")
    p.add_argument("--chunk-sweep", type=str, default="",
                   help="comma-separated extra max_chunk_blocks values to time on the fast side")
    p.add_argument("--loss", choices=("soft", "hard", "kl"), default="soft")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="write the results to this file")
    # internal: run one side in this process and write its result to --result
    p.add_argument("--worker", choices=("fast", "dense"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=str, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.valid_anchors is None:
        args.valid_anchors = args.anchors
    if not 1 <= args.valid_anchors <= args.anchors:
        p.error("--valid-anchors must be in [1, --anchors]")
    return args


# ----------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.M)
    if m is None:
        raise OSError(f"{field} not in /proc/self/status")
    return int(m.group(1))


def current_rss_bytes() -> int:
    try:
        return _status_kib("VmRSS") * 1024
    except OSError:
        return 0


def release_free_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmHWM") * 1024 <= current_rss_bytes() + (1 << 20)
    except OSError:
        return False


def peak_rss_bytes() -> int:
    try:
        return _status_kib("VmHWM") * 1024
    except OSError:  # ru_maxrss is KiB on Linux, bytes on macOS
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r if sys.platform == "darwin" else r * 1024


# ----------------------------------------------------------------------------- workload
def drafter_config(args):
    from blockdraft.config import DrafterConfig

    return DrafterConfig(target_hidden_size=576, target_num_layers=30, target_layer_ids=[1, 8, 14, 21, 27],
                         vocab_size=49152, mask_token_id=16, hidden_size=576, num_hidden_layers=args.layers,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                         block_size=args.block)


def packed_layout(T: int, docs: int, gen):
    """document_ids, position_ids, loss_mask [T] of `docs` unequal conversations."""
    import torch

    weights = [docs - i + 0.5 for i in range(docs)]
    lengths = [int(T * w / sum(weights)) for w in weights]
    lengths[0] += T - sum(lengths)
    doc_ids, pos_ids, mask = [], [], []
    for d, n in enumerate(lengths):
        doc_ids.append(torch.full((n,), d, dtype=torch.long))
        pos_ids.append(torch.arange(n))
        m = torch.zeros(n, dtype=torch.long)
        i, assistant = 0, False
        while i < n:
            lo, hi = (80, 400) if assistant else (30, 150)
            run = int(torch.randint(lo, hi + 1, (1,), generator=gen))
            if assistant:
                m[i:i + run] = 1
            i += run
            assistant = not assistant
        mask.append(m)
    return torch.cat(doc_ids), torch.cat(pos_ids), torch.cat(mask)


def build(args, side: str):
    """Everything the timed step needs, identical on both sides for the valid anchors."""
    import torch
    from torch import nn

    from blockdraft.model.blocks import supervised_slots
    from blockdraft.model.drafter import DFlashDrafter
    from blockdraft.train.anchors import sample_anchors

    cfg = drafter_config(args)
    T, B, H, V = args.seq, args.block, cfg.hidden_size, cfg.vocab_size
    torch.manual_seed(args.seed)
    drafter = DFlashDrafter(cfg).train()
    lm_head = nn.Linear(H, V, bias=False)
    nn.init.normal_(lm_head.weight, std=0.02)
    lm_head.requires_grad_(False)

    gen = torch.Generator().manual_seed(args.seed + 1)
    document_ids, position_ids, loss_mask = packed_layout(T, args.docs, gen)
    anchors = sample_anchors(document_ids, loss_mask, B, args.valid_anchors, generator=gen)
    sup = supervised_slots(document_ids, loss_mask, anchors, B)  # [N, B]
    N, S = int(anchors.numel()), int(sup.sum())
    features = torch.randn(T, cfg.feature_size, generator=gen)
    embeds = torch.randn(N, B, H, generator=gen)
    target_logits = 2.0 * torch.randn(S, V, generator=gen)

    n_pad = args.anchors - N
    if side == "dense" and n_pad > 0:
        pad_gen = torch.Generator().manual_seed(args.seed + 2)
        anchors = torch.cat([anchors, torch.zeros(n_pad, dtype=torch.long)])  # dummy anchors at position 0
        embeds = torch.cat([embeds, torch.randn(n_pad, B, H, generator=pad_gen)])
        sup = torch.cat([sup, torch.zeros(n_pad, B, dtype=torch.bool)])  # zero loss weight
    return dict(cfg=cfg, drafter=drafter, lm_head=lm_head, document_ids=document_ids, position_ids=position_ids,
                loss_mask=loss_mask, anchors=anchors, sup=sup, features=features, embeds=embeds,
                target_logits=target_logits, n_valid=N, n_pad=n_pad if side == "dense" else 0, supervised=S)


def train_step(w, backend: str, chunk_blocks: int, loss_kind: str):
    """Forward + backward of one step; returns the loss value."""
    from blockdraft.model.attention import BlockLayout
    from blockdraft.train.loss import default_gamma, dflash_loss

    B = w["cfg"].block_size
    layout = BlockLayout(w["document_ids"], w["position_ids"], w["anchors"], B, max_chunk_blocks=chunk_blocks)
    hidden = w["drafter"](w["features"], w["embeds"], layout, backend)  # [N, B, H]
    draft_logits = w["lm_head"](hidden[w["sup"]])  # [S, V], supervised slots only
    loss, _ = dflash_loss(draft_logits, w["target_logits"], w["sup"], gamma=default_gamma(B), kind=loss_kind)
    loss.backward()
    return float(loss.detach())


def attention_work(w, backend: str, chunk_blocks: int) -> dict:
    """Score-matrix elements per head and layer that SDPA is asked to compute."""
    from blockdraft.model.attention import BlockLayout

    T, B = w["document_ids"].shape[0], w["cfg"].block_size
    N = int(w["anchors"].numel())
    if backend == "dense":
        return {"sdpa_calls_per_layer": 1, "score_elements": N * B * (T + N * B)}
    layout = BlockLayout(w["document_ids"], w["position_ids"], w["anchors"], B, max_chunk_blocks=chunk_blocks)
    chunks = layout.chunks(None)
    elems = sum((c.j1 - c.j0) * B * ((c.hi - c.lo) + (c.j1 - c.j0) * B) for c in chunks)
    return {"sdpa_calls_per_layer": len(chunks), "score_elements": elems}


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    side = args.worker
    backend = "chunked" if side == "fast" else "dense"
    t0 = time.perf_counter()
    w = build(args, side)
    setup_s = time.perf_counter() - t0
    params = [p for p in w["drafter"].parameters() if p.requires_grad]

    def zero_grad():
        for p in params:
            p.grad = None

    zero_grad()
    t0 = time.perf_counter()
    loss = train_step(w, backend, args.chunk_blocks, args.loss)
    warmup_s = time.perf_counter() - t0
    grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
    zero_grad()

    release_free_memory()
    rss0 = current_rss_bytes()
    exact = reset_peak_rss()
    if not exact:
        rss0 = current_rss_bytes()
    times = []
    for _ in range(args.repeats):
        zero_grad()
        t0 = time.perf_counter()
        loss_r = train_step(w, backend, args.chunk_blocks, args.loss)
        times.append(time.perf_counter() - t0)
        if abs(loss_r - loss) > 1e-5 * max(1.0, abs(loss)):
            raise AssertionError(f"{side}: loss changed between repeats ({loss} -> {loss_r})")
    peak = peak_rss_bytes() - rss0
    return {
        "side": side, "backend": backend, "chunk_blocks": args.chunk_blocks if side == "fast" else None,
        "time_s": statistics.median(times), "times_s": times, "warmup_s": warmup_s, "setup_s": setup_s,
        "peak_bytes": peak, "baseline_rss_bytes": rss0,
        "memory_method": "VmHWM-after-reset minus RSS0" if exact else "ru_maxrss minus RSS0 (upper bound)",
        "loss": loss, "grad_norm": grad_norm, "valid_anchors": w["n_valid"], "padded_anchors": w["n_pad"],
        "queries": int(w["anchors"].numel()) * w["cfg"].block_size, "supervised_slots": w["supervised"],
        **attention_work(w, backend, args.chunk_blocks),
    }


# ----------------------------------------------------------------------------- driver
def run_side(args, side: str, chunk_blocks: int | None = None) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", side]
    for name in ("seq", "anchors", "valid_anchors", "block", "layers", "docs", "repeats", "threads",
                 "chunk_blocks", "loss", "seed"):
        value = getattr(args, name)
        if name == "chunk_blocks" and chunk_blocks is not None:
            value = chunk_blocks
        argv += ["--" + name.replace("_", "-"), str(value)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        t0 = time.perf_counter()
        proc = subprocess.run(argv + ["--result", out], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(out):
            why = "killed by signal %d (out of memory?)" % -proc.returncode if proc.returncode < 0 else \
                "exit status %d" % proc.returncode
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"{side} side failed after {wall:.0f} s: {why}")
        with open(out) as f:
            res = json.load(f)
    res["process_wall_s"] = wall
    return res


def mib(b: float) -> float:
    return b / 2 ** 20


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        res = worker(args)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0

    import torch

    print(f"train step fwd+bwd fp32 | seq {args.seq}, anchors {args.anchors} (sampled max {args.valid_anchors}), "
          f"block {args.block}, drafter 576 x {args.layers} layers, {args.docs} docs, loss {args.loss}, "
          f"threads {args.threads}, torch {torch.__version__}", flush=True)
    fast = run_side(args, "fast")
    dense = run_side(args, "dense")
    sweep = [run_side(args, "fast", int(c)) for c in args.chunk_sweep.split(",") if c.strip()]

    print(f"valid anchors {fast['valid_anchors']}, dense pads {dense['padded_anchors']} -> "
          f"Q = {dense['queries']} queries x {args.seq + dense['queries']} keys; "
          f"supervised slots {fast['supervised_slots']}")
    print(f"{'backend':<22}{'time s':>9}{'peak MiB':>11}{'SDPA calls/layer':>18}{'score elems':>14}"
          f"{'loss':>12}{'grad norm':>12}")
    for r in [dense, fast] + sweep:
        name = r["backend"] + (f" (chunk {r['chunk_blocks']})" if r["chunk_blocks"] else "")
        print(f"{name:<22}{r['time_s']:>9.2f}{mib(r['peak_bytes']):>11.0f}{r['sdpa_calls_per_layer']:>18d}"
              f"{r['score_elements'] / 1e6:>13.1f}M{r['loss']:>12.6f}{r['grad_norm']:>12.6f}")

    speedup = dense["time_s"] / fast["time_s"]
    mem_ratio = fast["peak_bytes"] / dense["peak_bytes"]
    loss_err = abs(fast["loss"] - dense["loss"]) / max(1e-12, abs(dense["loss"]))
    grad_err = abs(fast["grad_norm"] - dense["grad_norm"]) / max(1e-12, abs(dense["grad_norm"]))
    time_ok, mem_ok = speedup >= GOAL_SPEEDUP, mem_ratio <= GOAL_MEMORY
    print(f"time   fast/dense = {fast['time_s'] / dense['time_s']:.3f}  (speed-up {speedup:.2f}x, "
          f"goal >= {GOAL_SPEEDUP}x: {'MET' if time_ok else 'NOT MET'})")
    print(f"memory fast/dense = {mem_ratio:.3f}  (goal <= {GOAL_MEMORY}: {'MET' if mem_ok else 'NOT MET'})")
    print(f"equivalence: loss rel diff {loss_err:.2e} (tol {LOSS_RTOL:g}), grad-norm rel diff {grad_err:.2e} "
          f"(tol {GRAD_RTOL:g})")
    print(f"memory method: {fast['memory_method']}; times are medians of {args.repeats} after 1 warm-up "
          f"(fast {['%.2f' % t for t in fast['times_s']]}, dense {['%.2f' % t for t in dense['times_s']]})")

    results = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "result", "json")},
               "torch": torch.__version__, "fast": fast, "dense": dense, "sweep": sweep,
               "time_ratio_fast_over_dense": fast["time_s"] / dense["time_s"], "speedup": speedup,
               "memory_ratio_fast_over_dense": mem_ratio, "goal_time_met": time_ok, "goal_memory_met": mem_ok,
               "loss_rel_diff": loss_err, "grad_norm_rel_diff": grad_err}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if loss_err > LOSS_RTOL or grad_err > GRAD_RTOL:
        print("EQUIVALENCE FAILED: the two sides do not compute the same step", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
