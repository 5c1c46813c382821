"""Drafter decoder layer: a Qwen3 layer whose attention also reads the context rows (clause 2).

Legend: T context rows, N blocks, B block size, Hd hidden, Hq/Hkv heads, D head dim.

Reuses transformers' Qwen3 MLP, RMSNorm and rotate_half. The deliberate difference from
Qwen3Attention: keys/values are [context rows ; block rows], both through this layer's
own k_proj/v_proj and k_norm, RoPE at their own positions; queries come from the block only.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, rotate_half

from ..config import DrafterConfig
from .attention import BlockLayout, LayerVisibility, anchor_block_attention


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., S, H, D] with cos/sin [..., S, D]."""
    return x * cos.unsqueeze(-2) + rotate_half(x) * sin.unsqueeze(-2)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.d ** -0.5
        self.vis = LayerVisibility(cfg.layer_window(layer_idx), cfg.layer_causal_in_block(layer_idx),
                                   cfg.sliding_window_rule)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.hq * self.d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.d, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.d, eps=cfg.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Context rows [..., T, Hd] -> k, v [..., T, Hkv, D] (k normed and rotated at context positions)."""
        k = self.k_norm(self.k_proj(ctx).unflatten(-1, (self.hkv, self.d)))
        v = self.v_proj(ctx).unflatten(-1, (self.hkv, self.d))
        return rope(k, cos, sin), v

    def block_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Block rows [..., B, Hd] -> q [..., B, Hq, D], k, v [..., B, Hkv, D]."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.hq, self.d)))
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.hkv, self.d)))
        v = self.v_proj(x).unflatten(-1, (self.hkv, self.d))
        return rope(q, cos, sin), rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
               v_blk: torch.Tensor, layout: BlockLayout, backend: str) -> torch.Tensor:
        """Training: q [N, B, Hq, D], context k/v [T, Hkv, D], block k/v [N, B, Hkv, D] -> [N, B, Hq, D]."""
        return anchor_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, layout, self.vis, scale=self.scale,
                                      backend=backend)

    def attend_cached(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                      v_blk: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Drafting one block: q [B, Hq, D], cached context k/v [C, Hkv, D], block k/v [B, Hkv, D],
        mask [B, C+B] (None: all visible; `cached_block_mask`) -> [B, Hq, D]."""
        k = torch.cat([k_ctx, k_blk]).transpose(0, 1)  # [Hkv, C+B, D]
        v = torch.cat([v_ctx, v_blk]).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], attn_mask=None if mask is None else mask[None, None],
            scale=self.scale, enable_gqa=self.hq != self.hkv)[0]  # [Hq, B, D]
        return out.transpose(0, 1)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int, qwen3_cfg):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.mlp = Qwen3MLP(qwen3_cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx_kv, blk_rope, attend) -> torch.Tensor:
        """h [..., B, Hd] block rows. `ctx_kv(attn)` gives this layer's context (k, v) and `attend(q,
        k_ctx, v_ctx, k_blk, v_blk)` its attention, for the caller's path (a training layout or the
        drafting cache): one layer function serves both. Both run inside this forward, where a
        sharded (FSDP) layer has its weights gathered."""
        # The context rows are already normed by the drafter's hidden_norm; only the block is normed here.
        at = self.self_attn
        k_ctx, v_ctx = ctx_kv(at)
        q, k_blk, v_blk = at.block_qkv(self.input_layernorm(h), *blk_rope)  # [..., B, H*, D]
        h = h + at.o_proj(attend(q, k_ctx, v_ctx, k_blk, v_blk).flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))
