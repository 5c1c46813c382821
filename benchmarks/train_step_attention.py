"""Benchmark: one drafter training step with the chunked attention path vs. a dense-mask baseline.

The claim under test (from the project's issue): attention over the context must not cost
the full Q x T rectangle when most of it is masked (a block sees at most its anchor's
document prefix), and padded anchors must cost nothing. Goal: the fast step is at least
1.5x faster and needs at most 0.6x the peak memory of the dense step.

Workload (no real target model is loaded; everything is random but seeded)
--------------------------------------------------------------------------
* DrafterConfig with SmolLM2-135M-like geometry: hidden 576, 9 query / 3 key-value heads,
  head_dim 64, intermediate 1536, vocab 49152, mask token 16, a 30-layer target with
  feature layers [1, 8, 14, 21, 27] (features are [T, 5*576 = 2880]), `--layers` drafter
  layers (default 2), block size `--block` (default 16).
* A frozen random `lm_head` nn.Linear(576, 49152) stands in for the target's head; random
  features [T, 2880] for the captured target layers; random block embeddings [N, B, 576]
  for the target's frozen embedding of the block tokens; random target logits [S, 49152]
  as the labels of the S supervised slots. Only the drafter's parameters require grad.
* Layout: one packed sequence of T = `--seq` positions holding `--docs` documents of
  unequal lengths (weights n-i+1/2: 1152/896/640/384 for T=3072 and 4 docs). Each
  document is a conversation of alternating user turns (loss_mask 0, 30-150 tokens) and
  assistant turns (loss_mask 1, 80-400 tokens). Anchors come from
  `sample_anchors(document_ids, loss_mask, B, max_anchors=--valid-anchors)` (default
  --valid-anchors = --anchors; fewer come back if fewer positions are eligible), and
  `supervised_slots` gives the [N, B] slots that carry loss.

What the two sides compute (same weights, same inputs, same loss)
-----------------------------------------------------------------
* fast  ("chunked" backend): the drafter runs on the N valid anchors only (sorted), with
  BlockLayout(max_chunk_blocks=--chunk-blocks): consecutive blocks of one document form a
  chunk whose SDPA reads only its context range [document start, last anchor) plus the
  chunk's own block rows.
* dense (baseline, "dense" backend): the anchor list is padded up to --anchors slots (the
  maximum) with dummy anchors at position 0, whose block embeddings are random and whose
  slots are all unsupervised (zero loss weight). Every layer runs one SDPA over all
  Q = anchors*B queries and T + Q keys with the reference boolean mask
  `anchor_block_mask` [Q, T+Q] (which the dense backend rebuilds on every layer call).
* Both sides then take the final hidden states of the supervised slots only (row-major, so
  padded rows contribute nothing and the slot order is identical), apply the frozen
  lm_head, `dflash_loss_chunked(kind=--loss, gamma=default_gamma(B))` (slot-weighted soft
  cross-entropy by default, metrics included) and backward() into the drafter.
  The BlockLayout is built inside the timed step on both sides (chunk planning is part of
  the fast path's cost); anchor sampling and the random inputs are set-up, not timed.
* Equivalence: the script checks that both sides give the same drafter output on the
  valid blocks (max |diff| <= 1e-4 x max |h|), the same loss (relative 1e-4) and the same
  gradient norm over the drafter's parameters (relative 1e-3), so the benchmark also shows
  that padded anchors and chunking leave the result unchanged. It exits with status 1
  when they differ.

How time and memory are measured
--------------------------------
All measurements run in one child process (this file re-invoked with `--worker`, so that
an out-of-memory kill is reported instead of taking the report down), with
torch.set_num_threads(--threads). Both sides are set up, each does one warm-up step (the
values compared for equivalence), then --repeats rounds run one step of each side,
alternating which side goes first, so that load from other processes on a shared machine
hits both sides alike. The time of a side is the median of its steps (time.perf_counter).
The child runs with OMP_WAIT_POLICY=PASSIVE unless --omp-wait-policy says otherwise: with
the default spin-waiting, OpenMP threads that share their cores with another busy process
slow down every small parallel region by up to ~8x (measured here: the fast side's drafter
took 44 s instead of 5.4 s with max_chunk_blocks 8 while another job used the CPU), which
punishes the path with many small SDPA calls and turns the ratios into a measure of the
machine's load. Passive waiting may add some wake-up latency per parallel region on an idle
machine, which would cost the fast side (more, smaller calls) more than the dense one.

Peak memory is the operating system's view of physical memory: before every timed step
the script frees the previous step's gradients, runs gc.collect() and glibc
malloc_trim(0) (so freed heap pages go back to the OS), reads the resident set size RSS0
from /proc/self/status and resets the kernel's peak-RSS mark (`5` written to
/proc/self/clear_refs). The step's peak is VmHWM - RSS0: the most physical memory the
step needed on top of everything that existed before it (weights, inputs, labels). It
includes allocator overhead and SDPA scratch buffers, which tensor-level accounting would
miss. A side's peak is the maximum over its timed steps. Where the mark cannot be reset
(non-Linux, no permission) the numbers are flagged as upper bounds.

Each step is also split at the gradient of the drafter's output (a tensor hook): the
"drafter" part is the drafter's forward plus its backward (where the two attention
backends differ), the "head+loss" part is lm_head, loss and their backward (identical work
on both sides). The peak of each part is reported as well (high-water mark reset at the
boundaries), to show where the memory goes.

--chunk-sweep times the drafter alone (forward + backward from a fixed random gradient of
its output, no head or loss) on the fast side for several max_chunk_blocks values.

Usage
-----
    python benchmarks/train_step_attention.py                         # seq 3072, 512 anchors, block 16
    python benchmarks/train_step_attention.py --valid-anchors 384     # dense pads 128 anchor slots
    python benchmarks/train_step_attention.py --chunk-sweep 8,16,32,64 --json out.json
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
HIDDEN_RTOL = 1e-4
GOAL_SPEEDUP = 1.5
GOAL_MEMORY = 0.6
SIDES = ("dense", "fast")


# ----------------------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=3072, help="packed sequence length T")
    p.add_argument("--anchors", type=int, default=512, help="anchor slots (the maximum; the dense side pads to it)")
    p.add_argument("--valid-anchors", type=int, default=None,
                   help="max_anchors given to sample_anchors (default: --anchors); the fast side uses what "
                        "is sampled, the dense side pads it up to --anchors")
    p.add_argument("--block", type=int, default=16, help="block size B")
    p.add_argument("--layers", type=int, default=2, help="drafter layers")
    p.add_argument("--docs", type=int, default=4, help="documents packed into the sequence")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per side (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--chunk-blocks", type=int, default=32, help="BlockLayout.max_chunk_blocks of the fast side")
    p.add_argument("--chunk-sweep", type=str, default="",
                   help="comma-separated max_chunk_blocks values: time the drafter alone (fwd+bwd) on the "
                        "fast side for each")
    p.add_argument("--loss", choices=("soft", "hard", "kl"), default="soft", help="dflash_loss kind")
    p.add_argument("--omp-wait-policy", choices=("passive", "active", "inherit"), default="passive",
                   help="OMP_WAIT_POLICY of the measuring process (inherit: leave the environment as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="write the results to this file")
    p.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)  # internal: result file
    args = p.parse_args(argv)
    if args.valid_anchors is None:
        args.valid_anchors = args.anchors
    if not 1 <= args.valid_anchors <= args.anchors:
        p.error("--valid-anchors must be in [1, --anchors]")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    args.sweep = sorted({int(c) for c in args.chunk_sweep.split(",") if c.strip()})
    if any(c < 1 for c in args.sweep):
        p.error("--chunk-sweep values must be >= 1")
    return args


# ----------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.M)
    if m is None:
        raise OSError(f"{field} not in /proc/self/status")
    return int(m.group(1))


class Memory:
    """Peak physical memory of a code region above the resident memory at its start."""

    def __init__(self):
        self.resettable = self._reset()

    @staticmethod
    def rss() -> int:
        try:
            return _status_kib("VmRSS") * 1024
        except OSError:
            return 0

    @staticmethod
    def peak() -> int:
        try:
            return _status_kib("VmHWM") * 1024
        except OSError:  # ru_maxrss: KiB on Linux, bytes on macOS
            r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return r if sys.platform == "darwin" else r * 1024

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024
        except OSError:
            return False

    def start(self) -> int:
        """Release freed memory to the OS, reset the peak mark; returns RSS0."""
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        self._reset()
        return self.rss()

    def mark(self) -> int:
        """Peak RSS since the last reset, then reset (phase boundaries)."""
        p = self.peak()
        self._reset()
        return p


# ----------------------------------------------------------------------------- workload
def drafter_config(args):
    from blockdraft.config import DrafterConfig

    return DrafterConfig(target_hidden_size=576, target_num_layers=30, target_layer_ids=[1, 8, 14, 21, 27],
                         vocab_size=49152, mask_token_id=16, hidden_size=576, num_hidden_layers=args.layers,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                         block_size=args.block)


def packed_layout(T: int, docs: int, gen):
    """document_ids, position_ids, loss_mask [T]: `docs` conversations of unequal lengths."""
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


def build(args) -> dict:
    """Shared model and inputs plus each side's anchors, block embeddings and supervised slots."""
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
    N = int(anchors.numel())
    features = torch.randn(T, cfg.feature_size, generator=gen)
    embeds = torch.randn(N, B, H, generator=gen)
    target_logits = 2.0 * torch.randn(int(sup.sum()), V, generator=gen)

    n_pad = args.anchors - N
    pad_embeds = torch.randn(n_pad, B, H, generator=torch.Generator().manual_seed(args.seed + 2))
    sides = {
        "fast": dict(backend="chunked", anchors=anchors, embeds=embeds, sup=sup, padded=0),
        "dense": dict(backend="dense",
                      anchors=torch.cat([anchors, torch.zeros(n_pad, dtype=torch.long)]),  # dummies at position 0
                      embeds=torch.cat([embeds, pad_embeds]),
                      sup=torch.cat([sup, torch.zeros(n_pad, B, dtype=torch.bool)]),  # zero loss weight
                      padded=n_pad),
    }
    return dict(cfg=cfg, drafter=drafter, lm_head=lm_head, document_ids=document_ids, position_ids=position_ids,
                loss_mask=loss_mask, features=features, target_logits=target_logits, sides=sides, valid=N,
                loss_tokens=int(loss_mask.sum()))


def layout_of(w, side: dict, chunk_blocks: int):
    from blockdraft.model.attention import BlockLayout

    return BlockLayout(w["document_ids"], w["position_ids"], side["anchors"], w["cfg"].block_size,
                       max_chunk_blocks=chunk_blocks)


def train_step(w, side: dict, chunk_blocks: int, loss_kind: str, mem: Memory | None = None,
               keep_hidden: bool = False) -> dict:
    """Forward + backward of one step, timed and (with `mem`) memory-tracked per phase."""
    from blockdraft.train.loss import default_gamma, dflash_loss_chunked

    B = w["cfg"].block_size
    marks = {}

    def on_hidden_grad(grad):
        marks["t_hidden_grad"] = time.perf_counter()
        if mem is not None:
            marks["peak_head"] = mem.mark()
        return grad

    t0 = time.perf_counter()
    layout = layout_of(w, side, chunk_blocks)
    hidden = w["drafter"](w["features"], side["embeds"], layout, side["backend"])  # [N, B, H]
    t1 = time.perf_counter()
    if mem is not None:
        marks["peak_drafter_fwd"] = mem.mark()
    hidden.register_hook(on_hidden_grad)
    # the product's loss path: supervised slots only, [S, V] logits one chunk of slots at a time
    loss, _ = dflash_loss_chunked(hidden[side["sup"]], w["lm_head"], w["target_logits"], side["sup"],
                                  gamma=default_gamma(B), kind=loss_kind)
    loss.backward()
    t4 = time.perf_counter()
    if mem is not None:
        marks["peak_drafter_bwd"] = mem.mark()
    t3 = marks["t_hidden_grad"]
    out = {"loss": float(loss.detach()), "time": t4 - t0, "time_drafter": (t1 - t0) + (t4 - t3),
           "time_head": t3 - t1}
    if mem is not None:
        out.update({k: v for k, v in marks.items() if k.startswith("peak")})
    if keep_hidden:
        out["hidden"] = hidden.detach()
    return out


def drafter_only(w, side: dict, chunk_blocks: int, grad) -> float:
    """Forward + backward of the drafter alone from a fixed output gradient; seconds."""
    t0 = time.perf_counter()
    hidden = w["drafter"](w["features"], side["embeds"], layout_of(w, side, chunk_blocks), side["backend"])
    hidden.backward(grad)
    return time.perf_counter() - t0


def attention_work(w, side: dict, chunk_blocks: int) -> dict:
    """SDPA calls per layer and score-matrix elements per head and layer that SDPA computes."""
    T, B = w["document_ids"].shape[0], w["cfg"].block_size
    N = int(side["anchors"].numel())
    if side["backend"] == "dense":
        return {"sdpa_calls_per_layer": 1, "score_elements": N * B * (T + N * B)}
    chunks = layout_of(w, side, chunk_blocks).chunks(None)
    elems = sum((c.j1 - c.j0) * B * ((c.hi - c.lo) + (c.j1 - c.j0) * B) for c in chunks)
    return {"sdpa_calls_per_layer": len(chunks), "score_elements": elems}


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    w = build(args)
    setup_s = time.perf_counter() - t0
    params = [p for p in w["drafter"].parameters() if p.requires_grad]

    def zero_grad():
        for p in params:
            p.grad = None

    res = {name: {"backend": w["sides"][name]["backend"], "padded_anchors": w["sides"][name]["padded"],
                  "queries": int(w["sides"][name]["anchors"].numel()) * args.block,
                  **attention_work(w, w["sides"][name], args.chunk_blocks), "steps": []} for name in SIDES}
    hidden = {}
    for name in SIDES:  # warm-up; its loss, gradient and drafter output are compared
        zero_grad()
        r = train_step(w, w["sides"][name], args.chunk_blocks, args.loss, keep_hidden=True)
        hidden[name] = r.pop("hidden")
        res[name]["loss"] = r["loss"]
        res[name]["grad_norm"] = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        res[name]["warmup_s"] = r["time"]
        zero_grad()

    n = w["valid"]  # the dense side's rows past the valid anchors are padding
    hidden_diff = float((hidden["fast"] - hidden["dense"][:n]).abs().max())
    hidden_scale = float(hidden["dense"][:n].abs().max())
    del hidden
    mem = Memory()
    for rnd in range(args.repeats):
        for name in (SIDES if rnd % 2 == 0 else SIDES[::-1]):
            zero_grad()
            rss0 = mem.start()
            r = train_step(w, w["sides"][name], args.chunk_blocks, args.loss, mem)
            for k in ("peak_drafter_fwd", "peak_head", "peak_drafter_bwd"):
                r[k] -= rss0
            r["peak"] = max(r["peak_drafter_fwd"], r["peak_head"], r["peak_drafter_bwd"])
            r["rss0"] = rss0
            res[name]["steps"].append(r)
            if abs(r["loss"] - res[name]["loss"]) > 1e-5 * max(1.0, abs(res[name]["loss"])):
                raise AssertionError(f"{name}: loss changed between steps ({res[name]['loss']} -> {r['loss']})")
    zero_grad()
    for name in SIDES:
        steps = res[name]["steps"]
        for key in ("time", "time_drafter", "time_head"):
            res[name][key] = statistics.median(s[key] for s in steps)
        for key in ("peak", "peak_drafter_fwd", "peak_head", "peak_drafter_bwd"):
            res[name][key] = max(s[key] for s in steps)

    sweep = []
    if args.sweep:
        side = w["sides"]["fast"]
        grad = torch.randn(side["embeds"].shape, generator=torch.Generator().manual_seed(args.seed + 3))
        for c in args.sweep:  # warm-up
            drafter_only(w, side, c, grad)
            zero_grad()
        times = {c: [] for c in args.sweep}
        for rnd in range(args.repeats):
            for c in (args.sweep if rnd % 2 == 0 else args.sweep[::-1]):
                times[c].append(drafter_only(w, side, c, grad))
                zero_grad()
        sweep = [{"chunk_blocks": c, "time_drafter_only": statistics.median(times[c]), "times": times[c],
                  **attention_work(w, side, c)} for c in args.sweep]

    return {"sides": res, "sweep": sweep, "setup_s": setup_s, "valid_anchors": w["valid"],
            "supervised_slots": int(w["sides"]["fast"]["sup"].sum()), "loss_tokens": w["loss_tokens"],
            "memory_exact": mem.resettable, "torch": torch.__version__,
            "hidden_max_abs_diff": hidden_diff, "hidden_max_abs": hidden_scale}


# ----------------------------------------------------------------------------- driver
def mib(b: float) -> float:
    return b / 2 ** 20


def report(args, out: dict) -> int:
    d, f = out["sides"]["dense"], out["sides"]["fast"]
    T = args.seq
    print(f"valid anchors {out['valid_anchors']} (fast side), dense pads {d['padded_anchors']} -> "
          f"Q = {d['queries']} queries x {T + d['queries']} keys; supervised slots {out['supervised_slots']}; "
          f"set-up {out['setup_s']:.1f} s")
    print(f"{'backend':<10}{'step s':>8}{'drafter s':>11}{'head+loss s':>13}{'peak MiB':>10}{'drafter fwd':>13}"
          f"{'head+loss':>11}{'drafter bwd':>13}{'SDPA/layer':>12}{'scores/head':>13}")
    print(f"{'':<42}{'(peak MiB by phase, above RSS0)':>40}")
    for name in SIDES:
        r = out["sides"][name]
        print(f"{r['backend']:<10}{r['time']:>8.2f}{r['time_drafter']:>11.2f}{r['time_head']:>13.2f}"
              f"{mib(r['peak']):>10.0f}{mib(r['peak_drafter_fwd']):>13.0f}{mib(r['peak_head']):>11.0f}"
              f"{mib(r['peak_drafter_bwd']):>13.0f}{r['sdpa_calls_per_layer']:>12d}"
              f"{r['score_elements'] / 1e6:>12.1f}M")
    speedup = d["time"] / f["time"]
    mem_ratio = f["peak"] / d["peak"]
    time_ok, mem_ok = speedup >= GOAL_SPEEDUP, mem_ratio <= GOAL_MEMORY
    loss_err = abs(f["loss"] - d["loss"]) / max(1e-12, abs(d["loss"]))
    grad_err = abs(f["grad_norm"] - d["grad_norm"]) / max(1e-12, abs(d["grad_norm"]))
    hid_err = out["hidden_max_abs_diff"] / max(1e-12, out["hidden_max_abs"])
    print(f"step   time fast/dense = {f['time'] / d['time']:.3f} (speed-up {speedup:.2f}x; goal >= {GOAL_SPEEDUP}x: "
          f"{'MET' if time_ok else 'NOT MET'})")
    print(f"step   peak fast/dense = {mem_ratio:.3f} (goal <= {GOAL_MEMORY}: {'MET' if mem_ok else 'NOT MET'})")
    print(f"drafter part only: time fast/dense = {f['time_drafter'] / d['time_drafter']:.3f} "
          f"(speed-up {d['time_drafter'] / f['time_drafter']:.2f}x), peak fwd fast/dense = "
          f"{f['peak_drafter_fwd'] / d['peak_drafter_fwd']:.3f}, peak bwd fast/dense = "
          f"{f['peak_drafter_bwd'] / d['peak_drafter_bwd']:.3f}")
    print(f"equivalence: loss {f['loss']:.6f} vs {d['loss']:.6f} (rel diff {loss_err:.1e}, tol {LOSS_RTOL:g}); "
          f"grad norm {f['grad_norm']:.6g} vs {d['grad_norm']:.6g} (rel diff {grad_err:.1e}, tol {GRAD_RTOL:g}); "
          f"drafter output on valid blocks: max |diff| {out['hidden_max_abs_diff']:.1e} of max |h| "
          f"{out['hidden_max_abs']:.3g} (rel {hid_err:.1e}, tol {HIDDEN_RTOL:g})")
    steps = {n: " ".join(f"{s['time']:.2f}" for s in out["sides"][n]["steps"]) for n in SIDES}
    print(f"steps s: dense [{steps['dense']}] fast [{steps['fast']}] (medians of {args.repeats} after 1 warm-up, "
          f"sides alternating)")
    print("memory: VmHWM - RSS0 per step, max over steps" +
          ("" if out["memory_exact"] else " -- peak mark NOT resettable here: numbers are upper bounds"))
    if out["sweep"]:
        print("chunk sweep (fast side, drafter alone fwd+bwd, no head/loss):")
        for s in out["sweep"]:
            print(f"  max_chunk_blocks {s['chunk_blocks']:>4}: {s['time_drafter_only']:.2f} s "
                  f"[{' '.join('%.2f' % t for t in s['times'])}], {s['sdpa_calls_per_layer']} SDPA/layer, "
                  f"{s['score_elements'] / 1e6:.1f}M scores/head")
    out.update({"time_ratio_fast_over_dense": f["time"] / d["time"], "speedup": speedup,
                "memory_ratio_fast_over_dense": mem_ratio, "goal_time_met": time_ok, "goal_memory_met": mem_ok,
                "loss_rel_diff": loss_err, "grad_norm_rel_diff": grad_err, "hidden_rel_diff": hid_err,
                "args": {k: v for k, v in vars(args).items() if k not in ("worker", "json")}})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    if loss_err > LOSS_RTOL or grad_err > GRAD_RTOL or hid_err > HIDDEN_RTOL:
        print("EQUIVALENCE FAILED: the two sides do not compute the same step", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        out = worker(args)
        with open(args.worker, "w") as fh:
            json.dump(out, fh)
        return 0

    print(f"train step fwd+bwd fp32 | seq {args.seq}, {args.anchors} anchor slots (sample up to "
          f"{args.valid_anchors}), block {args.block}, drafter 576 x {args.layers} layers, {args.docs} docs, "
          f"loss {args.loss}, chunk {args.chunk_blocks}, threads {args.threads}, OMP_WAIT_POLICY "
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset') if args.omp_wait_policy == 'inherit' else args.omp_wait_policy}",
          flush=True)
    argv = [a for a in (sys.argv[1:] if argv is None else list(argv))]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        t0 = time.perf_counter()
        env = dict(os.environ)
        if args.omp_wait_policy != "inherit":
            env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--worker", path], env=env)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(path):
            why = (f"killed by signal {-proc.returncode} (out of memory?)" if proc.returncode < 0
                   else f"exit status {proc.returncode}")
            print(f"measurement failed after {wall:.0f} s: {why}", file=sys.stderr)
            return 2
        with open(path) as fh:
            out = json.load(fh)
    out["wall_s"] = wall
    rc = report(args, out)
    print(f"total wall time {wall:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
