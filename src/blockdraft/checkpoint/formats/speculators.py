"""The speculators layout, read by vllm-project/speculators (training) and by vLLM (serving).

Config: `speculators_model_type: "dflash"`, the drafter layers as `transformer_layer_config`,
`aux_hidden_state_layer_ids` one more than clause 1's ids (they name the input of the next
layer), `sliding_window_non_causal` always written (vLLM defaults it to true, speculators to
false), and a verifier path the readers open offline. vLLM turns the flag into one causal
setting for every layer; speculators applies it to sliding layers only.

Weights: a draft vocabulary leaves as `d2t`, `t2d` [V] bool and the head's draft rows
(`lm_head.weight`): speculators and vLLM both load a reduced head from the file.

Kinds (`speculators_model_type`), as speculators' own save_pretrained writes them:
`dflash` (architectures DFlashSpeculator); `dspark` (DSparkSpeculator, + markov_rank,
markov_head_type, enable_confidence_head, confidence_head_with_markov); `dflash2` (DFlash2DraftModel,
+ conv_kernel_size, conv_group_size, selector_rank, selector_top_k; the full target vocabulary
only). `sample_from_anchor: false` always, so B - 1 speculative tokens; the kind's weights keep
their names.
"""

from __future__ import annotations

from ...config import WINDOW_ANCHOR, DrafterConfig, kind_refusal
from ...target import hidden_states_index, layer_id_from_hidden_states_index
from .base import (OWN_KEY, Export, Format, agree_kind, check_sample_from_anchor, dflash2_fields, dspark_fields,
                   engine_head_weights, layer_kwargs, own_fields, qwen3_fields, read_dflash2, read_dspark, read_own,
                   verifier_dir)

# speculators_model_type -> the architectures speculators' config class writes, and what its
# pydantic default reads a missing sample_from_anchor as (DSpark: true; models/dspark/config.py)
ARCHITECTURES = {"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator", "dflash2": "DFlash2DraftModel"}
SAMPLE_FROM_ANCHOR_DEFAULT = {"dflash": False, "dspark": True, "dflash2": False}


def matches(d: dict) -> bool:
    return d.get("speculators_model_type") in ARCHITECTURES


def _kind_fields(cfg: DrafterConfig) -> dict:
    refused = kind_refusal(cfg.kind, "speculators")
    if refused:
        raise ValueError(refused)
    if cfg.kind == "dspark":
        return {k: v for k, v in dspark_fields(cfg).items() if k != "sample_from_anchor"}  # written above
    if cfg.kind == "dflash2":
        if cfg.draft_vocab_size:
            raise ValueError(f"speculators' DFlash2 requires the full target vocabulary, this drafter drafts from "
                             f"{cfg.draft_vocab_size} tokens: export it --to zlab, or retrain it without a draft "
                             "vocabulary")
        return dflash2_fields(cfg)
    return {}


def write_config(cfg: DrafterConfig, ex: Export) -> dict:
    kind_fields = _kind_fields(cfg)
    return {
        "architectures": [ARCHITECTURES[cfg.kind]], "speculators_model_type": cfg.kind,
        "aux_hidden_state_layer_ids": [hidden_states_index(i) for i in cfg.target_layer_ids],
        "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "num_target_layers": cfg.target_num_layers, "sample_from_anchor": False,
        # vLLM makes every layer causal when this is false (speculators reads it for sliding layers only):
        # false only where the drafter's layers are causal sliding ones
        "sliding_window_non_causal": not (cfg.has_sliding and cfg.sliding_causal_in_block),
        "transformer_layer_config": qwen3_fields(cfg), **kind_fields,
        "speculators_config": {
            "algorithm": cfg.kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_dir(ex.verifier), "architectures": []},
        },
        OWN_KEY: own_fields(cfg),
    }


def write_weights(sd: dict, cfg: DrafterConfig, ex: Export) -> dict:
    return engine_head_weights(sd, cfg, ex, with_t2d=True)


def read_config(d: dict, num_target_layers: int | None = None) -> DrafterConfig:
    if not matches(d):
        raise ValueError(f"not a speculators config of a kind blockdraft reads (speculators_model_type "
                         f"{d.get('speculators_model_type')!r}; blockdraft reads {', '.join(ARCHITECTURES)})")
    kind = d["speculators_model_type"]
    reader = "speculators"  # its config class's default for a missing sample_from_anchor
    if kind == "dspark":
        kind_kw = read_dspark(d, SAMPLE_FROM_ANCHOR_DEFAULT[kind], reader)
    else:
        check_sample_from_anchor(d, SAMPLE_FROM_ANCHOR_DEFAULT[kind], reader)
        kind_kw = read_dflash2(d) if kind == "dflash2" else {"kind": "dflash"}
    q = d.get("transformer_layer_config") or {}
    kw = layer_kwargs(q)
    spec_tokens = d["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    B = int(d.get("block_size", spec_tokens + 1))
    if B != spec_tokens + 1:
        raise ValueError(f"block_size {B} disagrees with speculative_tokens {spec_tokens} (must be B - 1)")
    n_layers = d.get("num_target_layers") or num_target_layers
    if n_layers is None:
        raise ValueError("this speculators config does not say how many layers its target has "
                         "(num_target_layers); load it together with its target (load_drafter(..., "
                         "num_target_layers=n) or the CLI's --target)")
    sliding = "sliding_attention" in (kw.get("layer_types") or [])
    if sliding and "sliding_window_non_causal" not in d and OWN_KEY not in d:
        raise ValueError("this speculators config has sliding layers but no sliding_window_non_causal: "
                         "speculators reads that as causal and vLLM as bidirectional, so the drafter's "
                         "function is ambiguous; add the flag its trainer used")
    # speculators trains with the anchor window; its own files say nothing of a rule
    own = agree_kind(read_own(d, {"target_hidden_size": int(d.get("target_hidden_size") or kw["hidden_size"]),
                                  "sliding_window_rule": WINDOW_ANCHOR,
                                  "sliding_causal_in_block": not sliding or not d.get("sliding_window_non_causal", True),
                                  **kind_kw}), kind, "speculators_model_type")
    vd = d.get("draft_vocab_size")
    if "draft_vocab_size" not in own and vd not in (None, kw.get("vocab_size")):
        own["draft_vocab_size"] = int(vd)
    return DrafterConfig(target_num_layers=int(n_layers),
                         target_layer_ids=[layer_id_from_hidden_states_index(i) for i in d["aux_hidden_state_layer_ids"]],
                         mask_token_id=int(d["mask_token_id"]), block_size=B, **kw, **own)


FORMAT = Format("speculators", "vllm-project/speculators layout: speculators, vLLM", matches, read_config,
                write_config, write_weights)
