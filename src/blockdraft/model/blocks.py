"""Blocks (clause 4) and which of their slots are supervised (clause 6).

Legend: T positions of one flat packed sequence, N anchors, B block size.

A block for anchor a is [token[a], MASK, ..., MASK] at positions a .. a+B-1. Slot k >= 1
predicts the token at a + k, whose label distribution is the target's logits at a + k - 1
(clause 3); slot 0 is never trained.
"""

from __future__ import annotations

import torch


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                    mask_token_id: int) -> torch.Tensor:
    """[N, B]: the anchor's own token followed by B-1 MASK tokens."""
    ids = torch.full((anchors.shape[0], block_size), int(mask_token_id), dtype=torch.long,
                     device=input_ids.device)
    ids[:, 0] = input_ids[anchors]
    return ids


def slot_token_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, B]: position a + k of the token slot k predicts."""
    return anchors[:, None] + torch.arange(block_size, device=anchors.device)[None, :]


def label_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, B]: position a + k - 1 whose target logits are slot k's label (slot 0: unused)."""
    return slot_token_positions(anchors, block_size) - 1


def supervised_slots(document_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """[N, B] bool: slot k >= 1 whose token a + k exists, lies in the anchor's document and
    has loss_mask == 1. Slot 0 and slots past the end of their document are never supervised."""
    T = document_ids.shape[0]
    pos = slot_token_positions(anchors, block_size)  # [N, B]
    inside = pos < T
    p = pos.clamp(max=T - 1)
    sup = inside & (document_ids[p] == document_ids[anchors][:, None]) & loss_mask[p].bool()
    sup[:, 0] = False
    return sup
