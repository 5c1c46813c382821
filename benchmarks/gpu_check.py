"""The product on GPUs, in one command: `blockdraft train` under torchrun (nccl; replicated, --fsdp,
and --target-fsdp --fsdp) on a random target of Qwen3-8B's shape built on the GPU, `blockdraft extract` and training
from its cache, speculative generation in bf16 against the target's own greedy output, a
device_map spread (2+ GPUs), and the attention backends against the dense reference.

    python benchmarks/gpu_check.py --out gpu.json          # every GPU it finds (1 to 8); ~8 min on one H200
    python benchmarks/gpu_check.py --cpu --out cpu.json    # the same parts on 2 gloo processes, tiny shapes

On a GPU machine without the embedded SmolLM2 package (no downloads there), carry its tokenizer:
    python benchmarks/gpu_check.py --pack-tokenizer .gpu/tokenizer          # here (3.5 MB)
    python3 benchmarks/gpu_check.py --tokenizer .gpu/tokenizer --out $OUT/gpu.json   # there, .gpu carried
It needs torch, transformers, accelerate, safetensors and tqdm there, and runs blockdraft from src/.

Each part runs in its own processes with a time limit; a part that fails records its error and
the others still run. Stored per part: seconds, and for training the first step's time (compile
included), the later steps' time, tokens/s, the peak memory of every rank, MFU and the memory
plan's figure for the same flags (blockdraft.plan). Nothing is downloaded: the target is
`--target random:qwen3-8b` (blockdraft.tiny.RANDOM_PRESETS) with SmolLM2's tokenizer, the data
the bundled conversations. tests/test_gpu_check.py runs the CPU mode, so the script cannot rot.

On one GPU torchrun still makes a process group (of one): nccl's collectives and FSDP's code
path run for real; several ranks need several GPUs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12,
             "A10": 125e12, "L4": 121e12}

MODES = {
    "cuda": dict(target="random:qwen3-8b", conversations=2500, extract_conversations=400, steps=4, nproc=None,
                 flags="--max-length 4096 --draft-layers 5 --block-size 16 --max-anchors 512 --draft-vocab full "
                       "--sliding-window 0 --batch-tokens 16384 --grad-accum 2 --gradient-checkpointing",
                 rows_per_micro=4, grad_accum=2, gen_tokens=128, timeout=420),
    "cpu": dict(target="random:tiny", conversations=160, extract_conversations=40, steps=3, nproc=2,
                flags="--max-length 256 --draft-layers 1 --block-size 8 --max-anchors 16 --batch-tokens 512 "
                      "--grad-accum 1 --threads 1 --device cpu",
                rows_per_micro=2, grad_accum=1, gen_tokens=24, timeout=600),
}


# ------------------------------------------------------------------------------- running parts

def env() -> dict:
    e = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + e.get("PYTHONPATH", "")
    return e


# a launch that failed on its own rendezvous (a port taken between choosing and binding it) is rerun once
RENDEZVOUS_ERRORS = ("Address already in use", "EADDRINUSE", "failed to listen", "DistNetworkError",
                     "RendezvousConnectionError")


def run(cmd: list[str], log: Path, timeout: float, tries: int = 2) -> None:
    """Run a command, its output to `log`; raise with the log's tail if it fails or outruns `timeout`."""
    for attempt in range(tries):
        with open(log, "w") as f:
            try:
                p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(), timeout=timeout, cwd=ROOT)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{tail(log)}") from None
        if not p.returncode:
            return
        if attempt + 1 < tries and any(e in tail(log, 20000) for e in RENDEZVOUS_ERRORS):
            print(f"gpu_check: rendezvous failed, rerunning once: {' '.join(cmd)}", flush=True)
            continue
        raise RuntimeError(f"exit {p.returncode}: {' '.join(cmd)}\n{tail(log)}")


def tail(log: Path, n: int = 2000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else ""


def torchrun(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
            "blockdraft", *args]


def part(report: dict, name: str, fn) -> None:
    """Run one part; its figures or its error go into the report, and the next part runs regardless."""
    t0 = time.perf_counter()
    try:
        got = fn() or {}
        report[name] = {"ok": True, **got}
    except Exception as e:  # noqa: BLE001  (every failure is a figure: keep going)
        report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:],
                        "traceback": traceback.format_exc()[-2000:]}
    report[name]["seconds"] = time.perf_counter() - t0
    print(f"gpu_check: {name}: {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['seconds']:.0f} s)",
          flush=True)


# ----------------------------------------------------------------------------- figures of a run

def training_figures(out: Path) -> dict:
    """From a run's metrics.jsonl: the first step (compile included), later steps, tokens/s, peaks."""
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"{out}/metrics.jsonl is empty")
    later = lines[1:] or lines
    step_s = statistics.median(m["step_s"] for m in later)
    tps = statistics.median(m["tokens_per_s"] for m in later)
    fig = {"steps": len(lines), "first_step_s": lines[0]["step_s"], "step_s": step_s, "tokens_per_s": tps,
           "loss": [m["loss"] for m in lines], "eval_tau": next((m["eval_tau"] for m in reversed(lines)
                                                                if "eval_tau" in m), None)}
    peaks = [m["peak_mem_gib"] for m in lines if "peak_mem_gib" in m]
    if peaks:
        fig["peak_mem_gib_per_rank"] = [max(p[r] for p in peaks) for r in range(len(peaks[0]))]
    return fig


def flops_per_token(target_params: int, drafter_params: int, blocks_per_token: float, B: int, hidden: int,
                    vocab: int) -> float:
    """Model FLOPs per training token: the frozen target's forward (2 P_t), the drafter's forward
    and backward over its block queries (6 P_d per query), the head over the supervised slots
    (forward and the input gradient: 4 H V per slot). Attention's own products are left out."""
    q = blocks_per_token * B
    return 2 * target_params + 6 * drafter_params * q + 4 * hidden * vocab * blocks_per_token * (B - 1)


def planned_peak_gib(target: str, flags: str, world: int, cuda: bool, fsdp: bool = False,
                     cache: bool = False, target_fsdp: bool = False) -> float:
    """The memory plan's peak per rank for these flags (benchmarks/memory_plan.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_plan

    from blockdraft.plan import plan_run
    from blockdraft.tiny import random_config

    extra = ((" --fsdp" if fsdp else "") + (" --features-cache CACHE" if cache else "")
             + (" --target-fsdp" if target_fsdp else ""))
    run_cfg = memory_plan.run_config(flags + extra)
    return plan_run(random_config(target), run_cfg, world=world, cuda=cuda).peak / 2**30


# --------------------------------------------------------------------------- parts in subprocesses

def part_parity(out: Path, cpu: bool) -> None:
    """Fast attention backends against the dense reference, forward and backward (fp32 and bf16)."""
    import torch

    from blockdraft.model.attention import LayerVisibility, anchor_block_attention
    from blockdraft.model import BlockLayout
    from blockdraft.train.anchors import sample_anchors
    from blockdraft.train.step import positions_from_documents

    device = torch.device("cpu" if cpu else "cuda")
    T, n_anchors, heads, kv_heads, D, B = (48, 6, 4, 2, 8, 4) if cpu else (1024, 96, 16, 8, 128, 16)
    g = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(T - 32, generator=g)[:3].add(16).tolist())
    doc = torch.zeros(T, dtype=torch.long)
    for c in cuts:
        doc[c:] += 1
    loss = torch.ones(T, dtype=torch.long)
    lay = BlockLayout(doc.to(device), positions_from_documents(doc[None])[0].to(device),
                      sample_anchors(doc, loss, B, n_anchors, g).to(device), B)
    N = lay.num_blocks
    base = [torch.randn(*s, generator=g) for s in ((N, B, heads, D), (T, kv_heads, D), (T, kv_heads, D),
                                                   (N, B, kv_heads, D), (N, B, kv_heads, D))]
    backends = ("chunked",) if cpu else ("flex", "chunked")  # flex has no CPU backward
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for window in (None, max(4, T // 8)):
            for causal in (False, True):
                for rule in (("query", "anchor") if window else ("query",)):
                    vis, res = LayerVisibility(window, causal, rule), {}
                    for backend in ("dense",) + backends:
                        xs = [x.detach().clone().to(device, dtype).requires_grad_(True) for x in base]
                        y = anchor_block_attention(*xs, lay, vis, scale=D ** -0.5, backend=backend)
                        (y.float() * torch.linspace(-1, 1, y.numel(), device=device).view_as(y)).sum().backward()
                        res[backend] = (y.detach().float(), [x.grad.float() for x in xs])
                    ry, rg = res["dense"]
                    for backend in backends:
                        y, gr = res[backend]
                        rows.append({"dtype": str(dtype).split(".")[-1], "window": window, "causal": causal,
                                     "rule": rule, "backend": backend, "max_out_diff": float((y - ry).abs().max()),
                                     "max_grad_diff": max(float((a - b).abs().max()) for a, b in zip(gr, rg)),
                                     "ref_scale": float(ry.abs().max()),
                                     "ref_grad_scale": max(float(x.abs().max()) for x in rg)})
    name = "cpu" if cpu else torch.cuda.get_device_name()
    out.write_text(json.dumps({"device": name, "torch": torch.__version__, "gpus": torch.cuda.device_count(),
                               "rows": rows}))


def part_generate(out: Path, cpu: bool, target: str, drafter: str, n_new: int) -> None:
    """Speculative generation with the trained drafter against the target's own greedy decoding."""
    from blockdraft.checkpoint import load_drafter
    from blockdraft.generate import speculative_generate
    from blockdraft.generate.baseline import target_greedy
    from blockdraft.target import TargetModel

    device = "cpu" if cpu else "cuda:0"
    d = load_drafter(drafter, device=device)
    t = TargetModel.from_pretrained(target, layer_ids=d.config.target_layer_ids, device=device)
    ids = t.tokenizer.apply_chat_template([{"role": "user", "content": "Explain speculative decoding briefly."}],
                                          add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    ref = target_greedy(t, ids, max_new_tokens=n_new)
    res = speculative_generate(t, d, ids, max_new_tokens=n_new)
    same = next((i for i, (a, b) in enumerate(zip(res.tokens, ref.tokens)) if a != b), min(len(res.tokens), len(ref.tokens)))
    steps = max(1, len(res.accepted))
    out.write_text(json.dumps({
        "dtype": str(t.dtype).split(".")[-1], "identical": res.tokens == ref.tokens, "identical_prefix": same,
        "new_tokens": len(res.tokens), "tau": res.tau, "steps": steps,
        "ms_per_step": 1e3 * (res.time_total - res.time_prefill) / steps,
        "ms_per_target_token": 1e3 * (ref.time_total - ref.time_prefill) / max(1, len(ref.tokens) - 1),
        "speculative_tokens_per_s": len(res.tokens) / max(1e-9, res.time_total - res.time_prefill),
        "target_tokens_per_s": len(ref.tokens) / max(1e-9, ref.time_total - ref.time_prefill)}))


def part_save_random(out_dir: Path, target: str) -> None:
    """The random target as a transformers directory (for the device_map part, which loads files)."""
    import torch

    from blockdraft.target import TargetModel

    t = TargetModel.from_pretrained(target, device="cuda:0", dtype=torch.bfloat16)
    t.model.save_pretrained(out_dir)
    t.tokenizer.save_pretrained(out_dir)


# ------------------------------------------------------------------------------------ the check

def write_data(path: Path, n: int) -> Path:
    """The first `n` bundled conversations as a JSONL file."""
    src = ROOT / "src" / "blockdraft" / "assets" / "data" / "default.jsonl.gz"
    with gzip.open(src, "rt") as f, open(path, "w") as g:
        for i, line in enumerate(f):
            if i >= n:
                break
            g.write(line)
    return path


def check(cpu: bool, out_json: str | None, work: Path, gpus: int | None = None) -> dict:
    mode = MODES["cpu" if cpu else "cuda"]
    if not cpu:
        import torch

        gpus = gpus or torch.cuda.device_count()
        if gpus < 1:
            raise SystemExit("no CUDA device: run with --cpu for the reduced check")
    nproc = mode["nproc"] or gpus
    steps, target = mode["steps"], mode["target"]
    report: dict = {"mode": "cpu" if cpu else "cuda", "ranks": nproc, "target": target, "flags": mode["flags"]}
    t0 = time.perf_counter()
    data = write_data(work / "data.jsonl", mode["conversations"])
    small = write_data(work / "small.jsonl", mode["extract_conversations"])
    me = [sys.executable, str(Path(__file__).resolve())]
    cpu_flag = ["--cpu"] if cpu else []

    def parity():
        run(me + ["--part", "parity", "--part-out", str(work / "parity.json")] + cpu_flag, work / "parity.log",
            mode["timeout"])
        got = json.loads((work / "parity.json").read_text())
        report["device"], report["torch"] = got["device"], got["torch"]
        worst = max(got["rows"], key=lambda r: r["max_out_diff"] / max(1.0, r["ref_scale"]))
        return {"rows": got["rows"], "worst": worst}

    part(report, "parity", parity)
    device_name = report.get("device", "")
    peak = None if cpu else next((v for k, v in PEAK_BF16.items() if k in device_name), None)
    sizes = model_sizes(target)
    rows = mode["rows_per_micro"] * mode["grad_accum"] * nproc * steps
    common = ["--target", target, *mode["flags"].split(), "--steps", str(steps), "--eval-every", str(steps),
              "--save-every", str(steps), "--max-rows", str(rows), "--no-progress"]

    def train(name: str, extra: list[str], fsdp=False, cache=False, data_args=None, target_fsdp=False):
        out = work / name
        args = ["train", *common, *(data_args or ["--data", str(data)]), "--out", str(out), *extra]
        run(torchrun(nproc, args), work / f"{name}.log", mode["timeout"])
        fig = training_figures(out)
        drafter_params = params_of(out / "drafter")
        fig["drafter_params"] = drafter_params
        L, B, A = flag(mode["flags"], "--max-length"), flag(mode["flags"], "--block-size"), flag(mode["flags"], "--max-anchors")
        fpt = flops_per_token(sizes["params"], drafter_params, min(A, L) / L, B, sizes["hidden"], sizes["vocab"])
        fig["model_flops_per_token"] = fpt
        if peak:
            fig["mfu"] = fig["tokens_per_s"] * fpt / (peak * nproc)
        fig["planned_peak_gib"] = planned_peak_gib(target, mode["flags"], nproc, not cpu, fsdp=fsdp, cache=cache,
                                                   target_fsdp=target_fsdp)
        return fig

    part(report, "train", lambda: train("train", []))
    part(report, "train_fsdp", lambda: train("train_fsdp", ["--fsdp"], fsdp=True))
    part(report, "train_target_fsdp", lambda: train("train_target_fsdp", ["--target-fsdp", "--fsdp"], fsdp=True,
                                                   target_fsdp=True))

    def extract():
        args = ["extract", "--target", target, "--data", str(small), "--max-length", str(flag(mode["flags"], "--max-length")),
                "--out", str(work / "cache")] + (["--threads", "1", "--device", "cpu"] if cpu else [])
        t = time.perf_counter()
        run(torchrun(nproc, args), work / "extract.log", mode["timeout"])
        man = json.loads((work / "cache" / "manifest.json").read_text())
        secs = time.perf_counter() - t
        return {"rows": man["rows"], "dtype": man["dtype"], "shards": len(man["shards"]),
                "tokens_per_s": man["rows"] * man["max_length"] / secs,
                "bytes": sum(f.stat().st_size for f in (work / "cache").iterdir())}

    part(report, "extract", extract)
    part(report, "train_from_cache", lambda: train("train_from_cache", [], cache=True,
                                                  data_args=["--features-cache", str(work / "cache")]))

    def generate():
        if not (work / "train" / "drafter").exists():
            raise RuntimeError("no trained drafter (the train part failed)")
        run(me + ["--part", "generate", "--part-out", str(work / "generate.json"), "--drafter", str(work / "train" / "drafter"),
                  "--target", target, "--new-tokens", str(mode["gen_tokens"])] + cpu_flag, work / "generate.log",
            mode["timeout"])
        return json.loads((work / "generate.json").read_text())

    part(report, "generate", generate)
    if not cpu and gpus >= 2:
        def device_map():
            run(me + ["--part", "save-random", "--part-out", str(work / "random-target"), "--target", target],
                work / "save.log", mode["timeout"])
            args = ["train", *common, "--target", str(work / "random-target"), "--target-device-map", "auto",
                    "--data", str(data), "--out", str(work / "device_map")]
            run(torchrun(1, args), work / "device_map.log", mode["timeout"])
            return training_figures(work / "device_map")

        part(report, "device_map", device_map)
    else:
        report["device_map"] = {"ok": None, "skipped": "needs 2 or more GPUs"}
    report["seconds"] = time.perf_counter() - t0
    text = json.dumps(report, indent=1)
    if out_json:
        Path(out_json).write_text(text + "\n")
    print(text)
    return report


def pack_tokenizer(out: Path) -> None:
    """The tokenizer files of random targets in `out` (small enough to carry to a GPU machine)."""
    from blockdraft.target_files import random_target_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    random_target_tokenizer().save_pretrained(out)
    print(f"tokenizer files in {out}: {sorted(p.name for p in out.iterdir())}")


def flag(flags: str, name: str) -> int:
    parts = flags.split()
    return int(parts[parts.index(name) + 1])


def params_of(drafter_dir: Path) -> int:
    """Parameters in a saved drafter (its float tensors)."""
    import math

    from safetensors import safe_open

    n = 0
    for f in drafter_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                if sl.get_dtype() in ("F32", "BF16", "F16"):
                    n += math.prod(sl.get_shape())
    return n


def model_sizes(target: str) -> dict:
    """Parameter count, hidden size and vocabulary of a random target (from its config alone)."""
    from blockdraft.plan import target_sizes
    from blockdraft.tiny import random_config

    return target_sizes(random_config(target))


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="the reduced CPU mode (2 gloo processes, tiny shapes)")
    p.add_argument("--out", default=None, help="write the figures here (JSON)")
    p.add_argument("--work", default=None, help="working directory (default: a temporary one, removed after)")
    p.add_argument("--gpus", type=int, default=None, help="ranks for torchrun (default: every GPU found)")
    p.add_argument("--tokenizer", default=None, help="a directory of SmolLM2's tokenizer files (see --pack-tokenizer)")
    p.add_argument("--pack-tokenizer", default=None, metavar="DIR",
                   help="copy the tokenizer files random targets use into DIR, to carry to a GPU machine")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--target", default=None, help=argparse.SUPPRESS)
    p.add_argument("--drafter", default=None, help=argparse.SUPPRESS)
    p.add_argument("--new-tokens", type=int, default=64, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tokenizer:  # read by blockdraft.target_files.random_target_tokenizer, here and in every subprocess
        os.environ["BLOCKDRAFT_TOKENIZER"] = str(Path(a.tokenizer).resolve())
    if a.pack_tokenizer:
        return pack_tokenizer(Path(a.pack_tokenizer))
    if a.part == "parity":
        return part_parity(Path(a.part_out), a.cpu)
    if a.part == "generate":
        return part_generate(Path(a.part_out), a.cpu, a.target, a.drafter, a.new_tokens)
    if a.part == "save-random":
        return part_save_random(Path(a.part_out), a.target)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return check(a.cpu, a.out, work, a.gpus)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
