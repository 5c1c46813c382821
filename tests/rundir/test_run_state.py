"""Run state that a crash, a full disk or an edit left unreadable (issue 43, item 4.2): `train
--resume` repairs what it can say it repaired (a metrics line cut short), recovers what the
checkpoint keeps (the run's settings), and otherwise refuses with one line naming the file, before
the target loads; it never records settings the run did not start with. Also: a run with no
checkpoint yet is never told to --resume.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from blockdraft.cli import main

TRAIN = ["--max-length", "128", "--batch-tokens", "256", "--max-anchors", "16", "--draft-vocab", "full",
         "--eval-every", "2", "--save-every", "2", "--no-progress", "--threads", "1", "--eval-fraction", "0.1"]


def one_line_error(capsys, argv: list[str], *fragments: str) -> str:
    """Exit 2, one line on stderr naming each fragment, and the target never loaded (no "train:" line)."""
    assert main(argv) == 2
    got = capsys.readouterr()
    err = got.err.strip()
    assert "Traceback" not in err, err
    line = err.splitlines()[-1]
    assert "error:" in line and sum("error:" in ln for ln in err.splitlines()) == 1, err
    for f in fragments:
        assert f in line, (f, line)
    assert "train:" not in got.out, got.out  # refused before the target loaded and the data was read
    return line


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_target_dir, chat_data):
    out = tmp_path_factory.mktemp("state") / "run"
    argv = ["train", "--target", tiny_target_dir, "--data", chat_data, "--out", str(out), "--steps", "4", *TRAIN]
    assert main(argv) == 0
    return out


@pytest.fixture
def run(tmp_path, finished_run, tiny_target_dir, chat_data):
    """A copy of a finished 4-step run, and the command that continues it to 6 steps."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out, symlinks=True)
    return out, ["train", "--target", tiny_target_dir, "--data", chat_data, "--out", str(out), "--steps", "6",
                 "--resume", *TRAIN]


def steps_logged(out: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_metrics_line_cut_short_is_dropped_on_resume_saying_so(run, capsys):
    out, argv = run
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"loss": 0.5, "tau": 1.0, "acc')  # the disk filled up during the append of step 5
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"the last line of {out / 'metrics.jsonl'} was cut short" in err and "dropped it" in err, err
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]


def test_a_damaged_metrics_line_inside_is_one_line_naming_the_file(run, capsys):
    out, argv = run
    lines = (out / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    one_line_error(capsys, argv, f"{out / 'metrics.jsonl'}:2", "not a step's metrics record")


def test_a_lost_run_record_is_recovered_from_the_checkpoint_and_history_is_kept(run, capsys):
    out, argv = run
    record = out / "train_config.json"
    first = json.loads(record.read_text())
    record.write_text(record.read_text()[:300])  # cut short by a crash while it was written
    line = one_line_error(capsys, [*argv, "--lr", "1e-2"], "--lr 0.0006 (now 0.01)")
    assert "--config" not in line  # the record it would replay is the damaged one
    assert main([*argv, "--eval-every", "3"]) == 0  # how it runs may change, not what it computes
    err = capsys.readouterr().err
    assert f"{record} is unreadable" in err and "recovered from" in err, err
    now = json.loads(record.read_text())
    assert now["train"]["lr"] == first["train"]["lr"] and now["train"]["eval_every"] == 2  # the run's own
    assert now["train"]["steps"] == 6 and {k: v for k, v in now["train"].items() if k != "steps"} == {
        k: v for k, v in first["train"].items() if k != "steps"}


def test_a_lost_run_record_without_a_copy_is_refused_naming_it(run, capsys):
    out, argv = run
    state = out / "checkpoint" / "trainer_state.json"
    meta = json.loads(state.read_text())
    del meta["settings"]  # a checkpoint written before checkpoints kept the settings
    state.write_text(json.dumps(meta))
    (out / "train_config.json").write_text('{"train": {"lr": ')
    before = (out / "train_config.json").read_text()
    one_line_error(capsys, [*argv, "--lr", "1e-2"], str(out / "train_config.json"), "unreadable", "restore the file")
    assert (out / "train_config.json").read_text() == before


@pytest.mark.parametrize("content", ["{}", "[]", '{"progress": {"step": 4}}', '{"progr'])
def test_a_damaged_trainer_state_is_one_line_naming_the_file(run, capsys, content):
    out, argv = run
    (out / "checkpoint" / "trainer_state.json").write_text(content)
    one_line_error(capsys, argv, str(out / "checkpoint" / "trainer_state.json"), "damaged")


def test_a_run_with_no_checkpoint_yet_is_not_told_to_resume(run, capsys):
    out, argv = run
    for name in ("checkpoint", "drafter"):  # killed after its first logged steps, before a checkpoint
        shutil.rmtree(out / name)
    (out / "summary.json").unlink()
    fresh = [a for a in argv if a != "--resume"]
    line = one_line_error(capsys, fresh, "saved no checkpoint", "--overwrite")
    assert "pass --resume" not in line
    one_line_error(capsys, argv, "no checkpoint", "drop --resume")
    assert main([*fresh, "--overwrite"]) == 0


def test_a_checkpoint_with_an_inf_is_refused_naming_the_file_and_tensor(run, capsys):
    import math

    from safetensors.torch import load_file, save_file

    out, argv = run
    path = out / "checkpoint" / "trainer_state.safetensors"
    tensors = load_file(str(path))
    tensors["drafter.norm.weight"][0] = math.inf
    save_file(tensors, str(path))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{path}: non-finite values in drafter.norm.weight (1 Inf of" in err, err
