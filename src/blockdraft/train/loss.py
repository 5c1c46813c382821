"""Loss and metrics (clause 7).

Legend: N blocks, B block size, S supervised slots, V vocabulary.

Per-slot weight w_k = exp(-(k-1)/gamma) for k >= 1, w_0 = 0; the loss is the weighted
mean over supervised slots. The accepted length of a block is exact:
1 + the number of leading slots whose argmax equals the target's argmax (a slot that is
not supervised ends the run, since it cannot be verified).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

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


def slot_losses(draft_logits: torch.Tensor, target_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """[S, V] x [S, V] -> [S] per-slot loss."""
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    if kind == "hard":
        return F.nll_loss(logq, target_logits.argmax(dim=-1), reduction="none")
    logp = F.log_softmax(target_logits.float(), dim=-1)
    p = logp.exp()
    if kind == "soft":
        return -(p * logq).sum(-1)
    if kind == "kl":
        return (p * (logp - logq)).sum(-1)
    raise ValueError(f"unknown loss {kind!r}; choose one of {LOSSES}")


def accepted_lengths(match: torch.Tensor) -> torch.Tensor:
    """match [N, B] bool (slot 0 ignored) -> [N] exact greedy accepted length 1 + leading matches."""
    return 1 + match[:, 1:].long().cumprod(dim=1).sum(dim=1)


class RestrictedLabels(NamedTuple):
    """Labels already restricted to a draft vocabulary: the target's logits on those ids [S, Vd]
    and its argmax over the full vocabulary [S] (known from earlier, e.g. a feature memo), so
    the full-vocabulary head need not run every step."""

    logits: torch.Tensor
    top: torch.Tensor


def _weights_and_labels(target_logits, supervised, gamma, kind, draft_vocab):
    """Slot weights [S], the target's argmax [S] (full vocabulary) and the label logits, restricted
    to the draft vocabulary if any (hard loss: slots whose argmax lies outside get weight 0)."""
    N, B = supervised.shape
    w = slot_weights(B, gamma, supervised.device).expand(N, B)[supervised]  # [S]
    if isinstance(target_logits, RestrictedLabels):
        if draft_vocab is None or target_logits.logits.shape[-1] != len(draft_vocab):
            raise ValueError("restricted labels need the draft vocabulary they were restricted to")
        target_top, labels = target_logits.top, target_logits.logits
    else:
        target_top = target_logits.argmax(-1)
        labels = target_logits if draft_vocab is None else target_logits[:, draft_vocab]
    if draft_vocab is not None and kind == "hard":
        w = w * torch.isin(target_top, draft_vocab)
    return w, target_top, labels


def _metrics(loss: torch.Tensor, hit: torch.Tensor, supervised: torch.Tensor) -> dict:
    """Per-slot accuracy and exact accepted lengths from the per-slot hits [S]."""
    N, B = supervised.shape
    with torch.no_grad():
        match = torch.zeros(N, B, dtype=torch.bool, device=supervised.device)
        match[supervised] = hit
        acc_len = accepted_lengths(match)
        n_sup = supervised.sum(0).clamp(min=1)
        slot_acc = (match.sum(0).float() / n_sup.float()).tolist()
        slot_acc = [a if supervised[:, k].any() else math.nan for k, a in enumerate(slot_acc)]
    return {"loss": float(loss.detach()), "tau": float(acc_len.float().mean()), "accuracy": float(hit.float().mean()),
            "slot_accuracy": slot_acc, "slot_counts": supervised.sum(0).tolist(),
            "accepted_lengths": acc_len.tolist(), "supervised_slots": int(supervised.sum()), "blocks": N}


def dflash_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, supervised: torch.Tensor, *,
                gamma: float, kind: str = "soft", draft_vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """draft logits [S, Vd] and target logits [S, V] for the supervised slots of `supervised`
    [N, B] (row-major order). With a draft vocabulary (ids [Vd]), the loss compares the draft
    with the target restricted to those ids (hard: slots whose target argmax lies outside are
    left out of the loss), while the metrics compare draft and target argmax in the full
    vocabulary, so a token the drafter cannot propose counts as a miss.

    Returns the scalar loss and metrics: per-slot accuracy, mean accepted length (tau) and
    the per-block accepted lengths.
    """
    N, B = supervised.shape
    S = int(supervised.sum())
    if S == 0:
        raise ValueError("no supervised slot in this batch: the loss mask is empty or every block "
                         "ends at its document's end; check the data's loss_mask")
    n_labels = (target_logits.logits if isinstance(target_logits, RestrictedLabels) else target_logits).shape[0]
    if draft_logits.shape[0] != S or n_labels != S:
        raise ValueError(f"expected logits for {S} supervised slots, got {draft_logits.shape[0]} and {n_labels}")
    w, target_top, target_logits = _weights_and_labels(target_logits, supervised, gamma, kind, draft_vocab)
    draft_top = draft_logits.argmax(-1)
    if draft_vocab is not None:
        draft_top = draft_vocab[draft_top]
    per = slot_losses(draft_logits, target_logits, kind)  # [S]
    loss = (w * per).sum() / w.sum().clamp(min=1e-12)
    return loss, _metrics(loss, draft_top == target_top, supervised)


def dflash_loss_chunked(hidden: torch.Tensor, head, target_logits: torch.Tensor, supervised: torch.Tensor, *,
                        gamma: float, kind: str = "soft", draft_vocab: torch.Tensor | None = None,
                        chunk: int = 256) -> tuple[torch.Tensor, dict]:
    """`dflash_loss` from the supervised slots' hidden states [S, Hd] and `head` (hidden -> [*, Vd]),
    never holding the [S, Vd] draft logits: each chunk of slots is recomputed in backward.
    Same value and gradient as `dflash_loss(head(hidden), ...)`; peak memory one chunk."""
    from torch.utils.checkpoint import checkpoint

    N, B = supervised.shape
    S = int(supervised.sum())
    if S == 0 or hidden.shape[0] != S:
        return dflash_loss(head(hidden), target_logits, supervised, gamma=gamma, kind=kind, draft_vocab=draft_vocab)
    w, target_top, target_logits = _weights_and_labels(target_logits, supervised, gamma, kind, draft_vocab)

    def part(h, t, wc):
        logits = head(h)
        return (wc * slot_losses(logits, t, kind)).sum(), logits.argmax(-1)

    total, tops = hidden.new_zeros(()), []
    for i in range(0, S, chunk):
        sl = slice(i, i + chunk)
        part_sum, top = checkpoint(part, hidden[sl], target_logits[sl], w[sl], use_reentrant=False)
        total = total + part_sum
        tops.append(top)
    loss = total / w.sum().clamp(min=1e-12)
    draft_top = torch.cat(tops)
    if draft_vocab is not None:
        draft_top = draft_vocab[draft_top]
    return loss, _metrics(loss, draft_top == target_top, supervised)
