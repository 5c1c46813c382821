"""NaN and Inf are found and named, never passed on: doctor's weight and logit checks, a cache's
features, a step's loss and gradient, saved weights, metrics records and config floats."""

from __future__ import annotations

import json
import math

import pytest
import torch

from blockdraft import doctor
from blockdraft.config import DrafterConfig
from blockdraft.data.features import DiskFeatures, extract
from blockdraft.finite import dumps_finite, nonfinite
from blockdraft.model import DFlashDrafter
from conftest import V, make, tiny_rows, tiny_target


def doctor_setup():
    t = tiny_target("llama")
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    return t, d, torch.randint(0, V - 1, (1, 40), generator=torch.Generator().manual_seed(0))


def plant(d, how: str) -> None:
    with torch.no_grad():
        if how == "one NaN weight":
            d.layers[0].mlp.down_proj.weight[3, 5] = math.nan
        elif how == "all NaN":
            for p in d.parameters():
                p.fill_(math.nan)
        else:  # an infinite norm
            d.norm.weight[0] = math.inf


@pytest.mark.parametrize("how", ["one NaN weight", "all NaN", "an infinite norm"])
def test_doctor_fails_a_drafter_with_non_finite_weights(how):
    t, d, ids = doctor_setup()
    plant(d, how)
    checks = {c.name: c for c in doctor.run_doctor(t, d, None, ids)}
    assert checks["finite weights"].status == "FAIL", checks["finite weights"]
    assert checks["finite logits"].status == "FAIL", checks["finite logits"]
    want = "down_proj" if how == "one NaN weight" else "norm.weight" if how == "an infinite norm" else "fc.weight"
    assert want in checks["finite weights"].message and ("Inf" if "infinite" in how else "NaN") in \
        checks["finite weights"].message


def test_doctor_passes_finite_weights_and_logits():
    t, d, ids = doctor_setup()
    checks = {c.name: c.status for c in doctor.run_doctor(t, d, None, ids)}
    assert checks["finite weights"] == checks["finite logits"] == "PASS"


def small_cache(tmp_path, t, rows):
    return extract(t, rows, tmp_path / "cache", shard_rows=2, dtype=torch.float32, progress=False)


def poison_shard(path, *rows: int) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    for row in rows:
        tensors["features"][row, 3, 7] = math.nan
    save_file(tensors, str(path))


def test_a_cache_with_nan_features_is_refused_naming_the_shard_and_row(tmp_path):
    t = tiny_target("llama")
    out = small_cache(tmp_path, t, tiny_rows(6))
    poison_shard(out / "shard-00001.safetensors", 1)
    cache = DiskFeatures(out)
    cache(torch.tensor([0, 1, 2]))  # finite rows read as before
    with pytest.raises(ValueError, match=r"shard-00001.safetensors, row 1: non-finite values in features \(1 NaN"):
        cache(torch.tensor([0, 3]))


def test_training_on_a_nan_cache_stops_with_the_shard_named_and_valid_metrics(tmp_path):
    from blockdraft.data.features import CacheView

    tr = make(tmp_path / "run", steps=4)
    out = small_cache(tmp_path, tr.target, tr.train_rows)
    for k in range(2, 6):  # rows 4-11: the first steps read some (rows 0-3 set the feature scale)
        poison_shard(out / f"shard-{k:05d}.safetensors", 0, 1)
    tr.train_features = CacheView(DiskFeatures(out), torch.arange(tr.train_rows["input_ids"].shape[0]))
    with pytest.raises(ValueError, match=r"feature cache shard .*shard-0000[2-5].safetensors, row [01]: non-finite"):
        tr.train()
    assert not (tmp_path / "run" / "drafter").exists()
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))


def test_extract_refuses_non_finite_target_outputs_and_writes_no_shard(tmp_path):
    t = tiny_target("llama")
    with torch.no_grad():
        t.model.model.layers[1].mlp.down_proj.weight.fill_(math.inf)
    with pytest.raises(ValueError, match=r"outputs for shard 0 \(rows 0-1\): non-finite values"):
        small_cache(tmp_path, t, tiny_rows(4))
    assert not list((tmp_path / "cache").glob("shard-*"))


def test_a_nan_loss_stops_the_run_before_the_step_is_applied(tmp_path):
    tr = make(tmp_path, steps=4)
    with torch.no_grad():
        tr.drafter.layers[0].mlp.up_proj.weight[0, 0] = math.nan
    with pytest.raises(ValueError, match=r"step 1: the loss is nan \(rows .*\); the step was not applied"):
        tr.train()
    assert not (tmp_path / "drafter").exists() and not (tmp_path / "checkpoint").exists()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_an_infinite_gradient_stops_the_run(tmp_path, monkeypatch):
    import blockdraft.train.trainer as trainer

    monkeypatch.setattr(trainer, "clip_grad_norm", lambda params, clip: math.inf)
    tr = make(tmp_path, steps=3)
    before = [p.detach().clone() for p in tr.drafter.parameters()]
    with pytest.raises(ValueError, match="step 1: the gradient norm is inf"):
        tr.train()
    assert all(torch.equal(a, b) for a, b in zip(before, tr.drafter.parameters()))


def test_metrics_records_are_valid_json_or_refused(tmp_path):
    from blockdraft.rundir.files import append_metrics

    assert json.loads(dumps_finite({"step": 1, "loss": 0.5}, "x")) == {"step": 1, "loss": 0.5}
    with pytest.raises(ValueError, match=r"metrics of step 2: eval_loss = nan is not finite"):
        append_metrics(tmp_path, {"step": 2, "loss": 1.0, "eval_loss": math.nan})
    with pytest.raises(ValueError, match=r"slot\[1\] = inf"):
        dumps_finite({"slot": [0.0, math.inf]}, "r")
    assert not (tmp_path / "metrics.jsonl").exists() or "NaN" not in (tmp_path / "metrics.jsonl").read_text()


def test_non_finite_weights_are_never_saved_or_exported(tmp_path):
    from blockdraft.checkpoint.native import save_drafter
    from blockdraft.rundir.state import save_state

    _, d, _ = doctor_setup()
    plant(d, "one NaN weight")
    n = d.layers[0].mlp.down_proj.weight.numel()
    assert nonfinite(d.state_dict()) == [f"layers.0.mlp.down_proj.weight (1 NaN of {n})"]
    with pytest.raises(ValueError, match="drafter to write in .*down_proj.weight \\(1 NaN"):
        save_drafter(d, tmp_path / "drafter")
    assert not (tmp_path / "drafter").exists()
    opt = torch.optim.AdamW(d.parameters())
    with pytest.raises(ValueError, match="checkpoint's drafter"):
        save_state(tmp_path / "ck", drafter=d, optimizer=opt, progress={"step": 1})
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("field, value", [("rms_norm_eps", math.nan), ("rope_theta", math.inf),
                                          ("rms_norm_eps", -math.inf)])
def test_non_finite_config_floats_are_refused_at_load(tmp_path, field, value, capsys):
    from blockdraft.checkpoint.native import save_drafter
    from blockdraft.cli import main

    _, d, _ = doctor_setup()
    save_drafter(d, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    where = cfg["rope_parameters"] if field == "rope_theta" else cfg  # z-lab keeps the theta there
    where[field] = value  # Python's json writes NaN / Infinity and reads them back
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    kw = {k: v for k, v in d.config.to_dict().items() if k != "format_version"}
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        DrafterConfig(**{**kw, field: value})
    assert main(["convert", "--to", "zlab", str(tmp_path / "d"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{field} must be a finite number" in err[0], err
    assert not (tmp_path / "out").exists()


def test_train_config_floats_must_be_finite():
    from blockdraft.train.train_options import TrainConfig

    for bad in (dict(lr=math.nan), dict(warmup=math.inf), dict(grad_clip=math.nan), dict(min_lr_ratio=math.nan)):
        with pytest.raises(ValueError, match="must be a finite number"):
            TrainConfig(**bad).validate()


LOADED_KINDS = {"dflash": {}, "dspark": dict(kind="dspark", markov_rank=8),
                "dflash2": dict(kind="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4)}


@pytest.mark.parametrize("kind", list(LOADED_KINDS))
def test_every_command_refuses_a_loaded_drafter_with_an_inf_naming_file_and_tensor(tmp_path, kind, capsys,
                                                                                   tiny_target_dir, chat_data):
    """Every command that loads a drafter (generate, bench, doctor --drafter, train --init-drafter,
    convert) checks it once, in the loader: an Inf drafts nothing and gave tau 1.00 with exit 0."""
    from safetensors.torch import load_file, save_file

    from blockdraft.checkpoint.native import save_drafter
    from blockdraft.cli import main
    from blockdraft.target import TargetModel

    t = TargetModel.from_pretrained(tiny_target_dir, device="cpu")
    torch.manual_seed(0)
    path = save_drafter(DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, **LOADED_KINDS[kind])),
                        tmp_path / "d")
    weights = path / "model.safetensors"
    sd = load_file(str(weights))
    name = sorted(k for k, v in sd.items() if v.is_floating_point())[-1]
    sd[name].view(-1)[0] = math.inf
    save_file(sd, str(weights))
    where = f"{weights}: non-finite values in {name} (1 Inf of {sd[name].numel()})"
    common = ["--target", tiny_target_dir, "--threads", "1"]
    capsys.readouterr()
    for argv in (["generate", "hi", "--drafter", str(path), "--max-new-tokens", "4", *common],
                 ["bench", "--drafter", str(path), "--sets", "gsm8k", "--n", "1", "--max-new-tokens", "4", *common],
                 ["train", "--init-drafter", str(path), "--data", chat_data, "--steps", "1", "--max-length", "128",
                  "--out", str(tmp_path / "run"), *common],
                 ["convert", "--to", "zlab", str(path), str(tmp_path / "zlab")]):
        assert main(argv) == 2, argv
        err = [ln for ln in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in ln]
        assert len(err) == 1 and where in err[0], (argv, err)  # progress bars aside: one line
    assert main(["doctor", "--drafter", str(path), *common]) == 1
    assert where in capsys.readouterr().out
    assert not (tmp_path / "run").exists() and not (tmp_path / "zlab").exists()
