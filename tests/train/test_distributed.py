"""Two gloo processes train exactly like one process with two-step gradient accumulation, under a
strict shim that fails wherever nccl on CUDA would (tests/cuda_shim.py): every collective's tensor
on the device, one gradient collective per bucket (replicated) or per unit and step (FSDP), the
held-out rows split across the ranks, one writer of metrics.jsonl."""

from __future__ import annotations

import json
import math
import pathlib
import time

import pytest
import torch
import torch.distributed as dist
from conftest import free_port, gloo_rank, spawn_ranks

from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.train.trainer import TrainConfig, Trainer

EVAL_ROWS = 5  # an odd count: one rank evaluates more batches than the other


KIND_KW = {"dflash": {}, "dspark": dict(kind="dspark", markov_rank=8),
           "dflash2": dict(kind="dflash2", selector_rank=8, selector_top_k=4, conv_group_size=8),
           "domino": dict(kind="domino", emb_dim=8, gru_hidden_dim=6),
           "lilicorr": dict(kind="lilicorr", lilicorr_candidate_topk=4, lilicorr_factor_dim=8, lilicorr_num_heads=2,
                            conv_kernel_size=2, conv_group_size=8)}


def build(out, grad_accum, fsdp=False, row_shards=None, memo=False, steps=5, kind="dflash"):
    from conftest import tiny_target
    from conftest import tiny_rows

    torch.set_num_threads(1)
    t = tiny_target("llama", seed=1)
    with torch.no_grad():
        t.model.get_output_embeddings().weight.mul_(20)
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, **KIND_KW[kind]))
    cfg = TrainConfig(out=str(out), steps=steps, batch_tokens=40, max_anchors=8, eval_every=2, save_every=2,
                      lr=3e-3, warmup=1, grad_accum=grad_accum, progress=False, fsdp=fsdp, row_shards=row_shards)
    train, held_out = tiny_rows(16), tiny_rows(EVAL_ROWS, seed=1)
    if memo:  # the target's outputs kept after their first use
        from blockdraft.data.features import FeatureMemo

        return Trainer(t, d, train, held_out, cfg, train_features=FeatureMemo(t, train),
                       eval_features=FeatureMemo(t, held_out))
    return Trainer(t, d, train, held_out, cfg)


class Stop(Exception):
    pass


def slow_metrics_rewrites(rank):
    """Make the metrics rewrite of a resume slow to finish and the other ranks slow to read, so a
    rank reading the file while another rewrites it (the race of several writers) shows every time."""
    real_write, real_read = pathlib.Path.write_text, pathlib.Path.read_text

    def write_text(self, data, *a, **kw):
        if self.name.startswith("metrics.jsonl"):
            with open(self, "w") as f:
                f.flush()
                time.sleep(0.4)
        return real_write(self, data, *a, **kw)

    def read_text(self, *a, **kw):
        if self.name == "metrics.jsonl" and rank != 0:
            time.sleep(0.15)
        return real_read(self, *a, **kw)

    pathlib.Path.write_text, pathlib.Path.read_text = write_text, read_text


def worker(rank, world, port, out, grad_accum=1, fsdp=False, stop_after=0, resume=False, memo=False, steps=5,
           kind="dflash"):
    """One rank of a run under the strict shim; writes what the shim saw to out/shim-{rank}-{phase}.json."""
    from cuda_shim import strict_collectives

    import blockdraft.train.trainer as trainer_mod

    evals, real_loss = [], trainer_mod.compute_loss

    def counted(*a, **kw):
        if kw.get("sync_metrics") is False:  # evaluate's call
            evals[-1] += 1
        return real_loss(*a, **kw)

    real_evaluate = trainer_mod.evaluate

    def evaluate(*a, **kw):
        evals.append(0)
        return real_evaluate(*a, **kw)

    trainer_mod.compute_loss, trainer_mod.evaluate = counted, evaluate
    if resume:
        slow_metrics_rewrites(rank)
    placement, coll = strict_collectives()
    with gloo_rank(rank, world, port):
        tr = build(out, grad_accum=grad_accum, fsdp=fsdp, memo=memo, steps=steps, kind=kind)
        if stop_after:  # a kill after `stop_after` steps, on every rank
            real = tr.step

            def step():
                if tr.progress["step"] == stop_after:
                    raise Stop
                return real()
            tr.step = step
        with coll, placement:
            try:
                tr.train(resume=resume)
            except Stop:
                pass
    phase = "resume" if resume else "first"
    kept = {k: sorted(getattr(f, "store", {})) for k, f in (("train", tr.train_features), ("eval", tr.eval_features))}
    (out / f"shim-{rank}-{phase}.json").write_text(json.dumps(
        {"violations": coll.violations, "calls": coll.calls, "evals": evals, "memo": kept}))


def shim(out, rank, phase="first"):
    return json.loads((out / f"shim-{rank}-{phase}.json").read_text())


def losses(out):
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


def spawn(world, *args):
    spawn_ranks(worker, world, (world, free_port(), *args), join=True)


def metrics(out):
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def check_shim(out, phases=("first",), world=2):
    """Nothing nccl would refuse; the held-out batches split across the ranks (each its share, none twice)."""
    share = math.ceil(EVAL_ROWS / world)
    for r in range(world):
        for ph in phases:
            got = shim(out, r, ph)
            assert got["violations"] == [], got["violations"][:5]
            assert got["calls"].get("all_reduce", 0) > 0
            assert got["evals"] and all(n <= share for n in got["evals"]), got["evals"]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_processes_match_one_process_with_accumulation(tmp_path):
    one = build(tmp_path / "one", grad_accum=2, row_shards=2)  # the rows split as two ranks split them
    one.train()
    spawn(2, tmp_path / "two")
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len(a) == len(b) == 5
    for key in ("loss", "tau", "grad_norm"):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=1e-5, abs=1e-6), key
    # the held-out figures of two ranks, each evaluating its share, are one process's
    for key in ("eval_tau", "eval_loss"):
        ev = [[(m["step"], m[key]) for m in x if key in m] for x in (a, b)]
        assert [s for s, _ in ev[0]] == [s for s, _ in ev[1]] == [2, 4, 5]
        assert [v for _, v in ev[1]] == pytest.approx([v for _, v in ev[0]], rel=1e-6), key
    check_shim(tmp_path / "two")
    # replicated: per step one gradient bucket, one metrics reduction, one stop-or-save poll
    # (blockdraft.preempt.poll); one per evaluation; one poll before the first step (a stop asked
    # while the ranks started up)
    n_evals = sum(1 for m in a if "eval_tau" in m)
    assert shim(tmp_path / "two", 0)["calls"]["all_reduce"] == 3 * 5 + n_evals + 1
    from blockdraft.checkpoint import load_drafter

    w1 = load_drafter(tmp_path / "one" / "drafter").fc.weight
    w2 = load_drafter(tmp_path / "two" / "drafter").fc.weight
    torch.testing.assert_close(w1, w2, rtol=1e-5, atol=1e-6)


def extract_worker(rank, world, port, out):
    from conftest import tiny_target
    from conftest import tiny_rows

    from blockdraft.data.features import extract

    torch.set_num_threads(1)
    with gloo_rank(rank, world, port):
        if rank == 0:  # rank 0 comes late: the others must not write into `out` before it checked and owns it
            time.sleep(1.0)
        extract(tiny_target("llama"), tiny_rows(10), out, shard_rows=3, rank=rank, world=world, progress=False)


def test_two_process_extraction_equals_one_process(tmp_path):
    from conftest import tiny_target
    from conftest import tiny_rows

    from blockdraft.data.features import DiskFeatures, extract

    extract(tiny_target("llama"), tiny_rows(10), tmp_path / "one", shard_rows=3, progress=False)
    spawn_ranks(extract_worker, 2, (2, free_port(), tmp_path / "two"), join=True)
    a, b = DiskFeatures(tmp_path / "one"), DiskFeatures(tmp_path / "two")
    idx = torch.arange(10)
    x, y = a(idx), b(idx)
    for field in ("features", "final_hidden", "top"):
        assert torch.equal(getattr(x, field), getattr(y, field))
    assert a.manifest == b.manifest


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp_two_processes_match_one_process_and_resume_exactly(tmp_path):
    """FSDP2 (sharded drafter) on 2 gloo processes: the same losses, grad norms, held-out metrics and
    final weights as one process with 2-step accumulation, through a kill after step 3 and a resume
    from the step-2 checkpoint (gathered full state, re-sharded optimizer state); every metrics line
    once, with the rewrite of the resume made slow enough that a second writer would be seen."""
    one = build(tmp_path / "one", grad_accum=2, fsdp=True, row_shards=2)  # fsdp on one process: plain training
    assert not one.fsdp
    one.train()
    spawn(2, tmp_path / "two", 1, True, 3, False)
    assert [m["step"] for m in metrics(tmp_path / "two")] == [1, 2, 3]
    spawn(2, tmp_path / "two", 1, True, 0, True)
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5]  # step 3 redone once, nothing lost
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=1e-5, abs=1e-6), key
    ev = [[(m["step"], m["eval_tau"]) for m in x if "eval_tau" in m] for x in (a, b)]
    assert [s for s, _ in ev[0]] == [s for s, _ in ev[1]] == [2, 4, 5]
    assert [v for _, v in ev[1]] == pytest.approx([v for _, v in ev[0]], rel=1e-6)
    check_shim(tmp_path / "two", ("first", "resume"))
    from blockdraft.checkpoint import load_drafter

    d1, d2 = load_drafter(tmp_path / "one" / "drafter"), load_drafter(tmp_path / "two" / "drafter")
    for (n, p1), p2 in zip(d1.state_dict().items(), d2.state_dict().values()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("kind", ["dspark", "dflash2", "domino", "lilicorr"])
def test_fsdp_trains_each_kind_as_one_process_does(tmp_path, kind):
    """The kinds' own modules (DSpark's heads and DFlash2's selector beside the layers, its convolutions
    inside them, LiLiCorr's correlator and its loss over whole blocks) sharded by FSDP2 on 2 gloo processes:
    one process's losses and final weights."""
    one = build(tmp_path / "one", grad_accum=2, fsdp=True, row_shards=2, kind=kind)
    one.train()
    spawn(2, tmp_path / "two", 1, True, 0, False, False, 5, kind)
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=1e-5, abs=1e-6), key
    from blockdraft.checkpoint import load_drafter

    d1, d2 = load_drafter(tmp_path / "one" / "drafter"), load_drafter(tmp_path / "two" / "drafter")
    assert d1.config.kind == d2.config.kind == kind
    # LiLiCorr's block loss reaches fc through the anchor row and its scaled scores: after 5 steps fc's
    # weights (entries up to 3.5) differed by 2.9e-6 at most, summation order, where the others' stay under 1e-6
    atol = 1e-5 if kind == "lilicorr" else 1e-6
    for (n, p1), p2 in zip(d1.state_dict().items(), d2.state_dict().values()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=atol, msg=n)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_each_rank_keeps_the_target_outputs_of_its_own_rows_only(tmp_path):
    """With the memo, rank r computes and keeps only the training rows of its part (every 2nd row
    from r) and the held-out rows it evaluates, over several epochs; training is one process's."""
    one = build(tmp_path / "one", grad_accum=2, row_shards=2, memo=True, steps=12)  # 1.5 epochs of the 16 rows
    one.train()
    spawn(2, tmp_path / "two", 1, False, 0, False, True, 12)
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-5, abs=1e-6)
    for r in range(2):
        kept = shim(tmp_path / "two", r)["memo"]
        assert kept["train"] == list(range(r, 16, 2)), kept
        assert kept["eval"] == list(range(r, EVAL_ROWS, 2)), kept


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp_reduces_gradients_once_per_step_under_accumulation(tmp_path):
    """With 2 micro-batches per step, FSDP reduce-scatters once per unit and step (the first
    micro-batch accumulates unsharded), and trains as one process with 4-step accumulation."""
    one = build(tmp_path / "one", grad_accum=4, row_shards=2)
    one.train()
    spawn(2, tmp_path / "two", 2, True)
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-5, abs=1e-6)
    calls = shim(tmp_path / "two", 0)["calls"]
    units = 2  # the drafter's one layer and its root
    reduce_scatters = sum(v for k, v in calls.items() if k.startswith("reduce_scatter"))
    assert reduce_scatters == units * 5, calls
    check_shim(tmp_path / "two")


def test_an_nccl_group_is_bound_to_the_ranks_gpu_with_a_long_timeout(monkeypatch):
    """init_process_group gets the rank's device (nccl binds the group to it; barriers use it) and a
    timeout covering rank 0's longest lone work; collectives then run on that device."""
    import datetime

    import blockdraft.process_group as pg
    import blockdraft.train.distributed as bd

    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("set_device", i))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(pg, "_COMM_DEVICE", None)
    assert bd.init_from_env("cuda", timeout_min=90) == (3, 4, "cuda:3")
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda:3") and seen["set_device"] == 3
    assert seen["timeout"] == datetime.timedelta(minutes=90)
    assert pg._COMM_DEVICE == torch.device("cuda:3")
    seen.clear()
    bd.init_from_env("cpu")
    assert seen["backend"] == "gloo" and "device_id" not in seen
    assert seen["timeout"] == datetime.timedelta(minutes=bd.DEFAULT_TIMEOUT_MIN)
    assert pg._COMM_DEVICE == torch.device("cpu")


def test_the_drafter_is_sharded_at_the_precision_it_trains_at(monkeypatch):
    """On CUDA (bf16 autocast) FSDP2 gathers bf16 shards and reduces fp32 gradients, so no layer
    re-casts its fp32 weights in every forward; on a CPU no policy (plain fp32). Every unit gets it."""
    import torch.distributed.fsdp as fsdp

    import blockdraft.train.distributed as bd

    assert bd.mixed_precision_policy("cpu") is None and bd.mixed_precision_policy(torch.device("cpu")) is None
    policy = bd.mixed_precision_policy("cuda:1")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert policy.cast_forward_inputs is False  # the residual stream between layers stays fp32
    assert bd.mixed_precision_policy(torch.device("cuda", 0)) == policy
    drafter = torch.nn.Module()
    drafter.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    calls = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: calls.append((module, kw)))
    bd.shard_drafter(drafter, device="cuda:1")
    assert [m for m, _ in calls] == [*drafter.layers, drafter]
    assert all(kw.get("mp_policy") == policy for _, kw in calls), calls
    calls.clear()
    bd.shard_drafter(drafter, device=torch.device("cpu"))
    assert len(calls) == 3 and all("mp_policy" not in kw for _, kw in calls), calls


def differing_worker(rank, world, port, out):
    with gloo_rank(rank, world, port):
        tr = build(out, grad_accum=1)
        if rank == 1:  # as a rank whose random state was moved by loading the target would build it
            with torch.no_grad():
                tr.drafter.fc.weight.add_(1e-3)
        try:
            tr.train()
            (out / f"r{rank}.txt").write_text("trained")
        except ValueError as e:
            (out / f"r{rank}.txt").write_text(str(e))


def test_ranks_that_built_different_drafters_are_stopped_before_training(tmp_path):
    spawn_ranks(differing_worker, 2, (2, free_port(), tmp_path), join=True)
    for r in range(2):
        assert "different initial drafters" in (tmp_path / f"r{r}.txt").read_text()


def preempt_worker(rank, world, port, out, resume):
    """One rank of a 6-step run whose rank 1 alone gets SIGTERM after step 3; --save-every-min 1 on
    clocks that disagree (rank 1's says a save is due every step, rank 0's never): rank 0's decides.
    Writes the step each rank stopped at to out/stopped-{rank}.json."""
    import datetime
    import itertools
    import os
    import signal
    import types

    import blockdraft.train.trainer as trainer_mod
    from blockdraft.preempt import Preempted

    ticks = itertools.count(0, 1000.0) if rank == 1 else itertools.repeat(0.0)
    trainer_mod.time = types.SimpleNamespace(time=time.time, perf_counter=time.perf_counter,
                                             monotonic=lambda: next(ticks))
    # ranks that disagree on a step to stop or save at would wait on each other: an error soon, not a hang
    with gloo_rank(rank, world, port, timeout=datetime.timedelta(seconds=60)):
        tr = build(out, grad_accum=1, steps=6)
        tr.cfg.save_every_min, tr.cfg.keep_checkpoints = 1.0, 10
        real = tr.step

        def step():
            got = real()
            if rank == 1 and tr.progress["step"] == 3 and not resume:
                os.kill(os.getpid(), signal.SIGTERM)
            return got
        tr.step = step
        try:
            tr.train(resume=resume)
        except Preempted as e:
            (out / f"stopped-{rank}.json").write_text(json.dumps([e.step, e.signame]))


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_a_signal_on_one_rank_stops_both_at_one_step_and_resume_is_exact(tmp_path):
    """Issue 43, item 3: SIGTERM reaching rank 1 only stops both ranks after the same step, its
    checkpoint saved; a resume then gives the losses of a run never stopped (one process with the
    ranks' accumulation: test_two_processes_match_one_process_with_accumulation)."""
    one = build(tmp_path / "one", grad_accum=2, row_shards=2, steps=6)
    one.train()
    out = tmp_path / "two"
    spawn_ranks(preempt_worker, 2, (2, free_port(), out, False), join=True)
    stopped = [json.loads((out / f"stopped-{r}.json").read_text()) for r in range(2)]
    assert stopped == [[3, "a signal another rank received"], [3, "SIGTERM"]]
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["progress"]["step"] == 3 and [m["step"] for m in metrics(out)] == [1, 2, 3]
    for r in range(2):
        (out / f"stopped-{r}.json").unlink()
    spawn_ranks(preempt_worker, 2, (2, free_port(), out, True), join=True)
    assert not any((out / f"stopped-{r}.json").exists() for r in range(2))  # the resumed run ends normally
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4, 5, 6]
    # saved at steps 1 and 2, 3 (the stop), 4 and 6: none on rank 1's clock, which says one is due every step
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step")) == [
        "step-0000001", "step-0000002", "step-0000003", "step-0000004"]
    assert losses(out) == pytest.approx(losses(tmp_path / "one"), rel=1e-5, abs=1e-6)
