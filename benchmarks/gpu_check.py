"""The CUDA path, checked in one command: attention backends against the dense reference
(forward and backward), training steps at real shapes (flex vs dense mask, torch.compile on/off:
tokens/s and peak memory), and speculative generation (greedy identity, time per step).

    python benchmarks/gpu_check.py --out gpu.json          # one CUDA GPU, within ~8 minutes
    python benchmarks/gpu_check.py --cpu --out cpu.json    # reduced: tiny shapes, dense/chunked backends

Everything is built in code (random targets shaped like Qwen3-0.6B and, for the drafter side,
like Qwen3-8B's: hidden 4096, 5 drafter layers, block 16, 512 anchors, 4096 tokens); nothing is
downloaded. The CPU mode runs the same code paths at tiny shapes (flex attention has no CPU
backward, so there the fast backend is the chunked one) and is part of the default test suite
(`tests/test_gpu_check.py`), so the script cannot rot. Writes one JSON of figures.

Legend: T context rows, N anchors, B block size, H heads, D head dim.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

RULES = ("query", "anchor")


def layout(T: int, n_docs: int, n_anchors: int, B: int, seed: int, device):
    """A packed row of `n_docs` documents (first 8 tokens of each not learned) and sorted anchors."""
    from blockdraft.model import BlockLayout
    from blockdraft.train.anchors import sample_anchors
    from blockdraft.train.step import positions_from_documents

    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(T - 32, generator=g)[: n_docs - 1].add(16).tolist())
    doc = torch.zeros(T, dtype=torch.long)
    for c in cuts:
        doc[c:] += 1
    loss = torch.ones(T, dtype=torch.long)
    starts = [0] + cuts
    for s in starts:
        loss[s:s + 8] = 0
    anchors = sample_anchors(doc, loss, B, n_anchors, g)
    pos = positions_from_documents(doc[None])[0]
    return BlockLayout(doc.to(device), pos.to(device), anchors.to(device), B)


def attention_parity(device, dtype, T, n_anchors, heads, kv_heads, D, B, backends, seed=0) -> list[dict]:
    """Max |out - ref| and |grad - ref| of each fast backend against the dense reference."""
    from blockdraft.model.attention import LayerVisibility, anchor_block_attention

    out = []
    lay = layout(T, 4, n_anchors, B, seed, device)
    N = lay.num_blocks
    g = torch.Generator(device="cpu").manual_seed(seed)
    base = [torch.randn(*shape, generator=g) for shape in ((N, B, heads, D), (T, kv_heads, D), (T, kv_heads, D),
                                                         (N, B, kv_heads, D), (N, B, kv_heads, D))]
    for window in (None, max(4, T // 8)):
        for causal in (False, True):
            for rule in RULES if window else ("query",):
                vis = LayerVisibility(window, causal, rule)
                results = {}
                for backend in ("dense",) + tuple(backends):
                    xs = [x.to(device, dtype).requires_grad_(True) for x in base]
                    y = anchor_block_attention(*xs, lay, vis, scale=D ** -0.5, backend=backend)
                    (y.float() * torch.linspace(-1, 1, y.numel(), device=device).view_as(y)).sum().backward()
                    results[backend] = (y.detach().float(), [x.grad.float() for x in xs])
                ref_y, ref_g = results["dense"]
                for backend in backends:
                    y, grads = results[backend]
                    out.append({"dtype": str(dtype).split(".")[-1], "window": window, "causal": causal, "rule": rule,
                                "backend": backend, "max_out_diff": float((y - ref_y).abs().max()),
                                "max_grad_diff": max(float((a - b).abs().max()) for a, b in zip(grads, ref_g)),
                                "ref_scale": float(ref_y.abs().max()),
                                "ref_grad_scale": max(float(x.abs().max()) for x in ref_g)})
    return out


def random_target(arch_kw: dict, device, dtype):
    from blockdraft.target import TargetModel
    from blockdraft.tiny import tiny_causal_lm

    model = tiny_causal_lm("qwen3", **arch_kw).to(device=device, dtype=dtype)
    with torch.no_grad():  # a confident target, so greedy decoding has no near-ties
        model.get_output_embeddings().weight.mul_(4)
    n = arch_kw["layers"]
    ids = [round(1 + i * (n - 4) / 4) for i in range(5)] if n >= 8 else [0, 1, 2][: max(1, n - 2)]
    return TargetModel(model, None, ids, mask_token_id=arch_kw["vocab"] - 1, name="random-qwen3")


def train_step_figures(target, drafter_layers, block, anchors, seq, rows, device, backends, compiles, repeats):
    """Tokens/s and peak memory of one optimizer step per (backend, compile) on random packed rows."""
    from blockdraft.model import DFlashDrafter, DrafterConfig
    from blockdraft.train import Batch, train_step

    out = []
    g = torch.Generator().manual_seed(1)
    V = target.vocab_size
    ids = torch.randint(0, V - 1, (rows, seq), generator=g)
    doc = (torch.arange(seq) >= seq // 2).long().expand(rows, seq).clone()
    loss = torch.ones(rows, seq, dtype=torch.long)
    loss[:, :16] = 0
    loss[:, seq // 2:seq // 2 + 16] = 0
    for backend in backends:
        for compiled in compiles:
            torch.manual_seed(0)
            drafter = DFlashDrafter(DrafterConfig.for_target(target, num_layers=drafter_layers, block_size=block))
            drafter.to(device)
            model = torch.compile(drafter, dynamic=True) if compiled else drafter
            opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
            batch = Batch(ids, loss, document_ids=doc)
            times, err = [], None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                for r in range(repeats + 1):
                    _sync(device)
                    t0 = time.perf_counter()
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                        m = train_step(target, model, opt, batch, max_anchors=anchors, backend=backend,
                                       generator=torch.Generator().manual_seed(r))
                    _sync(device)
                    times.append(time.perf_counter() - t0)
            except (RuntimeError, torch.OutOfMemoryError) as e:  # a path that does not fit is a figure too
                err = f"{type(e).__name__}: {str(e)[:200]}"
            best = min(times[1:]) if len(times) > 1 else None
            out.append({"backend": backend, "compile": compiled, "seq": seq, "rows": rows, "anchors": anchors,
                        "block": block, "drafter_layers": drafter_layers, "hidden": target.hidden_size,
                        "step_s": best, "first_step_s": times[0] if times else None,
                        "tokens_per_s": rows * seq / best if best else None,
                        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                        "loss": float(m["loss"]) if not err else None, "error": err})
    return out


def generation_figures(target, device, n_new: int, block: int) -> dict:
    from blockdraft.generate import speculative_generate
    from blockdraft.generate.baseline import target_greedy
    from blockdraft.model import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.for_target(target, num_layers=1, block_size=block)).to(device)
    ids = torch.randint(0, target.vocab_size - 1, (1, 64), generator=torch.Generator().manual_seed(2))
    ref = target_greedy(target, ids, max_new_tokens=n_new)
    _sync(device)
    res = speculative_generate(target, drafter, ids, max_new_tokens=n_new)
    _sync(device)
    steps = max(1, len(res.accepted))
    return {"identical": res.tokens == ref.tokens, "new_tokens": len(res.tokens), "steps": steps, "tau": res.tau,
            "ms_per_step": 1e3 * (res.time_total - res.time_prefill) / steps,
            "ms_per_target_token": 1e3 * (ref.time_total - ref.time_prefill) / max(1, len(ref.tokens) - 1),
            "ms_draft_per_step": 1e3 * res.time_draft / steps, "ms_verify_per_step": 1e3 * res.time_verify / steps}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


SHAPES = {  # (CPU: tiny; CUDA: Qwen3-0.6B, and Qwen3-8B's drafter side on a shallow random target)
    "cpu": {"parity": dict(T=48, n_anchors=6, heads=4, kv_heads=2, D=8, B=4),
            "small": dict(vocab=512, layers=8, hidden=64, heads=4, kv_heads=2, intermediate=128),
            "small_step": dict(drafter_layers=1, block=4, anchors=8, seq=64, rows=2),
            "large": None, "gen_tokens": 24},
    "cuda": {"parity": dict(T=1024, n_anchors=96, heads=16, kv_heads=8, D=128, B=16),
             "small": dict(vocab=151936, layers=28, hidden=1024, heads=16, kv_heads=8, intermediate=3072,
                           max_positions=8192),
             "small_step": dict(drafter_layers=1, block=16, anchors=512, seq=4096, rows=1),
             "large": dict(vocab=151936, layers=8, hidden=4096, heads=32, kv_heads=8, intermediate=12288,
                           max_positions=8192),
             "large_step": dict(drafter_layers=5, block=16, anchors=512, seq=4096, rows=1), "gen_tokens": 128},
}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="the reduced CPU mode (tiny shapes, dense/chunked)")
    p.add_argument("--out", default=None, help="write the figures here (JSON)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (after one warm-up)")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if not a.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu for the reduced check")
    mode = "cpu" if a.cpu else "cuda"
    device, S = torch.device(mode), SHAPES[mode]
    fast = ("chunked",) if a.cpu else ("flex", "chunked")
    t0 = time.perf_counter()
    report = {"mode": mode, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if mode == "cuda" else "cpu", "parity": []}
    for dtype in (torch.float32, torch.bfloat16):
        report["parity"] += attention_parity(device, dtype, backends=fast, **S["parity"])
    dt = torch.float32 if a.cpu else torch.bfloat16
    small = random_target(S["small"], device, dt)
    compiles = (False,) if a.cpu else (False, True)
    report["train_small"] = train_step_figures(small, device=device, backends=("dense",) + fast, compiles=compiles,
                                               repeats=a.repeats, **S["small_step"])
    if S["large"]:
        large = random_target(S["large"], device, dt)
        report["train_large"] = train_step_figures(large, device=device, backends=("flex", "dense"),
                                                   compiles=compiles, repeats=a.repeats, **S["large_step"])
        del large
    report["generation"] = generation_figures(random_target(S["small"], device, torch.float32), device,
                                              S["gen_tokens"], 16 if not a.cpu else 4)
    report["seconds"] = time.perf_counter() - t0
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
