"""`train --engine vllm` without vLLM: the engine processes, the spool and the trainer's reading order
run for real, with transformers standing in for vLLM inside the engine process (tests/engine_stub.py
writes what vLLM's hidden-states connector writes). Online training must equal training from
`extract --engine vllm`'s cache of the same data, step by step; the spool must stay within its budget
on data whose states are many times larger; a failing engine must stop training with one line. vLLM
itself is judged the same way in the reference suite (reference/test_vllm_online.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from blockdraft.data.pipeline import DataOptions
from blockdraft.engines.vllm.feed import STAND_IN
from blockdraft.engines.options import RunnerOptions
from blockdraft.engines.vllm.engine_options import VllmOptions
from blockdraft.target import TargetOptions
from blockdraft.train.build import DrafterOptions
from blockdraft.extract import ExtractOptions, run_extract
from blockdraft.train.train_options import TrainConfig
from blockdraft.train.run import RunConfig, run_training

TESTS = Path(__file__).resolve().parents[1]
L = 256


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setenv(STAND_IN, "engine_stub:TransformersCapturer")
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}")


@pytest.fixture(scope="module")
def split(tmp_path_factory, chat_data):
    d = tmp_path_factory.mktemp("online-data")
    lines = Path(chat_data).read_text().splitlines(keepends=True)
    (d / "train.jsonl").write_text("".join(lines[:20]))
    (d / "held.jsonl").write_text("".join(lines[20:]))
    return d


def config(target_dir, out, *, data: DataOptions, engine: VllmOptions | None = None, steps=4, kind="dflash",
           rows_per_step=2, eval_every=2):
    extra = {"dspark": dict(kind="dspark", markov_rank=8),
             "dflash2": dict(kind="dflash2", selector_rank=8, selector_top_k=4)}.get(kind, {})
    return RunConfig(target=TargetOptions(target=target_dir, threads=1, num_features=3),
                     data=data, drafter=DrafterOptions(draft_layers=1, block_size=8, draft_vocab="512", **extra),
                     train=TrainConfig(out=str(out), steps=steps, batch_tokens=rows_per_step * L, max_anchors=16,
                                       eval_every=eval_every,
                                       save_every=100, lr=3e-3, warmup=1, progress=False),
                     engine=engine or RunnerOptions())


def losses(out: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("eval_loss")) for r in rows]


def drafter_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "drafter" / "model.safetensors"))


@pytest.mark.parametrize("replicas", [1, 2])
def test_online_training_equals_training_from_the_engine_cache(tmp_path, tiny_target_dir, split, stand_in, replicas,
                                                              monkeypatch):
    """One replica, and two data-parallel ones (each on its own core, each capturing a share)."""
    import blockdraft.engines.vllm.launch as launch

    statuses = []
    real_stop = launch.Engines.stop

    def stop(self, *a, **kw):  # each replica's own record, read before the spool goes
        statuses.append([r.read() for r in self.replicas])
        return real_stop(self, *a, **kw)

    monkeypatch.setattr(launch.Engines, "stop", stop)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    vllm = VllmOptions(spool=str(tmp_path / "spool"), data_parallel_size=replicas)
    for name in ("train", "held"):  # what extract --engine vllm stores, through the same engine process
        run_extract(TargetOptions(target=tiny_target_dir, num_features=3),
                    DataOptions(data=str(split / f"{name}.jsonl"), max_length=L), ExtractOptions(out=str(tmp_path / name)),
                    vllm)
    offline = config(tiny_target_dir, tmp_path / "offline",
                     data=DataOptions(features_cache=str(tmp_path / "train"), eval_features_cache=str(tmp_path / "held"),
                                      max_length=L, max_rows=0))
    online = config(tiny_target_dir, tmp_path / "online", engine=vllm,
                    data=DataOptions(data=str(split / "train.jsonl"), eval_data=str(split / "held.jsonl"), max_length=L,
                                     max_rows=0))
    run_training(offline)
    run_training(online)
    a, b = losses(tmp_path / "offline"), losses(tmp_path / "online")
    assert len(a) == 4 and a == b  # the same function computed: the same losses, to the bit, every step
    wa, wb = drafter_weights(tmp_path / "offline"), drafter_weights(tmp_path / "online")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (tmp_path / "spool").exists()  # removed after a clean finish
    # what the engine served is on record in both: the cache's manifest and the online run's summary
    info = json.loads((tmp_path / "train" / "manifest.json").read_text())
    served = json.loads((tmp_path / "online" / "summary.json").read_text())["engine"]
    assert served == [{"dtype": info["engine_dtype"], "quantization": info["quantization"],
                       "layout": info["engine_layout"]}] * replicas
    assert info["engine_dtype"] == "float32" and info["engine_replicas"] == replicas
    for run in statuses:  # extract's two runs and training's: every replica captured, each on its own cores
        assert len(run) == replicas and all(st["items"] > 0 for st in run), run
        cores = [st["cores"] for st in run]
        assert len(set(cores)) == replicas or len(os.sched_getaffinity(0)) < replicas, cores


def test_the_spool_stays_within_its_budget(tmp_path, tiny_target_dir, split, stand_in, monkeypatch):
    """On data whose states are over 10x the bound, the engine waits: the spool's claimed bytes never pass
    the budget by more than the one item a reader needs first."""
    import blockdraft.engines.vllm.launch as launch
    from blockdraft.engines.vllm.spool import state_bytes

    row = state_bytes(L, 4, 32, 4)  # one row's states at most: 3 feature layers + the last, hidden 32, fp32
    budget = 2 * row
    vllm = VllmOptions(spool=str(tmp_path / "spool"), spool_gib=budget / 2**30)
    cfg = config(tiny_target_dir, tmp_path / "run", engine=vllm, steps=24, rows_per_step=1, eval_every=1000,
                 data=DataOptions(data=str(split / "train.jsonl"), max_length=L, max_rows=0, eval_fraction=0.1))
    seen = []
    real_stop = launch.Engines.stop

    def stop(self, *a, **kw):  # the replica's own record, read before the spool goes
        seen.extend(r.read() for r in self.replicas)
        return real_stop(self, *a, **kw)

    monkeypatch.setattr(launch.Engines, "stop", stop)
    run_training(cfg)
    (status,) = seen
    captured = status["tokens"] * (4 * 32 * 4 + 8)  # every state the run read, each epoch's anew
    assert captured >= 10 * budget
    assert 0 < status["peak_bytes"] <= budget + row


def test_a_failing_engine_stops_training_with_one_line(tmp_path, tiny_target_dir, split, stand_in, monkeypatch,
                                                       capsys):
    from blockdraft.cli import main

    monkeypatch.setenv("STUB_FAIL_AFTER", "3")
    rc = main(["train", "--engine", "vllm", "--target", tiny_target_dir, "--data", str(split / "train.jsonl"),
               "--max-length", str(L), "--steps", "6", "--batch-tokens", str(2 * L), "--draft-layers", "1",
               "--draft-vocab", "512", "--spool", str(tmp_path / "spool"), "--out", str(tmp_path / "run"),
               "--no-progress", "--threads", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "the stand-in engine was told to fail here" in err[0] and str(tmp_path / "spool") in err[0]
    assert (tmp_path / "spool" / "engine-0.log").exists()  # kept: the error names it
    import blockdraft.engines.vllm.launch as launch

    said = (tmp_path / "spool" / "engine-0.log").read_bytes()
    assert f"the next start keeps it in {tmp_path / 'spool' / 'previous'}" in err[0]
    launch.prepare_spool(tmp_path / "spool")  # what the rerun does before its engines start
    assert (tmp_path / "spool" / "previous" / "engine-0.log").read_bytes() == said
    assert not (tmp_path / "spool" / "engine-0.log").exists() and not (tmp_path / "spool" / "engine-0.json").exists()


@pytest.mark.parametrize("slow,flag,said", [("STUB_START_S", "--engine-start-min", "did not start within 0.02 min"),
                                             ("STUB_DELAY_S", "--engine-stall-min", "no heartbeat for 1 s (hung?)")])
def test_an_engine_that_never_starts_or_hangs_stops_training_in_one_line(tmp_path, tiny_target_dir, split, stand_in,
                                                                       monkeypatch, capsys, slow, flag, said):
    import time

    from blockdraft.cli import main

    monkeypatch.setenv(slow, "30")
    t0 = time.monotonic()
    rc = main(["train", "--engine", "vllm", "--target", tiny_target_dir, "--data", str(split / "train.jsonl"),
               "--max-length", str(L), "--steps", "2", "--batch-tokens", str(L), "--draft-layers", "1",
               "--draft-vocab", "512", "--spool", str(tmp_path / "spool"), "--out", str(tmp_path / "run"),
               "--no-progress", "--threads", "1", flag, "0.02"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and said in err[0], err
    assert str(tmp_path / "spool" / "engine-0.log") in err[0] and time.monotonic() - t0 < 25


@pytest.mark.slow
def test_a_killed_trainer_leaves_no_engine_and_resumes_exactly(tmp_path, tiny_target_dir, split, stand_in):
    """kill -9 of the trainer: its engine notices and exits (no process keeps the GPUs); `--resume` starts
    a new one on the same spool and ends with the losses of a run never stopped."""
    import os
    import signal
    import subprocess
    import sys
    import time

    flags = ["-m", "blockdraft", "train", "--engine", "vllm", "--target", tiny_target_dir, "--data",
             str(split / "train.jsonl"), "--eval-data", str(split / "held.jsonl"), "--max-length", str(L),
             "--steps", "8", "--batch-tokens", str(L), "--draft-layers", "1", "--draft-vocab", "512",
             "--save-every", "2", "--eval-every", "4", "--max-rows", "0", "--no-progress", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    whole = tmp_path / "whole"
    subprocess.run([sys.executable, *flags, "--spool", str(tmp_path / "s1"), "--out", str(whole)], env=env,
                   check=True, capture_output=True)
    out, spool = tmp_path / "killed", tmp_path / "s2"
    run = [sys.executable, *flags, "--spool", str(spool), "--out", str(out)]
    proc = subprocess.Popen(run, env={**env, "STUB_DELAY_S": "0.3"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics, deadline = out / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        assert proc.poll() is None
        time.sleep(0.2)
    engine = int(json.loads((spool / "engine-0.json").read_text())["pid"])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for _ in range(100):  # the engine watches the process that started it
        try:
            os.kill(engine, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the engine {engine} outlived the trainer that was killed")
    assert json.loads((spool / "engine-0.json").read_text())["state"] == "stopped"
    subprocess.run([*run, "--resume"], env=env, check=True, capture_output=True)
    assert losses(out) == losses(whole)


@pytest.mark.parametrize("who", ["engine and trainer", pytest.param("engine", marks=pytest.mark.slow)])
def test_a_stop_signal_to_the_engine_saves_the_last_whole_step_and_resumes_exactly(tmp_path, tiny_target_dir, split,
                                                                                   stand_in, who):
    """SIGTERM to the engine and the trainer together, as a scheduler preempting the job sends it (or to the
    engine alone): the step the engine can no longer feed is thrown away, the last whole one is saved, the
    run exits 75, and `--resume` (a new engine) ends with the losses of a run never stopped. The spool holds
    one row, so the trainer waits on the engine at every step and the signal lands mid-step."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from blockdraft.engines.vllm.spool import state_bytes
    from blockdraft.preempt import PREEMPTED

    budget = 1.5 * state_bytes(L, 4, 32, 4) / 2**30  # one row's states (3 feature layers + the last, hidden 32,
    # fp32, a header per document), not two
    flags = ["-m", "blockdraft", "train", "--engine", "vllm", "--target", tiny_target_dir, "--data",
             str(split / "train.jsonl"), "--eval-data", str(split / "held.jsonl"), "--max-length", str(L),
             "--steps", "10", "--batch-tokens", str(L), "--draft-layers", "1", "--draft-vocab", "512", "--max-rows",
             "0", "--eval-every", "5", "--no-progress", "--threads", "1", "--num-features", "3", "--spool-gib",
             f"{budget:.9f}"]
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    whole = tmp_path / "whole"
    subprocess.run([sys.executable, *flags, "--spool", str(tmp_path / "s1"), "--out", str(whole)], env=env,
                   check=True, capture_output=True)
    out, spool = tmp_path / "stopped", tmp_path / "s2"
    run = [sys.executable, *flags, "--spool", str(spool), "--out", str(out)]
    proc = subprocess.Popen(run, env={**env, "STUB_DELAY_S": "0.2"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    metrics, deadline = out / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    engine = int(json.loads((spool / "engine-0.json").read_text())["pid"])
    os.kill(engine, signal.SIGTERM)
    if who != "engine":
        os.kill(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=120)
    err = proc.stderr.read()
    said = [ln for ln in err.splitlines() if "stopped by" in ln]
    assert rc == PREEMPTED and len(said) == 1, err[-3000:]
    assert ("SIGTERM" if who != "engine" else "a stop signal to the vLLM engines") in said[0]
    assert "engine failed" not in err and "error:" not in err
    saved = int(said[0].split("after step ")[1].split(":")[0])
    assert 2 <= saved < 10 and [r[0] for r in losses(out)][-1] == saved  # nothing of the thrown-away step logged
    subprocess.run([*run, "--resume"], env=env, check=True, capture_output=True)
    assert losses(out) == losses(whole)


@pytest.mark.slow
def test_an_engine_that_dies_on_one_node_stops_every_node_in_one_line(tmp_path, tiny_target_dir, split, stand_in):
    """Two torchrun nodes on this machine, each with its own engine (a folder of the spool each): node 1's
    engine fails mid-run; node 0's rank, waiting in a collective, stops within seconds (not at the group's
    hour) with one line naming the rank, the host, the engine's node, its cause and its log; both exit 2."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from conftest import free_port

    port, codes = free_port(), tmp_path / "codes"
    codes.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "RANK_EXIT_DIR": str(codes)}
    procs = []
    for node in (0, 1):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "rank_exit",
             "train", "--engine", "vllm", "--target", tiny_target_dir, "--data", str(split / "train.jsonl"),
             "--max-length", str(L), "--steps", "12", "--batch-tokens", str(L), "--draft-layers", "1",
             "--draft-vocab", "512", "--spool", str(tmp_path / "spool"), "--out", str(tmp_path / "run"),
             "--no-progress", "--threads", "1"],
            env={**env, **({"STUB_FAIL_AFTER": "12"} if node == 1 else {})}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=300)[1] for p in procs]
    failed = json.loads((tmp_path / "spool" / "node-1" / "engine-0.json").read_text())
    gone = time.time() - float(failed["beat"])  # since node 1's engine wrote its failure
    assert [p.returncode for p in procs] == [1, 1]  # torchrun's own, on a rank's failure
    assert [f.read_text() for f in codes.iterdir()] == ["2"], errs  # node 1's rank returned
    assert "(exitcode: 2) local_rank: 0" in errs[0], errs[0][-3000:]  # node 0's ended by its watcher
    line = [ln for ln in errs[0].splitlines() if "error:" in ln]
    assert len(line) == 1, errs[0][-3000:]
    host = socket.gethostname()
    assert f"rank 1 on {host} stopped, so this rank does too" in line[0]
    assert f"the vLLM engine on node 1 ({host})" in line[0] and "told to fail here" in line[0]
    assert str(tmp_path / "spool" / "node-1" / "engine-0.log") in line[0]
    assert gone < 60, gone


def test_fp8_states_train_as_their_cache_does_and_stay_within_fp8s_error(tmp_path, tiny_target_dir, split, stand_in):
    """--engine-states fp8: the engine sends e4m3 states with a float32 scale per token, the reader
    dequantizes them. Online training equals training from `extract --engine-states fp8`'s cache, step
    by step; that cache's features are the full-precision cache's within fp8's rounding (3 mantissa bits:
    each value within 2^-4 of itself, so each token's features too), and its manifest says how they
    travelled."""
    from blockdraft.data.features import DiskFeatures

    caches = {}
    for states in ("engine", "fp8"):
        vllm = VllmOptions(spool=str(tmp_path / f"spool-{states}"), engine_states=states)
        for name in ("train", "held"):
            run_extract(TargetOptions(target=tiny_target_dir, num_features=3),
                        DataOptions(data=str(split / f"{name}.jsonl"), max_length=L),
                        ExtractOptions(out=str(tmp_path / f"{name}-{states}")), vllm)
        caches[states] = DiskFeatures(tmp_path / f"train-{states}")
    n = torch.arange(caches["fp8"].rows["input_ids"].shape[0])
    full, fp8 = caches["engine"](n).features, caches["fp8"](n).features
    err = (fp8 - full).norm(dim=-1) / full.norm(dim=-1).clamp(min=1e-12)  # each token's: e4m3 rounds by <= 2^-4
    assert 0 < err.max() <= 2**-4, err.max()
    assert caches["fp8"].manifest["engine_states"] == "fp8" and "engine_states" not in caches["engine"].manifest
    offline = config(tiny_target_dir, tmp_path / "offline",
                     data=DataOptions(features_cache=str(tmp_path / "train-fp8"),
                                      eval_features_cache=str(tmp_path / "held-fp8"), max_length=L, max_rows=0))
    online = config(tiny_target_dir, tmp_path / "online",
                    engine=VllmOptions(spool=str(tmp_path / "spool"), engine_states="fp8"),
                    data=DataOptions(data=str(split / "train.jsonl"), eval_data=str(split / "held.jsonl"), max_length=L,
                                     max_rows=0))
    run_training(offline)
    run_training(online)
    assert losses(tmp_path / "offline") == losses(tmp_path / "online")


def test_a_spool_smaller_than_one_micro_batch_is_refused_before_any_engine_starts(tmp_path, tiny_target_dir, split,
                                                                                  stand_in, monkeypatch):
    import blockdraft.engines.vllm.launch as launch
    from blockdraft.engines.vllm.spool import state_bytes

    row = state_bytes(L, 4, 32, 4)  # one full row's states: 3 feature layers + the last, hidden 32, fp32
    monkeypatch.setattr(launch, "start_engines", lambda *a, **kw: pytest.fail("an engine was started"))
    for rows_per_step, budget in ((1, row // 4), (2, row)):  # far below one row; below two full-ish rows
        vllm = VllmOptions(spool=str(tmp_path / f"spool{rows_per_step}"), spool_gib=budget / 2**30)
        cfg = config(tiny_target_dir, tmp_path / f"run{rows_per_step}", engine=vllm, rows_per_step=rows_per_step,
                     data=DataOptions(data=str(split / "train.jsonl"), max_length=L, max_rows=0, eval_fraction=0.1))
        with pytest.raises(ValueError, match=rf"{rows_per_step} rows of a micro-batch need at least .* GiB of "
                                             r"states at once, more than the spool's .*: raise --spool-gib"):
            run_training(cfg)
    vllm = VllmOptions(spool=str(tmp_path / "spool-x"), spool_gib=row / 4 / 2**30)
    with pytest.raises(ValueError, match=r"a row needs .* GiB of states at once, more than the spool's .*: raise "
                                         r"--spool-gib"):  # extract --engine vllm asks for one row at a time
        run_extract(TargetOptions(target=tiny_target_dir, num_features=3),
                    DataOptions(data=str(split / "train.jsonl"), max_length=L), ExtractOptions(out=str(tmp_path / "x")),
                    vllm)
