"""A frozen target sharded over 2 gloo ranks (`--target-fsdp`): features and labels equal the
unsharded target's, each rank holds about half of the decoder layers, and a training run with a
sharded target (and with it a sharded drafter, --fsdp) trains as the unsharded run does."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import free_port, gloo_rank, spawn_ranks
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

IDS = (torch.arange(80).reshape(2, 40) * 613) % 49152
POS = torch.cat([torch.arange(25), torch.arange(15)]).expand(2, 40)  # two packed documents per row


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, smollm2_dir):
    """A tiny Llama on disk, with SmolLM2's tokenizer (its vocabulary covers the tokenizer's ids)."""
    from blockdraft.target.tiny import tiny_causal_lm

    d = tmp_path_factory.mktemp("tiny-target")
    tiny_causal_lm("llama", vocab=49280, layers=4, hidden=32, seed=3).save_pretrained(d)
    for f in smollm2_dir.glob("*token*"):
        (d / f.name).write_bytes(f.read_bytes())
    return d


def forward_worker(rank, world, port, target_dir, out):
    from torch.distributed.fsdp import FSDPModule

    from blockdraft.target import TargetModel
    from blockdraft.target.shard import gathered

    torch.set_num_threads(1)
    with gloo_rank(rank, world, port):
        t = TargetModel.from_pretrained(str(target_dir), layer_ids=[0, 1, 2], device="cpu", shard=True)
        layers = list(t._layers)
        with gathered(layers[-1:]):  # before any forward (the drafter's init from the top layer)
            top_before = layers[-1].mlp.down_proj.weight.detach().clone()
        o = t(IDS, position_ids=POS)
        final = t(IDS, position_ids=POS, return_final_hidden=True).final_hidden
        with gathered(layers[-1:]):  # and after, under the root
            top_after = layers[-1].mlp.down_proj.weight.detach().clone()
        mine = sum(p.to_local().numel() for layer in t._layers for p in layer.parameters())
        whole = sum(p.numel() for layer in t._layers for p in layer.parameters())
        roots = [m for m in t.model.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._is_root]
        index = {id(m._get_fsdp_state()): i for i, m in enumerate(layers)}
        fsdp = {"roots": [type(m).__name__ for m in roots], "root_is_base": roots == [t.model.model],
                "prefetch": [[index.get(id(s)) for s in m._get_fsdp_state()._states_to_forward_prefetch]
                             for m in layers],
                "resharded": [isinstance(p, DTensor) for m in layers for p in m.parameters()],
                "embedding_whole": not isinstance(t.model.get_input_embeddings().weight, DTensor)}
        save_file({"features": o.features, "logits": o.logits, "final": final, "top_before": top_before,
                   "top_after": top_after}, str(out / f"r{rank}.safetensors"))
        (out / f"r{rank}.json").write_text(json.dumps({"mine": mine, "whole": whole, "fsdp": fsdp}))


@pytest.fixture(scope="module")
def sharded_forward(target_dir, tmp_path_factory):
    """What two ranks' forward_worker computed and held (one spawn for the tests that read it)."""
    out = tmp_path_factory.mktemp("sharded-forward")
    spawn_ranks(forward_worker, 2, (2, free_port(), target_dir, out), join=True)
    return out


def test_a_sharded_target_computes_the_unsharded_ones_features_and_labels(target_dir, sharded_forward):
    from blockdraft.target import TargetModel

    ref = TargetModel.from_pretrained(str(target_dir), layer_ids=[0, 1, 2], device="cpu")
    o = ref(IDS, position_ids=POS)
    final = ref(IDS, position_ids=POS, return_final_hidden=True).final_hidden
    for r in range(2):
        got = load_file(str(sharded_forward / f"r{r}.safetensors"))
        torch.testing.assert_close(got["features"], o.features, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["logits"], o.logits, rtol=1e-6, atol=1e-6)  # clause 3: the model's own
        torch.testing.assert_close(got["final"], final, rtol=1e-6, atol=1e-6)
        for when in ("top_before", "top_after"):  # gathered() gives the whole layer, before and after a forward
            torch.testing.assert_close(got[when], ref._layers[-1].mlp.down_proj.weight, rtol=0, atol=0)
        held = json.loads((sharded_forward / f"r{r}.json").read_text())
        assert held["mine"] <= held["whole"] / 2 + 64, held  # its half of every layer (plus padding)


def test_the_sharded_layers_run_under_one_root_each_prefetching_the_next(sharded_forward):
    """One FSDP root (the layers' owner, which every forward enters), so layer i starts layer
    i + 1's all-gather during its own forward, not each layer as its own root waiting for its
    gather; each layer is resharded after its forward (frozen: no backward), the embedding whole."""
    for r in range(2):
        fsdp = json.loads((sharded_forward / f"r{r}.json").read_text())["fsdp"]
        assert fsdp["roots"] == ["FSDPLlamaModel"] and fsdp["root_is_base"], fsdp
        assert fsdp["prefetch"] == [[1], [2], [3], []], fsdp
        assert all(fsdp["resharded"]) and fsdp["embedding_whole"], fsdp


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
        spawn_ranks(train_worker, 2, (2, free_port(), base + extra + ["--out", str(out)]), join=True)
        runs[name] = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in runs["sharded"]] == pytest.approx([m[key] for m in runs["whole"]], rel=1e-5), key
    assert runs["sharded"][-1]["eval_tau"] == pytest.approx(runs["whole"][-1]["eval_tau"])


def differing_worker(rank, world, port, out):
    """Rank 0 keeps one norm in fp32 (as from_pretrained does for a family with
    `_keep_in_fp32_modules_strict`) where rank 1, built from the config, has it in bf16."""
    import datetime

    from blockdraft.target.shard import load_sharded
    from blockdraft.target.tiny import tiny_causal_lm

    def build(device):
        model = tiny_causal_lm("llama", vocab=256, layers=3, hidden=32, device=device, dtype=torch.bfloat16)
        if rank == 0:
            model.model.layers[1].input_layernorm.float()
        return model

    torch.set_num_threads(1)
    with gloo_rank(rank, world, port, timeout=datetime.timedelta(seconds=60)):
        try:
            load_sharded(None, dtype=torch.bfloat16, device="cpu", build=build)
            (out / f"r{rank}.txt").write_text("loaded")
        except ValueError as e:
            (out / f"r{rank}.txt").write_text(str(e))


def test_ranks_whose_targets_differ_all_stop_before_the_broadcast(tmp_path):
    """A tensor whose dtype (or shape) differs between ranks would be broadcast into the wrong
    buffer (a hang or garbage): every rank raises the same ValueError naming it, none waits."""
    import time

    ctx = spawn_ranks(differing_worker, 2, (2, free_port(), tmp_path), join=False)
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the ranks with different targets hang")
    said = [(tmp_path / f"r{r}.txt").read_text() for r in range(2)]
    assert said[0] == said[1] and "\n" not in said[0], said
    assert "model.layers.1.input_layernorm.weight" in said[0] and "float32" in said[0] and "bfloat16" in said[0], said
