"""Fixtures the vLLM reference files share (pytest collects this beside them): one vLLM engine capturing
SmolLM2's states, started once per session and fed through a spool that `extract --engine vllm` and
`train --engine vllm` join with `--spool` (each vLLM start costs minutes on 2 cores). It runs as two
data-parallel replicas, one core each: the layout every file that joins it is judged in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SMOLLM2_LAYERS = [1, 8, 14, 21, 27]  # SmolLM2 has 30 layers: vLLM is asked for ids 2, 9, 15, 22, 28 and 30
SMOLLM2_LENGTH = 384
SMOLLM2_REPLICAS = 2  # --data-parallel-size of the shared engine


@pytest.fixture(scope="session")
def smollm2_engine(tmp_path_factory):
    """The spool of running fp32 vLLM engines for SmolLM2 and `SMOLLM2_LAYERS` (rows up to
    `SMOLLM2_LENGTH`; `SMOLLM2_REPLICAS` replicas, each on its own core); stopped at the end of the session."""
    pytest.importorskip("vllm")
    from blockdraft.engines.vllm.capture import capture_ids
    from blockdraft.engines.vllm.launch import open_engines
    from blockdraft.engines.vllm.engine_options import EngineOptions
    from blockdraft.target import resolve_source

    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the replicas' cores are blockdraft's choice
    root = Path(tmp_path_factory.mktemp("smollm2-engine")) / "spool"
    want = {"target": str(resolve_source("smollm2").local_dir), "aux_ids": capture_ids(SMOLLM2_LAYERS, 30),
            "dtype": "float32"}
    engines = open_engines(root, want, EngineOptions(engine="vllm", data_parallel_size=SMOLLM2_REPLICAS),
                           max_model_len=SMOLLM2_LENGTH + 8, itemsize=4,
                           on_gpu=False, architectures=["LlamaForCausalLM"])
    engines.wait_ready()
    yield root
    engines.stop(remove=True)
