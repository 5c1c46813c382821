"""The speculators layout, read by vllm-project/speculators (training) and by vLLM (serving).

Config: `speculators_model_type: "dflash"`, the drafter layers as `transformer_layer_config`,
`aux_hidden_state_layer_ids` one more than clause 1's ids (they name the input of the next
layer), `sliding_window_non_causal` always written (vLLM defaults it to true, speculators to
false), and a verifier path the readers open offline. vLLM turns the flag into one causal
setting for every layer; speculators applies it to sliding layers only.

Weights: a draft vocabulary leaves as `d2t`, `t2d` [V] bool and the head's draft rows
(`lm_head.weight`): speculators and vLLM both load a reduced head from the file.
"""

from __future__ import annotations

from ...config import WINDOW_ANCHOR, WINDOW_QUERY, DrafterConfig
from ...target import hidden_states_index, layer_id_from_hidden_states_index
from .base import (ANCHOR_RULE_SERVED, OWN_KEY, Difference, Export, Format, engine_head_weights, layer_kwargs,
                   own_fields, qwen3_fields, read_own, verifier_dir, vllm_mixed_layers)


def matches(d: dict) -> bool:
    return d.get("speculators_model_type") == "dflash"


def write_config(cfg: DrafterConfig, ex: Export) -> dict:
    return {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "aux_hidden_state_layer_ids": [hidden_states_index(i) for i in cfg.target_layer_ids],
        "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "num_target_layers": cfg.target_num_layers, "sample_from_anchor": False,
        "sliding_window_non_causal": not cfg.sliding_causal_in_block,
        "transformer_layer_config": qwen3_fields(cfg),
        "speculators_config": {
            "algorithm": "dflash",
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
        raise ValueError("not a speculators DFlash config (speculators_model_type != 'dflash')")
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
    own = read_own(d, {"target_hidden_size": int(d.get("target_hidden_size") or kw["hidden_size"]),
                       "sliding_window_rule": WINDOW_ANCHOR,
                       "sliding_causal_in_block": not d.get("sliding_window_non_causal", True)})
    vd = d.get("draft_vocab_size")
    if "draft_vocab_size" not in own and vd not in (None, kw.get("vocab_size")):
        own["draft_vocab_size"] = int(vd)
    return DrafterConfig(target_num_layers=int(n_layers),
                         target_layer_ids=[layer_id_from_hidden_states_index(i) for i in d["aux_hidden_state_layer_ids"]],
                         mask_token_id=int(d["mask_token_id"]), block_size=B, **kw, **own)


def differences(cfg: DrafterConfig) -> list[Difference]:
    out = []
    if cfg.has_sliding and cfg.sliding_window_rule == WINDOW_QUERY:
        out.append(Difference("speculators", False, "trains and evaluates sliding layers with the anchor window "
                                                    "(every slot sees a - W <= p < a); this drafter uses the "
                                                    "query rule that vLLM serves"))
    if cfg.has_sliding and cfg.sliding_window_rule == WINDOW_ANCHOR:
        out.append(Difference("vLLM", True, ANCHOR_RULE_SERVED))
    return out + vllm_mixed_layers(cfg, "turns sliding_window_non_causal: false into dflash_config.causal for every "
                                        "layer, so the full-attention layers become causal")


FORMAT = Format("speculators", "vllm-project/speculators layout: speculators, vLLM", matches, read_config,
                write_config, write_weights, differences)
