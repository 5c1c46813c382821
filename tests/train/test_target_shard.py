"""A frozen target sharded over 2 gloo ranks (`--target-fsdp`): features and labels equal the
unsharded target's, each rank holds about half of the decoder layers, and a training run with a
sharded target (and with it a sharded drafter, --fsdp) trains as the unsharded run does."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

IDS = (torch.arange(80).reshape(2, 40) * 613) % 49152
POS = torch.cat([torch.arange(25), torch.arange(15)]).expand(2, 40)  # two packed documents per row


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, smollm2_dir):
    """A tiny Llama on disk, with SmolLM2's tokenizer (its vocabulary covers the tokenizer's ids)."""
    from blockdraft.tiny import tiny_causal_lm

    d = tmp_path_factory.mktemp("tiny-target")
    tiny_causal_lm("llama", vocab=49280, layers=4, hidden=32, seed=3).save_pretrained(d)
    for f in smollm2_dir.glob("*token*"):
        (d / f.name).write_bytes(f.read_bytes())
    return d


def forward_worker(rank, world, port, target_dir, out):
    from blockdraft.target import TargetModel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t = TargetModel.from_pretrained(str(target_dir), layer_ids=[0, 1, 2], device="cpu", shard=True)
        o = t(IDS, position_ids=POS)
        final = t(IDS, position_ids=POS, return_final_hidden=True).final_hidden
        mine = sum(p.to_local().numel() for layer in t._layers for p in layer.parameters())
        whole = sum(p.numel() for layer in t._layers for p in layer.parameters())
        save_file({"features": o.features, "logits": o.logits, "final": final}, str(out / f"r{rank}.safetensors"))
        (out / f"r{rank}.json").write_text(json.dumps({"mine": mine, "whole": whole}))
    finally:
        dist.destroy_process_group()


def test_a_sharded_target_computes_the_unsharded_ones_features_and_labels(target_dir, tmp_path):
    from blockdraft.target import TargetModel

    mp.spawn(forward_worker, args=(2, free_port(), target_dir, tmp_path), nprocs=2, join=True)
    ref = TargetModel.from_pretrained(str(target_dir), layer_ids=[0, 1, 2], device="cpu")
    o = ref(IDS, position_ids=POS)
    final = ref(IDS, position_ids=POS, return_final_hidden=True).final_hidden
    for r in range(2):
        got = load_file(str(tmp_path / f"r{r}.safetensors"))
        torch.testing.assert_close(got["features"], o.features, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["logits"], o.logits, rtol=1e-6, atol=1e-6)  # clause 3: the model's own
        torch.testing.assert_close(got["final"], final, rtol=1e-6, atol=1e-6)
        held = json.loads((tmp_path / f"r{r}.json").read_text())
        assert held["mine"] <= held["whole"] / 2 + 64, held  # its half of every layer (plus padding)


def train_worker(rank, world, port, argv):
    from blockdraft.cli import main

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    assert main(argv) == 0


@pytest.mark.parametrize("drafter_fsdp", [False, True])
def test_training_with_a_sharded_target_is_training_with_the_whole_one(target_dir, tmp_path, drafter_fsdp):
    import gzip

    from blockdraft.data.pipeline import default_data_file

    data = tmp_path / "d.jsonl"
    with gzip.open(default_data_file(), "rt") as f:
        data.write_text("".join(next(f) for _ in range(60)))
    base = ["train", "--target", str(target_dir), "--data", str(data), "--max-length", "128", "--batch-tokens", "256",
            "--max-rows", "8", "--steps", "3", "--eval-every", "3", "--block-size", "4", "--max-anchors", "8",
            "--layer-ids", "0,1,2", "--threads", "1", "--no-progress", "--device", "cpu"] + (["--fsdp"] if drafter_fsdp else [])
    runs = {}
    for name, extra in (("whole", []), ("sharded", ["--target-fsdp"])):
        out = tmp_path / name
        mp.spawn(train_worker, args=(2, free_port(), base + extra + ["--out", str(out)]), nprocs=2, join=True)
        runs[name] = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in runs["sharded"]] == pytest.approx([m[key] for m in runs["whole"]], rel=1e-5), key
    assert runs["sharded"][-1]["eval_tau"] == pytest.approx(runs["whole"][-1]["eval_tau"])
