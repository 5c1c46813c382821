"""DFlashDrafter: fc + hidden_norm over the target features, Qwen3 layers, final norm (clause 2).

Legend: T context rows (flat packed sequence), N blocks, B block size, F feature layers,
Ht target hidden, Hd drafter hidden (== Ht: the target's embedding and head are reused).

The target's embedding and lm_head are not parameters of this module (clause 4): the
caller embeds the block tokens with the target and applies the target's head.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from ..config import DrafterConfig
from .attention import BlockLayout
from .layers import DFlashDecoderLayer


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        q3 = config.qwen3_config()
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i, q3) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(q3)
        self.gradient_checkpointing = False
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, Qwen3RMSNorm):
                nn.init.ones_(m.weight)

    @property
    def block_size(self) -> int:
        return self.config.block_size

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
        return self.hidden_norm(self.fc(features))

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
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                h = checkpoint(layer, h, ctx, ctx_rope, blk_rope, layout, backend, use_reentrant=False)
            else:
                h = layer(h, ctx, ctx_rope, blk_rope, layout, backend)
        return self.norm(h)
