"""Fixtures the vLLM reference files share (pytest collects this beside them): one vLLM engine capturing
SmolLM2's states, started once per session and fed through a spool that `extract --engine vllm` and
`train --engine vllm` join with `--spool` (each vLLM start costs minutes on 2 cores)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SMOLLM2_LAYERS = [1, 8, 14, 21, 27]  # SmolLM2 has 30 layers: vLLM is asked for ids 2, 9, 15, 22, 28 and 30
SMOLLM2_LENGTH = 384


@pytest.fixture(scope="session")
def smollm2_engine(tmp_path_factory):
    """The spool of a running fp32 vLLM engine for SmolLM2 and `SMOLLM2_LAYERS` (rows up to
    `SMOLLM2_LENGTH`); stopped at the end of the session."""
    pytest.importorskip("vllm")
    from blockdraft.engines.vllm.capture import capture_ids
    from blockdraft.engines.vllm.launch import open_engines
    from blockdraft.engines.vllm.options import EngineOptions
    from blockdraft.target import resolve_source

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    root = Path(tmp_path_factory.mktemp("smollm2-engine")) / "spool"
    want = {"target": str(resolve_source("smollm2").local_dir), "aux_ids": capture_ids(SMOLLM2_LAYERS, 30),
            "dtype": "float32"}
    engines = open_engines(root, want, EngineOptions(engine="vllm"), max_model_len=SMOLLM2_LENGTH + 8, itemsize=4,
                           on_gpu=False, architectures=["LlamaForCausalLM"])
    engines.wait_ready()
    yield root
    engines.stop(remove=True)
