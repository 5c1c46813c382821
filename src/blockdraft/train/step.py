"""One training step: target features and labels, anchors, drafter forward, loss.

Legend: Bz rows, T tokens per row, N anchors (all rows), B block size, S supervised slots,
F*Ht feature width, V vocabulary.

Rows are flattened into one packed sequence with globally unique document ids, so anchors
of every row share one attention layout and padding anchors do not exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.attention import BlockLayout
from ..model.blocks import block_input_ids, label_positions, slot_token_positions, supervised_slots
from ..model.masks import document_starts
from .anchors import sample_anchors
from .loss import Labels, default_gamma, dflash_loss_chunked, loss_chunk_slots
from .train_options import DEFAULTS


@dataclass
class Batch:
    input_ids: torch.Tensor  # [Bz, T]
    loss_mask: torch.Tensor  # [Bz, T] 1 on tokens to learn (assistant turns)
    position_ids: torch.Tensor | None = None  # [Bz, T] restart at 0 for each packed document
    document_ids: torch.Tensor | None = None  # [Bz, T] derived from position_ids when absent

    def __post_init__(self) -> None:
        if self.input_ids.dim() == 1:
            self.input_ids = self.input_ids[None]
            self.loss_mask = self.loss_mask[None]
            self.position_ids = None if self.position_ids is None else self.position_ids[None]
            self.document_ids = None if self.document_ids is None else self.document_ids[None]
        shape = self.input_ids.shape
        for name in ("loss_mask", "position_ids", "document_ids"):
            t = getattr(self, name)
            if t is not None and t.shape != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, input_ids {tuple(shape)}")
        if self.position_ids is None:
            if self.document_ids is None:
                self.document_ids = torch.zeros_like(self.input_ids)
            self.position_ids = positions_from_documents(self.document_ids)
        elif self.document_ids is None:
            self.document_ids = documents_from_positions(self.position_ids)


def documents_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[Bz, T]: a new document starts wherever the position does not continue by +1."""
    step = torch.ones_like(position_ids, dtype=torch.bool)
    step[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    step[:, 0] = False
    return step.long().cumsum(dim=1)


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """[Bz, T]: positions restarting at 0 at each document change."""
    return torch.arange(document_ids.shape[1], device=document_ids.device) - document_starts(document_ids)


@dataclass
class Flat:
    """A batch flattened to one packed sequence of Bz*T positions."""

    input_ids: torch.Tensor  # [Bz*T]
    loss_mask: torch.Tensor  # [Bz*T]
    position_ids: torch.Tensor  # [Bz*T]
    document_ids: torch.Tensor  # [Bz*T] unique across rows


def flatten(batch: Batch) -> Flat:
    Bz, T = batch.input_ids.shape
    doc = batch.document_ids - batch.document_ids.min(dim=1, keepdim=True).values
    offset = torch.cumsum(doc.max(dim=1).values + 1, 0) - (doc.max(dim=1).values + 1)
    return Flat(batch.input_ids.reshape(-1), batch.loss_mask.reshape(-1), batch.position_ids.reshape(-1),
                (doc + offset[:, None]).reshape(-1))


def sample_batch_anchors(batch: Batch, flat: Flat, block_size: int, max_anchors: int,
                         generator: torch.Generator | None) -> torch.Tensor:
    """Sorted flat anchors [N], at most max_anchors per row."""
    Bz, T = batch.input_ids.shape
    rows = [sample_anchors(flat.document_ids[r * T:(r + 1) * T], flat.loss_mask[r * T:(r + 1) * T],
                           block_size, max_anchors, generator) + r * T for r in range(Bz)]
    return torch.cat(rows)


@dataclass
class Prepared:
    """Everything a step needs before the drafter runs (no gradients)."""

    anchors: torch.Tensor  # [N] sorted flat anchor positions
    supervised: torch.Tensor  # [N, B] bool
    target_logits: Labels  # the target's labels at a + k - 1 for supervised (j, k): its final normed states
    # [P, Ht] at the distinct label positions and its head, which the loss runs chunk by chunk (on the draft
    # vocabulary's rows, with the full argmax, where that is known), + the row of each slot
    features: torch.Tensor  # [Bz*T, F*Ht]
    block_embeds: torch.Tensor  # [N, B, Hd]
    layout: BlockLayout
    prev: torch.Tensor  # [S] each supervised slot's previous token, the data's (Domino: [S, B - 1] its block prefix)
    host_supervised: torch.Tensor | None = None  # `supervised` on the host (the loss's chunks of whole blocks)
    input_ids: torch.Tensor | None = None  # [Bz*T] the batch's tokens, flat, on the device


@dataclass
class HostPlan:
    """A batch's host-side bookkeeping (flattening, anchors, supervised slots, label rows): no device
    work, so the trainer makes the next micro-batch's on a thread while the device runs this one."""

    host: Flat
    anchors: torch.Tensor  # [N]
    supervised: torch.Tensor  # [N, B] bool
    keep: torch.Tensor  # [Bz*T] bool: positions whose logits are labels
    index: torch.Tensor  # [S] each supervised slot's row among the kept positions


def plan_host(batch: Batch, block_size: int, *, max_anchors: int = DEFAULTS.max_anchors,
              generator: torch.Generator | None = None, anchors: torch.Tensor | None = None) -> HostPlan:
    """The host half of `prepare` (clauses 4 and 6): anchors, supervised slots and label positions."""
    B = block_size
    Bz, T = batch.input_ids.shape
    if T < B:
        raise ValueError(f"sequence length {T} is shorter than a block ({B}); use longer sequences "
                         f"or a smaller block size")
    if not bool(batch.loss_mask.any()):
        raise ValueError("the loss mask is empty: no token to learn in this batch")
    host = flatten(batch)
    host = Flat(*(t.cpu() for t in (host.input_ids, host.loss_mask, host.position_ids, host.document_ids)))
    anchors = (sample_batch_anchors(batch, host, B, max_anchors, generator) if anchors is None
               else anchors.cpu())
    if anchors.numel() == 0:
        raise ValueError("no position can anchor a block: every loss-mask run is shorter than 2 tokens "
                         "inside its document")
    sup = supervised_slots(host.document_ids, host.loss_mask, anchors, B)  # [N, B]
    lpos = label_positions(anchors, B)[sup]  # [S] flat positions whose logits are the labels
    keep = torch.zeros(Bz * T, dtype=torch.bool)
    keep[lpos] = True
    row_of = torch.cumsum(keep.long(), 0) - 1  # flat position -> row among the kept positions
    return HostPlan(host, anchors, sup, keep, row_of[lpos])


def prepare(target, drafter, batch: Batch, *, max_anchors: int = DEFAULTS.max_anchors,
            generator: torch.Generator | None = None,
            anchors: torch.Tensor | None = None, cached=None, host_plan: HostPlan | None = None,
            label_rows: bool = True) -> Prepared:
    """Run the target once: features, anchors, supervised slots and their labels (clauses 1, 3, 4, 6).

    `anchors` (flat, sorted) overrides sampling. The labels are the target's own head on its final
    normed states at the label positions, which equals its logits (one norm, never two), run by the
    loss one chunk of slots at a time. `cached` (data.features.StoredOutputs, stored earlier)
    replaces the target forward; with its full-vocabulary argmax known, a draft vocabulary's rows are
    all the head computes, and with `label_rows` False (a loss that reads only that argmax:
    `needs_label_rows`) the head does not run. `host_plan`: `plan_host` of this batch, made ahead
    (else made here).
    """
    B = drafter.block_size
    Bz, T = batch.input_ids.shape
    dev = target.device
    hp = host_plan or plan_host(batch, B, max_anchors=max_anchors, generator=generator, anchors=anchors)
    host, anchors, sup, keep, index = hp.host, hp.anchors, hp.supervised, hp.keep, hp.index
    flat = Flat(*(t.to(dev) for t in (host.input_ids, host.loss_mask, host.position_ids, host.document_ids)))
    anchors_d, sup_d, keep_d, index_d = (t.to(dev) for t in (anchors, sup, keep, index))
    rows = drafter.vocab_rows
    if cached is None and not final_states_supported(target):  # a model without a base: its own logits [P, V]
        out = target(batch.input_ids.to(dev), position_ids=batch.position_ids.to(dev), logits_mask=keep_d.view(Bz, T))
        labels, feats = Labels(out.logits, index_d), out.features.reshape(Bz * T, -1)
    else:
        # the final normed states at the label positions [P, Ht]; the loss runs the head on them one chunk
        # of slots at a time, so no [P, V] tensor exists (head(final state) is the target's logits, clause 3)
        if cached is None:
            out = target(batch.input_ids.to(dev), position_ids=batch.position_ids.to(dev), return_final_hidden=True)
            final, top, feats = out.final_hidden, None, out.features.reshape(Bz * T, -1)
        else:
            final = cached.final_hidden.to(dev, non_blocking=True)
            top = None if cached.top is None else cached.top.reshape(Bz * T)[keep].to(dev)  # [P]
            feats = cached.features.to(dev, non_blocking=True).reshape(Bz * T, -1)
        hidden = final.reshape(Bz * T, -1)[keep_d].to(target.dtype)
        if top is not None and not label_rows:  # the argmax is all the loss reads
            labels = Labels(None, index_d, top)
        elif top is not None and rows is not None:  # the full-vocabulary argmax is known: draft rows only
            labels = Labels(None, index_d, top, hidden, lambda h: target.head(h, rows), index)
        else:
            labels = Labels(None, index_d, None, hidden, target.head, index)
    embeds = target.embed(block_input_ids(flat.input_ids, anchors_d, B, drafter.mask_token_id))  # [N, B, Hd]
    layout = BlockLayout(flat.document_ids, flat.position_ids, anchors_d, B, host_document_ids=host.document_ids,
                         host_anchors=anchors)
    prev = drafter.kind.slot_prev(flat.input_ids, anchors_d, sup_d)  # the tokens before each slot its terms read
    return Prepared(anchors_d, sup_d, labels, feats, embeds, layout, prev, sup, flat.input_ids)


def final_states_supported(target) -> bool:
    """Whether the target returns its final normed states (a transformers model with a base `.model`):
    then the labels are its head on them, made chunk by chunk in the loss."""
    return getattr(target.model, "model", None) is not None


def compute_loss(target, drafter, batch: Batch, *, max_anchors: int = DEFAULTS.max_anchors,
                 gamma: float | None = DEFAULTS.gamma, loss: str = DEFAULTS.loss, generator: torch.Generator | None = None,
                 backend: str = "auto", anchors: torch.Tensor | None = None, cached=None,
                 sync_metrics: bool = True, host_plan: HostPlan | None = None) -> tuple[torch.Tensor, dict]:
    """Loss and metrics of one batch (clause 7); `sync_metrics=False` leaves them on the device as sums."""
    rows = drafter.vocab_rows
    terms = drafter.kind.slot_terms(drafter, lambda h: target.head(h.to(target.dtype), rows), rows, target.embed)
    p = prepare(target, drafter, batch, max_anchors=max_anchors, generator=generator, anchors=anchors,
                cached=cached, host_plan=host_plan, label_rows=needs_label_rows(loss, terms))
    dt = drafter.fc.weight.dtype
    # under autocast fc takes the features as they come (an fp32 copy of [T, F*Ht] would be the
    # largest tensor of the step); the block rows start the residual stream in the weights' dtype
    amp = torch.is_autocast_enabled(p.features.device.type)
    hidden = drafter(p.features if amp else p.features.to(dt), p.block_embeds.to(dt), p.layout, backend)  # [N, B, Hd]
    g = default_gamma(drafter.block_size) if gamma is None else gamma
    # the [S, Vd] draft logits are made one chunk of slots at a time
    # (as many slots per chunk as the device's free memory allows: 256 on a CPU)
    # the chunk's widest rows: the draft head's, or the label rows' (full width unless the full argmax is known)
    lab = p.target_logits
    width = max(len(rows) if rows is not None else target.vocab_size,
                0 if lab.logits is None and lab.hidden is None else
                len(rows) if lab.top is not None and rows is not None else target.vocab_size)
    out = dflash_loss_chunked(hidden[p.supervised], None, p.target_logits, p.supervised, gamma=g, kind=loss,
                              draft_vocab=rows, chunk=loss_chunk_slots(hidden.device, width),
                              sync_metrics=sync_metrics, terms=terms, prev=p.prev, host_supervised=p.host_supervised)
    if drafter.kind.block_loss is None:
        return out
    return out[0] + kind_block_loss(target, drafter, p, hidden), out[1]


def kind_block_loss(target, drafter, p: Prepared, hidden: torch.Tensor) -> torch.Tensor:
    """A kind's loss over whole blocks (LiLiCorr's correlator: model/kinds/lilicorr.py), from the drafter's
    rows [N, B, Hd], the data's tokens at a + k and the context row at a - 1 (when in the anchor's document)."""
    B = drafter.block_size
    ids = p.input_ids
    tokens = ids[slot_token_positions(p.anchors, B).clamp(max=ids.shape[0] - 1)]  # [N, B]
    before = (p.anchors - 1).clamp(min=0)
    docs = p.layout.document_ids
    valid = (p.anchors > 0) & (docs[before] == docs[p.anchors])
    feats = p.features[before]
    anchor = drafter.context(feats.to(drafter.fc.weight.dtype)) * valid[:, None].to(hidden.dtype)
    head = lambda h: target.head(h.to(target.dtype))  # noqa: E731  (the full vocabulary: LiLiCorr has no other)
    return drafter.kind.block_loss(drafter, head, target.embed, hidden, tokens, p.supervised, anchor, valid)


def needs_label_rows(loss: str, terms) -> bool:
    """Whether a step's loss reads the target's label rows, not only their argmax: every loss but the
    hard one, and kinds whose added terms compare distributions (DSpark's confidence)."""
    return loss != "hard" or terms.reads_label_rows


def train_step(target, drafter, optimizer, batch: Batch, *, grad_clip: float | None = 1.0, **kw) -> dict:
    """compute_loss + backward + clip + optimizer step; returns the metrics."""
    drafter.train()
    optimizer.zero_grad(set_to_none=True)
    loss, metrics = compute_loss(target, drafter, batch, **kw)
    loss.backward()
    if grad_clip:
        from .distributed import clip_grad_norm

        metrics["grad_norm"] = clip_grad_norm(drafter.parameters(), grad_clip)
    optimizer.step()
    return metrics
