"""Ownership that is checked, not assumed (issue 34): a command overwrites, swaps or removes only
what carries its own marker, refuses anything else with one line naming the path before any work,
never writes through a link, replaces a finished run only with --overwrite, and leaves nothing
behind when it is refused; a killed writer's temporaries are removed by the next run of that
writer, and only those.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from blockdraft.rundir.atomic import atomic_dir
from blockdraft.checkpoint.native import save_drafter
from blockdraft.cli import main
from blockdraft.rundir.locks import host
from blockdraft.rundir.ownership import MARKER, read_marker, temp_path
from conftest import dead_pid, tiny_target

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--max-length", "128", "--batch-tokens", "256", "--max-anchors", "16", "--draft-vocab", "full",
         "--eval-every", "2", "--save-every", "1", "--no-progress", "--threads", "1", "--eval-fraction", "0.1",
         "--steps", "2"]


def one_line_error(capsys, argv: list[str], *fragments: str) -> str:
    """The command fails as a user error: exit 2, one line on stderr, naming each fragment."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    line = err.splitlines()[-1]
    assert "error:" in line and sum("error:" in ln for ln in err.splitlines()) == 1, err
    for f in fragments:
        assert f in line, (f, line)
    return line


def tiny_drafter():
    from blockdraft.config import DrafterConfig
    from blockdraft.model import DFlashDrafter

    return DFlashDrafter(DrafterConfig.for_target(tiny_target("llama"), num_layers=1, block_size=4))


def tiny_drafter_dir(tmp_path: Path) -> Path:
    return save_drafter(tiny_drafter(), tmp_path / "src")


def listing(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


# ----------------------------------------------------------------- convert (class 2)
def test_convert_removes_only_what_it_wrote(tmp_path, capsys):
    src = tiny_drafter_dir(tmp_path)
    served = tmp_path / "served"
    for name in ("zlab.tmp", "zlab.old", f".zlab.blockdraft-tmp-{host()}-{dead_pid()}"):
        (served / name).mkdir(parents=True)
        (served / name / "notes.txt").write_text("mine")  # a user's, or named like ours but unmarked
    before = listing(served)
    assert main(["convert", "--to", "zlab", str(src), str(served / "zlab")]) == 0
    assert {k: v for k, v in listing(served).items() if k.split("/")[0] != "zlab"} == before
    assert read_marker(served / "zlab")["command"] == "convert"
    assert main(["convert", "--to", "zlab", str(src), str(served / "zlab")]) == 0  # its own output: replaced
    # a directory it did not write is refused, naming it, and left as it was
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text("{}")
    one_line_error(capsys, ["convert", "--to", "zlab", str(src), str(theirs)], str(theirs), "did not write")
    assert listing(theirs) == {"config.json": b"{}"}
    # ... also one another command wrote (train's drafter), or a link to a directory
    one_line_error(capsys, ["convert", "--to", "zlab", str(src), str(src.parent / "src")], "source")
    other = tmp_path / "other"
    save_drafter(tiny_drafter(), other, owner="train")
    one_line_error(capsys, ["convert", "--to", "zlab", str(src), str(other)], str(other), "convert did not write")
    (tmp_path / "link").symlink_to(served / "zlab", target_is_directory=True)
    one_line_error(capsys, ["convert", "--to", "zlab", str(src), str(tmp_path / "link")], "symbolic link")


def test_a_swap_never_follows_or_removes_a_link_inside(tmp_path):
    final = tmp_path / "d"
    atomic_dir(final, lambda d: (d / "x").write_text("1"), owned=("x",))
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (final / "x").unlink()
    (final / "x").symlink_to(outside)
    with pytest.raises(ValueError, match="symbolic link"):
        atomic_dir(final, lambda d: (d / "x").write_text("2"), owned=("x",))
    assert outside.read_text() == "keep" and (final / "x").is_symlink()


KILLED_SWAP = """
import os, signal, sys
from blockdraft.rundir.atomic import atomic_dir
def write(d):
    (d / "x").write_text("half")
    os.kill(os.getpid(), signal.SIGKILL)
atomic_dir(sys.argv[1], write, owned=("x",))
"""


def test_a_killed_swap_leaves_what_the_next_one_removes_and_nothing_else(tmp_path):
    final = tmp_path / "ckpt"
    atomic_dir(final, lambda d: (d / "x").write_text("old"), owned=("x",))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.Popen([sys.executable, "-c", KILLED_SWAP, str(final)], env=env)
    assert p.wait() == -signal.SIGKILL
    left = tmp_path / f".ckpt.blockdraft-tmp-{host()}-{p.pid}"
    assert (left / "x").read_text() == "half" and (final / "x").read_text() == "old"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / f".ckpt.blockdraft-tmp-{host()}-{alive.pid}"  # a writer still at work
        shutil.copytree(left, busy)
        (tmp_path / "ckpt.tmp").mkdir()  # the old name: no longer ours
        atomic_dir(final, lambda d: (d / "x").write_text("new"), owned=("x",))
        assert (final / "x").read_text() == "new" and not left.exists()
        assert busy.exists() and (tmp_path / "ckpt.tmp").exists()
    finally:
        alive.kill()
        alive.wait()


# --------------------------------------------------------- train --out (classes 3, 4, 7)
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_target_dir, chat_data):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", "--target", tiny_target_dir, "--data", chat_data, "--out", str(out), *TRAIN]) == 0
    return out


@pytest.fixture
def run(tmp_path, finished_run, tiny_target_dir, chat_data):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out, symlinks=True)
    return out, ["train", "--target", tiny_target_dir, "--data", chat_data, "--out", str(out), *TRAIN]


@pytest.mark.parametrize("name", ["metrics.jsonl", "train_config.json", "drafter/model.safetensors"])
def test_train_never_writes_through_a_link_in_its_run(tmp_path, run, capsys, name):
    out, argv = run
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (out / name).unlink()
    (out / name).symlink_to(outside)
    before = listing(out)
    for flag in ("--resume", "--overwrite"):
        one_line_error(capsys, argv + [flag], "symbolic link", Path(name).name)
        assert outside.read_text() == "keep" and listing(out) == before  # refused before any work


def test_a_metrics_line_is_never_written_through_a_link(tmp_path):
    from blockdraft.rundir.files import append_metrics

    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (tmp_path / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(ValueError, match="symbolic link"):
        append_metrics(tmp_path, {"step": 1})
    assert outside.read_text() == "keep"


@pytest.mark.parametrize("where", ["run", "drafter", "checkpoint"])
def test_a_strangers_file_in_the_run_is_refused_before_any_work(run, capsys, where):
    out, argv = run
    stranger = (out if where == "run" else out / where) / "notes.txt"
    stranger.write_text("mine")
    before = listing(out)
    for flag in ("--resume", "--overwrite"):
        one_line_error(capsys, argv + [flag], "notes.txt", "did not write")
        assert listing(out) == before  # nothing trained, nothing removed


def test_a_directory_train_did_not_write_is_refused(tmp_path, run, capsys):
    out, argv = run
    os.remove(out / MARKER)
    before = listing(out)
    one_line_error(capsys, argv + ["--overwrite"], str(out), "did not write")
    assert listing(out) == before


def test_a_run_is_replaced_only_with_overwrite(run, capsys):
    out, argv = run
    before = listing(out)
    one_line_error(capsys, argv, str(out), "--resume", "--overwrite")
    one_line_error(capsys, argv + ["--resume", "--overwrite"], "--resume", "--overwrite")
    assert listing(out) == before
    old_run = read_marker(out / "drafter")["run"]
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() * 3)  # an earlier, longer run
    assert main(argv + ["--overwrite"]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [1, 2]
    new_run = read_marker(out)["run"]
    assert new_run != old_run
    assert read_marker(out / "drafter")["run"] == read_marker(out / "checkpoint")["run"] == new_run
    assert "overwrite" not in json.loads((out / "train_config.json").read_text())["train"]


def test_a_refused_train_creates_nothing(tmp_path, tiny_target_dir, capsys):
    prompts_only = tmp_path / "prompts.jsonl"
    prompts_only.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "new" / "run"
    one_line_error(capsys, ["train", "--target", tiny_target_dir, "--data", str(prompts_only), "--out", str(out),
                            "--threads", "1"], "no conversation has an assistant turn")
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(capsys, ["train", "--target", tiny_target_dir, "--data", str(prompts_only), "--out", str(empty),
                            "--threads", "1"], "no conversation has an assistant turn")
    assert list(empty.iterdir()) == []


# ------------------------------------------------------------- leftovers (class 7)
KILLED_SHARD = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from conftest import tiny_rows, tiny_target
from blockdraft.data import features
def dying(tensors, path, *a, **k):
    open(path, "wb").write(b"half a shard")
    os.kill(os.getpid(), signal.SIGKILL)
features.save_file = dying
features.extract(tiny_target("llama"), tiny_rows(4), sys.argv[1], shard_rows=2, progress=False)
"""


def test_extract_removes_the_half_shard_a_killed_extract_left_and_nothing_else(tmp_path):
    from blockdraft.data.features import DiskFeatures, extract
    from conftest import tiny_rows

    out = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-c", KILLED_SHARD, str(out), str(ROOT / "tests")], env=env)
    assert p.wait() == -signal.SIGKILL
    left = [q.name for q in out.iterdir() if str(p.pid) in q.name]
    assert left == [f".shard-00000.safetensors.blockdraft-tmp-{host()}-{p.pid}"]
    (out / "shard-00000.tmp123").write_text("not ours")
    extract(tiny_target("llama"), tiny_rows(4), out, shard_rows=2, progress=False)
    assert not any(str(p.pid) in q.name for q in out.iterdir())
    assert (out / "shard-00000.tmp123").read_text() == "not ours"
    assert DiskFeatures(out).rows["input_ids"].shape[0] == 4


def test_an_extract_cache_is_written_only_where_extract_wrote(tmp_path):
    from blockdraft.data.features import extract
    from conftest import tiny_rows

    out = tmp_path / "c"
    extract(tiny_target("llama"), tiny_rows(4), out, shard_rows=2, progress=False)
    assert read_marker(out)["command"] == "extract"
    os.remove(out / MARKER)  # a cache as another tool would leave it
    os.remove(out / "shard-00001.safetensors")
    with pytest.raises(ValueError, match=f"{out}.*did not write"):
        extract(tiny_target("llama"), tiny_rows(4), out, shard_rows=2, progress=False)
    assert not (out / "shard-00001.safetensors").exists()


def test_write_prompts_removes_only_its_own_leftovers(tmp_path):
    from blockdraft.data.prompt_set import write_prompts

    out = tmp_path / "p.jsonl.gz"
    dead = temp_path(out).with_name(f".p.jsonl.gz.blockdraft-tmp-{host()}-{dead_pid()}")
    dead.write_text("half")
    (tmp_path / "p.jsonl.gz.tmp").write_text("a user's")
    write_prompts([{"id": 1, "messages": []}], out)
    assert not dead.exists() and (tmp_path / "p.jsonl.gz.tmp").read_text() == "a user's"
    assert sorted(q.name for q in tmp_path.iterdir()) == ["p.jsonl.gz", "p.jsonl.gz.tmp"]


# ------------------------------------------------------ one-file outputs (issue 43, item 4.1)
def test_prompts_out_never_replaces_a_users_file_or_writes_through_a_link(tmp_path, capsys, monkeypatch):
    import blockdraft.data.prompt_set as ps
    from blockdraft.data.prompt_set import samples_path, write_prompts

    built = []
    monkeypatch.setattr(ps, "build_prompt_set", lambda *a, **k: built.append(1) or [
        {"id": "builtin-000000", "kind": "prose", "messages": [{"role": "user", "content": "hi"}]}])
    out = tmp_path / "mine.jsonl"
    out.write_text(json.dumps({"messages": [{"role": "user", "content": "my own"}]}) + "\n")
    argv = ["prompts", "--out", str(out), "--magpie", "0", "--builtin", "1", "--threads", "1"]
    one_line_error(capsys, argv, str(out), "not a prompt set")
    outside = tmp_path / "outside.jsonl"
    outside.write_text("keep")
    link = tmp_path / "link.jsonl.gz"
    link.symlink_to(outside)
    one_line_error(capsys, ["prompts", "--out", str(link), *argv[3:]], str(link), "symbolic link")
    samples = samples_path(tmp_path / "new.jsonl")
    samples.write_text("my notes\n")
    one_line_error(capsys, ["prompts", "--out", str(tmp_path / "new.jsonl"), *argv[3:]], str(samples), "Magpie")
    assert not built and outside.read_text() == "keep" and "my own" in out.read_text()  # refused before any work
    assert samples.read_text() == "my notes\n"
    ours = tmp_path / "set.jsonl.gz"
    write_prompts([{"id": "magpie-000000", "kind": "magpie", "messages": []}], ours)  # an earlier prompts run
    assert main(["prompts", "--out", str(ours), *argv[3:]]) == 0  # replaced: prompts wrote it
    assert ps.read_prompts(ours)[0][0] == "builtin-000000"


def test_bench_json_and_plot_never_write_through_a_link_or_over_a_users_file(tmp_path, capsys, monkeypatch):
    import blockdraft.cli.commands as cli
    from blockdraft.bench.runner import check_outputs, plot_hist
    from blockdraft.rundir.ownership import replace_text

    monkeypatch.setattr(cli, "_load_pair", lambda args: pytest.fail("the target loaded before --json was checked"))
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    base = ["bench", "--sets", "gsm8k", "--n", "1", "--threads", "1"]
    for flag in ("--json", "--plot"):
        link = tmp_path / f"link{flag[2:]}"
        link.symlink_to(outside)
        one_line_error(capsys, [*base, flag, str(link)], str(link), "symbolic link")
    mine = tmp_path / "results.json"
    mine.write_text('{"my": "results"}')
    one_line_error(capsys, [*base, "--json", str(mine)], str(mine), "not a bench result")
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n my photo")
    one_line_error(capsys, [*base, "--plot", str(photo)], str(photo), "not a bench plot")
    assert outside.read_text() == "keep" and mine.read_text() == '{"my": "results"}'
    result = [{"set": "gsm8k", "n_prompts": 1, "tau": 1.5, "speedup": 1.2, "accepted_hist": {1: 2, 2: 3}}]
    replace_text(tmp_path / "b.json", json.dumps(result))
    plot_hist(result, tmp_path / "b.png")
    check_outputs(tmp_path / "b.json", tmp_path / "b.png")  # what bench wrote, a rerun replaces
