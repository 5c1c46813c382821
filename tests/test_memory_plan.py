"""The memory plan (blockdraft.plan, benchmarks/memory_plan.py) against measurements: the tensors
autograd keeps for a step (fp32 and bf16 autocast), and the peak resident set of real optimizer
steps at small shapes, a large vocabulary among them (a per-slot copy of the labels doubles that
one's peak: the plan's [P, V] labels are all the step may hold). The README's GPU commands fit."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import memory_plan  # noqa: E402

from blockdraft.plan import Shapes, fixed_activation_bytes, layer_activation_bytes, layout_chunks  # noqa: E402


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("spec", [dict(V=4096, H=128, I=384, hd=48, layers=2, rows=2, L=512, A=64, B=16),
                                  dict(V=2048, H=64, I=256, hd=32, layers=3, rows=4, L=256, A=32, B=8)])
def test_planned_activations_are_what_autograd_keeps(spec, amp):
    from blockdraft.train.step import compute_loss, prepare

    t, d, batch = memory_plan._build(spec)
    d.train()
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    p = prepare(t, d, batch, max_anchors=spec["A"], generator=gen())
    kept: dict[int, int] = {}

    def pack(x):
        kept[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp)
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        _, m = compute_loss(t, d, batch, max_anchors=spec["A"], generator=gen(), backend="chunked")
    cfg = d.config
    s = Shapes(rows=spec["rows"], L=spec["L"], blocks=m["blocks"], B=spec["B"], slots=m["supervised_slots"],
               label_positions=0, Hd=cfg.hidden_size, qd=cfg.num_attention_heads * cfg.head_dim,
               kvd=cfg.num_key_value_heads * cfg.head_dim, heads=cfg.num_attention_heads, I=cfg.intermediate_size,
               layers=cfg.num_hidden_layers, features=cfg.feature_size, V=spec["V"], Vd=spec["V"],
               target_hidden=spec["H"], target_intermediate=spec["I"])
    c = 2 if amp else 4
    planned = s.layers * layer_activation_bytes(s, c, "chunked", layout_chunks(p.layout)) + fixed_activation_bytes(s, c)
    assert 0.97 <= planned / sum(kept.values()) <= 1.10, (planned, sum(kept.values()))


def test_the_plan_matches_the_measured_peak_of_real_steps():
    """Two optimizer steps per shape in a fresh process: the rise of the peak resident set over the
    loaded models is within the plan's -20% / +30%."""
    for r in memory_plan.check(memory_plan.CHECK_SHAPES[:2]):
        assert 0.8 <= r["ratio"] <= 1.3, r


def test_the_readme_gpu_commands_fit_their_cards():
    readme = (ROOT / "README.md").read_text()
    flat = re.sub(r"\s*\\\n\s*", " ", readme)
    for r in memory_plan.readme_plans():
        assert r["flags"] in flat, f"README lacks: {r['flags']}"
        assert r["fits_card"], (r["command"], r["table"])
