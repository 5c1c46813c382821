"""Peak memory per rank of `blockdraft train`, part by part, for the README's GPU commands (and any
target config), from blockdraft.plan; and the check of that plan against measured steps on the CPU.

    python benchmarks/memory_plan.py                         # the README commands on 80 GB and 24 GB cards
    python benchmarks/memory_plan.py --target DIR -- --draft-layers 5 --max-length 4096 ...   # your own
    python benchmarks/memory_plan.py --check                 # plan vs measured peak RSS of real CPU steps

The check runs two optimizer steps of a random target in a fresh process per shape (glibc told to
return freed memory at once, so the resident set follows the live tensors) and compares the rise
of the peak resident set over the loaded models with the plan's gradients, optimizer state and
step peak. tests/test_memory_plan.py runs it at small shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The README's GPU commands (flags after `blockdraft train`), with the GPUs they run on.
QWEN3_8B = dict(arch="qwen3", vocab=151936, layers=36, hidden=4096, heads=32, kv_heads=8, intermediate=12288,
                head_dim=128)
LLAMA_70B = dict(arch="llama", vocab=128256, layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672,
                 head_dim=128)
QWEN3_235B_A22B = dict(arch="qwen3_moe", vocab=151936, layers=94, hidden=4096, heads=64, kv_heads=4, intermediate=12288,
                      head_dim=128, moe_intermediate=1536, experts=128, experts_per_token=8)
README_COMMANDS = [  # (what, target shape, GPUs, the card it is meant for in GB, flags)
    ("Qwen3-8B, one GPU", QWEN3_8B, 1, 80,
     "--draft-layers 5 --block-size 16 --max-rows 0 --max-length 4096 --batch-tokens 16384 --grad-accum 2 "
     "--max-anchors 512 --epochs 6 --lr 6e-4 --draft-vocab full --sliding-window 0 --gradient-checkpointing"),
    ("Qwen3-8B, 8 GPUs", QWEN3_8B, 8, 80,
     "--draft-layers 5 --max-rows 0 --max-length 4096 --batch-tokens 16384 --draft-vocab full --sliding-window 0"),
    ("Qwen3-8B, 8 GPUs --fsdp", QWEN3_8B, 8, 80,
     "--draft-layers 5 --max-rows 0 --max-length 4096 --batch-tokens 16384 --draft-vocab full --sliding-window 0 "
     "--fsdp"),
    ("Llama-3.3-70B, 8 GPUs, target and drafter sharded", LLAMA_70B, 8, 80,
     "--target-fsdp --fsdp --gradient-checkpointing --draft-layers 5 --max-rows 0 --max-length 4096 "
     "--batch-tokens 16384 --draft-vocab full --sliding-window 0"),
    ("Qwen3-8B from a feature cache, 8 x 24 GB GPUs", QWEN3_8B, 8, 24,
     "--features-cache CACHE --draft-layers 5 --max-rows 0 --max-length 4096 --batch-tokens 8192 --grad-accum 2 "
     "--draft-vocab full --sliding-window 0 --fsdp --gradient-checkpointing"),
    ("Qwen3-235B-A22B from a vLLM feature cache, 8 GPUs", QWEN3_235B_A22B, 8, 80,
     "--features-cache /shared/cache --draft-layers 5 --max-rows 0 --max-length 4096 --batch-tokens 16384 "
     "--draft-vocab full --sliding-window 0 --fsdp"),
]


def config_of(shape: dict):
    """A transformers config of that shape (nothing is built)."""
    import transformers as tf

    kw = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
              num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
              intermediate_size=shape["intermediate"], head_dim=shape["head_dim"], tie_word_embeddings=False)
    if shape["arch"] == "qwen3_moe":
        return tf.Qwen3MoeConfig(**kw, moe_intermediate_size=shape["moe_intermediate"], num_experts=shape["experts"],
                                 num_experts_per_tok=shape["experts_per_token"])
    return tf.Qwen3Config(**kw) if shape["arch"] == "qwen3" else tf.LlamaConfig(**kw)


def run_config(flags: str):
    """The RunConfig `blockdraft train FLAGS` would run."""
    from blockdraft.cli import train_parser, train_config

    argv = flags.split()
    args = train_parser().parse_args(argv)
    return train_config(args, argv)


def readme_plans() -> list[dict]:
    from blockdraft.plan import GIB, plan_run

    out = []
    for name, shape, gpus, card, flags in README_COMMANDS:  # the multi-GPU commands run under torchrun
        p = plan_run(config_of(shape), run_config(flags), world=gpus, cuda=True, torchrun=gpus > 1,
                     device_bytes=card * GIB)
        out.append({"command": name, "gpus": gpus, "card_gb": card, "flags": flags, "parts_gib": p.gib(),
                    "fits_80": p.fits(80), "fits_24": p.fits(24), "fits_card": p.fits(card), "table": p.table()})
    return out


# ------------------------------------------------------------------------------------------ the check

def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """This process's peak resident set. VmHWM belongs to the address space exec made; getrusage's
    ru_maxrss would keep the forking parent's size (a large test process) across the exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _build(spec: dict):
    import torch

    from blockdraft.config import DrafterConfig
    from blockdraft.model import DFlashDrafter
    from blockdraft.target import TargetModel
    from blockdraft.target.tiny import tiny_causal_lm
    from blockdraft.train import Batch

    torch.manual_seed(0)
    m = tiny_causal_lm("qwen3", vocab=spec["V"], layers=8, hidden=spec["H"], heads=4, kv_heads=2,
                       intermediate=spec["I"], head_dim=spec["hd"], max_positions=4096)
    t = TargetModel(m, None, [1, 2, 3, 4, 5], mask_token_id=spec["V"] - 1)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=spec["layers"], block_size=spec["B"]))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec["V"] - 1, (spec["rows"], spec["L"]), generator=g)
    doc = (torch.arange(spec["L"]) >= spec["L"] // 2).long().expand_as(ids).clone()
    return t, d, Batch(ids, torch.ones_like(ids), document_ids=doc)


def measure(spec: dict) -> dict:
    """In this process (a fresh one): the peak resident set of 2 optimizer steps over the loaded models."""
    import torch

    from blockdraft.train import train_step

    torch.set_num_threads(1)
    t, d, batch = _build(spec)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-4)
    base = _rss()
    for i in range(2):
        train_step(t, d, opt, batch, max_anchors=spec["A"], generator=torch.Generator().manual_seed(i),
                   backend="chunked")
    peak = _peak_rss()
    return {"base": base, "peak": peak, "rise": peak - base}


def measure_in_subprocess(spec: dict) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, __file__, "--measure", json.dumps(spec)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def planned(spec: dict):
    """The plan of the same step, with the step's own counts (blocks, slots, label positions, the
    context rows its chunks read); the models' weights are left out (the measurement starts after)."""
    import torch

    from blockdraft.model.blocks import label_positions
    from blockdraft.plan import Shapes, count_params, layout_chunks, step_plan
    from blockdraft.train.step import prepare

    t, d, batch = _build(spec)
    p = prepare(t, d, batch, max_anchors=spec["A"], generator=torch.Generator().manual_seed(0))
    # distinct label positions, counted from the anchors (not from the labels prepare made)
    positions = label_positions(p.anchors, spec["B"])[p.supervised].unique().numel()
    cfg = d.config
    s = Shapes(rows=spec["rows"], L=spec["L"], blocks=p.anchors.numel(), B=spec["B"], slots=int(p.supervised.sum()),
               label_positions=positions, Hd=cfg.hidden_size,
               qd=cfg.num_attention_heads * cfg.head_dim, kvd=cfg.num_key_value_heads * cfg.head_dim,
               heads=cfg.num_attention_heads, I=cfg.intermediate_size, layers=cfg.num_hidden_layers,
               features=cfg.feature_size, V=spec["V"], Vd=spec["V"], target_hidden=spec["H"],
               target_intermediate=spec["I"])
    plan = step_plan(s, target_params=count_params(t.model), head_only_params=0, drafter_params=count_params(d),
                     unit_params=0, cuda=False, chunks=layout_chunks(p.layout))
    return plan


CHECK_SHAPES = [  # small targets, a large vocabulary among them (the labels dominate there)
    dict(V=32768, H=64, I=192, hd=16, layers=1, rows=2, L=1024, A=256, B=16),
    dict(V=8192, H=256, I=768, hd=64, layers=2, rows=2, L=1024, A=256, B=16),
    dict(V=16384, H=128, I=512, hd=32, layers=3, rows=4, L=512, A=128, B=8),
]


def check(shapes=CHECK_SHAPES) -> list[dict]:
    out = []
    for spec in shapes:
        got = measure_in_subprocess(spec)
        plan = planned(spec)
        planned_rise = plan.peak - plan.parts["target"] - plan.parts["drafter"]
        out.append({"spec": spec, "measured_rise_mib": got["rise"] / 2**20, "planned_rise_mib": planned_rise / 2**20,
                    "ratio": planned_rise / got["rise"], "labels_mib": plan.parts["labels"] / 2**20,
                    "parts_mib": {k: v / 2**20 for k, v in plan.parts.items()}})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare the plan with measured CPU steps")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--target", default=None, help="a local transformers directory (its config.json)")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--torchrun", action="store_true", help="launched by torchrun (a process group even for one GPU)")
    ap.add_argument("--device-gib", type=float, default=139.0, help="each GPU's memory (default: an H200's)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("flags", nargs="*", help="blockdraft train flags (after --)")
    a = ap.parse_args(argv)
    if a.measure:
        print(json.dumps(measure(json.loads(a.measure))))
        return None
    if a.check:
        res = check()
        for r in res:
            print(f"{r['spec']}: measured +{r['measured_rise_mib']:.0f} MiB, planned +{r['planned_rise_mib']:.0f} MiB "
                  f"(ratio {r['ratio']:.2f})")
    elif a.target:
        from transformers import AutoConfig

        from blockdraft.plan import GIB, plan_run

        p = plan_run(AutoConfig.from_pretrained(a.target), run_config(" ".join(a.flags)), world=a.gpus, cuda=True,
                     torchrun=a.torchrun, device_bytes=int(a.device_gib * GIB))
        res = {"parts_gib": p.gib(), "fits_80": p.fits(80), "fits_24": p.fits(24), "fits": p.fits(a.device_gib)}
        print(p.table())
    else:
        res = readme_plans()
        for r in res:
            print(f"{r['command']} ({r['gpus']} GPU{'s' if r['gpus'] > 1 else ''}): fits 80 GB: {r['fits_80']}, "
                  f"24 GB: {r['fits_24']}\n{r['table']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
