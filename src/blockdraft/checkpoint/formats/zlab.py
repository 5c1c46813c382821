"""The z-lab layout (blockdraft's native one), read by z-lab's `dflash`, SGLang and vLLM.

Config: Qwen3 fields at the top (with `use_sliding_window` so transformers keeps the window),
`block_size`, `num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}` with the
layer ids of clause 1, `draft_vocab_size` for a draft vocabulary (vLLM), and blockdraft's own
fields under `blockdraft`. Causality: dflash, SGLang and vLLM make sliding layers causal and
full layers bidirectional unless one `is_causal` (all layers) says otherwise.

Weights: native names; a draft vocabulary leaves as `d2t` offsets and the head's draft rows
(`lm_head.weight`), which vLLM loads. dflash and SGLang ignore both and score the full head.

Kinds: LiLiCorr is `["LiLiCorrDraftModel"]` with lilicorr_enabled, the lilicorr_* fields,
conv_kernel_size / conv_group_size (0 / 0: no convolution) and block_size inside `dflash_config`, where
vLLM reads them (models/lilicorr.py). DFlash2 is `architectures: ["DFlash2DraftModel"]` with conv_kernel_size,
conv_group_size, selector_rank and selector_top_k inside `dflash_config` (where z-lab's dflash, vLLM and llama.cpp's
converter read them); DSpark is `["DSparkDraftModel"]` with markov_rank, markov_head_type,
enable_confidence_head, confidence_head_with_markov and sample_from_anchor at the top (what
llama.cpp's converter `DSparkModel` and vLLM read; the converter takes a missing sample_from_anchor
for true), and the head fields again inside `dflash_config`, where SpecForge's
DSparkDraftModel reads them (`SPECFORGE_DSPARK`; it reads nothing at the top, and without them builds
neither head and drops their weights). Reading takes the top-level fields and refuses a config whose
two copies disagree. Domino is `["DominoDraftModel"]` with projector_type "domino", emb_dim,
gru_hidden_dim, pure_draft_prefix_len and shift_label false inside `dflash_config` (SpecForge's
DominoDraftModel reads them there), its weights under SpecForge's names (`prefix_gru.*`, `embed_proj.*`).
"""

from __future__ import annotations

from ...config import SLIDING, WINDOW_QUERY, DrafterConfig
from .base import (DFLASH2_ARCH, DFLASH2_FIELDS, DOMINO_ARCH, DSPARK_ARCHS, LILICORR_ARCH, OWN_KEY, Export, Format,
                   agree_kind, dflash2_fields, domino_fields, dspark_fields, engine_head_weights, layer_kwargs,
                   lilicorr_fields, own_fields, qwen3_fields, read_dflash2, read_domino, read_dspark, read_lilicorr,
                   read_own)

ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel", "dflash2": DFLASH2_ARCH,
                 "lilicorr": LILICORR_ARCH, "domino": DOMINO_ARCH}


def matches(d: dict) -> bool:
    # speculators' own save_pretrained names the same architecture: its type field decides
    if d.get("speculators_model_type"):
        return False
    known = {"DFlashDraftModel", DFLASH2_ARCH, LILICORR_ARCH, DOMINO_ARCH, *DSPARK_ARCHS}
    return "dflash_config" in d or bool(known.intersection(d.get("architectures") or []))


def kind_of(d: dict) -> str:
    """The drafter kind of a z-lab config, by its architectures or its kind's fields."""
    archs = d.get("architectures") or []
    if LILICORR_ARCH in archs or "lilicorr_enabled" in (d.get("dflash_config") or {}):
        return "lilicorr"
    if DOMINO_ARCH in archs or (d.get("dflash_config") or {}).get("projector_type") == "domino":
        return "domino"
    if DFLASH2_ARCH in archs or any(k in (d.get("dflash_config") or {}) for k in DFLASH2_FIELDS):
        return "dflash2"
    if any(a in archs for a in DSPARK_ARCHS) or "markov_rank" in d:
        return "dspark"
    return "dflash"


# The DSpark fields SpecForge reads from `dflash_config` (modeling/draft/dspark.py): the head
# fields under the names and values speculators uses at the top, plus `attention_mode`, which its
# DSparkDraftModel checks against the head counts ("gqa" unless asked: "mha" must be said).
SPECFORGE_DSPARK = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def specforge_dspark_fields(cfg: DrafterConfig) -> dict:
    top = dspark_fields(cfg)
    mode = "mha" if cfg.num_key_value_heads == cfg.num_attention_heads else "gqa"
    return {**{k: top[k] for k in SPECFORGE_DSPARK}, "attention_mode": mode}


def _same_dspark_fields(d: dict) -> None:
    """Refuse a DSpark config whose `dflash_config` copy of a head field (SpecForge's) differs from the
    top-level one (what vLLM, llama.cpp's converter and blockdraft read)."""
    dc = d.get("dflash_config") or {}
    for key in SPECFORGE_DSPARK:
        if key in dc and key in d and dc[key] != d[key]:
            raise ValueError(f"{key} is {d[key]!r} at the top of the config but {dc[key]!r} in dflash_config "
                             "(where SpecForge reads it): the readers would build different drafters; "
                             "re-export the drafter")


def _causality(cfg: DrafterConfig) -> dict:
    """One `is_causal` for all layers; absent = sliding layers causal, full ones not (ours exactly)."""
    if cfg.has_sliding and not cfg.sliding_causal_in_block:
        return {"is_causal": False}
    return {}


def write_config(cfg: DrafterConfig, ex: Export) -> dict:
    dc = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    if cfg.kind == "dflash2":
        dc.update(dflash2_fields(cfg))
    if cfg.kind == "lilicorr":  # vLLM reads block_size from dflash_config first (models/lilicorr.py)
        dc.update(lilicorr_fields(cfg), block_size=cfg.block_size)
    if cfg.kind == "domino":
        dc.update(domino_fields(cfg))
    d = {"architectures": [ARCHITECTURES[cfg.kind]], **qwen3_fields(cfg), **_causality(cfg),
         "block_size": cfg.block_size, "num_target_layers": cfg.target_num_layers, "dflash_config": dc}
    if cfg.kind == "dspark":
        d.update(dspark_fields(cfg))
        dc.update(specforge_dspark_fields(cfg))
    if cfg.draft_vocab_size:
        d["draft_vocab_size"] = cfg.draft_vocab_size
    d[OWN_KEY] = own_fields(cfg)
    return d


def write_weights(sd: dict, cfg: DrafterConfig, ex: Export) -> dict:
    return engine_head_weights(sd, cfg, ex, with_t2d=False)


def read_causal(d: dict, layer_types: list[str]) -> bool:
    """The in-block causality of sliding layers, as dflash, SGLang and vLLM read it."""
    flag = d.get("is_causal", (d.get("dflash_config") or {}).get("causal"))
    if flag is None:
        return True
    if flag and any(t != SLIDING for t in layer_types):
        raise ValueError("this drafter's config makes its full-attention layers causal (is_causal: true); "
                         "blockdraft's full-attention layers are bidirectional in the block")
    return bool(flag)


def read_config(d: dict, num_target_layers: int | None = None) -> DrafterConfig:
    dc = d.get("dflash_config") or {}
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in dc and key not in d:
            raise ValueError(f"z-lab config lacks dflash_config.{key}")
    kw = layer_kwargs(d)
    if "sliding_window" not in kw and dc.get("swa_window_size") is not None:
        kw["sliding_window"] = int(dc["swa_window_size"])
    layer_types = kw.get("layer_types") or []
    n_layers = d.get("num_target_layers") or num_target_layers
    if n_layers is None:
        raise ValueError("this z-lab config does not say how many layers its target has (num_target_layers)")
    kind = kind_of(d)
    # llama.cpp's converter takes a z-lab DSpark config without sample_from_anchor for true
    kind_kw = (read_dspark(d, True, "llama.cpp's converter") if kind == "dspark"
               else read_dflash2({**d, **dc}) if kind == "dflash2"
               else read_lilicorr(dc) if kind == "lilicorr" else read_domino(dc) if kind == "domino"
               else {"kind": "dflash"})
    if kind == "dspark":
        _same_dspark_fields(d)
    # A directory from z-lab's own tools was trained for its readers' rule: the query window.
    own = agree_kind(read_own(d, {"target_hidden_size": kw["hidden_size"], "sliding_window_rule": WINDOW_QUERY,
                                  "sliding_causal_in_block": read_causal(d, layer_types), **kind_kw}),
                     kind, "architectures")
    if "draft_vocab_size" not in own and d.get("draft_vocab_size") not in (None, kw.get("vocab_size")):
        own["draft_vocab_size"] = int(d["draft_vocab_size"])
    return DrafterConfig(target_num_layers=int(n_layers),
                         target_layer_ids=list(dc.get("target_layer_ids", d.get("target_layer_ids"))),
                         mask_token_id=int(dc.get("mask_token_id", d.get("mask_token_id"))),
                         block_size=int(dc.get("block_size", d.get("block_size", 16))), **kw, **own)


FORMAT = Format("zlab", "z-lab layout: dflash, SGLang, vLLM (blockdraft's native layout)", matches, read_config,
                write_config, write_weights)
