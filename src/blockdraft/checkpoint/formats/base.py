"""What every drafter format shares: the Format interface, the Qwen3 layer fields, blockdraft's own
fields and the draft-vocabulary tensors. Where a consumer computes another function from a format
(its quirks) is the consumer's own knowledge: `blockdraft.engines`.

A format is a config map (DrafterConfig <-> config.json) and a weight map (native tensors <->
the consumer's tensors: renamed, added, dropped). The native tensors are `layers.*`, `fc.weight`
(feature scale folded in), `hidden_norm.weight`, `norm.weight`, a drafter kind's modules (named as
speculators names them, so every format passes them through) and, for a draft vocabulary, the
target ids `draft_vocab` [Vd].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ...config import FORMAT_VERSION, DrafterConfig

QWEN3_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "attention_bias",
                "hidden_act", "layer_types", "sliding_window", "vocab_size")
# LiLiCorr's fields (config.KIND_FIELDS), under vLLM's names
LILICORR_FIELDS = ("conv_kernel_size", "conv_group_size", "lilicorr_candidate_topk", "lilicorr_hidden_size",
                   "lilicorr_num_layers", "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim",
                   "lilicorr_vector_eps", "lilicorr_logit_scale")
OWN_FIELDS = ("target_hidden_size", "sliding_causal_in_block", "sliding_window_rule", "draft_vocab_size",
              "target_name", "tokenizer_hash", "generate_defaults", "kind", "markov_rank", "confidence_head",
              "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "sample_from_anchor",
              *LILICORR_FIELDS[2:], "emb_dim", "gru_hidden_dim", "pure_draft_prefix_len", "lambda_base_start",
              "lambda_base_decay_ratio")
OWN_KEY = "blockdraft"  # blockdraft's own fields ride along under this key; other readers ignore it


@dataclass(frozen=True)
class Export:
    """What an export needs beyond the drafter: the verifier (target) directory a consumer opens
    offline, and the rows of its head for a draft vocabulary ([Vd, Ht], in draft-vocabulary order)."""

    verifier: str | None = None
    head_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class Format:
    name: str
    description: str
    matches: Callable[[dict], bool]
    read_config: Callable[[dict, int | None], DrafterConfig]
    write_config: Callable[[DrafterConfig, Export], dict]
    write_weights: Callable[[dict, DrafterConfig, Export], dict]


def qwen3_fields(cfg: DrafterConfig) -> dict:
    """The drafter layers as a transformers Qwen3Config dict. transformers keeps `sliding_window`
    only when `use_sliding_window` is true (dflash, speculators and vLLM load through it)."""
    d = {k: getattr(cfg, k) for k in QWEN3_FIELDS}
    d.update(model_type="qwen3", rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    if cfg.has_sliding:
        d["use_sliding_window"] = True
    return d


def layer_kwargs(q: dict) -> dict:
    """DrafterConfig keyword arguments from a Qwen3 field dict."""
    kw = {k: q[k] for k in QWEN3_FIELDS if k in q and k != "rope_theta"}
    rp = q.get("rope_parameters") or {}
    kw["rope_theta"] = float(rp.get("rope_theta", q.get("rope_theta", 10000.0)))
    if kw.get("layer_types") is None:
        kw.pop("layer_types", None)
    if kw.get("sliding_window") is None:
        kw.pop("sliding_window", None)
    return kw


def own_fields(cfg: DrafterConfig) -> dict:
    return {"format_version": FORMAT_VERSION, **{k: getattr(cfg, k) for k in OWN_FIELDS}}


def read_own(d: dict, defaults: dict) -> dict:
    """blockdraft's fields from `d[OWN_KEY]`, else the producer's `defaults`. Written by an older
    blockdraft (no `sliding_window_rule`): the anchor rule it trained with."""
    own = d.get(OWN_KEY)
    version = (own or {}).get("format_version", FORMAT_VERSION)
    if version > FORMAT_VERSION:
        raise ValueError(f"drafter format_version {version} is newer than this blockdraft ({FORMAT_VERSION}); "
                         "upgrade blockdraft")
    out = dict(defaults)
    if own is not None:
        out["sliding_window_rule"] = "anchor"
        out.update({k: v for k, v in own.items() if k in OWN_FIELDS})
    return out


# The newer drafter kinds (docs/consumers.md, config.KIND_FIELDS) as their consumers name them.
DSPARK_ARCHS = ("DSparkDraftModel", "Qwen3DSparkModel", "DSparkSpeculator")  # llama.cpp's DSparkModel
DFLASH2_ARCH = "DFlash2DraftModel"  # speculators, z-lab's dflash, vLLM and llama.cpp
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
LILICORR_ARCH = "LiLiCorrDraftModel"  # vLLM (registry.py: lilicorr.LiLiCorrForCausalLM)


def dspark_fields(cfg: DrafterConfig) -> dict:
    """DSpark's fields as speculators writes them (models/dspark/config.py) and llama.cpp's
    converter and vLLM read them: the vanilla (first-order) Markov head, a confidence head over
    [hidden; W1[prev]] (blockdraft has no other), and the DFlash convention (slot 0 predicts nothing)."""
    return {"markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": bool(cfg.confidence_head),
            "confidence_head_with_markov": cfg.markov_rank > 0, "sample_from_anchor": cfg.sample_from_anchor}


def read_dspark(d: dict, sample_default: bool, reader: str) -> dict:
    """DrafterConfig fields of a DSpark config `d`; `sample_default` is what `reader` takes a missing
    sample_from_anchor for. Refused: another Markov head, a confidence head without W1[prev], and a
    drafter whose slot 0 predicts."""
    head = d.get("markov_head_type", "vanilla")
    if head != "vanilla":
        raise ValueError(f"markov_head_type {head!r}: blockdraft's DSpark has only the vanilla (first-order) Markov "
                         "head, as llama.cpp's converter; retrain with markov_head_type vanilla")
    if d.get("enable_confidence_head", True) and not d.get("confidence_head_with_markov", True):
        raise ValueError("confidence_head_with_markov false: blockdraft's DSpark confidence head reads "
                         "[hidden; W1[previous token]], not the hidden state alone")
    check_sample_from_anchor(d, sample_default, reader)
    rank, conf = d.get("markov_rank"), d.get("enable_confidence_head")
    return {"kind": "dspark", "markov_rank": None if rank is None else int(rank),
            "confidence_head": None if conf is None else bool(conf), "sample_from_anchor": False}


def check_sample_from_anchor(d: dict, default: bool, reader: str) -> None:
    if d.get("sample_from_anchor", default):
        absent = "" if "sample_from_anchor" in d else f" (absent, and {reader} reads it as true)"
        raise ValueError(f"sample_from_anchor is true{absent}: slot 0 (the anchor) predicts too, a convention "
                         "blockdraft neither trains nor serves (slot k predicts the token at anchor + k); "
                         "retrain with sample_from_anchor false")


def lilicorr_fields(cfg: DrafterConfig) -> dict:
    """LiLiCorr's `dflash_config` fields as vLLM reads them (models/lilicorr.py LiLiCorr, LiLiCorrHead)."""
    return {"lilicorr_enabled": True, **{k: getattr(cfg, k) for k in LILICORR_FIELDS}}


def read_lilicorr(dc: dict) -> dict:
    """DrafterConfig fields of a LiLiCorr `dflash_config` (missing: the defaults); lilicorr_enabled false
    is refused as vLLM refuses it."""
    if not dc.get("lilicorr_enabled", True):
        raise ValueError("lilicorr_enabled is false: vLLM refuses such a LiLiCorr directory, and blockdraft has "
                         "no LiLiCorr drafter without its correlator")
    return {"kind": "lilicorr", **{k: dc[k] for k in LILICORR_FIELDS if dc.get(k) is not None}}


DOMINO_ARCH = "DominoDraftModel"  # SpecForge's and Model-Optimizer's export
DOMINO_FIELDS = ("emb_dim", "gru_hidden_dim", "pure_draft_prefix_len")


def domino_fields(cfg: DrafterConfig) -> dict:
    """Domino's fields inside `dflash_config`, as SpecForge's DominoDraftModel reads them; shift_label
    false is blockdraft's convention (slot k predicts the token at anchor + k), said out loud."""
    return {"projector_type": "domino", **{k: getattr(cfg, k) for k in DOMINO_FIELDS}, "shift_label": False}


def read_domino(dc: dict) -> dict:
    """DrafterConfig fields of a Domino `dflash_config` (missing widths: blockdraft's defaults). Refused:
    shift_label true (Model-Optimizer's training: position k predicts the token at anchor + k + 1)."""
    if dc.get("shift_label", False):
        raise ValueError("shift_label is true: each block position predicts the token after its own (Model-"
                         "Optimizer's Domino), a convention blockdraft neither trains nor serves (slot k predicts "
                         "the token at anchor + k); retrain with shift_label false")
    if dc.get("projector_type", "domino") != "domino":
        raise ValueError(f"projector_type {dc['projector_type']!r}: a Domino drafter has projector_type domino")
    return {"kind": "domino", **{k: int(dc[k]) for k in DOMINO_FIELDS if dc.get(k) is not None}}


def dflash2_fields(cfg: DrafterConfig) -> dict:
    return {k: getattr(cfg, k) for k in DFLASH2_FIELDS}


def read_dflash2(src: dict) -> dict:
    """DrafterConfig fields of DFlash2's convolution and selector fields in `src` (missing: the defaults)."""
    return {"kind": "dflash2", **{k: int(src[k]) for k in DFLASH2_FIELDS if src.get(k) is not None}}


def agree_kind(own: dict, kind: str, layout: str) -> dict:
    """`own` (read_own's fields) after checking that blockdraft's own key names the kind the file's
    `layout` fields say."""
    if own.get("kind", "dflash") != kind:
        raise ValueError(f"the config's {OWN_KEY} fields say kind {own.get('kind')!r} but its {layout} fields say "
                         f"{kind!r}; re-export the drafter")
    return own


def d2t_offsets(draft_vocab: torch.Tensor) -> torch.Tensor:
    """The engines' form of a draft vocabulary: target id = i + d2t[i]."""
    return (draft_vocab - torch.arange(draft_vocab.numel(), dtype=draft_vocab.dtype)).to(torch.long)


def draft_vocab_from(sd: dict, vocab_size: int) -> torch.Tensor | None:
    """Target ids of a draft vocabulary from native (`draft_vocab`) or engine (`d2t`) tensors."""
    if "draft_vocab" in sd:
        return sd["draft_vocab"].to(torch.long)
    if "d2t" in sd:
        d2t = sd["d2t"].to(torch.long)
        ids = torch.arange(d2t.numel()) + d2t
        if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError("d2t does not map the draft vocabulary onto distinct ids of the target vocabulary")
        return ids
    return None


def native_weights(sd: dict, cfg: DrafterConfig) -> dict:
    """Any format's tensors -> native ones: d2t becomes `draft_vocab`; t2d and the head rows an
    engine needs (the target's own, never trained) are dropped."""
    ids = draft_vocab_from_weights(sd, cfg)
    out = {k: v for k, v in sd.items() if k not in ("d2t", "t2d", "lm_head.weight", "draft_vocab")}
    return out if ids is None else {**out, "draft_vocab": ids}


def draft_vocab_from_weights(sd: dict, cfg: DrafterConfig) -> torch.Tensor | None:
    ids = draft_vocab_from(sd, cfg.vocab_size)
    if cfg.draft_vocab_size and ids is None:
        raise ValueError(f"the config names a {cfg.draft_vocab_size}-token draft vocabulary but the weights carry "
                         "neither draft_vocab nor d2t")
    if ids is not None and ids.numel() != cfg.draft_vocab_size:
        raise ValueError(f"the weights map {ids.numel()} draft tokens, the config says {cfg.draft_vocab_size}")
    return ids


def engine_head_weights(sd: dict, cfg: DrafterConfig, ex: Export, *, with_t2d: bool) -> dict:
    """Native tensors -> an engine's: d2t offsets (+ t2d [V] bool) and the head's draft rows as
    `lm_head.weight`, which vLLM and speculators load instead of the target's full head."""
    out = {k: v for k, v in sd.items() if k != "draft_vocab"}
    if not cfg.draft_vocab_size:
        return out
    ids = sd["draft_vocab"].to(torch.long)
    if bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError("the draft vocabulary must be sorted by id (t2d selects the head rows in id order)")
    if ex.head_rows is None or tuple(ex.head_rows.shape) != (ids.numel(), cfg.hidden_size):
        raise ValueError("exporting a draft vocabulary needs the target's head rows: pass --verifier DIR "
                         "(the target's local directory)")
    out["d2t"] = d2t_offsets(ids)
    out["lm_head.weight"] = ex.head_rows.to(sd["fc.weight"].dtype).contiguous()
    if with_t2d:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return out


def verifier_dir(path: str | None) -> str:
    if path is None:
        raise ValueError("the speculators format names its verifier (the target) by a path its readers open "
                         "offline: pass --verifier DIR")
    if not (Path(path) / "config.json").exists():
        raise ValueError(f"--verifier {path}: not a local model directory (it needs config.json)")
    return str(Path(path).resolve())
