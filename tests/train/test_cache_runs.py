"""`extract --target-dtype` and `train --eval-features-cache`, through the CLI on a saved tiny target:
the cache holds what transformers' own model computes at that precision, and a run from a training
cache plus a held-out cache logs what the same run reading the conversations online logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from blockdraft.cli import main

ARGS = ["--max-length", "128", "--threads", "1"]
TRAIN = ["--batch-tokens", "256", "--max-anchors", "16", "--draft-vocab", "full", "--eval-every", "2",
         "--save-every", "100", "--no-progress", "--steps", "3", "--seed", "3",
         "--no-init-from-target", "--final-norm-init", "small"]  # a cached run loads no target layers to copy


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer):
    from blockdraft.target.tiny import tiny_causal_lm

    d = tmp_path_factory.mktemp("tiny-target")
    tiny_causal_lm("llama", vocab=len(smollm2_tokenizer), layers=8, hidden=32, max_positions=1024).save_pretrained(d)
    smollm2_tokenizer.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    from blockdraft.data import load_conversations
    from blockdraft.data.pipeline import default_data_file

    convs, _ = load_conversations(default_data_file())
    d = tmp_path_factory.mktemp("data")
    for name, part in (("train", convs[:20]), ("eval", convs[40:46])):
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in part))
    return d / "train.jsonl", d / "eval.jsonl"


def cache_tensors(cache: Path) -> dict:
    out: dict[str, list] = {}
    for shard in sorted(cache.glob("shard-*.safetensors")):
        for k, v in load_file(shard).items():
            out.setdefault(k, []).append(v)
    return {k: torch.cat(v) for k, v in out.items()}


def test_extract_runs_the_target_at_target_dtype(tmp_path, tiny_dir, split):
    """--target-dtype bfloat16: the stored features are transformers' own bf16 model's hidden states
    at the cache's layer ids + 1 (clause 1), not fp32 states rounded to bf16."""
    from transformers import AutoModelForCausalLM

    for td in ("bfloat16", "auto"):
        assert main(["extract", "--target", tiny_dir, "--data", str(split[0]), "--out", str(tmp_path / td),
                     "--dtype", "bfloat16", "--target-dtype", td, *ARGS]) == 0
    manifest = json.loads((tmp_path / "bfloat16" / "manifest.json").read_text())
    assert manifest["target_dtype"] == "bfloat16"
    assert json.loads((tmp_path / "auto" / "manifest.json").read_text())["target_dtype"] == "float32"
    got, fp32 = cache_tensors(tmp_path / "bfloat16"), cache_tensors(tmp_path / "auto")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    ids = got["input_ids"][:3]
    with torch.no_grad():
        hs = model(input_ids=ids, position_ids=got["position_ids"][:3], output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i + 1] for i in manifest["layer_ids"]], dim=-1)
    torch.testing.assert_close(got["features"][:3].float(), ref.float(), rtol=0.02, atol=0.02)
    # and the fp32 run is measurably another function of the same rows
    assert torch.equal(got["input_ids"], fp32["input_ids"])
    assert not torch.equal(got["features"], fp32["features"])


def test_a_held_out_cache_evaluates_as_the_online_held_out_file(tmp_path, tiny_dir, split, capsys):
    """train --features-cache A --eval-features-cache B trains on every row of A and evaluates on B:
    its losses and held-out tau equal the run that reads A's and B's conversations online. The cached
    run takes its row length from A (issue 50, item 7)."""
    train, held = split
    for name, path in (("a", train), ("b", held)):
        assert main(["extract", "--target", tiny_dir, "--data", str(path), "--out", str(tmp_path / name),
                     "--dtype", "float32", *ARGS]) == 0
    assert main(["train", "--target", tiny_dir, "--data", str(train), "--eval-data", str(held), "--max-rows", "0",
                 "--memo-features", "off", "--out", str(tmp_path / "online"), *ARGS, *TRAIN]) == 0
    # no --max-length: the cache's row length (128) is the default, where a text run's is 1,024
    assert main(["train", "--target", tiny_dir, "--features-cache", str(tmp_path / "a"), "--eval-features-cache",
                 str(tmp_path / "b"), "--max-rows", "0", "--out", str(tmp_path / "cached"), "--threads", "1",
                 *TRAIN]) == 0
    assert json.loads((tmp_path / "cached" / "train_config.json").read_text())["data"]["max_length"] == 128

    def logged(run):
        return [json.loads(ln) for ln in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    online, cached = logged("online"), logged("cached")
    assert [m["step"] for m in online] == [m["step"] for m in cached]
    evals = [m for m in online if "eval_tau" in m]
    assert evals, "the online run evaluated nothing"
    for a, b in zip(online, cached):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        if "eval_tau" in a:
            assert b["eval_tau"] == pytest.approx(a["eval_tau"], rel=1e-6)
            assert b["eval_blocks"] == a["eval_blocks"]
            assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-4)


def test_held_out_settings_a_cached_run_cannot_use_are_refused(tmp_path, tiny_dir, split, capsys):
    train, held = split
    cache = tmp_path / "a"
    assert main(["extract", "--target", tiny_dir, "--data", str(train), "--out", str(cache), *ARGS]) == 0
    cases = [(["--eval-features-cache", str(cache)], "needs --features-cache"),
             (["--features-cache", str(cache), "--eval-data", str(held)], "--eval-features-cache"),
             (["--features-cache", str(cache), "--eval-features-cache", str(cache)], "same rows")]
    for extra, fragment in cases:
        capsys.readouterr()
        assert main(["train", "--target", tiny_dir, *extra, "--out", str(tmp_path / "r"), *ARGS, *TRAIN]) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, err


def test_extract_batches_few_rows_per_forward_on_a_cpu(tmp_path, tiny_dir, split, monkeypatch):
    """--batch-tokens 0 (the default): 2,048 tokens per target forward on a CPU, where 16-row forwards
    ran 1.6-1.9x slower (benchmarks/extract_batch.py); a given value is passed as it is."""
    import blockdraft.data.features as features

    seen = []
    monkeypatch.setattr(features, "extract", lambda *a, batch_tokens, **k: seen.append(batch_tokens) or k)
    for i, extra in enumerate(([], ["--batch-tokens", "512"])):
        main(["extract", "--target", tiny_dir, "--data", str(split[0]), "--out", str(tmp_path / str(i)), *ARGS, *extra])
    assert seen == [2048, 512]
