"""The product on a GPU, in one command that fits a lent machine's time and keeps what it measured.

    bash benchmarks/gpu_prepare.sh                  # on a CPU machine: packs .gpu/tokenizer (what travels)
    bash benchmarks/gpu_device_run.sh               # on the GPU machine, from the repo root (OUT=dir)
    python benchmarks/gpu_check.py --cpu --out DIR  # the same parts on 2 gloo processes, tiny shapes

Parts, in order of value, each in its own process group with its own time limit, within
`--budget-s` for the whole run:

1. preflight: versions, imports, free disk, nvidia-smi, the device;
2. parity: flex attention (compiled once for every layer kind) against the dense reference, outputs
   and gradients, bf16 and fp32, for every layer kind the product trains (full and sliding, causal
   or not in the block, both window rules), with asserted tolerances; a recompile-limit hit fails;
3. train: `torchrun ... blockdraft train` of a real-shaped random target (Qwen3-0.6B's shape) with
   the default sliding layer and a draft vocabulary, `--fsdp --target-fsdp --gradient-checkpointing`,
   evaluation and a save; then `--resume` continues it;
4. generate: speculative generation with that drafter against the target's own greedy decoding;
5. big (if the time left allows): the README's Qwen3-8B command shape for peak allocated and
   reserved memory, tokens/s and MFU beside the memory plan; its checkpoint deleted after.

After every part the report (`gpu-check.json`) and that part's log tail (`gpu-check-logs.txt`)
are written to `--out`, so a run stopped at any moment leaves the parts done. Each part checks its
disk need first and deletes what it wrote once measured. Nothing is downloaded: targets are
`random:NAME` (blockdraft.target.tiny.RANDOM_PRESETS) with SmolLM2's tokenizer (`--tokenizer`, packed by
`--pack-tokenizer`), the data the bundled conversations. tests/test_gpu_check.py runs the CPU mode,
and CI runs benchmarks/gpu_device_run.sh in an environment with the GPU image's versions.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # the GPU image has no blockdraft installed: run it from src/
    sys.path.insert(0, str(ROOT / "src"))

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12,
             "A10": 125e12, "L4": 121e12}
REPORT, LOGS = "gpu-check.json", "gpu-check-logs.txt"
TAIL = 4000  # characters of a part's log kept in the report
GIB = 2**30

# each mode: the quick train's target and flags, the big run's (None: not in this mode), per-part caps (s)
MODES = {
    "cuda": dict(
        target="random:qwen3-0.6b", nproc=1, conversations=600, steps=6, resume_to=8,
        flags="--max-length 2048 --draft-layers 2 --block-size 16 --max-anchors 256 --draft-vocab 32768 "
              "--batch-tokens 8192 --grad-accum 2 --fsdp --target-fsdp --gradient-checkpointing "
              "--max-eval-rows 16",
        big_target="random:qwen3-8b", big_steps=4, big_conversations=400,
        big_flags="--max-length 4096 --draft-layers 5 --block-size 16 --max-anchors 512 --draft-vocab full "
                  "--sliding-window 0 --batch-tokens 16384 --grad-accum 2 --gradient-checkpointing "
                  "--max-eval-rows 8",
        caps=dict(preflight=60, parity=150, train=240, resume=120, generate=90, big=330), gen_tokens=96),
    "cpu": dict(
        target="random:tiny", nproc=2, conversations=120, steps=3, resume_to=4,
        flags="--max-length 256 --draft-layers 1 --block-size 8 --max-anchors 16 --draft-vocab 4096 "
              "--batch-tokens 512 --grad-accum 2 --fsdp --target-fsdp --gradient-checkpointing "
              "--max-eval-rows 4 --threads 1 --device cpu",
        big_target=None, caps=dict(preflight=60, parity=120, train=240, resume=180, generate=120),
        gen_tokens=24),
}


# ------------------------------------------------------------------------------ running parts

class Stopped(Exception):
    """The run was told to stop (SIGTERM from a timeout around it)."""


def child_env() -> dict:
    e = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def run(cmd: list[str], log: Path, timeout: float) -> None:
    """Run `cmd` in its own process group, its output to `log`. Past `timeout`, or when this process
    is told to stop, the whole group (torchrun and its ranks) gets SIGTERM, then SIGKILL."""
    if timeout < 5:
        raise RuntimeError(f"no time left for: {' '.join(cmd)}")
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
                             start_new_session=True)
        try:
            code = p.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, Stopped) as e:
            stop_group(p)
            if isinstance(e, Stopped):
                raise
            raise RuntimeError(f"timed out after {timeout:.0f} s (process group stopped): {' '.join(cmd)}") from None
    if code:
        raise RuntimeError(f"exit {code}: {' '.join(cmd)}")


def stop_group(p: subprocess.Popen, grace: float = 15.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def torchrun(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
            "blockdraft", *args]


def tail(path: Path, n: int = TAIL) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


class Check:
    """The run: its report, written after every part, its budget, its scratch and output folders."""

    def __init__(self, out: Path, work: Path, budget_s: float, cpu: bool):
        self.out, self.work, self.cpu = out, work, cpu
        self.mode = MODES["cpu" if cpu else "cuda"]
        self.t0, self.budget = time.monotonic(), budget_s
        self.report: dict = {"mode": "cpu" if cpu else "cuda", "budget_s": budget_s, "parts": {}, "done": False}
        self.stopped = False
        out.mkdir(parents=True, exist_ok=True)
        (out / LOGS).write_text("")
        self.write()

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def write(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out / (REPORT + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=1) + "\n")
        os.replace(tmp, self.out / REPORT)

    def part(self, name: str, fn, *, need_s: float = 0.0) -> dict:
        """Run one part within its cap and the time left; record figures or the error, the log tails,
        and write the report. A part needing more than the time left is skipped, not started."""
        cap = min(self.mode["caps"].get(name, 120), self.left())
        if self.stopped:
            got = {"ok": None, "skipped": "the run was stopped (SIGTERM)"}
        elif cap < max(need_s, 10):
            got = {"ok": None, "skipped": f"{self.left():.0f} s left of the budget, the part needs {need_s:.0f}"}
        else:
            t = time.monotonic()
            try:
                got = {"ok": True, **(fn(cap) or {})}
            except Stopped:
                self.stopped = True
                self.report["stopped"] = True
                got = {"ok": False, "error": "stopped (SIGTERM) while running"}
            except Exception as e:  # noqa: BLE001  (every failure is a figure: the next part still runs)
                got = {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:],
                       "traceback": traceback.format_exc()[-2000:]}
            got["seconds"] = round(time.monotonic() - t, 1)
        logs = sorted(self.work.glob(f"{name}*.log"))
        got["log_tail"] = {p.name: tail(p) for p in logs}
        with open(self.out / LOGS, "a") as f:
            for p in logs:
                f.write(f"===== {p.name} (last {TAIL} characters)\n{tail(p)}\n")
        self.report["parts"][name] = got
        self.write()
        state = {True: "ok", False: "FAILED", None: "skipped"}[got["ok"]]
        print(f"gpu_check: {name}: {state} ({got.get('seconds', 0):.0f} s; {self.left():.0f} s left)", flush=True)
        return got


def free_gib(path: Path) -> float:
    return shutil.disk_usage(path).free / GIB


def need_disk(path: Path, gib: float, what: str) -> None:
    if free_gib(path) < gib:
        raise RuntimeError(f"not enough disk for {what}: {gib:.1f} GiB needed, {free_gib(path):.1f} GiB free in {path}")


# ---------------------------------------------------------------------------------- the parts

def preflight(check: Check) -> dict:
    """Versions, imports, free disk, the GPU: in this process (seconds), before anything is spent."""
    import importlib

    got: dict = {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform()}
    for name in ("torch", "transformers", "triton", "accelerate", "safetensors", "tqdm", "numpy", "gguf"):
        try:
            got[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # noqa: BLE001  (a missing optional package is a figure)
            got[name] = f"missing ({type(e).__name__})"
    for mod in ("blockdraft.cli", "blockdraft.train.run", "blockdraft.model.attention", "blockdraft.target.shard"):
        importlib.import_module(mod)  # a failure here fails the part: nothing else could run
    got["free_gib"] = {str(p): round(free_gib(p), 1) for p in (check.work, check.out)}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,memory.total,memory.used,driver_version,compute_cap",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        got["nvidia_smi"] = (q.stdout or q.stderr).strip()
    import torch

    got["cuda"] = torch.cuda.is_available()
    if got["cuda"]:
        p = torch.cuda.get_device_properties(0)
        got.update(device=p.name, capability=list(torch.cuda.get_device_capability(0)),
                   memory_gib=round(p.total_memory / GIB, 1), gpus=torch.cuda.device_count())
        check.report["device"] = p.name
    elif not check.cpu:
        raise RuntimeError("no CUDA device: run with --cpu for the reduced check")
    check.report["versions"] = {k: got[k] for k in ("python", "torch", "transformers", "triton")}
    return got


def parity(check: Check, cap: float) -> dict:
    me = [sys.executable, str(Path(__file__).resolve())]
    out = check.work / "parity.json"
    run(me + ["--part", "parity", "--part-out", str(out)] + (["--cpu"] if check.cpu else []),
        check.work / "parity.log", cap)
    got = json.loads(out.read_text())
    bad = [r for r in got["rows"] if not r["ok"]]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(got['rows'])} layer kinds outside tolerance: {bad[:3]}")
    return got


def part_parity(out: Path, cpu: bool) -> None:
    """Every layer kind the product trains, through the backend training uses (flex on CUDA, compiled
    once for all kinds; the chunked path and the compiled flex forward on a CPU), against the dense
    reference in fp32: outputs and every input's gradient, within the dtype's tolerance."""
    import torch

    from blockdraft.model import BlockLayout
    from blockdraft.model.attention import LayerVisibility, anchor_block_attention
    from blockdraft.train.anchors import sample_anchors
    from blockdraft.train.step import positions_from_documents

    device = torch.device("cpu" if cpu else "cuda")
    T, n_anchors, heads, kv_heads, D, B = (96, 8, 4, 2, 16, 4) if cpu else (4096, 256, 16, 8, 128, 16)
    g = torch.Generator().manual_seed(0)
    doc = torch.zeros(T, dtype=torch.long)
    for c in sorted(torch.randperm(T - 32, generator=g)[:3].add(16).tolist()):
        doc[c:] += 1
    lay = BlockLayout(doc.to(device), positions_from_documents(doc[None])[0].to(device),
                      sample_anchors(doc, torch.ones(T, dtype=torch.long), B, n_anchors, g).to(device), B)
    N, W = lay.num_blocks, max(4, T // 8)
    base = [torch.randn(*s, generator=g) for s in ((N, B, heads, D), (T, kv_heads, D), (T, kv_heads, D),
                                                   (N, B, kv_heads, D), (N, B, kv_heads, D))]
    kinds = [LayerVisibility(None, c, "query") for c in (False, True)]
    kinds += [LayerVisibility(W, c, r) for c in (False, True) for r in ("query", "anchor")]
    backend = "chunked" if cpu else "flex"
    weight = None

    def attend(dtype, vis, how):
        nonlocal weight
        xs = [x.detach().to(device, dtype).requires_grad_(True) for x in base]
        y = anchor_block_attention(*xs, lay, vis, scale=D ** -0.5, backend=how)
        weight = torch.linspace(-1, 1, y.numel(), device=device).view_as(y) if weight is None else weight
        (y.float() * weight).sum().backward()
        return y.detach().float(), [x.grad.float() for x in xs]

    rows, t0 = [], time.perf_counter()
    for vis in kinds:
        ry, rg = attend(torch.float32, vis, "dense")
        for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 2e-5 if cpu else 1e-3)):
            y, gr = attend(dtype, vis, backend)
            scale_y, scale_g = float(ry.abs().max()), max(float(x.abs().max()) for x in rg)
            dy = float((y - ry).abs().max())
            dg = max(float((a - b).abs().max()) for a, b in zip(gr, rg))
            rows.append({"window": vis.window, "causal": vis.causal, "rule": vis.rule, "dtype": str(dtype)[6:],
                         "backend": backend, "max_out_diff": dy, "max_grad_diff": dg, "ref_scale": scale_y,
                         "ref_grad_scale": scale_g, "tolerance": tol,
                         "ok": dy <= tol * max(1.0, scale_y) and dg <= tol * max(1.0, scale_g) and scale_g > 0})
    got = {"rows": rows, "seconds": time.perf_counter() - t0, "torch": torch.__version__,
           "shape": dict(T=T, blocks=N, B=B, heads=heads, kv_heads=kv_heads, head_dim=D)}
    got["compiled_graphs"] = compiled_graphs()
    if not cpu:
        got["device"] = torch.cuda.get_device_name()
    out.write_text(json.dumps(got))


def compiled_graphs() -> int | None:
    """Graphs dynamo compiled in this process (one is expected for all layer kinds of one dtype)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return None


def write_data(path: Path, n: int) -> Path:
    """The first `n` bundled conversations as a JSONL file."""
    src = ROOT / "src" / "blockdraft" / "assets" / "data" / "default.jsonl.gz"
    with gzip.open(src, "rt") as f, open(path, "w") as g:
        for i, line in enumerate(f):
            if i >= n:
                break
            g.write(line)
    return path


def train_args(target: str, flags: str, steps: int, data: Path, out: Path, save_every: int) -> list[str]:
    return ["train", "--target", target, *flags.split(), "--steps", str(steps), "--eval-every", str(steps),
            "--save-every", str(save_every), "--data", str(data), "--out", str(out), "--no-progress"]


def train(check: Check, cap: float) -> dict:
    """The quick run: the product's default layer kinds and a draft vocabulary on a real-shaped target,
    sharded (--fsdp --target-fsdp), with gradient checkpointing, evaluation and a save."""
    m = check.mode
    need_disk(check.work, 2.0, "the quick run")
    data = write_data(check.work / "data.jsonl", m["conversations"])
    out = check.work / "train"
    args = train_args(m["target"], m["flags"], m["steps"], data, out, m["steps"])
    run(torchrun(m["nproc"], args), check.work / "train.log", cap)
    fig = training_figures(out)
    fig.update(figures_of_run(m["target"], m["flags"], m["nproc"], out / "drafter", check,
                              fig["tokens_per_s"]))
    if not (out / "checkpoint").is_dir() or not fig.get("eval_tau"):
        raise RuntimeError("the run wrote no checkpoint or no held-out tau")
    return fig


def resume(check: Check, cap: float) -> dict:
    """`--resume` with more steps: the checkpoint (FSDP-gathered, fused AdamW state) loads and training
    continues from the saved step, appending to the same metrics."""
    m, out = check.mode, check.work / "train"
    if not (out / "checkpoint").is_dir():
        raise RuntimeError("no checkpoint to resume (the train part failed)")
    args = train_args(m["target"], m["flags"], m["resume_to"], check.work / "data.jsonl", out, m["resume_to"])
    run(torchrun(m["nproc"], args + ["--resume"]), check.work / "resume.log", cap)
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    if steps != list(range(1, m["resume_to"] + 1)):
        raise RuntimeError(f"metrics after the resume hold steps {steps}, not 1..{m['resume_to']}")
    fig = training_figures(out)
    return {"steps": steps[-1], "resumed_from": m["steps"], "loss": fig["loss"], "eval_tau": fig["eval_tau"]}


def generate(check: Check, cap: float) -> dict:
    m, drafter = check.mode, check.work / "train" / "drafter"
    if not drafter.is_dir():
        raise RuntimeError("no trained drafter (the train part failed)")
    out = check.work / "generate.json"
    run([sys.executable, str(Path(__file__).resolve()), "--part", "generate", "--part-out", str(out), "--drafter",
         str(drafter), "--target", m["target"], "--new-tokens", str(m["gen_tokens"])] + (["--cpu"] if check.cpu else []),
        check.work / "generate.log", cap)
    got = json.loads(out.read_text())
    shutil.rmtree(check.work / "train", ignore_errors=True)  # measured: free the disk for the big run
    return got


def part_generate(out: Path, cpu: bool, target: str, drafter: str, n_new: int) -> None:
    """Speculative generation with the trained drafter against the target's own greedy decoding (in
    bf16 a verify of 16 tokens may round a near tie otherwise than a one-token step: the report says
    where the two first part, if they do)."""
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
    speculative_generate(t, d, ids, max_new_tokens=8)  # warm-up: compiles and allocator growth untimed
    ref = target_greedy(t, ids, max_new_tokens=n_new)
    res = speculative_generate(t, d, ids, max_new_tokens=n_new)
    same = next((i for i, (a, b) in enumerate(zip(res.tokens, ref.tokens)) if a != b),
                min(len(res.tokens), len(ref.tokens)))
    steps = max(1, len(res.accepted))
    out.write_text(json.dumps({
        "dtype": str(t.dtype).split(".")[-1], "identical": res.tokens == ref.tokens, "identical_prefix": same,
        "new_tokens": len(res.tokens), "tau": res.tau, "steps": steps,
        "ms_draft_per_step": 1e3 * res.time_draft / steps, "ms_verify_per_step": 1e3 * res.time_verify / steps,
        "ms_per_target_token": 1e3 * (ref.time_total - ref.time_prefill) / max(1, len(ref.tokens) - 1),
        "speculative_tokens_per_s": len(res.tokens) / max(1e-9, res.time_total - res.time_prefill),
        "target_tokens_per_s": len(ref.tokens) / max(1e-9, ref.time_total - ref.time_prefill)}))


def big(check: Check, cap: float) -> dict:
    """The README's Qwen3-8B command shape (5 layers, full vocabulary, 32k tokens a step) for its peak
    allocated and reserved memory, tokens/s and MFU beside the plan; its files deleted after."""
    m = check.mode
    params = planned(m["big_target"], m["big_flags"], m["nproc"], True)["drafter_params"]
    need_disk(check.work, (2 * 12 * params + 4 * params) / GIB + 2, "the 8B-shaped run's checkpoint and drafter")
    data = write_data(check.work / "big.jsonl", m["big_conversations"])
    out = check.work / "big"
    try:
        args = train_args(m["big_target"], m["big_flags"], m["big_steps"], data, out, 10**6)
        run(torchrun(m["nproc"], args), check.work / "big.log", cap)
        fig = training_figures(out)
        fig.update(figures_of_run(m["big_target"], m["big_flags"], m["nproc"], out / "drafter", check,
                                  fig["tokens_per_s"]))
        fig["checkpoint_gib"] = round(sum(f.stat().st_size for f in (out / "checkpoint").rglob("*") if f.is_file())
                                      / GIB, 2)
        return fig
    finally:
        shutil.rmtree(out, ignore_errors=True)


# ----------------------------------------------------------------------------- figures of a run

def training_figures(out: Path) -> dict:
    """From a run's metrics.jsonl: the first step (compile included), later steps, tokens/s, peaks."""
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"{out}/metrics.jsonl is empty")
    later = lines[1:] or lines
    fig = {"steps": len(lines), "first_step_s": lines[0]["step_s"],
           "step_s": statistics.median(m["step_s"] for m in later),
           "tokens_per_s": statistics.median(m["tokens_per_s"] for m in later),
           "loss": [m["loss"] for m in lines],
           "eval_tau": next((m["eval_tau"] for m in reversed(lines) if "eval_tau" in m), None)}
    for key in ("peak_mem_gib", "peak_reserved_gib"):
        peaks = [m[key] for m in lines if key in m]
        if peaks:
            fig[key + "_per_rank"] = [max(p[r] for p in peaks) for r in range(len(peaks[0]))]
    return fig


def flops_per_token(target_params: int, drafter_params: int, blocks_per_token: float, B: int, hidden: int,
                    vocab: int) -> float:
    """Model FLOPs per training token: the frozen target's forward (2 P_t), the drafter's forward
    and backward over its block queries (6 P_d per query), the head over the supervised slots
    (forward and the input gradient: 4 H V per slot). Attention's own products are left out."""
    q = blocks_per_token * B
    return 2 * target_params + 6 * drafter_params * q + 4 * hidden * vocab * blocks_per_token * (B - 1)


def planned(target: str, flags: str, world: int, cuda: bool) -> dict:
    """The memory plan's figures per rank for these flags (blockdraft.plan, benchmarks/memory_plan.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import memory_plan
    finally:
        sys.path.pop(0)
    from blockdraft.plan import plan_run
    from blockdraft.target.tiny import random_config

    plan = plan_run(random_config(target), memory_plan.run_config(flags), world=world, cuda=cuda, torchrun=True)
    return {"planned_peak_gib": plan.peak / GIB, "planned_reserved_gib": plan.reserved / GIB,
            "planned_total_gib": plan.total / GIB, "planned_parts_gib": plan.gib(), "drafter_params": plan.drafter_params}


def figures_of_run(target: str, flags: str, world: int, drafter_dir: Path, check: Check,
                   tokens_per_s: float) -> dict:
    """The plan's figures beside a finished run's, the model FLOPs per token and, on a known GPU, MFU."""
    from blockdraft.plan import target_sizes
    from blockdraft.target.tiny import random_config

    fig = planned(target, flags, world, not check.cpu)
    fig["drafter_params"] = params_of(drafter_dir)
    sizes = target_sizes(random_config(target))
    L, B, A = flag(flags, "--max-length"), flag(flags, "--block-size"), flag(flags, "--max-anchors")
    fig["model_flops_per_token"] = flops_per_token(sizes["params"], fig["drafter_params"], min(A, L) / L, B,
                                                   sizes["hidden"], sizes["vocab"])
    peak = next((v for k, v in PEAK_BF16.items() if k in check.report.get("device", "")), None)
    if peak and not check.cpu:
        fig["mfu"] = tokens_per_s * fig["model_flops_per_token"] / (peak * world)
    return fig


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


# ------------------------------------------------------------------------------------ the check

def check(out: Path, work: Path, budget_s: float, cpu: bool, skip_big: bool = False) -> dict:
    c = Check(out, work, budget_s, cpu)
    try:
        parts(c, skip_big)
    except Stopped:  # between two parts: what was done is already written
        c.report["stopped"] = True
    c.report["done"] = not c.report.get("stopped", False)
    c.write()
    return c.report


def parts(c: Check, skip_big: bool) -> None:
    c.part("preflight", lambda cap: preflight(c))
    if c.report["parts"]["preflight"]["ok"]:
        c.part("parity", lambda cap: parity(c, cap), need_s=20)
        c.part("train", lambda cap: train(c, cap), need_s=60)
        c.part("resume", lambda cap: resume(c, cap), need_s=30)
        c.part("generate", lambda cap: generate(c, cap), need_s=20)
        if c.mode["big_target"] and not skip_big:
            c.part("big", lambda cap: big(c, cap), need_s=150)
        else:
            c.report["parts"]["big"] = {"ok": None, "skipped": "--skip-big" if skip_big else "no big run in CPU mode"}


def pack_tokenizer(out: Path) -> None:
    """The tokenizer files of random targets in `out` (small enough to carry to a GPU machine)."""
    from blockdraft.target.files import random_target_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    random_target_tokenizer().save_pretrained(out)
    print(f"tokenizer files in {out}: {sorted(p.name for p in out.iterdir())}")


def on_sigterm(signum, frame):
    raise Stopped()


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="the reduced CPU mode (2 gloo processes, tiny shapes)")
    p.add_argument("--out", default="runs/gpu-check", help="where the report and the log tails go")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for the whole run, compiles included")
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed after)")
    p.add_argument("--skip-big", action="store_true", help="leave out the 8B-shaped run")
    p.add_argument("--tokenizer", default=None, help="a directory of SmolLM2's tokenizer files (see --pack-tokenizer)")
    p.add_argument("--pack-tokenizer", default=None, metavar="DIR",
                   help="copy the tokenizer files random targets use into DIR, to carry to a GPU machine")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--target", default=None, help=argparse.SUPPRESS)
    p.add_argument("--drafter", default=None, help=argparse.SUPPRESS)
    p.add_argument("--new-tokens", type=int, default=64, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tokenizer:  # read by blockdraft.target.files.random_target_tokenizer, here and in every subprocess
        os.environ["BLOCKDRAFT_TOKENIZER"] = str(Path(a.tokenizer).resolve())
    if a.pack_tokenizer:
        return pack_tokenizer(Path(a.pack_tokenizer))
    if a.part == "parity":
        return part_parity(Path(a.part_out), a.cpu)
    if a.part == "generate":
        return part_generate(Path(a.part_out), a.cpu, a.target, a.drafter, a.new_tokens)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    old = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return check(Path(a.out), work, a.budget_s, a.cpu, a.skip_big)
    finally:
        signal.signal(signal.SIGTERM, old)
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
