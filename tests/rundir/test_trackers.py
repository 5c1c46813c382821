"""`train --report-to`: what each tracker wrote, read back with that library's own reader, against
metrics.jsonl (names, steps, values) and the run's settings (once), through a kill and a --resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make

HERE = Path(__file__).resolve().parent
ALL = "tensorboard,trackio,wandb,mlflow"


def records(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def expected(out: Path) -> dict[int, dict[str, float]]:
    from blockdraft.rundir.trackers import figures

    return {r["step"]: figures(r) for r in records(out)}


def drive(out: str) -> None:
    """In its own process (trackio reads its store's place once, at import): six steps killed after
    the fifth was logged (checkpoint at 4), then --resume; prints what trackio's own API reads back."""
    out = Path(out)
    part = make(out, steps=6, report_to=ALL, report_required=True)
    real_step = part.step

    def killed_after_step_5():
        if part.progress["step"] == 5:
            raise KeyboardInterrupt
        return real_step()

    part.step = killed_after_step_5
    try:
        part.train()
    except KeyboardInterrupt:
        part.trackers.close(flush=False)  # what the process's exit does (atexit)
    assert len(records(out)) == 5
    make(out, steps=6, report_to=ALL, report_required=True).train(resume=True)
    from trackio.api import Api
    from trackio.sqlite_storage import SQLiteStorage

    runs = list(Api().runs("blockdraft"))
    print("TRACKIO " + json.dumps({"runs": [r.name for r in runs], "config": runs[0].config,
                      "logs": SQLiteStorage.get_logs("blockdraft", runs[0].name, run_id=runs[0].id)}, default=str))


def read_tensorboard(out: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()  # purge_orphaned_data (its default) drops the killed run's steps after the checkpoint
    got = {}
    for tag in ea.Tags()["scalars"]:
        for e in ea.Scalars(tag):
            assert tag not in got.get(e.step, {}), f"step {e.step} of {tag} reported twice"
            got.setdefault(e.step, {})[tag] = e.value
    texts = ea.Tensors("settings/text_summary")
    return got, [json.loads(t.tensor_proto.string_val[0].decode()) for t in texts]


def read_mlflow(out: Path):
    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("blockdraft").experiment_id])
    got = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            assert m.key not in got.get(m.step, {}), f"step {m.step} of {key} reported twice"
            got.setdefault(m.step, {})[key] = m.value
    return got, run.data.params


def read_wandb(out: Path):
    """`wandb leet inspect --json`: W&B's own reader of an offline run's transaction log."""
    got, configs, ids = {}, [], set()
    for run_dir in sorted((out / "wandb").glob("offline-run-*")):
        text = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json",
                               str(run_dir)], capture_output=True, text=True, check=True).stdout
        for line in text.splitlines():
            rec = json.loads(line)
            if rec["type"] == "run":
                ids.add(rec["run"]["run_id"])
                cfg = {k: v for k, v in rec["run"].get("config", {}).get("update", {}).items() if k != "_wandb"}
                configs += [cfg] if cfg else []
            if rec["type"] == "history":
                item = rec["history"]["item"]
                step = item.pop("_step")
                assert step not in got, f"step {step} reported twice"
                got[step] = {k: v for k, v in item.items() if not k.startswith("_")}
    return got, configs, ids


def same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for step, figs in want.items():
        assert sorted(got[step]) == sorted(figs), step
        assert got[step] == pytest.approx(figs, rel=1e-6, abs=1e-7), step


def test_every_tracker_holds_metrics_jsonl_and_the_settings_once_through_a_resume(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE),
                                                                             os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", f"from test_trackers import drive; drive({str(out)!r})"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    want = expected(out)
    assert sorted(want) == [1, 2, 3, 4, 5, 6] and "eval_slot_accuracy/1" in want[3]
    settings = json.loads((out / "train_config.json").read_text())
    tb, tb_settings = read_tensorboard(out)
    same(tb, want)
    assert tb_settings == [settings]
    ml, params = read_mlflow(out)
    same(ml, want)
    from blockdraft.rundir.trackers import flat_settings

    assert params == flat_settings(settings)
    wb, wb_configs, ids = read_wandb(out)
    same(wb, want)
    assert wb_configs == [settings] and len(ids) == 1  # two offline runs (one per command), one run id
    tr = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("TRACKIO "))[8:])
    assert len(tr["runs"]) == 1 and {k: v for k, v in tr["config"].items() if not k.startswith("_")} == settings
    steps = [r["step"] for r in tr["logs"]]
    assert len(steps) == len(set(steps))
    same({r["step"]: {k: v for k, v in r.items() if k in want[r["step"]]} for r in tr["logs"]}, want)
    assert all(set(want[r["step"]]) <= set(r) for r in tr["logs"])


def test_a_tracker_that_cannot_start_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    import blockdraft.rundir.trackers as trackers

    class Broken:
        def __init__(self, *a):
            raise ImportError("No module named 'wandb'")

    monkeypatch.setitem(trackers.OPENERS, "wandb", Broken)
    tr = make(tmp_path / "a", steps=2, report_to="tensorboard,wandb")
    tr.train()
    err = [ln for ln in capsys.readouterr().err.splitlines() if "--report-to" in ln]
    assert len(err) == 1 and "wandb could not start" in err[0] and "blockdraft[wandb]" in err[0]
    same(read_tensorboard(tmp_path / "a")[0], expected(tmp_path / "a"))
    assert json.loads((tmp_path / "a" / "trackers.json").read_text()).keys() == {"tensorboard"}
    strict = make(tmp_path / "b", steps=2, report_to="wandb", report_required=True)
    with pytest.raises(ValueError, match="--report-to wandb could not start .*--report-required"):
        strict.train()


def test_only_rank_0_reports(tmp_path):
    tr = make(tmp_path, steps=2, report_to="tensorboard")
    tr.rank = 1  # the other ranks write nothing into --out
    tr.train()
    assert tr.trackers is None and not (tmp_path / "tensorboard").exists()


def test_report_to_is_a_flag_and_a_config_setting_alike(tmp_path):
    from blockdraft.cli import build_parser, train_config
    from blockdraft.train.preflight import RESUMABLE
    from blockdraft.rundir.trackers import check_installed, parse_report_to

    argv = ["train", "--report-to", "mlflow,tensorboard", "--report-required", "--out", str(tmp_path / "r")]
    args = build_parser().parse_args(argv)
    flags = train_config(args, argv[1:])
    assert (flags.train.report_to, flags.train.report_required) == ("mlflow,tensorboard", True)
    path = tmp_path / "train_config.json"
    path.write_text(json.dumps({"train": {"report_to": "mlflow,tensorboard", "report_required": True}}))
    argv = ["train", "--config", str(path)]
    replayed = train_config(build_parser().parse_args(argv), argv[1:])
    assert (replayed.train.report_to, replayed.train.report_required) == ("mlflow,tensorboard", True)
    assert {"report_to", "report_required"} <= RESUMABLE["train"]  # how a run reports, not what it computes
    assert parse_report_to("none") == [] and parse_report_to("WandB, wandb") == ["wandb"]
    with pytest.raises(ValueError, match="unknown tracker 'comet'"):
        parse_report_to("tensorboard,comet")
    check_installed(ALL, True)  # every library is here (the dev extra installs them)


def test_blockdraft_imports_no_tracker_library():
    code = ("import sys, blockdraft.cli, blockdraft.train.trainer, blockdraft.rundir.trackers, blockdraft.train.run;"
            "print([m for m in ('tensorboard', 'trackio', 'wandb', 'mlflow') if m in sys.modules])")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert got.strip() == "[]"


def flush_then_kill_9(out: str) -> None:
    """In its own process: trackio gets steps 1-5 and a checkpoint's flush, then the process is killed."""
    import signal

    from blockdraft.rundir.trackers import Trackers

    t = Trackers(["trackio"], Path(out), {"train": {"lr": 1.0}}, required=True)
    for step in range(1, 6):
        t.report({"step": step, "loss": 1.0 / step})
    t.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no thread gets another turn


def read_trackio(out: str) -> None:
    from trackio.api import Api
    from trackio.sqlite_storage import SQLiteStorage

    os.environ["TRACKIO_DIR"] = str(Path(out) / "trackio")  # read before the import above in a fresh process
    try:
        runs = list(Api().runs("blockdraft"))
    except Exception:  # noqa: BLE001 -- no project in the store: nothing was written
        runs = []
    print("TRACKIO " + json.dumps([[r["step"], r["loss"]] for run in runs for r in SQLiteStorage.get_logs(
        "blockdraft", run.name, run_id=run.id)]))


@pytest.mark.slow  # about 20 s: two processes import trackio
def test_trackio_holds_every_flushed_step_through_a_kill_9(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRACKIO_DIR": str(tmp_path / "trackio"),
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c",
                             f"from test_trackers import flush_then_kill_9 as f; f({str(tmp_path)!r})"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert killed.returncode == -9, killed.stderr[-3000:]
    done = subprocess.run([sys.executable, "-c", f"from test_trackers import read_trackio as f; f({str(tmp_path)!r})"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("TRACKIO "))[8:])
    assert got == [[s, pytest.approx(1.0 / s)] for s in range(1, 6)]  # trackio's own reader: none lost


def test_report_to_naming_no_tracker_is_refused_not_taken_as_none():
    from blockdraft.rundir.trackers import parse_report_to

    for text in (" , ", ",", "", "  "):
        with pytest.raises(ValueError, match="--report-to: no tracker named in"):
            parse_report_to(text)
    assert parse_report_to(" none ") == [] and parse_report_to("mlflow, ,") == ["mlflow"]


@pytest.mark.parametrize("damage", [b"{\"mlflow\": {\"run_", b"[1, 2]", b"\xff\xfe"])
def test_a_damaged_trackers_json_is_refused_before_a_second_mlflow_run_starts(tmp_path, damage):
    from mlflow.tracking import MlflowClient

    from blockdraft.rundir.trackers import Trackers
    from blockdraft.train.run import check_resumed_state

    first = Trackers(["mlflow"], tmp_path, {"train": {"lr": 1.0}}, required=True)
    first.report({"step": 1, "loss": 0.5})
    first.close()
    (tmp_path / "trackers.json").write_bytes(damage)
    with pytest.raises(ValueError, match="trackers.json .*(cannot be read|holds no JSON object).* delete it"):
        Trackers(["mlflow"], tmp_path, {"train": {"lr": 1.0}}, resumed_at=1, required=True)
    with pytest.raises(ValueError, match="trackers.json"):  # the same, before the target loads
        check_resumed_state(tmp_path, "mlflow")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())  # MLflow's own reader: still one run
    assert len(client.search_runs([client.get_experiment_by_name("blockdraft").experiment_id])) == 1



def tensorboard_on_a_full_disk(out: str) -> None:
    """In its own process (pytest catches thread failures itself): TensorBoard's writes fail as on a
    full disk after it started; three steps are reported."""
    import errno

    from tensorboard.summary.writer import record_writer

    from blockdraft.rundir.trackers import Trackers

    t = Trackers(["tensorboard"], Path(out), {"train": {"lr": 1.0}})

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    record_writer.RecordWriter.write = full
    for step in range(1, 4):
        t.report({"step": step, "loss": 0.5})
    assert "tensorboard" not in t.open
    t.close()


@pytest.mark.slow  # about 10 s: a process imports torch and TensorBoard
def test_tensorboard_on_a_full_disk_is_one_line_and_no_writer_thread_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "from test_trackers import tensorboard_on_a_full_disk as f; "
                           f"f({str(tmp_path)!r})"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines() == ["blockdraft train: warning: --report-to tensorboard could not write (OSError: "
                                        "[Errno 28] No space left on device); training goes on without it"], done.stderr
