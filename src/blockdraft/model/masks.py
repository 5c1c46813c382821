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
    Used by the chunked path (on index grids); flex attention calls `visible_kind` directly.
    """
    kind = layer_kind_tensors(sliding_window, causal_in_block, window_rule, anchors.device)
    return visible_kind(q_block, q_slot, k_idx, anchors=anchors, document_ids=document_ids,
                        block_size=block_size, kind=kind)


# a window no position difference reaches: full attention as a window, so one predicate serves both
NO_WINDOW = 2**40


def layer_kind_tensors(sliding_window: int | None, causal_in_block: bool, window_rule: str,
                       device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer kind (window, in-block causality, window rule) as three 0-d tensors. A compiled
    flex attention guards the Python constants a mask closes over, one graph per kind (past
    dynamo's recompile limit it silently ran unfused); tensors are graph inputs, so one graph
    serves every kind."""
    check_window_rule(window_rule)
    window = NO_WINDOW if sliding_window is None else int(sliding_window)
    return (torch.tensor(window, dtype=torch.int64, device=device),
            torch.tensor(bool(causal_in_block), device=device),
            torch.tensor(window_rule == WINDOW_QUERY, device=device))


def visible_kind(q_block: torch.Tensor, q_slot: torch.Tensor, k_idx: torch.Tensor, *, anchors: torch.Tensor,
                 document_ids: torch.Tensor, block_size: int, kind: tuple) -> torch.Tensor:
    """`visible` with the layer kind as tensors (`layer_kind_tensors`), without a Python branch on it."""
    window, causal, query_rule = kind
    T = document_ids.shape[0]
    a = anchors[q_block]
    is_ctx = k_idx < T
    p = torch.clamp(k_idx, max=T - 1)
    ctx_ok = is_ctx & (p < a) & (document_ids[p] == document_ids[a])
    rel = k_idx - T
    k_slot = torch.remainder(rel, block_size)
    blk_ok = (~is_ctx) & (torch.div(rel, block_size, rounding_mode="floor") == q_block)
    blk_ok = blk_ok & (~causal | (k_slot <= q_slot))
    # rule "query": counted from the query's own position a + i, inside the block too;
    # rule "anchor": context p >= a - W, the block not windowed (NO_WINDOW passes both)
    ctx_win = torch.where(query_rule, a + q_slot - p < window, p >= a - window)
    blk_win = ~query_rule | ((q_slot - k_slot < window) & (k_slot - q_slot < window))
    return (ctx_ok & ctx_win) | (blk_ok & blk_win)


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
    """mask_mod(b, h, q_idx, kv_idx) for torch's flex attention over the flat layout. The layer
    kind is closed over as tensors (`layer_kind_tensors`): every kind shares one compiled graph."""
    kind = layer_kind_tensors(sliding_window, causal_in_block, window_rule, anchors.device)

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = torch.div(q_idx, block_size, rounding_mode="floor")
        q_slot = torch.remainder(q_idx, block_size)
        return visible_kind(q_block, q_slot, kv_idx, anchors=anchors, document_ids=document_ids,
                            block_size=block_size, kind=kind)

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


# ------------------------------------------------------------------ flex-attention block masks
# A BlockMask says, per tile of TILE queries x TILE keys, whether the tile is empty (skipped),
# full (every query sees every key: no mask_mod call) or partial (mask_mod decides). torch's
# uncompiled `create_block_mask` finds that by evaluating the rule on all Q x K pairs; here the
# tiles come from each block's visible key ranges instead, so nothing of Q x K elements is ever
# made (docs/scale.md, rule 2). A tile may be called partial when it is empty or full (only
# slower); a visible key is never in an empty tile, and a full tile is truly full: tests check
# both against the dense reference.

TILE = 128


def _context_ranges(anchors: torch.Tensor, document_ids: torch.Tensor, block_size: int, sliding_window: int | None,
                    window_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block j: [lo_any, a_j) holds every context key some slot of j sees, [lo_all, a_j) only keys
    every slot sees. Returns (lo_any [N], lo_all [N], a [N])."""
    a = anchors
    start = document_starts(document_ids)[a]
    lo_any, lo_all = start.clone(), start.clone()
    W, B = sliding_window, block_size
    if W is not None and window_rule == WINDOW_QUERY:  # slot i sees p > a + i - W
        lo_any = torch.maximum(start, a - W + 1)
        lo_all = torch.maximum(start, a + B - W)
    elif W is not None:
        lo_any = lo_all = torch.maximum(start, a - W)
    return lo_any, lo_all, a


def block_mask_tiles(anchors: torch.Tensor, document_ids: torch.Tensor, block_size: int,
                     sliding_window: int | None, causal_in_block: bool, window_rule: str = DEFAULT_WINDOW_RULE,
                     tile: int = TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full): BoolTensors [Qt, Kt] over tiles of `tile` queries x `tile` keys of the flat
    layout (Q = N*B queries, K = T + N*B keys), on the host. `causal_in_block` only narrows which
    block tiles are visible, so block tiles are always partial."""
    check_window_rule(window_rule)
    a, doc = anchors.cpu().long(), document_ids.cpu()
    T, N, B = doc.shape[0], a.shape[0], int(block_size)
    Q, K = N * B, T + N * B
    Qt, Kt = -(-Q // tile), -(-K // tile)
    lo_any, lo_all, hi = _context_ranges(a, doc, B, sliding_window, window_rule)
    j = torch.arange(N)
    # every (block, query tile) pair: a block spans the tiles of its first and last query
    first, last = (j * B) // tile, ((j + 1) * B - 1) // tile
    span = last - first + 1  # [N]
    pj = torch.repeat_interleave(j, span)  # [M] block of each pair
    pq = first[pj] + (torch.arange(pj.numel()) - torch.repeat_interleave(torch.cumsum(span, 0) - span, span))
    # key ranges [k0, k1) every pair touches: its context range and its own block's keys
    ranges = [(lo_any[pj], hi[pj]), (T + pj * B, T + (pj + 1) * B)]
    diff = torch.zeros(Qt, Kt + 1, dtype=torch.int32)
    for k0, k1 in ranges:
        ok = k1 > k0
        q, t0, t1 = pq[ok], k0[ok] // tile, (k1[ok] - 1) // tile + 1
        diff.index_put_((q, t0), torch.ones_like(q, dtype=torch.int32), accumulate=True)
        diff.index_put_((q, t1), -torch.ones_like(q, dtype=torch.int32), accumulate=True)
    touched = diff.cumsum(1)[:, :Kt] > 0  # [Qt, Kt]
    # full context tiles: inside [max lo_all, min a) over the tile's blocks, and inside the context
    big = torch.iinfo(torch.long).max
    lo_max = torch.full((Qt,), -1, dtype=torch.long).scatter_reduce(0, pq, lo_all[pj], "amax")
    hi_min = torch.full((Qt,), big, dtype=torch.long).scatter_reduce(0, pq, hi[pj], "amin")
    k0 = torch.arange(Kt) * tile  # [Kt]
    full = (k0[None, :] >= lo_max[:, None]) & (k0[None, :] + tile <= torch.minimum(hi_min, torch.tensor(T))[:, None])
    if Q % tile:  # a last, short query tile is never called full
        full[-1] = False
    full &= touched
    return touched & ~full, full


def _ordered(tiles: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[Qt, Kt] bool -> (count [1, 1, Qt], indices [1, 1, Qt, Kt]) int32, the tiles in ascending order."""
    count = tiles.sum(-1).to(torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[None, None].to(device), order[None, None].to(device)


def flex_block_mask(anchors: torch.Tensor, document_ids: torch.Tensor, block_size: int, sliding_window: int | None,
                    causal_in_block: bool, window_rule: str = DEFAULT_WINDOW_RULE, *, device=None,
                    device_anchors: torch.Tensor | None = None, device_document_ids: torch.Tensor | None = None):
    """The clause-5 BlockMask for flex attention over the flat layout, from the tiles of
    `block_mask_tiles` (host tensors in) and `flex_mask_mod` for the partial tiles (evaluated
    on the device copies of anchors and document ids)."""
    import inspect

    from torch.nn.attention.flex_attention import BlockMask

    partial, full = block_mask_tiles(anchors, document_ids, block_size, sliding_window, causal_in_block, window_rule)
    N, T = anchors.shape[0], document_ids.shape[0]
    dev = torch.device(device) if device is not None else anchors.device
    da = anchors.to(dev) if device_anchors is None else device_anchors
    dd = document_ids.to(dev) if device_document_ids is None else device_document_ids
    mod = flex_mask_mod(da, dd, block_size, sliding_window, causal_in_block, window_rule)
    kv_num, kv_idx = _ordered(partial, dev)
    full_num, full_idx = _ordered(full, dev)
    kw = {}
    if "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters:
        kw["seq_lengths"] = (N * block_size, T + N * block_size)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE, mask_mod=mod, **kw)
