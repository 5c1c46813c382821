"""The node plan (benchmarks/online.py --plan-only) for the published targets of blockdraft.plan.PUBLISHED
(GLM-5, GLM-5-Next, DeepSeek-V4, MiniMax-M3, Kimi-K3) against brute-force counts: each model built on the
meta device with transformers' own class, its parameters summed module by module, times the bytes each
weight takes in the checkpoint's scheme. A family transformers lacks is planned from a config JSON of a
type it has, or refused in one line."""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers as tf

from blockdraft.plan import PUBLISHED, config_file, published_config, target_sizes

ROOT = Path(__file__).resolve().parents[1]
# the class transformers itself gives each config type (written out, not looked up through blockdraft)
CLASSES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "glm5_next": "Glm5NextForConditionalGeneration",
           "deepseek_v4": "DeepseekV4ForCausalLM", "minimax_m3_vl": "MiniMaxM3SparseForConditionalGeneration",
           "kimi_linear": "KimiLinearForCausalLM"}
FP8_BLOCK = 1 + Fraction(4, 128 * 128)  # e4m3 and one fp32 scale per 128 x 128 block
MX4, MX8 = Fraction(1, 2) + Fraction(1, 32), 1 + Fraction(1, 32)  # e2m1 / e4m3 and one e8m0 scale per 32
# bytes per weight of a linear layer: (a routed expert's, any other's); embeddings, head, norms: bf16
PER_WEIGHT = {"bf16": (2, 2), "fp8": (FP8_BLOCK, FP8_BLOCK), "mxfp4-experts": (MX4, 2),
              "mxfp4-experts-fp8": (MX4, FP8_BLOCK), "mxfp8": (MX8, MX8)}
_BUILT: dict = {}


def brute(name: str) -> dict:
    """The model of a PUBLISHED target built by transformers' own class on the meta device, and its
    parameters summed module by module: all, the text part's, the embedding and head, the routed experts'."""
    if name not in _BUILT:
        cfg, scheme = published_config(name)
        with torch.device("meta"):
            model = getattr(tf, CLASSES[cfg.model_type])(cfg)
        out = {"all": 0, "text": 0, "head": 0, "experts": 0, "linear": 0, "other": 0, "scheme": scheme}
        for mod_name, mod in model.named_modules():
            for p in mod._parameters.values():
                if p is None:
                    continue
                n = p.numel()
                out["all"] += n
                out["text"] += 0 if "vision" in mod_name or "multi_modal" in mod_name else n
                if isinstance(mod, torch.nn.Embedding) or mod_name == "lm_head":
                    out["head"] += n
                    out["other"] += n
                elif type(mod).__name__.endswith("Experts"):
                    out["experts"] += n
                elif p.dim() >= 2:
                    out["linear"] += n
                else:
                    out["other"] += n
        _BUILT[name] = out
    return _BUILT[name]


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_plan_counts_each_published_target_as_its_transformers_class_does(name):
    """The plan's parameter count equals the brute count, and the text part's is within 5% of the published
    total where one is published (the figures and their sources: docs/scale.md)."""
    cfg, _ = published_config(name)
    got, want = target_sizes(cfg), brute(name)
    assert got["params"] == want["all"], (got["params"], want["all"])
    assert got["head_only"] == want["head"]
    total = PUBLISHED[name].total_b
    if total is not None:
        assert abs(want["text"] / (total * 1e9) - 1) < 0.05, (name, want["text"] / 1e9, total)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_an_engine_gpu_holds_the_brute_force_bytes_of_its_scheme_over_the_tensor_parallel_size(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the engine's plan is the benchmark's (benchmarks/engine_plan.py)
    from engine_plan import GIB, engine_plan

    cfg, scheme = published_config(name)
    b = brute(name)
    expert, linear = PER_WEIGHT[scheme]
    want = 2 * b["other"] + expert * b["experts"] + linear * b["linear"]
    p = engine_plan(cfg, scheme=scheme, tp=8, card_bytes=141 * GIB, max_length=4096)
    assert abs(p.weights * 8 - want) <= 8 + 1e-9 * want, (name, p.weights * 8, float(want))
    assert p.expert_parallel and p.flags() == "--tensor-parallel-size 8 --expert-parallel"


def test_a_training_rank_beside_the_engine_holds_only_the_targets_embedding_and_head():
    """A rank trains as from a cache: the target's part of its plan is the brute count of the embedding and
    head, in bf16 (Kimi-K3, planned from its config JSON)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import online

    from blockdraft.plan import plan_run
    from memory_plan import run_config

    name = "Kimi-K3 (MXFP4 experts)"
    cfg, _ = published_config(name)
    p = plan_run(cfg, run_config(online.trainer_flags(4096, online.STEP_TOKENS)), world=8, torchrun=True)
    assert p.parts["target"] == 2 * brute(name)["head"]
    assert "target forward" not in p.parts


def test_a_config_json_of_a_type_transformers_has_plans_as_that_config(tmp_path):
    """The JSON path (--config): keys starting with '_' are comments; the rest build the config transformers
    itself builds from them, whose model the plan counts as the brute force does."""
    shape = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=128, moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                 kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 linear_num_heads=4, linear_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    f = tmp_path / "kimi-like.json"
    f.write_text(json.dumps({"_about": "a note", "model_type": "kimi_linear", **shape}))
    cfg = config_file(f)
    assert not hasattr(cfg, "_about") and cfg.to_dict() == tf.KimiLinearConfig(**shape).to_dict()
    with torch.device("meta"):
        model = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(**shape))
    assert target_sizes(cfg)["params"] == sum(p.numel() for m in model.modules() for p in m._parameters.values()
                                              if p is not None)


def test_a_family_transformers_lacks_is_refused_in_one_line_naming_why(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import online

    f = tmp_path / "kimi-k3.json"
    f.write_text(json.dumps({"model_type": "kimi_k3", "text_config": {"hidden_size": 7168}}))
    with pytest.raises(ValueError) as e:
        config_file(f)
    msg = str(e.value)
    assert "\n" not in msg and "'kimi_k3'" in msg and tf.__version__ in msg and "kimi_linear" in msg
    args = SimpleNamespace(targets="", config=str(f), scheme="bf16", name=None)
    with pytest.raises(SystemExit) as e:
        online.chosen_targets(args)
    assert str(e.value) == msg
