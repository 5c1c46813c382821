"""DFlashDrafter: fc + hidden_norm over the target features, Qwen3 layers, final norm (clause 2).

Legend: T context rows (flat packed sequence), N blocks, B block size, F feature layers,
Ht target hidden, Hd drafter hidden (== Ht: the target's embedding and head are reused).

The target's embedding and lm_head are not parameters of this module (clause 4): the
caller embeds the block tokens with the target and applies the target's head.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from ..config import DrafterConfig
from . import kinds
from .attention import BlockLayout
from .masks import cached_block_mask
from .linear import use_few_rows_linears


@contextlib.contextmanager
def _no_random_init():
    """nn.init's fills as no-ops while modules are built whose every weight is loaded next: a
    1B-parameter drafter's two random fills cost ~20 s of host time (and a GPU's nothing)."""
    names = ("kaiming_uniform_", "uniform_", "normal_", "zeros_", "ones_", "constant_", "trunc_normal_")
    kept = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda t, *args, **kwargs: t)
    try:
        yield
    finally:
        for n, fn in kept.items():
            setattr(nn.init, n, fn)


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig, initialize: bool = True):
        """`initialize=False`: leave the weights unset (memory as allocated), for a caller that loads
        every one of them next; buffers (rotary tables, draft vocabulary, feature scale) are set."""
        super().__init__()
        self.config = config
        q3 = config.qwen3_config()
        self.kind = kinds.get(config.kind)  # what this kind adds to the backbone (model/kinds/)
        with contextlib.nullcontext() if initialize else _no_random_init():
            self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
            self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.layers = nn.ModuleList(self.kind.layer(config, i, q3) for i in range(config.num_hidden_layers))
            self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.kind.build(self)
        self.rotary_emb = Qwen3RotaryEmbedding(q3)
        # Per-dimension input scale for the optimiser's sake (the target's features have a few huge
        # outlier dimensions). Not a weight of the published architecture: `folded_state_dict` folds
        # it into fc, which has no bias, so checkpoints keep the reference layout.
        self.feature_scale = nn.Buffer(torch.ones(config.feature_size), persistent=False)
        # Target-vocabulary ids of the draft vocabulary (saved with the weights); empty = full vocabulary.
        n_draft = config.draft_vocab_size or 0
        self.draft_vocab = nn.Buffer(torch.arange(n_draft, dtype=torch.long), persistent=n_draft > 0)
        self.gradient_checkpointing = False
        if initialize:
            self.reset_parameters()
        use_few_rows_linears(self)  # drafting projects 1-3 new context rows per step

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, Qwen3RMSNorm):
                nn.init.ones_(m.weight)
        # A unit-RMS output through the target head gives logits far sharper than the target's
        # (KL ~100 nats on SmolLM2); a small final-norm scale starts near uniform (KL ~14).
        nn.init.constant_(self.norm.weight, 0.1)
        self.kind.reset_parameters(self)

    @property
    def vocab_rows(self) -> torch.Tensor | None:
        """Rows of the target head the drafter scores, or None for all of them."""
        return self.draft_vocab if self.config.draft_vocab_size else None

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        if self.config.draft_vocab_size != len(token_ids):
            raise ValueError(f"draft vocabulary has {len(token_ids)} ids, config says {self.config.draft_vocab_size}")
        # sorted by id: the order only permutes the draft logits, and the engines' t2d picks head rows in id order
        ids = torch.sort(torch.as_tensor(token_ids, dtype=torch.long)).values
        if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError("draft vocabulary ids must be distinct and inside the target vocabulary")
        self.draft_vocab.copy_(ids.to(self.draft_vocab.device))

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def causal_in_block(self) -> bool:
        """Every layer's block rows see only earlier block rows: slot k's draft is then the same
        whether or not the slots after it are computed."""
        return all(layer.self_attn.vis.causal for layer in self.layers)

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Clause 2: [..., T, F*Ht] target features -> [..., T, Hd] context rows."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"features have width {features.shape[-1]} but this drafter's fc expects "
                f"{self.fc.in_features} = {self.config.num_features} layers x {self.config.target_hidden_size}; "
                f"capture the target layers {self.config.target_layer_ids}"
            )
        return self.hidden_norm(self.fc(features * self.feature_scale.to(features.dtype)))

    @torch.no_grad()
    def set_feature_scale(self, scale: torch.Tensor, keep_function: bool = True) -> None:
        """Use `scale` [F*Ht] on the features from now on. With keep_function, fc's columns absorb
        old scale / new scale so the drafter computes the same function; without, only the input
        scaling changes (for a freshly initialised drafter)."""
        scale = scale.to(self.fc.weight)
        if keep_function:
            self.fc.weight.mul_((self.feature_scale / scale)[None, :])
        self.feature_scale.copy_(scale)

    def folded_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict in the reference layout: fc.weight * scale, no scale buffer."""
        sd = {k: v.detach().clone() for k, v in self.state_dict().items()}
        sd["fc.weight"] = sd["fc.weight"] * self.feature_scale.to(sd["fc.weight"])[None, :]
        return sd

    def rope(self, positions: torch.Tensor, like: torch.Tensor):
        """positions [...] -> cos, sin [..., D]."""
        cos, sin = self.rotary_emb(like, positions.reshape(1, -1))
        return cos[0].reshape(*positions.shape, -1), sin[0].reshape(*positions.shape, -1)

    def forward(self, features: torch.Tensor, block_embeds: torch.Tensor, layout: BlockLayout,
                backend: str = "auto") -> torch.Tensor:
        """features [T, F*Ht], block_embeds [N, B, Hd] -> final-normed hidden [N, B, Hd]."""
        if block_embeds.shape[:2] != (layout.num_blocks, layout.block_size):
            raise ValueError(f"block_embeds {tuple(block_embeds.shape)} do not match {layout.num_blocks} "
                             f"blocks of {layout.block_size}")
        ctx = self.context(features)  # [T, Hd]
        ctx_rope = self.rope(layout.position_ids, ctx)  # [T, D] x2
        blk_rope = self.rope(layout.block_positions(), ctx)  # [N, B, D] x2
        h = block_embeds

        def ctx_kv(at):
            return at.context_kv(ctx, *ctx_rope)  # [T, Hkv, D] x2

        for layer in self.layers:
            at = layer.self_attn

            def attend(q, k_ctx, v_ctx, k_blk, v_blk, at=at):
                return at.attend(q, k_ctx, v_ctx, k_blk, v_blk, layout, backend)

            if self.gradient_checkpointing and self.training:
                h = checkpoint(layer, h, ctx_kv, blk_rope, attend, use_reentrant=False)
            else:
                h = layer(h, ctx_kv, blk_rope, attend)
        return self.norm(h)

    # ------------------------------------------------------------------ inference
    def new_context_cache(self) -> "ContextCache":
        return ContextCache(len(self.layers))

    def draft_hidden(self, new_features: torch.Tensor, new_positions: torch.Tensor, block_embeds: torch.Tensor,
                     anchor_position: int, cache: "ContextCache") -> torch.Tensor:
        """Clause 8 drafting with cached context K/V: only the `new_features` rows [n, F*Ht]
        (positions [n]) are projected; block_embeds [B, Hd] sit at anchor_position + k.
        Every cached row is before the anchor and in its document. Returns normed hidden [B, Hd].
        The layers are the training ones; only the attention reads the cache (`attend_cached`)."""
        B = block_embeds.shape[0]
        ctx = self.context(new_features) if new_features.shape[0] else None  # [n, Hd]
        ctx_rope = self.rope(new_positions, block_embeds) if ctx is not None else None
        blk_rope = self.rope(anchor_position + torch.arange(B, device=block_embeds.device), block_embeds)  # [B, D]
        cache.positions = new_positions if cache.positions is None else torch.cat([cache.positions, new_positions])
        if ctx is not None:
            cache.anchor = ctx[-1]  # the last context row (LiLiCorr's anchor: hidden_norm(fc(features)))
        h = block_embeds
        for i, layer in enumerate(self.layers):
            at, window = layer.self_attn, layer.self_attn.vis.window
            # sliding layers read only rows at positions >= a - W (both window rules see nothing before)
            keep = None if window is None else cache.positions >= anchor_position - window
            pos = cache.positions if keep is None else cache.positions[keep]
            mask = cached_block_mask(pos, anchor_position, B, sliding_window=window, causal_in_block=at.vis.causal,
                                     window_rule=at.vis.rule)

            def ctx_kv(at, i=i, keep=keep):
                if ctx is not None:
                    cache.append(i, *at.context_kv(ctx, *ctx_rope))
                k, v = cache.get(i, block_embeds.new_empty(0, at.hkv, at.d))
                return (k, v) if keep is None else (k[keep], v[keep])

            def attend(q, k_c, v_c, k_blk, v_blk, at=at, mask=mask):
                return at.attend_cached(q, k_c, v_c, k_blk, v_blk, mask)

            h = layer(h, ctx_kv, blk_rope, attend)
        return self.norm(h)


class ContextCache:
    """Per-layer K/V [C, Hkv, D] of the context rows committed so far (one sequence)."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None
        self.anchor: torch.Tensor | None = None  # the newest context row [Hd]

    def __len__(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[0])

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k])
        self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v])

    def get(self, i: int, empty: torch.Tensor):
        """Layer i's cached k, v [C, Hkv, D]; `empty` [0, Hkv, D] before anything is cached."""
        if self.k[i] is None:
            return empty, empty
        return self.k[i], self.v[i]
