"""engines.vllm.job.run_job, the process boundary around a vLLM engine: a start that fails is retried once
without the compile cache, any other failure is raised at once, and the error names the cause a failed
start prints far above its traceback. vLLM itself is replaced by a scripted process; the reference suite
(reference/test_vllm.py) runs the real one."""

from __future__ import annotations

import json
import subprocess

import pytest

from blockdraft.engines.vllm import job as engine

# what a failed start printed in CI, cut down: the cause, then pages of the parent's traceback
DEAD_WORKER = ("INFO loading weights\n"
               "WARNING ImportError: optional module absent, carrying on\n"
               "ERROR [multiproc_executor.py:316] Worker proc VllmWorker-0 died unexpectedly (exit code: -9), "
               "shutting down executor.\n"
               + "ERROR [core.py:1510]   File \"shm_broadcast.py\", line 971, in dequeue\n" * 200
               + "ERROR [core.py:1510] RuntimeError: cancelled\n"
               "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
LATE_ERROR = "INFO engine ready\nValueError: prompt too long for max_model_len\n"


def scripted(outcomes):
    """A stand-in for subprocess.run that plays `outcomes` in order: a log text and exit code per start,
    writing the job's result on exit code 0. Records each start's environment."""
    calls = []

    def run(argv, *, env, stdout, stderr, timeout):
        assert stderr is subprocess.STDOUT
        log, rc = outcomes[len(calls)]
        calls.append(dict(env))
        stdout.write(log)
        if rc == 0:
            with open(argv[-1], "w") as f:
                json.dump({"tokens": [[1, 2, 3]]}, f)
        return subprocess.CompletedProcess(argv, rc)

    return run, calls


def test_a_failed_start_is_retried_once_without_the_compile_cache(tmp_path, monkeypatch, capsys):
    run, calls = scripted([(DEAD_WORKER, 1), ("INFO ok\n", 0)])
    monkeypatch.setattr(engine.subprocess, "run", run)
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    assert engine.run_job({"prompts": []}, tmp_path, "case") == {"tokens": [[1, 2, 3]]}
    assert [c.get("VLLM_DISABLE_COMPILE_CACHE") for c in calls] == [None, "1"]
    err = capsys.readouterr().err
    assert "died unexpectedly (exit code: -9)" in err and "starting it again" in err
    # both starts' logs are kept whole
    assert (tmp_path / "case.log").read_text() == DEAD_WORKER
    assert (tmp_path / "case.retry1.log").read_text() == "INFO ok\n"


def test_a_start_that_fails_twice_is_raised_with_its_cause_not_the_traceback_tail(tmp_path, monkeypatch):
    run, calls = scripted([(DEAD_WORKER, 1), (DEAD_WORKER, 1)])
    monkeypatch.setattr(engine.subprocess, "run", run)
    with pytest.raises(RuntimeError) as e:
        engine.run_job({"prompts": []}, tmp_path, "case")
    first = str(e.value).splitlines()[0]
    assert first.startswith("vLLM exited with 1: ") and "died unexpectedly (exit code: -9)" in first
    assert str(tmp_path / "case.retry1.log") in first
    assert len(calls) == 2


def test_a_failure_after_the_engine_started_is_not_retried(tmp_path, monkeypatch):
    run, calls = scripted([(LATE_ERROR, 1), ("INFO ok\n", 0)])
    monkeypatch.setattr(engine.subprocess, "run", run)
    with pytest.raises(RuntimeError, match=r"^vLLM exited with 1: ValueError: prompt too long"):
        engine.run_job({"prompts": []}, tmp_path, "case")
    assert len(calls) == 1


def test_no_retries_means_one_start(tmp_path, monkeypatch):
    run, calls = scripted([(DEAD_WORKER, 1), ("INFO ok\n", 0)])
    monkeypatch.setattr(engine.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="died unexpectedly"):
        engine.run_job({"prompts": []}, tmp_path, "case", retries=0)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="retries must be 0 or more"):
        engine.run_job({"prompts": []}, tmp_path, "case", retries=-1)


def test_the_cause_is_the_first_line_that_says_why_else_the_last():
    assert engine.failure_cause(DEAD_WORKER).endswith("died unexpectedly (exit code: -9), shutting down executor.")
    assert engine.failure_cause("a\nb\n\n") == "b"
    assert engine.failure_cause("") == "no output"


def test_an_in_process_start_that_fails_is_one_line_naming_vllms_reason(tmp_path, capfd):
    """regenerate and prompts start vLLM in their own process: its output goes to a log while it starts,
    and a failed start names the cause found there, not the traceback's last line."""
    import os

    log = tmp_path / "start.log"
    with pytest.raises(engine.EngineFailed) as e:
        with engine.logged_start(log):
            os.write(2, DEAD_WORKER.encode())  # what vLLM's processes print, on the real file descriptors
            raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    msg = str(e.value)
    assert "\n" not in msg and "died unexpectedly (exit code: -9)" in msg and str(log) in msg
    assert "died unexpectedly" in log.read_text()
    os.write(2, b"after\n")  # the process's own output is its own again
    assert "after" in capfd.readouterr().err and "after" not in log.read_text()


def test_the_cause_is_an_error_vllm_logged_not_a_warnings_traceback():
    log = ("(EngineCore) WARNING [base.py:380] ValueError: Tokenizer not available when `skip_tokenizer_init=True`\n"
           "(Worker) ERROR [multiproc_executor.py:1063] WorkerProc hit an exception.\n"
           "(Worker) ERROR [multiproc_executor.py:1063] AssertionError: CPU GDN attention requires BF16.\n"
           "(EngineCore) ERROR [core.py:1512] RuntimeError: Worker failed with error 'CPU GDN attention requires BF16.'\n")
    assert engine.stated_cause(log) == "AssertionError: CPU GDN attention requires BF16."
    assert engine.stated_cause("INFO all is well\n") is None
    bare = ("(Worker) ERROR [x.py:1]   File \"cpu_router.py\", line 239, in _compute_routing\n"
            "(Worker) ERROR [x.py:1]     assert self.scoring_func == \"softmax\"\n"
            "(Worker) ERROR [x.py:1] AssertionError\n"
            "(EngineCore) ERROR [core.py:1] RuntimeError: Worker failed with error '', please check the stack trace\n")
    assert engine.stated_cause(bare) == 'AssertionError (assert self.scoring_func == "softmax")'
    assert engine.stated_cause("ValueError: prompt too long\n") == "ValueError: prompt too long"
    # killed from outside after a warning's traceback: nothing says why (the signal does)
    assert engine.stated_cause(log.splitlines()[0] + "\n(EngineCore) INFO [core.py:1] ready\n") is None


def test_a_warnings_traceback_and_the_start_up_tokenizer_notice_are_never_the_cause():
    warned = ("(EngineCore pid=7) INFO [core.py:1] starting\n"
              "(EngineCore pid=7) WARNING [base.py:380] could not load the tokenizer:\n"
              "Traceback (most recent call last):\n"
              "  File \"base.py\", line 378, in get_tokenizer\n"
              "ValueError: Tokenizer not available when `skip_tokenizer_init=True`\n"
              "(EngineCore pid=7) INFO [core.py:1] ready\n")
    assert engine.stated_cause(warned) is None  # killed from outside afterwards: the signal says why
    bare = "ValueError: Tokenizer not available when `skip_tokenizer_init=True`\n"  # printed with no level at all
    assert engine.stated_cause(bare) is None
    after = warned + "(EngineCore pid=7) ERROR [core.py:9] RuntimeError: CUDA error: an illegal memory access\n"
    assert engine.stated_cause(after) == "RuntimeError: CUDA error: an illegal memory access"
    unlevelled = warned + "(EngineCore pid=7) INFO [core.py:9] serving\nKeyError: 'model.layers.0'\n"
    assert engine.stated_cause(unlevelled) == "KeyError: 'model.layers.0'"  # under an INFO line: not a warning's
