"""Two gloo processes train exactly like one process with two-step gradient accumulation."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.train.trainer import TrainConfig, Trainer


def build(out, grad_accum, fsdp=False):
    from conftest import tiny_target
    from conftest import tiny_rows

    torch.set_num_threads(1)
    t = tiny_target("llama", seed=1)
    with torch.no_grad():
        t.model.get_output_embeddings().weight.mul_(20)
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    cfg = TrainConfig(out=str(out), steps=5, batch_tokens=40, max_anchors=8, eval_every=100, save_every=2,
                      lr=3e-3, warmup=1, grad_accum=grad_accum, progress=False, fsdp=fsdp)
    return Trainer(t, d, tiny_rows(16), tiny_rows(4, seed=1) if fsdp else None, cfg)


def worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        build(out, grad_accum=1).train()
    finally:
        dist.destroy_process_group()


class Stop(Exception):
    pass


def fsdp_worker(rank, world, port, out, stop_after, resume):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tr = build(out, grad_accum=1, fsdp=True)
        if stop_after:  # a kill after `stop_after` steps, on every rank
            real = tr.step

            def step():
                if tr.progress["step"] == stop_after:
                    raise Stop
                return real()
            tr.step = step
        try:
            tr.train(resume=resume)
        except Stop:
            pass
    finally:
        dist.destroy_process_group()


def losses(out):
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_processes_match_one_process_with_accumulation(tmp_path):
    one = build(tmp_path / "one", grad_accum=2)
    one.train()
    mp.spawn(worker, args=(2, free_port(), tmp_path / "two"), nprocs=2, join=True)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 5
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    from blockdraft.checkpoint import load_drafter

    w1 = load_drafter(tmp_path / "one" / "drafter").fc.weight
    w2 = load_drafter(tmp_path / "two" / "drafter").fc.weight
    torch.testing.assert_close(w1, w2, rtol=1e-5, atol=1e-6)


def extract_worker(rank, world, port, out):
    from conftest import tiny_target
    from conftest import tiny_rows

    from blockdraft.data.features import extract

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        extract(tiny_target("llama"), tiny_rows(10), out, shard_rows=3, rank=rank, world=world, progress=False)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_process_extraction_equals_one_process(tmp_path):
    from conftest import tiny_target
    from conftest import tiny_rows

    from blockdraft.data.features import DiskFeatures, extract

    extract(tiny_target("llama"), tiny_rows(10), tmp_path / "one", shard_rows=3, progress=False)
    mp.spawn(extract_worker, args=(2, free_port(), tmp_path / "two"), nprocs=2, join=True)
    a, b = DiskFeatures(tmp_path / "one"), DiskFeatures(tmp_path / "two")
    idx = torch.arange(10)
    x, y = a(idx), b(idx)
    for field in ("features", "final_hidden", "top"):
        assert torch.equal(getattr(x, field), getattr(y, field))
    assert a.manifest == b.manifest


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp_two_processes_match_one_process_and_resume_exactly(tmp_path):
    """FSDP2 (sharded drafter) on 2 gloo processes: the same losses, held-out metrics and final
    weights as one process with 2-step accumulation, through a kill after step 3 and a resume
    from the step-2 checkpoint (gathered full state, re-sharded optimizer state)."""
    one = build(tmp_path / "one", grad_accum=2, fsdp=True)  # fsdp on one process: plain training
    assert not one.fsdp
    one.train()
    mp.spawn(fsdp_worker, args=(2, free_port(), tmp_path / "two", 3, False), nprocs=2, join=True)
    assert len(losses(tmp_path / "two")) == 3
    mp.spawn(fsdp_worker, args=(2, free_port(), tmp_path / "two", 0, True), nprocs=2, join=True)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 5
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    ev = [[json.loads(ln).get("eval_tau") for ln in (p / "metrics.jsonl").read_text().splitlines()]
          for p in (tmp_path / "one", tmp_path / "two")]
    assert ev[0][-1] is not None and ev[0] == ev[1]
    from blockdraft.checkpoint import load_drafter

    d1, d2 = load_drafter(tmp_path / "one" / "drafter"), load_drafter(tmp_path / "two" / "drafter")
    for (n, p1), p2 in zip(d1.state_dict().items(), d2.state_dict().values()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6, msg=n)
