"""Loss and metrics (clause 7).

Legend: N blocks, B block size, S supervised slots, V vocabulary.

Per-slot weight w_k = exp(-(k-1)/gamma) for k >= 1, w_0 = 0, or D-PACE's weights (`DPace`), which
follow the drafter's own confidence; the loss is the weighted mean over supervised slots. The accepted length of a block is exact:
1 + the number of leading slots whose argmax equals the target's argmax (a slot that is
not supervised ends the run, since it cannot be verified).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

# the chunk's sizing is the memory plan's (train.loss runs it, blockdraft.plan counts it)
from ..plan import LOSS_BYTES_PER_ENTRY, LOSS_CHUNK_MAX, LOSS_CHUNK_MIN, LOSS_MEMORY_SHARE, chunk_slots  # noqa: F401

LOSSES = ("soft", "hard", "kl")
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """Paper values (7 for B=16, 5 for B=10, 4 for B=8), linear in B elsewhere."""
    return PAPER_GAMMA.get(block_size, max(1.0, 7.0 * block_size / 16))


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B]: 0 for the anchor slot, exp(-(k-1)/gamma) for k >= 1."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


class DPace(NamedTuple):
    """D-PACE slot weights (speculators' DFlash default since its PR #736), used in place of a gamma.

    With q_k the drafter's probability of the target's argmax at slot k (exp(-CE)) and
    c_k = (1 - alpha) q_k + alpha (1 on slots outside the loss), a supervised slot k weighs
    sum over supervised j >= k of c_1 ... c_j: how much of the expected accepted length still
    rides on slot k. The weights are constants of the step (no gradient flows through them).
    speculators divides the weighted sum by the number of supervised slots; blockdraft, as for
    every weighting, by the sum of the weights."""

    alpha: float = 0.5


def dpace_weights(confidence: torch.Tensor, supervised: torch.Tensor, alpha: float) -> torch.Tensor:
    """[N, B] the drafter's probability of the target's argmax per slot, [N, B] bool -> [N, B] D-PACE
    weights (0 off the supervised slots)."""
    if not 0 < alpha <= 1:
        raise ValueError(f"the D-PACE alpha must be in (0, 1], got {alpha}")
    mask = supervised.to(torch.float32)
    c = torch.where(supervised, (1 - alpha) * confidence.detach().float() + alpha, torch.ones_like(mask))
    reach = torch.cumprod(c, dim=1) * mask  # [N, B] chance-like mass of reaching slot j
    return reach.flip(1).cumsum(1).flip(1) * mask


def slot_losses(draft_logits: torch.Tensor, target_logits: torch.Tensor | None, kind: str,
                target_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[S, V] x [S, V] -> [S] per-slot loss. The hard loss needs only the target's argmax: `target_ids` [S]
    (its column in the draft logits) when known, so no label row is read."""
    if kind == "hard":
        ids = target_logits.argmax(dim=-1) if target_ids is None else target_ids
        return F.cross_entropy(draft_logits.float(), ids, reduction="none")
    if kind not in ("soft", "kl"):
        raise ValueError(f"unknown loss {kind!r}; choose one of {LOSSES}")
    return _TargetLoss.apply(draft_logits, target_logits.detach(), kind == "kl")


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[S, V] . [S, V] -> [S], summed pairwise (a batched matmul sums a 49k-long row with ~1e-4 error)."""
    return torch.linalg.vecdot(a, b)


class _TargetLoss(torch.autograd.Function):
    """The per-slot loss against the target's distribution p = softmax(target): soft -sum p log q, kl
    sum p (log p - log q), q = softmax(draft). Both have the gradient q - p to the draft logits (p sums
    to 1), which forward keeps in place of log q: one [S, V] tensor saved, and backward one product,
    where autograd through log_softmax, the difference and the product makes and keeps several."""

    @staticmethod
    def forward(ctx, draft_logits, target_logits, kl: bool):
        logq = F.log_softmax(draft_logits.float(), dim=-1)
        logp = F.log_softmax(target_logits.float(), dim=-1)
        p = logp.exp()
        per = _row_dot(p, logp.sub_(logq)) if kl else -_row_dot(p, logq)
        ctx.dtype = draft_logits.dtype
        ctx.save_for_backward(logq.exp_().sub_(p))  # q - p, in log q's place
        return per

    @staticmethod
    def backward(ctx, g):
        (q_minus_p,) = ctx.saved_tensors
        return (q_minus_p * g.float()[:, None]).to(ctx.dtype), None, None


def accepted_lengths(match: torch.Tensor) -> torch.Tensor:
    """match [N, B] bool (slot 0 ignored) -> [N] exact greedy accepted length 1 + leading matches."""
    return 1 + match[:, 1:].long().cumprod(dim=1).sum(dim=1)


class RestrictedLabels(NamedTuple):
    """Labels already restricted to a draft vocabulary: the target's logits on those ids [S, Vd]
    and its argmax over the full vocabulary [S] (known from earlier, e.g. a feature memo), so
    the full-vocabulary head need not run every step."""

    logits: torch.Tensor
    top: torch.Tensor


class Labels(NamedTuple):
    """The target's labels once per distinct label position, and which of them each supervised slot
    reads (overlapping blocks share positions). Slots pick their row inside each loss chunk, so no
    [S, V] copy exists (docs/scale.md, rule 3).

    Either `logits` [P, V] (or [P, Vd], already restricted to the draft vocabulary: then `top`, the
    full-vocabulary argmax [P], is required), or `hidden` [P, Ht], the target's final normed states
    at those positions, with `head` (its own head: rows -> logits, restricted likewise when `top` is
    given), which the loss runs one chunk of slots at a time, so no [P, V] tensor exists either; or
    neither, when the loss needs only `top`: the hard loss of a kind whose added terms read no label
    row. `index` [S] row per supervised slot; `host_index` the same on the host (lets each chunk run
    the head on the span of rows it reads without a device read; without it, once per slot)."""

    logits: torch.Tensor | None
    index: torch.Tensor
    top: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    host_index: torch.Tensor | None = None

    def rows(self, i: int, j: int) -> torch.Tensor | None:
        """The label logits of slots i..j-1 [j - i, V'] (None without logits or states), made now."""
        if self.hidden is None:
            return None if self.logits is None else self.logits[self.index[i:j]]
        with torch.no_grad():
            if self.host_index is None:
                return self.head(self.hidden[self.index[i:j]])
            part = self.host_index[i:j]
            lo, hi = int(part.min()), int(part.max()) + 1
            made = self.head(self.hidden[lo:hi])  # the rows this chunk spans, each once
            return made if hi - lo == j - i and bool((part == torch.arange(lo, hi)).all()) \
                else made[self.index[i:j] - lo]

    def per_slot(self) -> torch.Tensor:
        """[S, V] one row per supervised slot (tests and checks; training never builds it)."""
        return self.rows(0, self.index.shape[0])


def as_labels(target_logits) -> Labels:
    """Labels from any accepted form: [S, V] per-slot logits, RestrictedLabels or Labels."""
    if isinstance(target_logits, Labels):
        return target_logits
    if isinstance(target_logits, RestrictedLabels):
        n = target_logits.logits.shape[0]
        return Labels(target_logits.logits, torch.arange(n, device=target_logits.logits.device), target_logits.top)
    return Labels(target_logits, torch.arange(target_logits.shape[0], device=target_logits.device))


def _weighted_parts(target_logits, supervised, gamma, kind, draft_vocab):
    """Slot weights [S], the target's argmax [S] (full vocabulary), the label rows [P, V or Vd], the
    slot -> row index [S], and whether the rows still need restricting to the draft vocabulary
    (hard loss: slots whose argmax lies outside the draft vocabulary get weight 0)."""
    N, B = supervised.shape
    if isinstance(gamma, DPace):  # its weights need the draft: here only the hard loss's mask below
        w = torch.ones(int(supervised.sum()), device=supervised.device)
    else:
        w = slot_weights(B, gamma, supervised.device).expand(N, B)[supervised]  # [S]
    lab = as_labels(target_logits)
    if lab.hidden is not None:  # the unchunked loss: every label row at once
        with torch.no_grad():
            lab = Labels(lab.head(lab.hidden), lab.index, lab.top)
    restricted = lab.top is not None
    if lab.logits is None and (lab.top is None or kind != "hard"):
        raise ValueError(f"labels without logits carry only the target's argmax: the {kind!r} loss needs its logits")
    if restricted:
        if lab.logits is not None and (draft_vocab is None or lab.logits.shape[-1] != len(draft_vocab)):
            raise ValueError("restricted labels need the draft vocabulary they were restricted to")
        top_rows = lab.top
    else:
        top_rows = lab.logits.argmax(-1)  # [P]
    target_top = top_rows[lab.index]  # [S]
    if draft_vocab is not None and kind == "hard":
        w = w * torch.isin(target_top, draft_vocab)
    return w, target_top, lab.logits, lab.index, draft_vocab is not None and not restricted


def _metrics(loss: torch.Tensor, hit: torch.Tensor, supervised: torch.Tensor, sync: bool = True) -> dict:
    """Per-slot accuracy and exact accepted lengths from the per-slot hits [S].

    Read back to the host in one transfer (`sync`); with sync=False the figures stay on the device
    as sums (`totals`), for a caller that adds them up over batches or ranks first."""
    N, B = supervised.shape
    with torch.no_grad():
        match = torch.zeros(N, B, dtype=torch.bool, device=supervised.device)
        match[supervised] = hit
        acc_len = accepted_lengths(match)  # [N]
        counts = supervised.sum(0)  # [B]
        slot_hits = match.sum(0)  # [B]
        S = counts.sum()
        f = torch.float64
        n_blocks = torch.tensor(float(N), dtype=f, device=supervised.device)
        head = torch.stack([n_blocks, acc_len.sum().to(f), loss.detach().to(f) * S, S.to(f)])
        totals = {"blocks_lengths_loss_slots": head, "slot_hits": slot_hits.to(f), "slot_counts": counts.to(f)}
        if not sync:
            return {"loss": loss.detach(), "totals": totals}
        packed = torch.cat([loss.detach().to(f)[None], hit.to(f).mean()[None], slot_hits.to(f), counts.to(f),
                            acc_len.to(f)]).tolist()  # the one host read of a step's metrics
    loss_v, accuracy = packed[0], packed[1]
    hits_v, counts_v, lengths = packed[2:2 + B], packed[2 + B:2 + 2 * B], packed[2 + 2 * B:]
    slot_acc = [h / c if c else math.nan for h, c in zip(hits_v, counts_v)]
    return {"loss": loss_v, "tau": sum(lengths) / len(lengths), "accuracy": accuracy,
            "slot_accuracy": slot_acc, "slot_counts": [int(c) for c in counts_v],
            "accepted_lengths": [int(x) for x in lengths], "supervised_slots": int(sum(counts_v)), "blocks": N,
            "totals": totals}


def _confidence(draft_logits: torch.Tensor, target_top: torch.Tensor, draft_vocab) -> torch.Tensor:
    """[s, Vd], [s] target argmax (full vocabulary) -> [s] the drafter's probability of it (0 for a
    token outside the draft vocabulary, whose ids are sorted)."""
    with torch.no_grad():
        logq = F.log_softmax(draft_logits.float(), dim=-1)
        if draft_vocab is None:
            return logq.gather(1, target_top[:, None])[:, 0].exp()
        at = torch.searchsorted(draft_vocab, target_top).clamp(max=len(draft_vocab) - 1)
        inside = draft_vocab[at] == target_top
        return torch.where(inside, logq.gather(1, at[:, None])[:, 0].exp(), torch.zeros_like(logq[:, 0]))


def _weighted(w, per, confidence, supervised, gamma):
    """The loss from per-slot losses [S]: the fixed weights `w`, or D-PACE's from the confidences [S]
    (times `w`, which then holds only the hard loss's draft-vocabulary mask)."""
    if isinstance(gamma, DPace):
        q = torch.zeros(supervised.shape, dtype=torch.float32, device=supervised.device)
        q[supervised] = confidence
        w = dpace_weights(q, supervised, gamma.alpha)[supervised] * w
    return (w * per).sum() / w.sum().clamp(min=1e-12)


def _slot_labels(logits: torch.Tensor | None, index: torch.Tensor, draft_vocab, restrict: bool) -> torch.Tensor | None:
    """The label rows of some slots [s, V'], gathered now (inside a loss chunk); None without logits."""
    if logits is None:
        return None
    t = logits[index]
    return t[:, draft_vocab] if restrict else t


def _draft_column(target_top: torch.Tensor, draft_vocab) -> torch.Tensor:
    """The target's argmax [s] as a column of the draft logits (a token outside the draft vocabulary,
    whose slots weigh 0 in the hard loss, gets column 0)."""
    if draft_vocab is None:
        return target_top
    at = torch.searchsorted(draft_vocab, target_top).clamp(max=len(draft_vocab) - 1)
    return torch.where(draft_vocab[at] == target_top, at, torch.zeros_like(at))


def dflash_loss(draft_logits: torch.Tensor, target_logits, supervised: torch.Tensor, *,
                gamma: "float | DPace", kind: str = "soft", draft_vocab: torch.Tensor | None = None,
                sync_metrics: bool = True) -> tuple[torch.Tensor, dict]:
    """draft logits [S, Vd] and the target's label logits for the supervised slots of `supervised`
    [N, B] (row-major order): [S, V] per slot, or `Labels` (distinct rows + index). With a draft
    vocabulary (ids [Vd]), the loss compares the draft with the target restricted to those ids
    (hard: slots whose target argmax lies outside are left out of the loss), while the metrics
    compare draft and target argmax in the full vocabulary, so a token the drafter cannot propose
    counts as a miss.

    Returns the scalar loss and metrics: per-slot accuracy, mean accepted length (tau) and
    the per-block accepted lengths.
    """
    N, B = supervised.shape
    S = int(supervised.sum())
    if S == 0:
        raise ValueError("no supervised slot in this batch: the loss mask is empty or every block "
                         "ends at its document's end; check the data's loss_mask")
    n_labels = as_labels(target_logits).index.shape[0]
    if draft_logits.shape[0] != S or n_labels != S:
        raise ValueError(f"expected logits for {S} supervised slots, got {draft_logits.shape[0]} and {n_labels}")
    w, target_top, logits, index, restrict = _weighted_parts(target_logits, supervised, gamma, kind, draft_vocab)
    draft_top = draft_logits.argmax(-1)
    if draft_vocab is not None:
        draft_top = draft_vocab[draft_top]
    per = slot_losses(draft_logits, _slot_labels(logits, index, draft_vocab, restrict), kind,
                      _draft_column(target_top, draft_vocab))  # [S]
    conf = _confidence(draft_logits, target_top, draft_vocab) if isinstance(gamma, DPace) else None
    loss = _weighted(w, per, conf, supervised, gamma)
    return loss, _metrics(loss, draft_top == target_top, supervised, sync_metrics)


def cuda_free_bytes(device) -> int:
    """What a new tensor on this CUDA device can take: the driver's free memory plus the blocks torch's
    caching allocator holds unused (after the first step the allocator keeps the step's peak reserved,
    so the driver's figure alone would shrink every later step's chunk to the floor)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free) + int(torch.cuda.memory_reserved(device)) - int(torch.cuda.memory_allocated(device))


def loss_chunk_slots(device, vocab: int, free_bytes: int | None = None) -> int:
    """Slots per chunk of `dflash_loss_chunked` for a head `vocab` wide on `device`.

    Off CUDA: 256, always (a CPU's results and memory stay as they were). On CUDA a 256-slot chunk
    is bound by kernel launches (~120 chunks for 30k slots), so a chunk takes as many slots as keep
    its transient tensors (LOSS_BYTES_PER_ENTRY per slot and vocabulary entry) near 1/32 of the free
    memory (`free_bytes`; default `cuda_free_bytes`), within [256, 8192], rounded down to a multiple
    of 256."""
    if torch.device(device).type != "cuda":
        return LOSS_CHUNK_MIN
    return chunk_slots(cuda_free_bytes(device) if free_bytes is None else free_bytes, vocab)


class _ChunkShare:
    """`dflash_loss_chunked`'s share of one chunk, called as `share(h, span)` by `fused_chunks`."""

    def __init__(self, lab, terms, prev, supervised, gamma, kind, draft_vocab, *, restrict, width, fixed,
                 need_rows, where):
        self.lab, self.terms, self.prev, self.supervised = lab, terms, prev, supervised
        self.gamma, self.kind, self.draft_vocab = gamma, kind, draft_vocab
        self.restrict, self.width, self.fixed, self.need_rows, self.where = restrict, width, fixed, need_rows, where
        self.dpace = isinstance(gamma, DPace)

    def __call__(self, h, span):
        """The chunk of slots i..j (blocks b..e under D-PACE): its weighted loss, and per slot the
        drafted id, the target's argmax and the weight."""
        lab, terms, prev, supervised, gamma, kind, draft_vocab = (self.lab, self.terms, self.prev, self.supervised,
                                                                  self.gamma, self.kind, self.draft_vocab)
        restrict, width, fixed, need_rows, where, dpace = (self.restrict, self.width, self.fixed, self.need_rows,
                                                           self.where, self.dpace)
        from ..model.kinds.base import to_target_ids

        B = supervised.shape[1]
        i, j, b, e = span
        t = lab.rows(i, j) if need_rows else None  # [c, V or Vd], made here (no grad), freed after
        if t is not None and width is not None and t.shape[-1] != width:
            raise ValueError(f"restricted labels are {t.shape[-1]} wide, the draft vocabulary {width}")
        top = lab.top[lab.index[i:j]] if lab.top is not None else t.argmax(-1)  # [c] full vocabulary
        if restrict:
            t = t[:, draft_vocab]
        draft = terms.logits(h, prev[i:j])  # [c, Vd]
        w = torch.ones(j - i, device=h.device) if dpace else fixed[i:j]
        if draft_vocab is not None and kind == "hard":  # a target token the drafter cannot propose: not learnt
            w = w * torch.isin(top, draft_vocab)
        plain = w  # what a kind's added term weighs its slots by (under D-PACE too)
        if dpace:
            at = where[i:j] - b * B  # the chunk's slots in its blocks' flat [e - b, B]
            q = torch.zeros((e - b) * B, dtype=torch.float32, device=h.device)
            q[at] = _confidence(draft, top, draft_vocab)
            w = dpace_weights(q.view(e - b, B), supervised[b:e], gamma.alpha).reshape(-1)[at] * w
        per = slot_losses(draft, t, kind, _draft_column(top, draft_vocab))
        lam = terms.base_share  # Domino: (1 - lambda) of the corrected logits' loss + lambda of the head's alone
        if lam:
            per = (1 - lam) * per + lam * slot_losses(terms.base_logits(h), t, kind, _draft_column(top, draft_vocab))
        added, picked = terms.added(draft, t, h, prev[i:j], top)
        picked = to_target_ids(draft.argmax(-1), draft_vocab) if picked is None else picked
        value = (w * per).sum()
        if added is None:
            return value[None], (picked, top, w.detach()[:, None])
        if not dpace:  # one weighting, one sum
            value = value + terms.weight * (w * added).sum()
            return value[None], (picked, top, w.detach()[:, None])
        # under D-PACE the added term keeps its plain weights, and its own sum of them
        value = torch.stack([value, terms.weight * (plain * added).sum()])
        return value, (picked, top, torch.stack([w, plain], 1).detach())


def dflash_loss_chunked(hidden: torch.Tensor, head, target_logits, supervised: torch.Tensor, *,
                        gamma: "float | DPace", kind: str = "soft", draft_vocab: torch.Tensor | None = None,
                        chunk: int = 256, sync_metrics: bool = True, terms=None,
                        prev: torch.Tensor | None = None,
                        host_supervised: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """`dflash_loss` from the supervised slots' hidden states [S, Hd] and `head` (hidden -> [*, Vd]),
    never holding the [S, Vd] draft logits nor an [S, V] copy of the labels, nor (labels as the
    target's final states: `Labels.hidden`) its [P, V] logits: peak memory one chunk, both sides.

    Each chunk's draft and label logits are made once and its share of the loss differentiated at
    once (`fused_chunks`: no head runs again in backward). A chunk adds up its slots' weighted losses
    and weights; the loss is the sum over chunks divided by the weights' sum, a constant of the step.
    D-PACE's weights of a slot read only its own block's drafts, so under D-PACE a chunk holds whole
    blocks (at least one), found from the supervised mask on the host (`host_supervised`, default
    `supervised` read back).

    `terms` (a drafter kind's `SlotTerms`, model/kinds/) replaces `head`: its logits (DSpark adds its
    Markov bias, from each slot's previous token `prev` [S]) and the per-slot loss it adds, weighted
    as the token loss's slots are under a gamma, by the slots' plain weights under D-PACE (times
    `terms.weight`)."""
    from ..model.kinds import SlotTerms

    terms = terms or SlotTerms(None, head, draft_vocab)
    S = hidden.shape[0]
    prev = torch.zeros(S, dtype=torch.long, device=hidden.device) if prev is None else prev
    lab = as_labels(target_logits)
    if S == 0 or lab.index.shape[0] != S:
        return dflash_loss(terms.logits(hidden, prev), target_logits, supervised, gamma=gamma, kind=kind,
                           draft_vocab=draft_vocab, sync_metrics=sync_metrics)
    restrict, width = _label_form(lab, kind, draft_vocab)
    N, B = supervised.shape
    dpace = isinstance(gamma, DPace)
    fixed = None if dpace else slot_weights(B, gamma, supervised.device).expand(N, B)[supervised]  # [S]
    need_rows = kind != "hard" or terms.reads_label_rows or lab.top is None
    host_sup = where = None
    if dpace:
        host_sup = (supervised if host_supervised is None else host_supervised).cpu()
        # each slot's place in the flat [N * B] mask, from the host: a chunk scatters its confidences and
        # gathers its weights by index, not by a boolean mask (each a device read on CUDA)
        where = host_sup.reshape(-1).nonzero()[:, 0].to(supervised.device, non_blocking=True)

    share = _ChunkShare(lab, terms, prev, supervised, gamma, kind, draft_vocab, restrict=restrict, width=width,
                        fixed=fixed, need_rows=need_rows, where=where)
    spans = block_spans(host_sup, chunk) if dpace else [(i, min(i + chunk, S), 0, 0) for i in range(0, S, chunk)]
    total, (draft_top, target_top, w) = fused_chunks(hidden, share, spans, trainable(terms))
    loss = (total / w.sum(0).clamp(min=1e-12)).sum()  # each sum of weighted losses over its weights' sum
    return loss, _metrics(loss, draft_top == target_top, supervised, sync_metrics)


def _label_form(lab: Labels, kind: str, draft_vocab) -> tuple[bool, int | None]:
    """Whether each chunk's label rows still need restricting to the draft vocabulary, and the width
    restricted rows must have (None: not checked); refuses labels the loss cannot read."""
    if lab.logits is None and lab.hidden is None and (lab.top is None or kind != "hard"):
        raise ValueError(f"labels without logits carry only the target's argmax: the {kind!r} loss needs its logits")
    if lab.hidden is not None and lab.head is None:
        raise ValueError("labels given as the target's final states need its head")
    if lab.top is None:
        return draft_vocab is not None, None
    if draft_vocab is None and lab.logits is not None:
        raise ValueError("restricted labels need the draft vocabulary they were restricted to")
    if lab.logits is not None and lab.logits.shape[-1] != len(draft_vocab):
        raise ValueError("restricted labels need the draft vocabulary they were restricted to")
    return False, None if draft_vocab is None else len(draft_vocab)


def block_spans(supervised: torch.Tensor, chunk: int) -> list[tuple[int, int, int, int]]:
    """Chunks of whole blocks from the supervised mask [N, B] (host): (first slot, end slot, first
    block, end block), each at most `chunk` slots unless one block alone has more."""
    counts = supervised.sum(1).tolist()
    spans, i, b, n = [], 0, 0, 0
    for e, c in enumerate(counts):
        if n and n + c > chunk:
            spans.append((i, i + n, b, e))
            i, b, n = i + n, e, 0
        n += c
    if n:
        spans.append((i, i + n, b, len(counts)))
    return spans


def trainable(terms) -> list[torch.Tensor]:
    """The parameters a kind's slot terms may train beside the drafter's hidden states (its own heads)."""
    mods = [m for m in (getattr(terms.drafter, name, None) for name in ("markov_head", "confidence_head",
                                                                       "candidate_selector", "prefix_gru",
                                                                       "embed_proj")) if m is not None]
    return [p for m in mods for p in m.parameters() if p.requires_grad]


def fused_chunks(hidden: torch.Tensor, share, spans: list[tuple[int, ...]], params: list[torch.Tensor]):
    """The sum over chunks of `share(h, span)` (values [k] and a tuple of per-slot tensors of the chunk,
    span (i, j, ...) its slots i..j), with the gradient of each of the k values to `hidden` and
    `params` taken chunk by chunk as the value is: (the k totals, the per-slot tensors over every slot,
    concatenated)."""
    if not (torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params))):
        with torch.no_grad():
            outs = [share(hidden[sp[0]:sp[1]], sp) for sp in spans]
        return torch.stack([v.float() for v, _ in outs]).sum(0), tuple(torch.cat(x) for x in zip(*(o for _, o in outs)))
    total, *extra = _FusedChunks.apply(hidden, share, spans, *params)
    return total, tuple(extra)


def _keep(x):
    return x


class _FusedChunks(torch.autograd.Function):
    """A chunked loss whose backward only scales gradients its forward took: each chunk's logits exist
    once, inside forward (the recomputation a checkpoint would do is the head's cost again). With k
    values per chunk (k > 1: sums normalised apart) each keeps its own gradients."""

    @staticmethod
    def forward(ctx, hidden, share, spans, *params):
        grad_h = None
        grads: list[torch.Tensor | None] = [None] * len(params)
        total = None
        outs = []
        for span in spans:
            i, j = span[0], span[1]
            h = hidden[i:j].detach().requires_grad_(True)
            # what a chunk's own graph saves lives only until its gradient is taken, here: hooks outside
            # (activation offloading, memory accounting) see only what backward keeps
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                value, out = share(h, span)
                k = value.shape[0]
                gs = [torch.autograd.grad(value[c], [h, *params], allow_unused=True, retain_graph=c < k - 1)
                      for c in range(k)]
            if grad_h is None:
                grad_h = hidden.new_zeros((k, *hidden.shape))
                total = torch.zeros(k, dtype=torch.float32, device=hidden.device)
            for c, g in enumerate(gs):
                if g[0] is not None:
                    grad_h[c, i:j] = g[0]
                for n, gp in enumerate(g[1:]):
                    if gp is not None:
                        if grads[n] is None:
                            grads[n] = gp.new_zeros((k, *gp.shape))
                        grads[n][c] += gp
            total += value.detach().float()
            outs.append(out)
        extra = tuple(torch.cat(x) for x in zip(*outs))
        ctx.mark_non_differentiable(*extra)
        ctx.has = [g is not None for g in grads]
        ctx.save_for_backward(grad_h, *[g for g in grads if g is not None])
        return (total, *extra)

    @staticmethod
    def backward(ctx, g_total, *_g_extra):
        grad_h, *kept = ctx.saved_tensors
        it = iter(kept)

        def scaled(g):  # [k, ...] per value -> their sum, each times its value's incoming gradient
            return (g * g_total.to(g.dtype).view(-1, *[1] * (g.dim() - 1))).sum(0)

        params = [scaled(next(it)) if has else None for has in ctx.has]
        return (scaled(grad_h), None, None, *params)
