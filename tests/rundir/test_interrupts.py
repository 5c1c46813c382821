"""Ctrl-C is one line and exit code 130 from the moment `blockdraft` starts (issue 43, item 4.6),
the imports of torch and transformers included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockdraft.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_ctrl_c_during_the_imports_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """Never raised inside a module being imported (torch's native initialisation aborts there,
    numpy is left half-imported, importlib's lock callbacks drop it), but once the import is done."""
    import importlib
    import signal
    import sys
    import time

    import blockdraft.cli as cli

    (tmp_path / "slow_module.py").write_text(
        "import signal, time\nsignal.raise_signal(signal.SIGINT)\ntime.sleep(0.2)\nwhole = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reached = []

    def interrupted_import(only=None):  # Ctrl-C while torch and transformers are imported
        importlib.import_module("slow_module")
        time.sleep(2)  # the next import; the interrupt comes meanwhile
        reached.append(True)

    def caught_import(only=None):  # a library that catches it and goes on
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        return real(only)

    real = cli.build_parser
    for fake in (interrupted_import, caught_import):
        monkeypatch.setattr(cli, "build_parser", fake)
        assert main(["train", "--threads", "1", "--out", str(tmp_path / "r")]) == 130
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith(("blockdraft: interrupted; nothing was done",  # before the flags were read
                               "blockdraft train: interrupted; no checkpoint was saved yet")), err
    whole = getattr(sys.modules.get("slow_module"), "whole", False)
    assert whole and not reached  # the module imported whole, the interrupt right after it
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_rank_that_left_its_group_exits_with_its_code_after_the_atexit_work(tmp_path):
    """cli.exit_after_group: the atexit work runs (trackers, logs), stdout is flushed, the code is
    the run's, and nothing of the interpreter's teardown runs after it (a finaliser would print)."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import atexit, sys\n"
        "import blockdraft.train.distributed as d\n"
        "from blockdraft.cli import exit_after_group\n"
        "class Late:\n"
        "    def __del__(self):\n"
        "        print('teardown ran', flush=True)\n"
        "keep = Late()\n"
        f"atexit.register(lambda: open({str(tmp_path / 'atexit')!r}, 'w').write('ran'))\n"
        "exit_after_group(0)  # not in a group: returns\n"
        "print('still here', end='')\n"
        "d._LEFT = True\n"
        "exit_after_group(75)\n"
        "print('never')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("BLOCKDRAFT_FULL_TEARDOWN", None)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 75 and r.stdout == "still here", (r.returncode, r.stdout, r.stderr)
    assert (tmp_path / "atexit").read_text() == "ran"


@pytest.mark.parametrize("background", [False, True])
def test_sigterm_or_sigusr1_to_a_resumable_command_is_one_line_naming_it(tmp_path, monkeypatch, capsys, background):
    """extract, regenerate, prompts... end on a stop signal as on Ctrl-C (what was finished is kept),
    saying which signal, with exit 128 + its number, instead of dying with no word (143, 138).
    `background`: SIGINT ignored, as a shell's background job has it."""
    import signal
    import time

    import blockdraft.cli as cli

    if background:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        for name in ("SIGTERM", "SIGUSR1"):
            def signalled(args, name=name):
                os.kill(os.getpid(), getattr(signal, name))
                time.sleep(5)  # the work the signal stops
                raise AssertionError("not stopped")

            monkeypatch.setitem(cli.COMMANDS, "extract", signalled)
            assert main(["extract", "--out", str(tmp_path / "cache")]) == 128 + int(getattr(signal, name))
            err = capsys.readouterr().err
            assert err == f"blockdraft extract: stopped by {name}; rerun the same command to continue\n", err
            assert {s: signal.getsignal(s) for s in before} == before
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert set(cli.SIGNAL_AS_INTERRUPT) | {"train", "engine"} == set(cli.COMMANDS)  # every command decided
