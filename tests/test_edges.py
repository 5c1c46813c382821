"""Validation at the edge: every flag of every command, every config file, is checked before any
work, and a bad one is one line on stderr and exit code 2 (no traceback). In-process through
`blockdraft.cli.main`; a refused flag never loads a model."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from blockdraft.cli import build_parser, main
from blockdraft.options import Checked

MISSING = "/nonexistent/blockdraft-probe"
# what each command needs besides the flag under test (values that are valid)
BASE = {"regenerate": ["--out", "{tmp}/a.jsonl"], "prompts": ["--out", "{tmp}/p.jsonl"],
        "extract": ["--out", "{tmp}/cache"], "convert": ["--to", "zlab"], "generate": []}
POSITIONALS = {"convert": ["default", "{tmp}/out"], "generate": ["hi"]}


def commands() -> dict:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def bad_values(action) -> list[str]:
    """The wrong values of an option's type: not a number, negative, zero where it must be
    positive, not finite, empty, a path that does not exist."""
    t = action.type
    if action.choices is not None and not isinstance(t, Checked):
        return ["", "banana"]
    out = []
    if t.kind in (int, float, list):
        out += ["x", "-1"]
        low = t.bounds.get("min", t.bounds.get("above"))
        if low is not None and low >= 0 and ("above" in t.bounds or low >= 1):
            out.append("0")
    if t.kind is float:
        out += ["nan", "inf"]
    if t.kind in (str, list):
        out.append("")
    if t.check is not None and t.kind is str:
        out.append(MISSING)
    return out


def cases():
    for name, p in commands().items():
        for action in p._actions:
            if action.nargs == 0 or action.dest in ("help", "version"):
                continue  # a switch takes no value
            for bad in bad_values(action):
                yield name, action, bad


def argv_for(name: str, action, bad: str, tmp) -> list[str]:
    fill = [a.format(tmp=tmp) for a in BASE.get(name, [])]
    pos = [a.format(tmp=tmp) for a in POSITIONALS.get(name, [])]
    if action.option_strings:
        return [name, *fill, action.option_strings[0], bad, *pos]
    positionals = [a.dest for a in commands()[name]._actions if not a.option_strings and a.dest != "help"]
    pos[positionals.index(action.dest)] = bad
    return [name, *fill, *pos]


def one_line_error(argv: list[str], capsys) -> str:
    """Run a command that must be refused: exit code 2, one line on stderr naming the error, no traceback."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (argv, rc, err[-2000:])
    assert "Traceback" not in err and len(lines) == 1 and "error:" in lines[0], (argv, err[-2000:])
    return lines[0]


def test_every_option_of_every_command_declares_its_type():
    """A flag that takes a value states what the value must be (blockdraft.options.Checked, or choices):
    a new flag cannot escape the walk below."""
    loose = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, p in commands().items() for a in p._actions
             if a.nargs != 0 and a.dest not in ("help", "version") and not isinstance(a.type, Checked)
             and a.choices is None]
    assert not loose, loose


def test_every_command_refuses_every_bad_value_in_one_line(tmp_path, capsys):
    seen = {}
    for name, action, bad in cases():
        line = one_line_error(argv_for(name, action, bad, tmp_path), capsys)
        flag = action.option_strings[0] if action.option_strings else action.dest
        assert flag in line, (name, flag, bad, line)
        seen[name] = seen.get(name, 0) + 1
    assert set(seen) == set(commands()), seen  # every command walked
    assert sum(seen.values()) > 200, seen
    assert not os.listdir(tmp_path)  # nothing written by a refused command


@pytest.fixture
def drafter_dir(tmp_path):
    from blockdraft.checkpoint.native import save_drafter
    from blockdraft.config import DrafterConfig
    from blockdraft.model import DFlashDrafter
    from conftest import tiny_causal_lm, tiny_target

    t = tiny_target("llama")
    save_drafter(DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4)), tmp_path / "d")
    target = tmp_path / "target"
    tiny_causal_lm("llama").save_pretrained(target)
    return tmp_path / "d", target


@pytest.mark.parametrize("mangle, says", [
    (lambda c: [c], "must be a JSON object"),
    (lambda c: {**c, "num_attention_heads": "4"}, "num_attention_heads must be an integer, got '4'"),
    (lambda c: {**c, "hidden_act": "banana"}, "unknown hidden_act 'banana'"),
    (lambda c: {**c, "dflash_config": 5}, "not a drafter config"),
    (lambda c: {**c, "max_position_embeddings": -5}, "max_position_embeddings must be >= 0, got -5"),
    (lambda c: {**c, "intermediate_size": 0}, "sizes must be >= 1, got intermediate_size 0"),
])
def test_a_bad_drafter_config_is_one_line_in_convert_and_a_fail_line_in_doctor(drafter_dir, tmp_path, capsys,
                                                                                mangle, says):
    d, target = drafter_dir
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(mangle(cfg)))
    line = one_line_error(["convert", "--to", "zlab", str(d), str(tmp_path / "out")], capsys)
    assert says in line, line
    assert main(["doctor", "--target", str(target), "--drafter", str(d)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL  checkpoint") and says in out, out


def test_train_config_with_a_wrongly_typed_value_is_one_line(tmp_path, capsys):
    for bad, says in (({"train": {"lr": "fast"}}, "train.lr must be a number, got 'fast'"),
                      ({"data": {"max_length": 1.5}}, "data.max_length must be an integer"),
                      ({"train": {"warmup": -1}}, "train.warmup must be >= 0"),
                      ([1, 2], "an object of sections"), ({"train": 3}, "an object of sections")):
        f = tmp_path / "cfg.json"
        f.write_text(json.dumps(bad))
        line = one_line_error(["train", "--config", str(f), "--out", str(tmp_path / "run")], capsys)
        assert says in line and str(f) in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_cuda_on_a_cpu_only_torch_is_one_line(capsys):
    for cmd in (["train"], ["doctor"], ["generate", "hi"], ["bench"], ["extract", "--out", "x"]):
        line = one_line_error([*cmd, "--device", "cuda"], capsys)
        assert "--device: cuda: " in line and "use --device cpu" in line, line
    from blockdraft.target import pick_device

    with pytest.raises(ValueError, match="--device 'banana' is not a device"):
        pick_device("banana")


def pickled_target(tmp_path):
    from conftest import tiny_causal_lm

    d = tmp_path / "pickled"
    model = tiny_causal_lm("llama")
    model.config.save_pretrained(d)
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    return d, model


def test_a_target_of_pickled_weights_only_is_refused_naming_the_conversion(tmp_path, capsys, monkeypatch):
    from blockdraft.target import TargetModel
    from blockdraft.target.files import resolve_target

    d, model = pickled_target(tmp_path)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))
    for cmd in (["train", "--out", str(tmp_path / "r")], ["doctor"], ["generate", "hi"], ["extract", "--out", "c"]):
        line = one_line_error([*cmd, "--target", str(d)], capsys)
        assert "pytorch_model.bin" in line and "safe_serialization=True" in line, line
    with pytest.raises(ValueError, match="only pickled weights"):
        resolve_target(d)
    with pytest.raises(ValueError, match="only pickled weights"):
        TargetModel.from_pretrained(d)
    model.save_pretrained(d)  # safetensors beside the pickle: those are read, the pickle never
    assert resolve_target(d)[0] == d
    assert (d / "model.safetensors").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(d, use_safetensors=True)


def test_bench_refuses_no_prompts_instead_of_slicing(capsys):
    from blockdraft.data.eval_prompts import load_prompt_set
    from blockdraft.bench.runner import run_bench

    for argv in (["--n", "-1"], ["--n", "0"], ["--sets", ""], ["--sets", ","], ["--sets", "mtbench,nope"]):
        one_line_error(["bench", *argv], capsys)
    for n in (-1, 0):
        with pytest.raises(ValueError, match="must be >= 1"):
            load_prompt_set("mtbench", n)
    with pytest.raises(ValueError, match="no prompt set named"):
        run_bench(None, None, [], 3)


def test_generate_refuses_an_empty_prompt(capsys):
    for prompt in ("", "   "):
        assert "argument prompt: must not be empty" in one_line_error(["generate", prompt], capsys)


# ----------------------------------------------------------- flags that were clamped or ignored
def test_sliding_layers_beyond_the_layers_are_refused(tmp_path, capsys):
    from blockdraft.train.build import DrafterOptions

    with pytest.raises(ValueError, match="--sliding-layers 3 exceeds --draft-layers 2"):
        DrafterOptions(sliding_layers=3, draft_layers=2).layout()
    line = one_line_error(["train", "--target", "random:tiny", "--sliding-layers", "3", "--draft-layers", "2",
                           "--out", str(tmp_path / "r")], capsys)
    assert "--sliding-layers 3 exceeds --draft-layers 2" in line
    assert DrafterOptions(sliding_layers=2, draft_layers=2).layout()["layer_types"] == ["sliding_attention"] * 2
    assert "layer_types" not in DrafterOptions(sliding_window=0, sliding_layers=5).layout()  # no window: unused
    assert not (tmp_path / "r").exists()


def test_a_draft_vocabulary_beyond_the_targets_is_refused(tmp_path, capsys):
    from blockdraft.train.build import DrafterOptions

    with pytest.raises(ValueError, match="exceeds the target's vocabulary"):
        DrafterOptions(draft_vocab="161").vocab_size("cpu", 160)
    line = one_line_error(["train", "--target", "random:tiny", "--draft-vocab", "100000", "--out",
                           str(tmp_path / "r")], capsys)
    assert "--draft-vocab 100000 exceeds the target's vocabulary (49280)" in line
    assert DrafterOptions(draft_vocab="160").vocab_size("cpu", 160) == 160
    assert DrafterOptions(draft_vocab="auto").vocab_size("cpu", 160) is None  # smaller than 8192: the full one


def test_fsdp_without_torchrun_is_refused(tmp_path, capsys, monkeypatch):
    from blockdraft.train.preflight import check_launch
    from blockdraft.train.run import RunConfig

    for var in ("WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    cfg = RunConfig()
    cfg.train.fsdp = True
    with pytest.raises(ValueError, match="--fsdp shards the drafter over the ranks of a torchrun launch"):
        check_launch(cfg)
    line = one_line_error(["train", "--target", "random:tiny", "--fsdp", "--out", str(tmp_path / "r")], capsys)
    assert "--fsdp" in line and "torchrun" in line
    line = one_line_error(["train", "--target", "random:tiny", "--target-fsdp", "--out", str(tmp_path / "r")], capsys)
    assert "--target-fsdp" in line and "torchrun" in line


def test_resume_with_another_schedule_is_refused(tmp_path, capsys):
    from blockdraft.train.train_options import TrainConfig
    from blockdraft.train.run import RunConfig

    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    first = RunConfig(train=TrainConfig(out=str(out), lr=6e-4, steps=10))
    first.target.target = "random:tiny"
    (out / "train_config.json").write_text(json.dumps(first.to_dict()))
    from blockdraft.train.preflight import check_resumed_settings

    faster = RunConfig.from_dict(first.to_dict())
    faster.train.resume, faster.train.lr = True, 1e-3
    with pytest.raises(ValueError, match=r"started with --lr 0.0006 \(now 0.001\)"):
        check_resumed_settings(faster)
    base = ["train", "--target", "random:tiny", "--out", str(out), "--steps", "10", "--resume"]
    line = one_line_error([*base, "--lr", "1e-3"], capsys)
    assert "--lr 0.0006 (now 0.001)" in line and "--config" in line, line
    line = one_line_error([*base, "--warmup", "0.1", "--max-length", "512"], capsys)
    assert "--max-length 1024 (now 512), --warmup 0.05 (now 0.1)" in line, line

    again = RunConfig.from_dict(first.to_dict())
    again.train.resume, again.train.progress, again.train.eval_every = True, False, 7  # how it runs, not what
    check_resumed_settings(again)
    assert capsys.readouterr().err == ""
    again.train.steps = 20  # a run grown on --resume (benchmarks/gpu_check.py): said, not refused
    check_resumed_settings(again)
    assert "warning: --resume with another run length, --steps 10 (now 20)" in capsys.readouterr().err


def test_resume_may_move_the_engine_but_not_change_what_it_computes(tmp_path):
    """Where the engines run (their layout, cores, spool, interpreter, timeouts) may change on --resume, as
    a preempted job comes back on other nodes; their dtype, quantization and states precision change the
    features, and are refused."""
    from blockdraft.train.preflight import check_resumed_settings
    from blockdraft.train.run import RunConfig

    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    first = RunConfig.from_dict({"target": {"target": "random:tiny"}, "train": {"out": str(out)},
                                 "engine": {"engine": "vllm", "tensor_parallel_size": 8, "spool": "/a"}})
    (out / "train_config.json").write_text(json.dumps(first.to_dict()))
    moved = RunConfig.from_dict(first.to_dict())
    moved.train.resume = True
    moved.engine.tensor_parallel_size, moved.engine.data_parallel_size, moved.engine.spool = 4, 2, "/b"
    moved.engine.share_gpus, moved.engine.engine_memory, moved.engine.engine_stall_min = True, 0.6, 3.0
    check_resumed_settings(moved)
    for key, value in (("engine_states", "fp8"), ("engine_dtype", "float16"), ("quantization", "fp8"),
                       ("engine", "transformers")):
        other = RunConfig.from_dict(first.to_dict())
        other.train.resume = True
        setattr(other.engine, key, value)
        with pytest.raises(ValueError, match=f"started with --{key.replace('_', '-')} "):
            check_resumed_settings(other)
