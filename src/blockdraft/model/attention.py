"""Anchor-block attention (clause 5) with three interchangeable backends.

Legend: T context rows, N blocks, B block size, Hq query heads, Hkv key/value heads, D head dim.

- "dense": one SDPA over all T + N*B keys with the reference mask `anchor_block_mask`
  (the slow reference; also what a naive implementation costs).
- "chunked": the CPU fast path. Consecutive blocks of one document form a chunk that
  reads only its context range [doc start, last anchor), so a block never pays for the
  Q x T rectangle and padded anchors do not exist (they are dropped before this point).
- "flex": torch flex attention with a block-sparse BlockMask built from the same
  predicate, for CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .masks import anchor_block_mask, chunk_mask, flex_block_mask, plan_chunks

BACKENDS = ("auto", "dense", "chunked", "flex")


@dataclass
class BlockLayout:
    """Where the blocks sit in one flat packed sequence.

    document_ids [T]: document of every context row (globally unique across packed rows).
    position_ids [T]: RoPE position of every context row (restarts per document).
    anchors [N]: sorted flat indices of the anchors (valid ones only).
    host_document_ids, host_anchors: the same on the CPU, where the caller has them (the masks'
    tile plans are built there; without them they are copied back once).

    The masks of a layer kind are built once per layout and shared by every layer of that kind,
    the gradient-checkpoint recompute and evaluation.
    """

    document_ids: torch.Tensor
    position_ids: torch.Tensor
    anchors: torch.Tensor
    block_size: int
    max_chunk_blocks: int = 32
    host_document_ids: torch.Tensor | None = None
    host_anchors: torch.Tensor | None = None
    _chunks: dict = field(default_factory=dict, repr=False)
    _block_masks: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.document_ids.dim() != 1 or self.position_ids.shape != self.document_ids.shape:
            raise ValueError("document_ids and position_ids must be 1-D and of equal length")
        if self.anchors.dim() != 1:
            raise ValueError("anchors must be 1-D")

    @property
    def num_blocks(self) -> int:
        return int(self.anchors.shape[0])

    def block_positions(self) -> torch.Tensor:
        """[N, B] RoPE position of every block slot: the anchor's position + k."""
        k = torch.arange(self.block_size, device=self.anchors.device)
        return self.position_ids[self.anchors][:, None] + k[None, :]

    def host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors, document_ids) on the CPU."""
        if self.host_anchors is None:
            self.host_anchors = self.anchors.cpu()
        if self.host_document_ids is None:
            self.host_document_ids = self.document_ids.cpu()
        return self.host_anchors, self.host_document_ids

    def chunks(self, window: int | None):
        if window not in self._chunks:
            a, doc = self.host()
            self._chunks[window] = plan_chunks(a, doc, max_blocks=self.max_chunk_blocks, sliding_window=window)
        return self._chunks[window]

    def block_mask(self, vis: "LayerVisibility", device):
        """The flex-attention BlockMask of one layer kind, built on first use (masks.flex_block_mask)."""
        key = (vis, str(device))
        if key not in self._block_masks:
            a, doc = self.host()
            self._block_masks[key] = flex_block_mask(
                a, doc, self.block_size, vis.window, vis.causal, vis.rule, device=device,
                device_anchors=self.anchors.to(device), device_document_ids=self.document_ids.to(device))
        return self._block_masks[key]


@dataclass(frozen=True)
class LayerVisibility:
    """One layer's side of clause 5: its window (None = full attention), whether its block rows
    are causal, and how the window is counted (config.WINDOW_RULES)."""

    window: int | None
    causal: bool
    rule: str


def anchor_block_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                           v_blk: torch.Tensor, layout: BlockLayout, vis: LayerVisibility, *,
                           scale: float, backend: str = "auto") -> torch.Tensor:
    """q [N, B, Hq, D], k/v_ctx [T, Hkv, D], k/v_blk [N, B, Hkv, D] -> out [N, B, Hq, D]."""
    if backend == "auto":
        backend = "flex" if q.is_cuda and not _flex_refused(q.device, q.shape[-1]) else "chunked"
    fns = {"chunked": _chunked, "dense": _dense, "flex": _flex}
    if backend not in fns:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    return fns[backend](q, k_ctx, v_ctx, k_blk, v_blk, layout, vis, scale)


def _sdpa(q, k, v, mask, scale):
    """q [Hq, Q, D], k/v [Hkv, K, D], mask [Q, K] -> [Hq, Q, D]. Grouped heads share K/V without copies."""
    gqa = q.shape[0] != k.shape[0]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None], scale=scale,
                                          enable_gqa=gqa)[0]


def _dense(q, k_ctx, v_ctx, k_blk, v_blk, layout, vis, scale):
    N, B, Hq, D = q.shape
    mask = anchor_block_mask(layout.document_ids, layout.anchors, B, vis.window, vis.causal,
                             vis.rule).to(q.device)  # [N*B, T+N*B]
    k = torch.cat([k_ctx, k_blk.reshape(N * B, -1, D)]).transpose(0, 1)  # [Hkv, T+N*B, D]
    v = torch.cat([v_ctx, v_blk.reshape(N * B, -1, D)]).transpose(0, 1)
    out = _sdpa(q.reshape(N * B, Hq, D).transpose(0, 1), k, v, mask, scale)  # [Hq, N*B, D]
    return out.transpose(0, 1).reshape(N, B, Hq, D)


def _chunked(q, k_ctx, v_ctx, k_blk, v_blk, layout, vis, scale):
    N, B, Hq, D = q.shape
    outs = []
    for c in layout.chunks(vis.window):
        nb = c.j1 - c.j0
        mask = chunk_mask(c, anchors=layout.anchors, document_ids=layout.document_ids, block_size=B,
                          sliding_window=vis.window, causal_in_block=vis.causal,
                          window_rule=vis.rule)  # [nb*B, (hi-lo) + nb*B]
        kc = torch.cat([k_ctx[c.lo:c.hi], k_blk[c.j0:c.j1].reshape(nb * B, -1, D)]).transpose(0, 1)
        vc = torch.cat([v_ctx[c.lo:c.hi], v_blk[c.j0:c.j1].reshape(nb * B, -1, D)]).transpose(0, 1)
        qc = q[c.j0:c.j1].reshape(nb * B, Hq, D).transpose(0, 1)  # [Hq, nb*B, D]
        outs.append(_sdpa(qc, kc, vc, mask, scale).transpose(0, 1).reshape(nb, B, Hq, D))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs)


_compiled_flex = None
_refusal_said = False


def flex_refusal(device: torch.device, head_dim: int) -> str | None:
    """Why flex attention cannot train on this device, or None. torch's compiled flex backward
    fails on compute capability 12.x (RTX PRO 6000, RTX 50xx) when head_dim > 128 (pytorch
    #198224): drafters with head_dim 256, or MLA-shaped ones, take the SDPA path there."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major == 12 and head_dim > 128:
        return (f"flex attention's compiled backward fails on compute capability {major}.{minor} with head_dim "
                f"{head_dim} > 128 (pytorch #198224): training uses the SDPA (chunked) path instead")
    return None


def _flex_refused(device: torch.device, head_dim: int) -> bool:
    global _refusal_said
    why = flex_refusal(device, head_dim)
    if why and not _refusal_said:
        print(f"blockdraft: {why}", flush=True)
        _refusal_said = True
    return why is not None


def _limit_key() -> str:
    """dynamo's switch that makes a recompile-limit hit an error (renamed across torch releases)."""
    import torch._dynamo.config as cfg

    return next(k for k in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit") if hasattr(cfg, k))


def compiled_flex(compile_backend: str = "inductor"):
    """flex attention compiled once for every layout and layer kind (the masks pass the kind as
    tensors, masks.layer_kind_tensors). Past dynamo's recompile limit a compiled function runs
    eagerly, which for flex attention means materialising every score (~200 GB at Q 32k x K 49k):
    here that raises instead."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    fn = torch.compile(flex_attention, dynamic=True, backend=compile_backend)
    key = _limit_key()

    def call(*args, **kwargs):
        with torch._dynamo.config.patch(**{key: True}):
            return fn(*args, **kwargs)

    return call


def same_dtype(*xs: torch.Tensor) -> list[torch.Tensor]:
    """q, k and v in one dtype: under autocast the autocast dtype, else their promoted one. Under
    bf16 autocast the RMSNorm and RoPE follow fp32 weights while v stays bf16; SDPA is cast by
    autocast, flex attention is not, and torch before 2.10 refuses mixed dtypes."""
    dev = xs[0].device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
    else:
        dt = xs[0].dtype
        for x in xs[1:]:
            dt = torch.promote_types(dt, x.dtype)
    return [x.to(dt) for x in xs]


def _flex(q, k_ctx, v_ctx, k_blk, v_blk, layout, vis, scale):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    N, B, Hq, D = q.shape
    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = compiled_flex()
        fn = _compiled_flex
    bm = layout.block_mask(vis, q.device)  # built once per layout and layer kind, no Q x K tensor
    k = torch.cat([k_ctx, k_blk.reshape(N * B, -1, D)]).transpose(0, 1)[None]  # [1, Hkv, T+N*B, D]
    v = torch.cat([v_ctx, v_blk.reshape(N * B, -1, D)]).transpose(0, 1)[None]
    qf = q.reshape(N * B, Hq, D).transpose(0, 1)[None]  # [1, Hq, N*B, D]
    qf, k, v = same_dtype(qf, k, v)
    out = fn(qf, k, v, block_mask=bm, scale=scale, enable_gqa=Hq != k.shape[1])
    return out[0].transpose(0, 1).reshape(N, B, Hq, D)
