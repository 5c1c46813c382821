"""What runs the target, as one interface (`engines.runners.Runner`): a run carries its runner's own options
and no other runner's, resolves its runner once, and the transformers runner does its own work (the target,
its memo, extract's shards) instead of its callers."""

from __future__ import annotations

import json

import pytest

from blockdraft.engines.options import RunnerOptions
from blockdraft.engines.vllm.engine_options import VllmOptions
from blockdraft.train.run import RunConfig


def test_a_transformers_run_carries_no_vllm_option():
    assert RunConfig().to_dict()["engine"] == {"engine": "transformers"}
    vllm = RunConfig.from_dict({"engine": {"engine": "vllm", "spool": "/s"}})
    assert type(vllm.engine) is VllmOptions and vllm.engine.spool == "/s"
    # a train_config.json written before the split holds every vLLM option at its default: it still loads
    old = {"engine": {**vllm.to_dict()["engine"], "engine": "transformers", "spool": None}}
    assert type(RunConfig.from_dict(old).engine) is RunnerOptions
    with pytest.raises(ValueError, match="--spool set how vLLM runs the target.*--engine transformers"):
        RunConfig.from_dict({"engine": {"engine": "transformers", "spool": "/s"}})


def test_a_run_resolves_its_runner_once(tmp_path, tiny_target_dir, chat_data, monkeypatch):
    import blockdraft.engines as engines
    from blockdraft.data.pipeline import DataOptions
    from blockdraft.target import TargetOptions
    from blockdraft.train.build import DrafterOptions
    from blockdraft.train.run import run_training
    from blockdraft.train.train_options import TrainConfig

    asked, real = [], engines.runner
    monkeypatch.setattr(engines, "runner", lambda name: asked.append(name) or real(name))
    cfg = RunConfig(target=TargetOptions(target=tiny_target_dir, threads=1, num_features=3),
                    data=DataOptions(data=chat_data, max_length=64, max_rows=4, eval_fraction=0.0),
                    drafter=DrafterOptions(draft_layers=1, block_size=4, draft_vocab="512"),
                    train=TrainConfig(out=str(tmp_path / "run"), steps=1, batch_tokens=128, max_anchors=4,
                                      progress=False))
    run_training(cfg)
    assert asked == ["transformers"]
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["engine"] == {"engine": "transformers"}
