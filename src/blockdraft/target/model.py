"""TargetModel: the verifier LLM, its feature layers (clause 1) and its labels (clause 3).

Legend: Bz batch rows, T tokens, F feature layers, Ht target hidden size, V vocabulary.

Clause 1 owner (with layers.py, where `hidden_states_index` holds the one "+1" between a layer id
and the transformers `output_hidden_states` tuple, and `layer_state` what a layer's output is taken as):
features are captured by forward hooks on the chosen decoder layers only, so the other n - F hidden states
are never kept.

Clause 3 owner: `TargetModel.__call__` returns the logits of the model's own forward
(`model(input_ids).logits`, its own final norm, head and soft-capping), optionally only
at chosen positions, so labels can never come from a feature layer or a re-implemented norm.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import nn

from ..config import default_target_layer_ids, validate_layer_ids
from ..model.linear import few_rows_linear, use_few_rows_linears
from .family import document_starts, isolates_packed_documents, logit_transform, output_logits
from .files import default_dtype, pick_mask_token, special_ids, tokenizer_hash
from .files import head_rows as stored_head_rows
from .layers import find_decoder_layers, layer_state, residual_streams, stream_refusal, text_config
from .load import TargetSource, load_head_only, load_model, random_source, resolve_source, spreads


@functools.cache
def mask_keep_supported() -> bool:
    """Whether this transformers takes a boolean [Bz, T] `logits_to_keep` (newer releases; older ones
    take a 1-D column index, and the rows are picked after the head)."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class TargetOutput:
    features: torch.Tensor  # [Bz, T, F*Ht] outputs of the chosen layers, concatenated in config order
    logits: torch.Tensor | None  # [Bz, T, V], or [P, V] at the positions of a boolean logits mask
    final_hidden: torch.Tensor | None = None  # [Bz, T, Ht] after the final norm (head(final_hidden) == logits)


class CropRefused(ValueError):
    """The target's cache cannot take back tokens, so blockdraft's speculative decoding (which crops the
    rejected drafts after each verification) cannot run it exactly; training does not use a cache."""


# what a cache layer that transformers marks not croppable keeps that a crop would not take back, by class
UNCROPPABLE = {"DeepseekV4HCACache": "its compressor's buffered window, compressed entries and their count",
               "DeepseekV4CSACache": "its compressor's and indexer's buffered windows, compressed entries and "
                                     "overlap state"}


def crop_refusal(name: str, cache) -> CropRefused | None:
    """The one-line refusal of a cache (made with past recording) that holds a layer transformers marks not
    croppable, naming it and what it keeps; None where every layer can take tokens back."""
    for i, layer in enumerate(getattr(cache, "layers", ())):
        if getattr(layer, "is_croppable", True) is False:
            cls = type(layer).__name__
            keeps = UNCROPPABLE.get(cls, "state")
            return CropRefused(f"{name}: transformers' cache for its layer {i} ({cls}) cannot be cropped ({keeps} "
                               "would keep rejected draft tokens), so blockdraft cannot verify drafts exactly; "
                               "it trains for this target, and a serving engine runs its speculative decoding")
    return None


def is_recording(cache) -> bool:
    """Whether a transformers cache keeps its past for a later crop (activate_past_recording)."""
    return any(getattr(layer, "record_past", False) for layer in getattr(cache, "layers", ()))


def _takes_kwargs(fn) -> bool:
    import inspect

    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


class TargetModel(nn.Module):
    """A frozen transformers causal LM plus the feature hooks of clause 1."""

    def __init__(self, model: nn.Module, tokenizer, layer_ids: list[int] | None = None, *,
                 num_features: int = 5, name: str | None = None, mask_token_id: int | None = None,
                 output_device: str | torch.device | None = None):
        """`output_device`: where features, logits and head outputs are returned, for a model spread
        over several devices (`device_map`); default: the device of the model's head."""
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.output_device = None if output_device is None else torch.device(output_device)
        self.tokenizer = tokenizer
        tc = text_config(model)
        self.num_layers = int(tc.num_hidden_layers)
        self.hidden_size = int(tc.hidden_size)
        if (why := stream_refusal(model.config)) is not None:
            n = residual_streams(model.config)
            raise ValueError(f"{name or type(model).__name__}: its decoder layers output {n} residual streams per "
                             f"token (hyper-connections), and {why}")
        self.streams = residual_streams(model.config)  # hc_mult: a layer's state is its streams' mean (layer_state)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        if layer_ids is None:
            layer_ids = default_target_layer_ids(self.num_layers, num_features)
        self.layer_ids = validate_layer_ids(layer_ids, self.num_layers)
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        self.tokenizer_hash = tokenizer_hash(tokenizer) if tokenizer is not None else None
        self._layers = find_decoder_layers(model, self.num_layers)
        use_few_rows_linears(model)
        if mask_token_id is None:
            mask_token_id = pick_mask_token(tokenizer, self.vocab_size) if tokenizer is not None else self.vocab_size - 1
        self.mask_token_id = self.check_mask_token(mask_token_id)
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False
        self._cache_name: str | None = None
        for lid in self.layer_ids:
            self._layers[lid].register_forward_hook(self._make_hook(lid))

    # -------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike = "smollm2", *, layer_ids: list[int] | None = None,
                        num_features: int = 5, dtype: torch.dtype | None = None, device: str | None = None,
                        mask_token_id: int | None = None, shard: bool = False, **model_kwargs) -> "TargetModel":
        """The target `path` names: the embedded name, a local transformers directory, a .gguf file or
        `random:NAME` (load.resolve_source), then loaded as `from_source` says. `shard`: the decoder
        layers sharded over this process group (shard.py, --target-fsdp); `model_kwargs`: transformers'
        from_pretrained keywords (a `device_map` spreads the model: --target-device-map)."""
        return cls.from_source(resolve_source(path), layer_ids=layer_ids, num_features=num_features, dtype=dtype,
                               device=device, mask_token_id=mask_token_id, shard=shard, **model_kwargs)

    @classmethod
    def random(cls, spec: str, *, layer_ids: list[int] | None = None, num_features: int = 5,
               dtype: torch.dtype | None = None, device: str | None = None,
               mask_token_id: int | None = None, shard: bool = False) -> "TargetModel":
        """`random:NAME` (tiny.RANDOM_PRESETS): a random target of a real shape built on `device`, with
        SmolLM2's tokenizer; no files, no download. `shard`: built by rank 0 and sharded over the
        process group (shard.py)."""
        return cls.from_source(random_source(spec), layer_ids=layer_ids, num_features=num_features, dtype=dtype,
                               device=device, mask_token_id=mask_token_id, shard=shard)

    @classmethod
    def from_source(cls, source: TargetSource, *, layer_ids: list[int] | None = None, num_features: int = 5,
                    dtype: torch.dtype | None = None, device: str | None = None, mask_token_id: int | None = None,
                    shard: bool = False, **model_kwargs) -> "TargetModel":
        """The target of a resolved source (load.py), top to bottom: its model built or loaded on
        `device` in `dtype` (default: default_dtype) and, with `shard`, sharded by decoder layer over
        this process group (load.load_model); then its feature layers hooked (__init__)."""
        dtype = default_dtype(device) if dtype is None else dtype
        model = load_model(source, dtype=dtype, device=device, shard=shard, **model_kwargs)
        # a spread model (device_map) hands its outputs to the drafter's device
        output_device = (device or "cpu") if spreads(source, model_kwargs) else None
        target = cls(model, source.tokenizer, layer_ids, num_features=num_features, name=source.name,
                     mask_token_id=mask_token_id, output_device=output_device)
        target.local_dir = source.local_dir
        target.sharded = shard  # its forward is then a collective: every rank runs the same ones
        return target

    @classmethod
    def head_only(cls, path: str | os.PathLike = "smollm2", *, layer_ids: list[int] | None = None,
                  num_features: int = 5, dtype: torch.dtype | None = None, device: str | None = None,
                  mask_token_id: int | None = None, final_norm: bool = False) -> "TargetModel":
        """The target's config, tokenizer, embedding and head only (decoder layers stay on the meta
        device): enough to train from a feature cache, which never runs the target. Loaded in the
        training precision (default: bf16 on CUDA), so no loss chunk recasts a 150k-row head.
        `final_norm`: its final norm too (what turns an engine's last-layer output into the final
        state the head reads: `extract --engine vllm`). A `random:` target is built whole (the same
        weights as the run that extracted), then its layers dropped (load.load_head_only)."""
        dtype = dtype or default_dtype(device)
        source = resolve_source(path)
        model = load_head_only(source, dtype=dtype, device=device, final_norm=final_norm)
        target = cls(model, source.tokenizer, layer_ids, num_features=num_features, name=source.name,
                     mask_token_id=mask_token_id)
        target.head_only_loaded = True
        target.local_dir = source.local_dir
        target.sharded = False
        return target

    # -------------------------------------------------------------- checks
    def check_mask_token(self, mask_token_id: int) -> int:
        m = int(mask_token_id)
        if not 0 <= m < self.vocab_size:
            raise ValueError(f"mask_token_id {m} is outside the target vocabulary [0, {self.vocab_size})")
        if self.tokenizer is not None and m in special_ids(self.tokenizer):
            raise ValueError(
                f"mask_token_id {m} is the tokenizer's pad/eos/bos/unk token; MASK must be a dedicated "
                "token (a reserved/unused id): omit mask_token_id to pick one"
            )
        return m

    # ------------------------------------------------------------ forward
    @property
    def device(self) -> torch.device:
        """Where this target takes inputs and returns outputs."""
        if self.output_device is not None:
            return self.output_device
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    def _make_hook(self, lid: int):
        def hook(_module, _inputs, output):
            if self._capturing:
                self._captured[lid] = layer_state(output, self.streams)
        return hook

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, logits_mask: torch.Tensor | None = None,
                return_logits: bool = True, cache=None, return_final_hidden: bool = False,
                **kwargs) -> TargetOutput:
        """Features of the chosen layers [Bz, T, F*Ht] and the model's own logits.

        `logits_mask` (bool [Bz, T]) keeps only the logits at its True positions, flattened
        to [P, V] in row-major order: a 150k vocabulary at 8k tokens does not fit otherwise.
        Packed rows pass `position_ids` restarting at 0 per document; transformers then keeps
        attention inside each document, and where the family's forward does not keep them apart
        (measured once: family.isolates_packed_documents; recurrent hybrids, gpt-oss) each document
        runs alone. `cache` (from `new_cache`) is extended in place.
        `return_final_hidden` returns the final normed state instead of logits (what an offline
        cache stores; `head` turns it into exactly these logits).
        """
        if getattr(self, "head_only_loaded", False):
            raise ValueError("this target was loaded head-only (for a feature cache) and cannot run forward")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        keep: int | torch.Tensor = 0
        if logits_mask is not None:
            if logits_mask.shape != input_ids.shape or logits_mask.dtype != torch.bool:
                raise ValueError("logits_mask must be a bool tensor with the shape of input_ids")
            keep = logits_mask if mask_keep_supported() else logits_mask.any(0).nonzero()[:, 0]  # [T'] columns, older transformers
        # the model's own measurement (once, cached) first: a family that keeps documents apart
        # reads nothing from the device here, per step
        if position_ids is not None and cache is None and attention_mask is None and not kwargs \
                and not self.isolates_packed_documents() and bool(document_starts(position_ids)[:, 1:].any()):
            return self._forward_by_document(input_ids, position_ids, logits_mask, return_logits, return_final_hidden)
        if cache is not None:
            kwargs[self._cache_kwarg()] = cache
        self._captured.clear()
        self._capturing = True
        try:
            final = None
            if return_final_hidden:
                final = self._base()(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                     use_cache=False, **kwargs).last_hidden_state
                logits = None
            elif return_logits:
                out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                 logits_to_keep=keep, use_cache=cache is not None, **kwargs)
                logits = out.logits
                if logits_mask is not None and not mask_keep_supported():  # [Bz, T', V] -> the mask's [P, V]
                    logits = logits[logits_mask[:, keep]]
            else:
                self._base()(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             use_cache=False, **kwargs)
                logits = None
        finally:
            self._capturing = False
        dev = self.device  # layers of a spread model sit on several devices
        feats = torch.cat([self._captured[lid].to(dev) for lid in self.layer_ids], dim=-1)  # [Bz, T, F*Ht]
        self._captured.clear()
        return TargetOutput(features=feats, logits=None if logits is None else logits.to(dev),
                            final_hidden=None if final is None else final.to(dev))

    def isolates_packed_documents(self) -> bool:
        """Whether this model keeps packed documents apart by their position ids (measured once)."""
        if getattr(self, "_isolates_packed", None) is None:
            self._isolates_packed = isolates_packed_documents(self.model)
        return self._isolates_packed

    def _forward_by_document(self, input_ids, position_ids, logits_mask, return_logits, return_final_hidden):
        """`forward` of packed rows one document at a time, stitched back: features and final states
        [Bz, T, ...], logits [Bz, T, V] or, with a mask, [P, V] in row-major order."""
        if getattr(self, "sharded", False):  # ranks hold different documents: their forwards would not pair up
            raise ValueError(f"{self.name} lets packed documents see each other, so blockdraft runs them one at a "
                             "time, which a target sharded over ranks (--target-fsdp) cannot: drop --target-fsdp")
        starts = document_starts(position_ids)
        feats, finals, logits = [], [], []
        for r in range(input_ids.shape[0]):
            cuts = starts[r].nonzero()[:, 0].tolist() + [input_ids.shape[1]]
            row_f, row_h, row_l = [], [], []
            for a, b in zip(cuts[:-1], cuts[1:]):
                m = None if logits_mask is None else logits_mask[r:r + 1, a:b]
                out = self.forward(input_ids[r:r + 1, a:b], position_ids=position_ids[r:r + 1, a:b], logits_mask=m,
                                   return_logits=return_logits, return_final_hidden=return_final_hidden)
                row_f.append(out.features)
                row_h.append(out.final_hidden)
                row_l.append(out.logits)
            feats.append(torch.cat(row_f, 1))
            if row_h[0] is not None:
                finals.append(torch.cat(row_h, 1))
            if row_l[0] is not None:
                logits.append(torch.cat(row_l, 0 if logits_mask is not None else 1))
        return TargetOutput(features=torch.cat(feats), logits=torch.cat(logits) if logits else None,
                            final_hidden=torch.cat(finals) if finals else None)

    def _cache_kwarg(self) -> str:
        """`cache` in recent transformers, `past_key_values` before; looked up once (verify is a hot path)."""
        if self._cache_name is None:
            import inspect

            params = inspect.signature(self.model.forward).parameters
            self._cache_name = "cache" if "cache" in params else "past_key_values"
        return self._cache_name

    def new_cache(self, rollback: int = 0):
        """An empty KV cache. With `rollback` > 0 it records its past so that `crop_cache` can take back
        up to `rollback` tokens of the last forward (rejected drafts): sliding-window layers keep their
        keys until the crop, and on transformers >= 5.25 recurrent layers keep their state after each
        of the last `rollback` tokens, which the crop restores (generate/recurrent.py). 0: a cache that
        only grows, for plain decoding (recording there would keep a state copy per token). A cache with a
        layer transformers cannot crop (DeepSeek-V4's compressed attention) is refused for `rollback`:
        CropRefused, one line."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if rollback > 0 and (refused := crop_refusal(self.name, cache)) is not None:
            raise refused
        if rollback > 0 and hasattr(cache, "activate_past_recording"):
            if _takes_kwargs(cache.activate_past_recording):
                # 5.25 added the count, defaulting to None, which its recurrent forwards cannot compare
                cache.activate_past_recording(recurrent_states_to_keep=int(rollback))
            else:
                cache.activate_past_recording()
        return cache

    @staticmethod
    def crop_cache(cache, length: int) -> None:
        """Keep the first `length` positions of the cache. A cache that records its past is cropped after
        every forward, by nothing if need be, so that it drops what it recorded."""
        extra = int(cache.get_seq_length()) - length
        if extra > 0 or (extra == 0 and is_recording(cache)):
            cache.crop(-extra)

    def _base(self) -> nn.Module:
        base = getattr(self.model, "model", None)
        if base is None:
            raise ValueError(f"{type(self.model).__name__} has no base `.model`; use return_logits=True")
        return base

    # ------------------------------------------------- frozen pieces the drafter uses
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw rows of the target's input embedding (no model-specific scaling), as z-lab does."""
        w = self.model.get_input_embeddings().weight
        return nn.functional.embedding(ids.to(w.device), w).to(ids.device)

    def _head_rows(self, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """weight[rows], kept between calls (drafting asks for the same draft vocabulary every
        step; gathering 8k x 576 rows each time was a quarter of a drafting step). Keyed by the
        tensors and their version counters, so an in-place change of either is seen."""
        key = (rows.data_ptr(), rows._version, rows.numel(), weight.data_ptr(), weight._version)
        cached = getattr(self, "_rows_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, weight[rows])
            self._rows_cache = cached
        return cached[1]

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the head's weight, [len(ids), H] fp32 on the CPU: what an engine loads as a
        draft vocabulary's `lm_head.weight`. Read from the target's safetensors where it has files
        (exactly what `convert` copies, in the files' precision), else from the loaded head. Raw
        rows, as every export writes them: a logit scale or soft-cap (`head`) is not in them."""
        local = getattr(self, "local_dir", None)
        if local is not None:
            return stored_head_rows(str(local), ids)
        w = self.model.get_output_embeddings().weight
        return w.detach()[ids.to(w.device)].float().cpu()

    def head(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The target's lm_head and what its forward does to the head's output (soft-capping,
        Granite's logits_scaling, Cohere's logit_scale: family.output_logits), so that
        head(final_hidden) == logits; with `rows`, only those vocabulary rows ([..., len(rows)]
        logits: a draft vocabulary)."""
        out = self.model.get_output_embeddings()
        home, hidden = hidden.device, hidden.to(out.weight.device)  # differ for a spread model
        if rows is None:
            logits = out(hidden)
        else:
            rows = rows.to(out.weight.device)
            bias = None if getattr(out, "bias", None) is None else out.bias[rows]
            logits = few_rows_linear(hidden, self._head_rows(out.weight, rows), bias)
        return output_logits(logits, logit_transform(self.model.config)).to(home)
