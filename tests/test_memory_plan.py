"""The memory plan (blockdraft.plan, benchmarks/memory_plan.py) against measurements: the tensors
autograd keeps for a step (fp32 and bf16 autocast), and the peak resident set of real optimizer
steps at small shapes, a large vocabulary among them (the labels are the target's final states at
the label positions; the vocabulary enters only through a loss chunk). The README's GPU commands fit."""

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
    readme = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    flat = re.sub(r"\s*\\\n\s*", " ", readme)
    for r in memory_plan.readme_plans():
        assert r["flags"] in flat, f"README lacks: {r['flags']}"
        assert r["fits_card"], (r["command"], r["table"])


# ---------------------------------------------------------------- the terms issue 32 added (GPU review)

from blockdraft.plan import GIB, plan_run, step_plan  # noqa: E402
from blockdraft.train.loss import loss_chunk_slots  # noqa: E402

MIB = 2**20
SMALL = Shapes(rows=1, L=64, blocks=4, B=4, slots=12, label_positions=12, Hd=32, qd=32, kvd=16, heads=2, I=64,
               layers=2, features=96, V=1000, Vd=1000, target_hidden=32, target_intermediate=64)
WEIGHTS = dict(target_params=10_000, head_only_params=1_000, drafter_params=2_000, unit_params=500)


def small_plan(**kw):
    return step_plan(SMALL, **WEIGHTS, **kw)


def test_cuda_context_and_cublas_workspace_are_parts_of_cuda_plans_only():
    p = small_plan(cuda=True)
    assert p.parts["cuda context"] == 600 * MIB  # ~0.6 GiB per rank, outside the allocator
    assert p.parts["cublas workspace"] == 32 * MIB  # one stream's workspace, inside it (in the peak)
    assert p.total == p.reserved + 600 * MIB  # one rank, no process group: no NCCL
    cpu = small_plan(cuda=False)
    assert not {"cuda context", "cublas workspace", "nccl buffers"} & set(cpu.parts)
    assert cpu.peak == cpu.reserved == cpu.total


def test_nccl_buffers_with_a_process_group():
    assert small_plan(cuda=True, world=2).parts["nccl buffers"] == 4 * MIB * 32  # 4 MiB x 32 channels
    assert small_plan(cuda=True, world=1, grouped=True).parts["nccl buffers"] == 128 * MIB  # torchrun, one GPU
    assert "nccl buffers" not in small_plan(cuda=True, world=1).parts
    assert "nccl buffers" not in small_plan(cuda=False, world=2).parts  # gloo
    p = small_plan(cuda=True, world=2)
    assert p.total == p.reserved + 600 * MIB + 128 * MIB


def test_reserved_is_the_allocated_peak_with_its_reserve():
    p = small_plan(cuda=True)
    # the largest block: a loss chunk's fp32 rows, 12 slots x 1000 x 4 (its label rows are 12 x 1000 x 2,
    # fc's features 64 x 96 x 2)
    assert p.reserved == int(p.peak * 1.1) + 12 * 1000 * 4 > p.peak
    assert p.gib()["reserved"] == p.reserved / GIB and p.gib()["total"] == p.total / GIB
    assert "reserved per rank" in p.table() and p.fits(p.total / GIB) and not p.fits(p.total / GIB - 0.01)


def test_fsdp_with_gradient_accumulation_keeps_unsharded_gradients():
    for cuda in (True, False):  # FSDP2 does it on gloo too
        p = small_plan(cuda=cuda, world=4, fsdp=True, grad_accum=2)
        assert p.parts["unsharded gradients"] == 2_000 * 4  # the whole fp32 gradient, not 1/world
        assert p.parts["gradients"] == 2_000 * 4 // 4
    assert "unsharded gradients" not in small_plan(world=4, fsdp=True, grad_accum=1).parts
    assert "unsharded gradients" not in small_plan(world=4, fsdp=False, grad_accum=2).parts


def test_fsdp_on_one_rank_holds_the_whole_drafter():
    p = small_plan(cuda=True, world=1, fsdp=True)
    assert (p.parts["drafter"], p.parts["gradients"], p.parts["optimizer"]) == (8_000, 8_000, 16_000)
    assert p.parts["bf16 gathers"] == 2 * 500 * 2
    p3 = small_plan(cuda=True, world=3, fsdp=True)
    assert p3.parts["drafter"] == 2_667 and 3 * p3.parts["drafter"] >= 8_000  # padded shards, never less


def test_autocast_cache_without_fsdp_bf16_gathers_with_it():
    assert small_plan(cuda=True).parts["autocast cache"] == 2_000 * 2  # a bf16 copy of every weight
    assert small_plan(cuda=True, gradient_checkpointing=True).parts["autocast cache"] == 2_000 * 2 + 500 * 2
    f = small_plan(cuda=True, world=2, fsdp=True)  # MixedPrecisionPolicy: nothing left for autocast
    assert "autocast cache" not in f.parts and "fsdp gathers" not in f.parts
    assert f.parts["bf16 gathers"] == 2 * 500 * 2  # a unit and the next, bf16
    cpu = small_plan(cuda=False, world=2, fsdp=True)
    assert "autocast cache" not in cpu.parts and "bf16 gathers" not in cpu.parts
    assert cpu.parts["fsdp gathers"] == 2 * 500 * 4
    assert "autocast cache" not in small_plan(cuda=False).parts


def test_no_part_holds_the_labels_for_every_position_and_vocabulary_entry():
    """The labels are the target's final states at the label positions [P, Ht] (the head runs in each
    loss chunk): past the chunk, no part grows with the vocabulary, with or without a feature cache."""
    for cache in (False, True):
        for cuda in (False, True):
            c = 2 if cuda else 4
            p = small_plan(cuda=cuda, features_cache=cache)
            assert p.parts["labels"] == 12 * 32 * c
            wide = step_plan(Shapes(**{**SMALL.__dict__, "V": 1000 * 50, "Vd": 1000 * 50}), **WEIGHTS, cuda=cuda,
                             features_cache=cache)
            grew = {k for k in p.parts if wide.parts[k] != p.parts[k]}
            assert grew <= {"loss chunk", "backward transient"}, grew
            # the chunk: a fixed number of slots, each a draft and a label row of the vocabulary
            assert wide.parts["loss chunk"] == 12 * 50_000 * (c + 12) * 2


def test_the_loss_term_follows_the_chunk():
    s = Shapes(**{**SMALL.__dict__, "slots": 10_000, "V": 50_000, "Vd": 50_000})
    per_slot = 50_000 * (2 + 12) * 2  # draft and label rows, bf16 plus their fp32 work
    outside = ("cuda context", "nccl buffers")
    before_loss = ("target", "drafter", "gradients", "optimizer", "autocast cache", "cublas workspace",
                   "activations", "labels", "block inputs", "masks")
    for device in (4 * GIB, 40 * GIB, 80 * GIB, 10**15):
        p = step_plan(s, **WEIGHTS, cuda=True, device_bytes=device)
        free = device - sum(p.parts.get(k, 0) for k in outside) - sum(p.parts[k] for k in before_loss)
        assert p.loss_chunk == loss_chunk_slots("cuda", 50_000, free)
        assert p.parts["loss chunk"] == p.loss_chunk * per_slot
    assert step_plan(s, **WEIGHTS, cuda=True, device_bytes=4 * GIB).loss_chunk == 256
    # (80 GiB - 0.6 GiB context - 32 MiB workspace - a few kB) / 32 / (12 x 50k) = 4439 slots -> 4352
    assert step_plan(s, **WEIGHTS, cuda=True, device_bytes=80 * GIB).loss_chunk == 4352
    assert step_plan(s, **WEIGHTS, cuda=True, device_bytes=10**15).loss_chunk == 8192
    cpu = step_plan(s, **WEIGHTS, cuda=False, device_bytes=10**15)
    assert cpu.loss_chunk == 256 and cpu.parts["loss chunk"] == 256 * 50_000 * (4 + 12) * 2
    assert small_plan(cuda=False).parts["loss chunk"] == 12 * 1000 * 16 * 2  # a chunk holds at most S slots


TINY = dict(arch="qwen3", vocab=1024, layers=12, hidden=64, heads=4, kv_heads=2, intermediate=128, head_dim=16)
TINY_FLAGS = "--draft-layers 1 --max-length 256 --batch-tokens 512 --draft-vocab full --sliding-window 0"


def test_the_cuda_chunk_is_sized_for_the_wider_of_the_draft_and_label_rows():
    """With a draft vocabulary, a chunk's label rows are the target's full head unless a feature
    cache's stored argmax lets the head run on the draft rows alone: the chunk (and its bytes) follow."""
    s = Shapes(**{**SMALL.__dict__, "slots": 10_000, "V": 50_000, "Vd": 10_000})
    for cache, width in ((False, 50_000), (True, 10_000)):
        p = step_plan(s, **WEIGHTS, cuda=True, device_bytes=80 * GIB, features_cache=cache)
        held = sum(p.parts.get(k, 0) for k in ("target", "drafter", "gradients", "optimizer", "autocast cache",
                                                "cublas workspace", "activations", "labels", "block inputs", "masks"))
        free = 80 * GIB - p.parts["cuda context"] - held
        assert p.loss_chunk == loss_chunk_slots("cuda", width, free)
        assert p.parts["loss chunk"] == p.loss_chunk * (10_000 + width) * (2 + 12)
    assert step_plan(s, **WEIGHTS, cuda=True, device_bytes=80 * GIB).loss_chunk < \
        step_plan(s, **WEIGHTS, cuda=True, device_bytes=80 * GIB, features_cache=True).loss_chunk


def test_plan_run_under_torchrun_and_without():
    cfg = memory_plan.config_of(TINY)
    run = memory_plan.run_config(TINY_FLAGS + " --fsdp --grad-accum 2")
    alone = plan_run(cfg, run, world=1, cuda=True)  # the signature benchmarks/gpu_check.py calls
    assert "autocast cache" in alone.parts
    assert not {"nccl buffers", "bf16 gathers", "unsharded gradients"} & set(alone.parts)
    one = plan_run(cfg, run, world=1, cuda=True, torchrun=True)  # a group of one: FSDP and NCCL for real
    assert one.parts["nccl buffers"] == 128 * MIB and "bf16 gathers" in one.parts and "autocast cache" not in one.parts
    assert one.parts["unsharded gradients"] == one.parts["drafter"]  # world 1: the shard is the whole
