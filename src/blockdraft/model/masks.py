"""The anchor-block visibility rule (clause 5): a dense reference and the fast paths' pieces.

Legend: T context positions (one flat packed sequence), N anchors (blocks), B block size,
K = T + N*B keys (the T context positions followed by the N*B block slots), Q = N*B queries.

A query in block j (anchor a_j), slot i (position a_j + i) sees context position p iff
doc(p) == doc(a_j) and p < a_j; it sees every slot of its own block (only slots <= its own on
sliding layers when `causal_in_block`), and nothing of any other block. Sliding-window layers
add one of two window rules (`DrafterConfig.sliding_window_rule`):

- "anchor" (blockdraft before the rule was a field, speculators' training): every slot of the
  block sees context p >= a_j - W; the window does not limit the block itself.
- "query" (z-lab dflash, vLLM: what the engines serve): the window counts from each query's
  own position, a_j + i - p < W for context and block keys alike, and |i - i'| < W between
  block slots when the block is bidirectional.

`anchor_block_mask` is the dense reference, built block by block with plain slicing and
shared by nothing else. The fast paths (chunked SDPA on CPU, flex attention on CUDA)
use the vectorised predicate `visible`; tests compare both element by element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DEFAULT_WINDOW_RULE, WINDOW_QUERY, WINDOW_RULES


def check_window_rule(rule: str) -> str:
    if rule not in WINDOW_RULES:
        raise ValueError(f"unknown sliding-window rule {rule!r}; use one of {WINDOW_RULES}")
    return rule


def anchor_block_mask(document_ids: torch.Tensor, anchor_positions: torch.Tensor, block_size: int,
                      sliding_window: int | None = None, causal_in_block: bool = False,
                      window_rule: str = DEFAULT_WINDOW_RULE) -> torch.Tensor:
    """Dense reference of clause 5: BoolTensor [N*B, T + N*B], True = may attend."""
    check_window_rule(window_rule)
    doc = torch.as_tensor(document_ids).cpu()
    anchors = torch.as_tensor(anchor_positions).cpu().tolist()
    T, N, B, W = doc.shape[0], len(anchors), int(block_size), sliding_window
    per_query = W is not None and window_rule == WINDOW_QUERY
    mask = torch.zeros(N * B, T + N * B, dtype=torch.bool)
    for j, a in enumerate(anchors):
        if not 0 <= a < T:
            raise ValueError(f"anchor {a} is outside the sequence [0, {T})")
        base = T + j * B
        for i in range(B):
            row = j * B + i
            # context: strictly before the anchor, same document, inside the window
            lo = 0 if W is None else max(0, a + i - W + 1) if per_query else max(0, a - W)
            mask[row, lo:a] = doc[lo:a] == doc[a]
            # own block: all slots, or those up to this one; a per-query window also bounds them
            first, last = (0, i + 1) if causal_in_block else (0, B)
            if per_query:
                first, last = max(first, i - W + 1), min(last, i + W)
            mask[row, base + first:base + last] = True
    return mask


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[..., T] index of the first position of each position's document (documents are contiguous
    runs along the last dimension)."""
    T = document_ids.shape[-1]
    idx = torch.arange(T, device=document_ids.device).expand_as(document_ids)
    new = torch.ones_like(document_ids, dtype=torch.bool)
    new[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    return torch.cummax(torch.where(new, idx, torch.zeros_like(idx)), dim=-1).values


def visible(q_block: torch.Tensor, q_slot: torch.Tensor, k_idx: torch.Tensor, *, anchors: torch.Tensor,
            document_ids: torch.Tensor, block_size: int, sliding_window: int | None,
            causal_in_block: bool, window_rule: str = DEFAULT_WINDOW_RULE) -> torch.Tensor:
    """Vectorised clause-5 predicate over broadcastable index tensors.

    q_block/q_slot: the query's block j and slot i; k_idx: key index in [0, T + N*B).
    Used by the chunked path (on index grids) and as the flex-attention mask_mod.
    """
    T, W = document_ids.shape[0], sliding_window
    a = anchors[q_block]
    is_ctx = k_idx < T
    p = torch.clamp(k_idx, max=T - 1)
    ctx_ok = is_ctx & (p < a) & (document_ids[p] == document_ids[a])
    rel = k_idx - T
    k_slot = torch.remainder(rel, block_size)
    blk_ok = (~is_ctx) & (torch.div(rel, block_size, rounding_mode="floor") == q_block)
    if causal_in_block:
        blk_ok = blk_ok & (k_slot <= q_slot)
    if W is not None and window_rule == WINDOW_QUERY:  # counted from the query's own position a + i
        ctx_ok = ctx_ok & (a + q_slot - p < W)
        blk_ok = blk_ok & (q_slot - k_slot < W) & (k_slot - q_slot < W)
    elif W is not None:
        ctx_ok = ctx_ok & (p >= a - W)
    return ctx_ok | blk_ok


@dataclass
class Chunk:
    """A run of consecutive blocks [j0, j1) attending to context positions [lo, hi)."""

    j0: int
    j1: int
    lo: int
    hi: int


def plan_chunks(anchors: torch.Tensor, document_ids: torch.Tensor, *, max_blocks: int,
                sliding_window: int | None = None) -> list[Chunk]:
    """Split sorted anchors into chunks whose context range is the union of their blocks' ranges.

    A chunk ends at a document change or after `max_blocks` blocks, so each chunk reads
    only [doc start (or a - W), last anchor) of the context instead of all T positions.
    """
    if anchors.numel() == 0:
        return []
    a = anchors.cpu()
    if bool((a[1:] < a[:-1]).any()):
        raise ValueError("anchors must be sorted")
    doc = document_ids.cpu()
    starts = document_starts(doc)
    lo_all = starts[a]
    if sliding_window is not None:
        lo_all = torch.maximum(lo_all, a - sliding_window)
    a_l, d_l, lo_l = a.tolist(), doc[a].tolist(), lo_all.tolist()
    chunks, j0 = [], 0
    for j in range(1, len(a_l) + 1):
        if j == len(a_l) or j - j0 >= max_blocks or d_l[j] != d_l[j0]:
            chunks.append(Chunk(j0, j, min(lo_l[j0:j]), max(a_l[j0:j])))
            j0 = j
    return chunks


def chunk_mask(chunk: Chunk, *, anchors: torch.Tensor, document_ids: torch.Tensor, block_size: int,
               sliding_window: int | None, causal_in_block: bool, window_rule: str = DEFAULT_WINDOW_RULE) -> torch.Tensor:
    """BoolTensor [(j1-j0)*B, (hi-lo) + (j1-j0)*B]: the rule restricted to one chunk's keys."""
    dev = anchors.device
    T, B = document_ids.shape[0], block_size
    nb = chunk.j1 - chunk.j0
    q = torch.arange(nb * B, device=dev)
    q_block = chunk.j0 + torch.div(q, B, rounding_mode="floor")
    q_slot = torch.remainder(q, B)
    k_ctx = torch.arange(chunk.lo, chunk.hi, device=dev)
    k_blk = T + chunk.j0 * B + torch.arange(nb * B, device=dev)
    k_idx = torch.cat([k_ctx, k_blk])
    return visible(q_block[:, None], q_slot[:, None], k_idx[None, :], anchors=anchors,
                   document_ids=document_ids, block_size=B, sliding_window=sliding_window,
                   causal_in_block=causal_in_block, window_rule=window_rule)


def chunked_mask_as_dense(document_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, *,
                          max_blocks: int, sliding_window: int | None = None,
                          causal_in_block: bool = False, window_rule: str = DEFAULT_WINDOW_RULE) -> torch.Tensor:
    """Scatter the chunked path's masks into the dense [N*B, T + N*B] layout, for testing.

    Keys a chunk does not read are False, so equality with `anchor_block_mask` proves the
    chunked path neither leaks nor drops a visible key.
    """
    T, N, B = document_ids.shape[0], anchors.shape[0], block_size
    out = torch.zeros(N * B, T + N * B, dtype=torch.bool)
    for c in plan_chunks(anchors, document_ids, max_blocks=max_blocks, sliding_window=sliding_window):
        m = chunk_mask(c, anchors=anchors, document_ids=document_ids, block_size=B,
                       sliding_window=sliding_window, causal_in_block=causal_in_block,
                       window_rule=window_rule).cpu()
        rows = slice(c.j0 * B, c.j1 * B)
        out[rows, c.lo:c.hi] = m[:, : c.hi - c.lo]
        out[rows, T + c.j0 * B:T + c.j1 * B] = m[:, c.hi - c.lo:]
    return out


def flex_mask_mod(anchors: torch.Tensor, document_ids: torch.Tensor, block_size: int,
                  sliding_window: int | None, causal_in_block: bool, window_rule: str = DEFAULT_WINDOW_RULE):
    """mask_mod(b, h, q_idx, kv_idx) for torch's flex attention over the flat layout."""

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = torch.div(q_idx, block_size, rounding_mode="floor")
        q_slot = torch.remainder(q_idx, block_size)
        return visible(q_block, q_slot, kv_idx, anchors=anchors, document_ids=document_ids,
                       block_size=block_size, sliding_window=sliding_window, causal_in_block=causal_in_block,
                       window_rule=window_rule)

    return mask_mod


def cached_block_mask(context_positions: torch.Tensor, anchor_position: int, block_size: int, *,
                      sliding_window: int | None, causal_in_block: bool,
                      window_rule: str = DEFAULT_WINDOW_RULE) -> torch.Tensor | None:
    """Drafting's fast path of the rule for one block over cached context rows (all of the anchor's
    document and before it): BoolTensor [B, C + B], or None when every key is visible.
    Tests compare it with `anchor_block_mask` on the equivalent layout."""
    W, B = sliding_window, block_size
    if W is None and not causal_in_block:
        return None
    dev = context_positions.device
    i = torch.arange(B, device=dev)[:, None]  # query slot
    ctx = torch.ones(B, context_positions.shape[0], dtype=torch.bool, device=dev)
    blk = torch.ones(B, B, dtype=torch.bool, device=dev)
    k = torch.arange(B, device=dev)[None, :]  # key slot
    if causal_in_block:
        blk &= k <= i
    if W is not None and window_rule == WINDOW_QUERY:
        ctx &= anchor_position + i - context_positions[None, :] < W
        blk &= (i - k < W) & (k - i < W)
    elif W is not None:
        ctx &= context_positions[None, :] >= anchor_position - W
    return torch.cat([ctx, blk], dim=1)
