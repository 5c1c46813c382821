"""Fixtures the vLLM reference files share (pytest collects this beside them): one vLLM engine capturing
SmolLM2's states, started once per session and fed through a spool that `extract --engine vllm` and
`train --engine vllm` join with `--spool` (each vLLM start costs minutes on 2 cores). It runs as two
data-parallel replicas, one core each: the layout every file that joins it is judged in. It runs eager
(vLLM's enforce_eager), as the servers on other nodes that are held to its cache do: each replica's start
is about a minute shorter, and compiled capture stays judged on GLM-4.x MoE (test_vllm_capture.py), whose
decoder forward blockdraft's plugin rewrites."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SMOLLM2_LAYERS = [1, 8, 14, 21, 27]  # SmolLM2 has 30 layers: vLLM is asked for ids 2, 9, 15, 22, 28 and 30
SMOLLM2_LENGTH = 384
SMOLLM2_REPLICAS = 2  # --data-parallel-size of the shared engine
# the flags every train and extract of these files share
SMOLLM2_COMMON = ["--max-length", str(SMOLLM2_LENGTH), "--layer-ids", ",".join(map(str, SMOLLM2_LAYERS)),
                  "--threads", "2"]


@pytest.fixture(scope="session")
def smollm2_engine(tmp_path_factory):
    """The spool of running fp32 vLLM engines for SmolLM2 and `SMOLLM2_LAYERS` (rows up to
    `SMOLLM2_LENGTH`; `SMOLLM2_REPLICAS` replicas, each on its own core); stopped at the end of the session."""
    pytest.importorskip("vllm")
    from blockdraft.engines.vllm.capture import capture_ids
    from blockdraft.engines.vllm.launch import open_engines
    from blockdraft.engines.vllm.engine_options import VllmOptions
    from blockdraft.target import resolve_source

    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the replicas' cores are blockdraft's choice
    root = Path(tmp_path_factory.mktemp("smollm2-engine")) / "spool"
    want = {"target": str(resolve_source("smollm2").local_dir), "aux_ids": capture_ids(SMOLLM2_LAYERS, 30),
            "dtype": "float32"}
    engines = open_engines(root, want, VllmOptions(data_parallel_size=SMOLLM2_REPLICAS, engine_eager=True),
                           max_model_len=SMOLLM2_LENGTH + 8, itemsize=4,
                           on_gpu=False, architectures=["LlamaForCausalLM"])
    engines.wait_ready()
    yield root
    engines.stop(remove=True)


@pytest.fixture(scope="session")
def smollm2_data(tmp_path_factory, smollm2_engine):
    """Training and held-out conversations (bundled, no evaluation prompt), and their caches written by
    `extract --engine vllm` through the shared engine: the offline side of every online comparison."""
    import gzip
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    tmp = tmp_path_factory.mktemp("online")
    with gzip.open(root / "src" / "blockdraft" / "assets" / "data" / "default.jsonl.gz", "rt") as fh:
        lines = [next(fh) for _ in range(28)]
    (tmp / "train.jsonl").write_text("".join(lines[:24]))
    (tmp / "held.jsonl").write_text("".join(lines[24:]))
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    for name in ("train", "held"):
        argv = [sys.executable, "-m", "blockdraft", "extract", "--engine", "vllm", "--spool", str(smollm2_engine),
                "--data", str(tmp / f"{name}.jsonl"), *SMOLLM2_COMMON, "--out", str(tmp / f"cache-{name}")]
        log = tmp / f"extract-{name}.log"
        with open(log, "w") as fh:
            rc = subprocess.run(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=1800).returncode
        assert rc == 0, f"extract exited {rc}:\n" + log.read_text()[-4000:]
    return tmp
