"""Config tables of the ecosystem's drafter formats (DESIGN.md section 2).

- z-lab (the native layout, read by the reference `dflash` package, SGLang and vLLM):
  Qwen3 fields at the top, `block_size`, `num_target_layers`,
  `dflash_config: {mask_token_id, target_layer_ids}`; layer ids as in clause 1.
  blockdraft's own fields (format version, in-block causal flag, draft vocabulary size,
  provenance) ride along under the `blockdraft` key, which other readers ignore.
- speculators (read by vLLM): `speculators_model_type: "dflash"`, the Qwen3 layer config
  nested as `transformer_layer_config`, and `aux_hidden_state_layer_ids` one more than
  clause 1's ids (they name the input of the next layer: `hidden_states_index`).

The weights (`layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`) are named the
same in both formats.
"""

from __future__ import annotations

from typing import Any

from ..config import FORMAT_VERSION, SLIDING, DrafterConfig
from ..target import hidden_states_index, layer_id_from_hidden_states_index

QWEN3_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "attention_bias",
                "hidden_act", "layer_types", "sliding_window", "vocab_size")
OWN_FIELDS = ("target_hidden_size", "sliding_causal_in_block", "draft_vocab_size", "target_name", "tokenizer_hash",
              "extra")


def _zlab_causal(cfg: DrafterConfig) -> dict:
    """z-lab reads one `is_causal` for all layers; absent = sliding layers causal, full ones not."""
    if SLIDING in cfg.layer_types and not cfg.sliding_causal_in_block:
        return {"is_causal": False}
    return {}


def _qwen3(cfg: DrafterConfig) -> dict:
    d = {k: getattr(cfg, k) for k in QWEN3_FIELDS}
    d.update(model_type="qwen3", rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    return d


def to_zlab(cfg: DrafterConfig) -> dict:
    """z-lab config; a draft vocabulary survives only under the `blockdraft` key (see `convert`)."""
    d = {"architectures": ["DFlashDraftModel"], **_qwen3(cfg), **_zlab_causal(cfg),
         "block_size": cfg.block_size, "num_target_layers": cfg.target_num_layers,
         "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
         "blockdraft": {"format_version": FORMAT_VERSION, **{k: getattr(cfg, k) for k in OWN_FIELDS}}}
    return d


def _own(d: dict, hidden: int, layer_types: list, causal_default: bool) -> dict:
    own = dict(d.get("blockdraft") or {})
    version = own.pop("format_version", FORMAT_VERSION)
    if version > FORMAT_VERSION:
        raise ValueError(f"drafter format_version {version} is newer than this blockdraft ({FORMAT_VERSION})")
    own.setdefault("target_hidden_size", hidden)
    own.setdefault("sliding_causal_in_block", causal_default)
    return {k: v for k, v in own.items() if k in OWN_FIELDS}


def _layer_kwargs(q: dict) -> dict:
    kw = {k: q[k] for k in QWEN3_FIELDS if k in q and k != "rope_theta"}
    rp = q.get("rope_parameters") or {}
    kw["rope_theta"] = float(rp.get("rope_theta", q.get("rope_theta", 10000.0)))
    if kw.get("layer_types") is None:
        kw.pop("layer_types", None)
    return kw


def from_zlab(d: dict) -> DrafterConfig:
    dc = d.get("dflash_config") or {}
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in dc and key not in d:
            raise ValueError(f"z-lab config lacks dflash_config.{key}")
    kw = _layer_kwargs(d)
    layer_types = kw.get("layer_types") or []
    causal = bool(d["is_causal"]) if "is_causal" in d else SLIDING in layer_types
    return DrafterConfig(target_num_layers=int(d["num_target_layers"]),
                         target_layer_ids=list(dc.get("target_layer_ids", d.get("target_layer_ids"))),
                         mask_token_id=int(dc.get("mask_token_id", d.get("mask_token_id"))),
                         block_size=int(d.get("block_size", 16)), **kw,
                         **_own(d, kw["hidden_size"], layer_types, causal))


def to_speculators(cfg: DrafterConfig, verifier: str | None = None, verifier_arch: list | None = None) -> dict:
    return {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "aux_hidden_state_layer_ids": [hidden_states_index(i) for i in cfg.target_layer_ids],
        "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "num_target_layers": cfg.target_num_layers, "sample_from_anchor": False,
        "sliding_window_non_causal": not cfg.sliding_causal_in_block,
        "transformer_layer_config": _qwen3(cfg),
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier or cfg.target_name, "architectures": verifier_arch or []},
        },
        "blockdraft": {"format_version": FORMAT_VERSION, **{k: getattr(cfg, k) for k in OWN_FIELDS}},
    }


def from_speculators(d: dict, num_target_layers: int | None = None) -> DrafterConfig:
    if d.get("speculators_model_type") != "dflash":
        raise ValueError("not a speculators DFlash config (speculators_model_type != 'dflash')")
    q = d.get("transformer_layer_config") or {}
    kw = _layer_kwargs(q)
    spec_tokens = d["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    B = int(d.get("block_size", spec_tokens + 1))
    if B != spec_tokens + 1:
        raise ValueError(f"block_size {B} disagrees with speculative_tokens {spec_tokens} (must be B - 1)")
    n_layers = d.get("num_target_layers") or num_target_layers
    if n_layers is None:
        raise ValueError("this speculators config does not say how many layers its target has "
                         "(num_target_layers); load it together with its target (load_drafter(..., "
                         "num_target_layers=n) or the CLI's --target)")
    return DrafterConfig(target_num_layers=int(n_layers),
                         target_layer_ids=[layer_id_from_hidden_states_index(i) for i in d["aux_hidden_state_layer_ids"]],
                         mask_token_id=int(d["mask_token_id"]), block_size=B, **kw,
                         **_own(d, int(d.get("target_hidden_size", kw["hidden_size"])), kw.get("layer_types") or [],
                                not d.get("sliding_window_non_causal", True)))


def detect(d: dict[str, Any]) -> str:
    if d.get("speculators_model_type") == "dflash":
        return "speculators"
    if "dflash_config" in d or "DFlashDraftModel" in (d.get("architectures") or []):
        return "zlab"
    if "format_version" in d and "target_layer_ids" in d:
        return "blockdraft-v0"
    raise ValueError("unknown drafter config: neither z-lab (dflash_config) nor speculators (speculators_model_type)")


def config_from_json(d: dict, num_target_layers: int | None = None) -> DrafterConfig:
    kind = detect(d)
    if kind == "speculators":
        return from_speculators(d, num_target_layers)
    if kind == "zlab":
        return from_zlab(d)
    return DrafterConfig.from_dict(d)
