"""DrafterConfig: the drafter's hyper-parameters and its side of the DFlash contract.

Every field that the contract (DESIGN.md section 1) depends on lives here and is written
into the checkpoint's config.json: the target layer ids (clause 1), the feature width
(clause 2), the block size and mask token (clause 4), and the sliding-window layout with
its in-block causal flag (clause 5). Bad values raise ValueError with what to change.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .releases import (LLAMACPP_RELEASE, MODELOPT_RELEASE, SGLANG_RELEASE, SPECFORGE_RELEASE, SPECULATORS_RELEASE,
                       VLLM_SERIES)

FULL = "full_attention"
SLIDING = "sliding_attention"
FORMAT_VERSION = 1
# Sliding-window rules (clause 5; docs/consumers.md has the engines' table). "query": the window
# counts from each query's own position, as z-lab's dflash and vLLM serve it; "anchor": every slot
# of a block sees the W positions before its anchor, as speculators trains (and blockdraft did
# before the rule became a field, so configs without the field read as "anchor").
WINDOW_QUERY = "query"
WINDOW_ANCHOR = "anchor"
WINDOW_RULES = (WINDOW_QUERY, WINDOW_ANCHOR)
DEFAULT_WINDOW_RULE = WINDOW_QUERY
# Drafter kinds (DESIGN.md section 1; docs/consumers.md): the DFlash backbone alone, plus DSpark's Markov
# and confidence heads, DFlash2's convolutions and candidate selector, LiLiCorr's candidate-lattice correlator,
# or Domino's GRU correction. Each kind's fields and their defaults (speculators' where it has the kind); a
# field of another kind must stay unset. The modules are in model/kinds/.
KINDS = ("dflash", "dspark", "dflash2", "lilicorr", "domino")
# kind fields that may be 0 (off, or "the drafter's width"), per kind
ZERO_OK = {"dspark": ("markov_rank",), "lilicorr": ("conv_kernel_size", "conv_group_size", "lilicorr_hidden_size"),
           "domino": ("pure_draft_prefix_len", "lambda_base_start", "lambda_base_decay_ratio")}
KIND_FIELDS = {
    "dflash": {},
    "dspark": {"markov_rank": 256, "confidence_head": True},
    "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
    # LiLiCorr (vLLM's dflash_config names): conv 0/0 = no convolution; hidden 0 = the drafter's
    "lilicorr": {"conv_kernel_size": 0, "conv_group_size": 0, "lilicorr_candidate_topk": 8, "lilicorr_hidden_size": 0,
                 "lilicorr_num_layers": 2, "lilicorr_num_heads": 4, "lilicorr_mlp_ratio": 2.0,
                 "lilicorr_factor_dim": 64, "lilicorr_vector_eps": 1e-6, "lilicorr_logit_scale": 10.0},
    # Domino: Model-Optimizer's recipe widths (speculative_decoding/domino.yaml; SpecForge has no default),
    # SpecForge's prefix (0 under shift_label false) and lambda schedule (lambda_base_start, _decay_ratio)
    "domino": {"emb_dim": 256, "gru_hidden_dim": 1024, "pure_draft_prefix_len": 0, "lambda_base_start": 1.0,
               "lambda_base_decay_ratio": 0.5},
}
# What a kind refuses, declared once and read before any work: a draft vocabulary (why; DrafterConfig.validate,
# so every command that builds, continues, loads or converts one, and train's --draft-vocab auto, which
# resolves to the full vocabulary for these kinds), and the export formats no reader has it in (`kind_refusal`).
FULL_VOCAB_ONLY = {
    "lilicorr": f"LiLiCorr's candidates come from the full vocabulary (vLLM {VLLM_SERIES} refuses a draft "
                "vocabulary for it)",
    "domino": "Domino's correction scores the full vocabulary (SpecForge's and Model-Optimizer's embed_proj has "
              "one row per target token, so the z-lab directory, train's own, has no place for a draft vocabulary)",
}
NO_FORMAT = {  # kind -> {format: which reader has no such drafter}
    "lilicorr": {"speculators": f"speculators {SPECULATORS_RELEASE} has no LiLiCorr",
                 "gguf": f"llama.cpp {LLAMACPP_RELEASE} has no LiLiCorr"},
    "domino": {"speculators": f"speculators {SPECULATORS_RELEASE} has no Domino drafter (its issue #773 is open)",
               "gguf": f"llama.cpp {LLAMACPP_RELEASE} has no Domino drafter (no GRU correction in its DFlash graph)"},
}
WRITE_INSTEAD = {  # kind -> where its files go instead
    "lilicorr": f"export it --to zlab, the directory vLLM {VLLM_SERIES} serves it from (its V2 GPU runner)",
    "domino": f"export it --to zlab, the DominoDraftModel layout SpecForge {SPECFORGE_RELEASE} and Model-Optimizer "
              f"{MODELOPT_RELEASE} read (no serving engine blockdraft has read runs Domino: not vLLM {VLLM_SERIES}, "
              f"SGLang {SGLANG_RELEASE} or llama.cpp)",
}


def kind_refusal(kind: str, fmt: str) -> str | None:
    """Why a drafter of `kind` has no files in format `fmt` and where they go instead, or None."""
    why = NO_FORMAT.get(kind, {}).get(fmt)
    return f"{why}: a {kind} drafter has no {fmt} layout; {WRITE_INSTEAD[kind]}" if why else None


def full_vocab_refusal(kind: str, draft_vocab_size: int | None) -> str | None:
    """Why `kind` cannot have a draft vocabulary of `draft_vocab_size` tokens, or None."""
    if not draft_vocab_size or kind not in FULL_VOCAB_ONLY:
        return None
    return (f"{FULL_VOCAB_ONLY[kind]}; this {kind} drafter would draft from {draft_vocab_size} tokens: train it with "
            "--draft-vocab full (or the default, auto), or --init-drafter from a full-vocabulary drafter")


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """Clause 1: `num_features` ids spread uniformly over the target's decoder layers.

    Id L means the output of decoder layer L (0-based). The ids are
    `round(1 + i * (n - 4) / (F - 1))`; a single feature takes the middle layer `n // 2`.
    A 36-layer target gives [1, 9, 17, 25, 33].
    """
    n, f = int(num_target_layers), int(num_features)
    if f < 1:
        raise ValueError(f"num_features must be >= 1, got {f}")
    if n < 2:
        raise ValueError(f"the target needs at least 2 decoder layers, got {n}")
    if f == 1:
        return [n // 2]
    # Python's round() is banker's rounding; the contract means round-half-up.
    ids = [int((1 + i * (n - 4) / (f - 1)) + 0.5) for i in range(f)]
    if len(set(ids)) != f or max(ids) > n - 2 or min(ids) < 0:
        raise ValueError(
            f"cannot spread {f} distinct feature layers over a {n}-layer target; "
            f"use fewer features (--num-features) or pass explicit layer ids"
        )
    return ids


def validate_layer_ids(layer_ids: list[int], num_target_layers: int) -> list[int]:
    """Ids must be distinct ints in [0, n-2].

    The last layer (n-1) is refused: its output is what the target's final norm and head
    turn into the labels (clause 3), and serving engines capture a layer's *input*, so
    they cannot hand the drafter the output of the last layer.
    """
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError("target_layer_ids is empty; give at least one target layer id")
    if len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids has duplicates: {ids}")
    bad = [i for i in ids if not 0 <= i <= num_target_layers - 2]
    if bad:
        raise ValueError(
            f"target layer ids {bad} are out of range for a {num_target_layers}-layer target: "
            f"ids name decoder-layer outputs (0-based) and must lie in [0, {num_target_layers - 2}]"
        )
    return ids


@dataclass
class DrafterConfig:
    """Hyper-parameters of a DFlash drafter (Qwen3-style layers) bound to one target."""

    # --- binding to the target ---
    target_hidden_size: int
    target_num_layers: int
    target_layer_ids: list[int]
    vocab_size: int
    mask_token_id: int
    # --- drafter layers (Qwen3 fields) ---
    hidden_size: int
    num_hidden_layers: int = 1
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    intermediate_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # Clause 5: whether sliding-window layers are causal inside the block (as `blockdraft train` makes them).
    sliding_causal_in_block: bool = True
    # Clause 5: how a sliding window is counted (WINDOW_RULES above).
    sliding_window_rule: str = DEFAULT_WINDOW_RULE
    # --- block diffusion ---
    block_size: int = 16
    # Draft vocabulary: the drafter scores only these many rows of the target head (the most
    # frequent tokens of the training data; ids in the checkpoint's `draft_vocab` tensor).
    # None = the full vocabulary. The verifier always uses the full head, so output is unchanged.
    draft_vocab_size: int | None = None
    # --- the drafter kind (KINDS) and its own fields (KIND_FIELDS; unset = the kind's default) ---
    kind: str = "dflash"
    markov_rank: int | None = None  # DSpark: rank of the Markov bias W2 W1[previous token]
    confidence_head: bool | None = None  # DSpark: a per-slot acceptance predictor over [hidden; W1[prev]]
    conv_kernel_size: int | None = None  # DFlash2: taps of the in-block causal convolutions
    conv_group_size: int | None = None  # DFlash2: channels sharing one dynamic tap coefficient
    selector_rank: int | None = None  # DFlash2: rank of the candidate selector's bilinear edge scores
    selector_top_k: int | None = None  # DFlash2: candidates per slot the selector chooses among
    lilicorr_candidate_topk: int | None = None  # LiLiCorr: candidates per slot (a power of two <= 16)
    lilicorr_hidden_size: int | None = None  # LiLiCorr: the correlator's width (0: the drafter's)
    lilicorr_num_layers: int | None = None  # LiLiCorr: lattice transformer layers
    lilicorr_num_heads: int | None = None  # LiLiCorr: their attention heads
    lilicorr_mlp_ratio: float | None = None  # LiLiCorr: their MLP width / the correlator's width
    lilicorr_factor_dim: int | None = None  # LiLiCorr: width of the outgoing / incoming unit vectors
    lilicorr_vector_eps: float | None = None  # LiLiCorr: the unit vectors' normalisation floor
    lilicorr_logit_scale: float | None = None  # LiLiCorr: scores = scale * cosine
    emb_dim: int | None = None  # Domino: width of the correction MLP (embed_proj)
    gru_hidden_dim: int | None = None  # Domino: width of the GRU state over the block's tokens
    pure_draft_prefix_len: int | None = None  # Domino: slots 1..this keep the head's logits alone
    lambda_base_start: float | None = None  # Domino: the base loss's first weight (falls linearly to 0)
    lambda_base_decay_ratio: float | None = None  # Domino: share of the run over which it falls
    # Whether slot 0 (the anchor) predicts too (DSpark's reference default); blockdraft trains every
    # kind with the DFlash convention, slot k predicting the token at anchor + k, and writes it out.
    sample_from_anchor: bool = False
    # --- provenance ---
    target_name: str | None = None
    tokenizer_hash: str | None = None
    # The fastest generate/bench settings measured for this drafter ({"draft_threshold", "lookup"}): what
    # `blockdraft generate` and `bench` use when no flag says otherwise.
    generate_defaults: dict | None = None

    def __post_init__(self) -> None:
        from .options import check_fields

        check_fields(self, where="drafter config: ")  # types (a JSON config may hold anything) and finite numbers
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 3 * self.hidden_size
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        self.target_layer_ids = list(self.target_layer_ids)
        for name, default in KIND_FIELDS.get(self.kind, {}).items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(self.block_size >= 2, f"block_size must be >= 2 (one anchor + at least one draft slot), got {self.block_size}")
        sizes = ("target_hidden_size", "target_num_layers", "vocab_size", "hidden_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")
        small = [f"{k} {getattr(self, k)}" for k in sizes if getattr(self, k) < 1]
        need(not small, f"drafter config: sizes must be >= 1, got {', '.join(small)}")
        need(self.rms_norm_eps > 0 and self.rope_theta > 0,
             f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps} and {self.rope_theta}")
        need(self.hidden_act in _activations(), f"unknown hidden_act {self.hidden_act!r}; use one of transformers' "
             f"activations ({', '.join(sorted(a for a in _activations() if a in ('silu', 'gelu', 'relu')))}, ...)")
        need(self.num_hidden_layers >= 1, f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        need(self.hidden_size == self.target_hidden_size,
             f"drafter hidden_size ({self.hidden_size}) must equal the target's ({self.target_hidden_size}): "
             "the drafter uses the target's embedding and lm_head")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
             f"num_key_value_heads ({self.num_key_value_heads})")
        validate_layer_ids(self.target_layer_ids, self.target_num_layers)
        need(0 <= self.mask_token_id < self.vocab_size,
             f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        need(self.draft_vocab_size is None or 1 <= self.draft_vocab_size <= self.vocab_size,
             f"draft_vocab_size must be in [1, {self.vocab_size}] or None, got {self.draft_vocab_size}")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in (FULL, SLIDING)})
        need(not bad, f"unknown layer_types {bad}; use '{FULL}' or '{SLIDING}'")
        need(self.sliding_window_rule in WINDOW_RULES,
             f"unknown sliding_window_rule {self.sliding_window_rule!r}; use one of {WINDOW_RULES}")
        if SLIDING in self.layer_types:
            need(self.sliding_window is not None and self.sliding_window >= 1,
                 "sliding_attention layers need sliding_window >= 1")
        self._validate_kind(need)

    def _validate_kind(self, need) -> None:
        need(self.kind in KINDS, f"unknown drafter kind {self.kind!r}; use one of {', '.join(KINDS)}")
        mine = KIND_FIELDS[self.kind]
        foreign = sorted(n for k in KINDS for n in KIND_FIELDS[k] if n not in mine and getattr(self, n) is not None)
        need(not foreign, f"{', '.join(foreign)} belong to another drafter kind than {self.kind!r}")
        vocab = full_vocab_refusal(self.kind, self.draft_vocab_size)
        need(vocab is None, vocab or "")
        need(not self.sample_from_anchor, "sample_from_anchor: blockdraft trains and serves the DFlash convention "
             "(slot 0 is the anchor and predicts nothing); a drafter trained with slot 0 predicting is not supported")
        small = [f"{n} {getattr(self, n)}" for n in mine if not isinstance(getattr(self, n), bool)
                 and getattr(self, n) < (0 if n in ZERO_OK.get(self.kind, ()) else 1e-30 if isinstance(getattr(self, n), float) else 1)]
        need(not small, f"{self.kind} fields out of range: {', '.join(small)}")
        if self.kind == "dspark":
            need(self.markov_rank > 0 or not self.confidence_head,
                 "a DSpark confidence head reads W1[previous token]: it needs markov_rank > 0")
        if self.kind == "domino":
            need(self.pure_draft_prefix_len < self.block_size - 1, f"pure_draft_prefix_len "
                 f"{self.pure_draft_prefix_len} leaves no slot of a {self.block_size} block corrected")
            need(self.lambda_base_start <= 1, f"lambda_base_start {self.lambda_base_start} exceeds 1")
        if self.kind == "dflash2":
            need(self.hidden_size % self.conv_group_size == 0,
                 f"hidden_size {self.hidden_size} must be a multiple of conv_group_size {self.conv_group_size}")
            need(self.conv_kernel_size <= self.block_size,
                 f"conv_kernel_size {self.conv_kernel_size} cannot exceed block_size {self.block_size}")
            need(self.selector_top_k <= (self.draft_vocab_size or self.vocab_size),
                 f"selector_top_k {self.selector_top_k} exceeds the draft vocabulary")
        if self.kind == "lilicorr":
            self._validate_lilicorr(need)

    def _validate_lilicorr(self, need) -> None:
        """vLLM's own checks (models/lilicorr.py), said before a run rather than at serving."""
        k, h = self.lilicorr_candidate_topk, self.lilicorr_hidden_size or self.hidden_size
        need(k <= 16 and k & (k - 1) == 0, f"lilicorr_candidate_topk must be a power of two <= 16, got {k}")
        need(bool(self.conv_kernel_size) == bool(self.conv_group_size),
             "LiLiCorr + conv needs both conv_kernel_size and conv_group_size (0 and 0: no convolution)")
        if self.conv_kernel_size:
            need(self.hidden_size % self.conv_group_size == 0 and self.conv_kernel_size <= self.block_size,
                 f"conv_group_size must divide hidden_size and conv_kernel_size be <= block_size")
        need(h % self.lilicorr_num_heads == 0, f"lilicorr width {h} must be a multiple of lilicorr_num_heads")
        need(h >= k, f"lilicorr width {h} must be >= lilicorr_candidate_topk {k} (its start gives each rank a channel)")

    # ------------------------------------------------------------- properties
    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def feature_size(self) -> int:
        """Clause 2: width of the concatenated context features, F * Ht."""
        return self.num_features * self.target_hidden_size

    def layer_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING else None

    def layer_causal_in_block(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == SLIDING and self.sliding_causal_in_block

    @property
    def has_sliding(self) -> bool:
        return SLIDING in self.layer_types

    # -------------------------------------------------------------- builders
    @classmethod
    def for_target(
        cls,
        target: Any,
        *,
        num_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int | None = None,
        **overrides: Any,
    ) -> "DrafterConfig":
        """A drafter whose layers copy the target's attention geometry (Qwen3 layers)."""
        tc = target.model.config
        tc = getattr(tc, "text_config", None) or tc
        heads = tc.num_attention_heads
        kw: dict[str, Any] = dict(
            target_hidden_size=tc.hidden_size,
            target_num_layers=tc.num_hidden_layers,
            target_layer_ids=list(target.layer_ids),
            vocab_size=target.vocab_size,
            mask_token_id=target.mask_token_id if mask_token_id is None else int(mask_token_id),
            hidden_size=tc.hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            intermediate_size=tc.intermediate_size,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(tc),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
            block_size=block_size,
            target_name=target.name,
            tokenizer_hash=target.tokenizer_hash,
        )
        kw.update(overrides)
        cfg = cls(**kw)
        if mask_token_id is not None:
            target.check_mask_token(cfg.mask_token_id)
        return cfg

    # ------------------------------------------------------------------- json
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["format_version"] = FORMAT_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        d = dict(d)
        version = d.pop("format_version", FORMAT_VERSION)
        if version > FORMAT_VERSION:
            raise ValueError(f"config format_version {version} is newer than this blockdraft ({FORMAT_VERSION}); upgrade blockdraft")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown DrafterConfig fields {unknown}")
        return cls(**d)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "DrafterConfig":
        p = Path(text_or_path) if not str(text_or_path).lstrip().startswith("{") else None
        text = p.read_text() if p is not None else str(text_or_path)
        return cls.from_dict(json.loads(text))

    def qwen3_config(self):
        """A transformers Qwen3Config for the building blocks (MLP, RMSNorm, rotary)."""
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            attention_bias=self.attention_bias,
            layer_types=self.layer_types,
            sliding_window=self.sliding_window,
        )


def _activations() -> set:
    """The activation names transformers' MLP builds (what `hidden_act` may name)."""
    from transformers.activations import ACT2FN

    return set(ACT2FN)


def _rope_theta(tc: Any) -> float:
    rp = getattr(tc, "rope_parameters", None) or {}
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    if isinstance(rp, dict) and rp and isinstance(next(iter(rp.values())), dict):
        # per-layer-type parameters (Gemma3): take the full-attention ones
        inner = rp.get(FULL) or next(iter(rp.values()))
        if "rope_theta" in inner:
            return float(inner["rope_theta"])
    return float(getattr(tc, "rope_theta", 10000.0))
