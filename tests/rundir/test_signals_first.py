"""The command line answers at once and hears stop signals from its first line (issue 58, item 7.4):
`blockdraft --help` used to import torch, transformers and the model (6.5 s) and a SIGTERM in train's
first seconds, before the handlers were set after parsing, killed it with no word (exit 143)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_preempt_cli import TRAIN, catches

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
HEAVY = ("torch", "transformers", "numpy", "safetensors")


def run(code: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *argv], env=ENV, capture_output=True, text=True, timeout=120)


def test_help_and_a_mistaken_command_import_nothing_heavy():
    """Counted in the process itself (sys.modules), not timed."""
    code = ("import sys\nfrom blockdraft.cli import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    rc = e.code\nprint(rc, sorted(m for m in %r if m in sys.modules))\n" % (HEAVY,))
    for argv, rc in ((["--help"], 0), (["--version"], 0), (["trian"], 2), ([], 2)):
        r = run(code, *argv)
        assert r.stdout.strip().splitlines()[-1] == f"{rc} []", (argv, r.stdout[-300:], r.stderr)
    assert "train a drafter" in run(code, "--help").stdout


def test_a_signal_while_the_parser_is_built_stops_train_as_preempted():
    """SIGTERM arrives while train's flags are being read (building the parser imports the library): the
    handler is already there, so the command goes on to stop before its first step, exit 75 and its line;
    the trainer's start (its first poll of the signals) is stood in for, the rest is the command line's."""
    code = """
import os, signal, sys
from pathlib import Path
import blockdraft.cli as cli
from blockdraft.preempt import Preempted, StopSignals

real = cli.build_parser

def building(only=None):  # a signal while the library is imported for the flags
    os.kill(os.getpid(), signal.SIGTERM)
    return real(())

def trainer_start(args):  # as Trainer.train begins: a signal noted while starting up stops the run
    with StopSignals() as s:
        if s.got:
            raise Preempted(0, s.got, Path("run") / "checkpoint", starting=True)
    return 0

cli.build_parser = building
cli.COMMANDS["train"] = trainer_start
sys.exit(cli.main(["train"]))
"""
    r = run(code)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 75, r.stderr
    assert lines[0] == "blockdraft train: SIGTERM: stopping before the first step (still starting up)", r.stderr
    assert lines[-1] == ("blockdraft train: stopped by SIGTERM during start-up, before step 1: nothing was trained "
                         "or saved; rerun the same command, without --resume, to start (exit code 75)"), r.stderr


def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow  # the whole start-up of a tiny run (the target and data load before the first step)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_sigterm_right_after_start_exits_75_with_its_line_and_writes_nothing(tmp_path, tiny_target_dir, chat_data):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "blockdraft", "train", "--target", tiny_target_dir, "--data", chat_data,
            "--steps", "2", *TRAIN, "--out", str(out)]
    p = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not catches(p.pid, signal.SIGTERM):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.002)
    early = not maps_torch(p.pid)  # the handler is there before torch is imported
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert early
    assert p.returncode == 75, err
    assert err.strip().splitlines()[-1].startswith("blockdraft train: stopped by SIGTERM during start-up, before "
                                                   "step 1: nothing was trained or saved"), err
    assert "Traceback" not in err and not (out / "checkpoint").exists() and not (out / "drafter").exists()
