"""Anchor sampling (clause 6).

Legend: T positions of one row (or one flat packed sequence), N anchors, B block size.

An anchor is a position with loss_mask == 1 whose block has at least one supervised slot
in the same document. Anchors are drawn without replacement, round-robin over documents
(each document gives its i-th random pick before any gives its (i+1)-th), so short
documents are not starved by long ones, and returned sorted.
"""

from __future__ import annotations

import torch

from ..model.blocks import supervised_slots
from ..model.masks import document_starts


def eligible_anchors(document_ids: torch.Tensor, loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T] bool: positions that may be anchors."""
    T = document_ids.shape[0]
    all_pos = torch.arange(T, device=document_ids.device)
    has_sup = supervised_slots(document_ids, loss_mask, all_pos, block_size).any(dim=1)
    return loss_mask.bool() & has_sup


def sample_anchors(document_ids: torch.Tensor, loss_mask: torch.Tensor, block_size: int, max_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted LongTensor [n] of anchor positions, n <= max_anchors (all eligible ones if fewer)."""
    if document_ids.dim() != 1 or loss_mask.shape != document_ids.shape:
        raise ValueError("document_ids and loss_mask must be 1-D tensors of equal length")
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1, got {max_anchors}")
    ok = eligible_anchors(document_ids, loss_mask, block_size).cpu()
    cand = ok.nonzero().flatten()
    if cand.numel() <= max_anchors:
        return _home(cand, document_ids)
    docs = document_ids.cpu()[cand]
    # random rank inside each document, then take ranks 0, 1, 2, ... across all documents
    perm = torch.randperm(cand.numel(), generator=generator)
    shuffled_docs = docs[perm]
    order = torch.argsort(shuffled_docs, stable=True)  # group by document, random order inside
    grouped_docs = shuffled_docs[order]
    rank = torch.arange(grouped_docs.numel()) - document_starts(grouped_docs)  # rank inside its document
    # ties in rank are broken randomly so no document is favoured at the cut
    tie = torch.rand(rank.numel(), generator=generator)
    pick = torch.argsort(rank.double() + tie.double() * 0.5)[:max_anchors]
    chosen = cand[perm[order[pick]]]
    return _home(torch.sort(chosen).values, document_ids)


def _home(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` on `like`'s device (the host work above ran on the CPU); no move when it is there already."""
    return t if t.device == like.device else t.to(like.device)
