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
from .attention import BlockLayout, anchor_block_attention


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., S, H, D] with cos/sin [..., S, D]."""
    return x * cos.unsqueeze(-2) + rotate_half(x) * sin.unsqueeze(-2)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.d ** -0.5
        self.window = cfg.layer_window(layer_idx)
        self.causal_in_block = cfg.layer_causal_in_block(layer_idx)
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

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, ctx_rope, blk_rope, layout: BlockLayout,
                backend: str) -> torch.Tensor:
        """x [N, B, Hd] (normed block rows), ctx [T, Hd] -> [N, B, Hd]."""
        k_ctx, v_ctx = self.context_kv(ctx, *ctx_rope)  # [T, Hkv, D]
        q, k_blk, v_blk = self.block_qkv(x, *blk_rope)  # [N, B, H*, D]
        out = anchor_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, layout, window=self.window,
                                     causal=self.causal_in_block, scale=self.scale, backend=backend)
        return self.o_proj(out.flatten(-2))  # [N, B, Hd]


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int, qwen3_cfg):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.mlp = Qwen3MLP(qwen3_cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, ctx_rope, blk_rope, layout: BlockLayout,
                backend: str) -> torch.Tensor:
        # The context rows are already normed by the drafter's hidden_norm; only the block is normed here.
        h = h + self.self_attn(self.input_layernorm(h), ctx, ctx_rope, blk_rope, layout, backend)
        return h + self.mlp(self.post_attention_layernorm(h))
