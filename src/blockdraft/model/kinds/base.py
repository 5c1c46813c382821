"""The kind interface, and DFlash: the backbone alone (clause 8's drafts: each slot's own argmax).

Legend: s slots, c slots of one loss chunk, Hd hidden, Vd draft vocabulary, V target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..layers import DFlashDecoderLayer

Head = Callable[[torch.Tensor], torch.Tensor]  # final-normed rows [s, Hd] -> the target head's logits [s, Vd]
Probs = Callable[[torch.Tensor], torch.Tensor]  # logits [s, n] -> sampling probabilities [s, n]
Embed = Callable[[torch.Tensor], torch.Tensor]  # target ids [...] -> the target's raw embedding rows [..., Ht]


@dataclass
class Drafted:
    """One block's drafts: target ids [s], (sampling) the distribution each was drawn from [s, V], and
    the confidence a draft threshold cuts on [s] (known before the slot's own token is drawn)."""

    tokens: torch.Tensor
    q: torch.Tensor | None
    conf: torch.Tensor


class SlotTerms:
    """A kind's part of the loss of one chunk of supervised slots. `prev` [c] is each slot's previous
    token (the data's token at the slot's label position: teacher forcing); `rows` the draft
    vocabulary's target ids or None. DFlash: the head's logits, nothing added."""

    weight = 1.0  # of the added term, against the token loss
    base_share = 0.0  # lambda: the token loss is (1 - lambda) of the logits' + lambda of the head's alone (Domino)
    reads_label_rows = False  # whether `added` reads the label rows (else the target's argmax is all it takes)

    def __init__(self, drafter: nn.Module, head: Head, rows: torch.Tensor | None):
        self.drafter, self.head, self.rows = drafter, head, rows

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[c, Hd] -> the head's logits alone [c, Vd] (what `base_share` weighs)."""
        return self.head(h)

    def logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """[c, Hd], [c] -> the draft logits the token loss compares with the target [c, Vd]."""
        return self.head(h)

    def added(self, draft: torch.Tensor, labels: torch.Tensor, h: torch.Tensor, prev: torch.Tensor,
              target_top: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The added per-slot loss [c] (None: none) and the drafted target ids [c] the metrics read when
        they are not the argmax of `draft` (None). `labels` [c, Vd] the target's rows on the draft
        vocabulary, `target_top` [c] its full-vocabulary argmax."""
        return None, None


def to_target_ids(picks: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return picks if rows is None else rows[picks]


def full_vocab(probs: torch.Tensor, ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[s, n] probabilities over target ids `ids` ([n] or [s, n]; None: n is the vocabulary) -> [s, V]."""
    if ids is None:
        return probs
    full = probs.new_zeros(probs.shape[0], vocab_size)
    return full.scatter_(1, ids.expand(probs.shape[0], -1) if ids.dim() == 1 else ids, probs)


def pick_one(logits: torch.Tensor, rows: torch.Tensor | None, probs: Probs | None, vocab_size: int,
             generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One slot's draft from its logits [1, Vd], for the kinds that walk slot by slot: (target id [1], its
    confidence [1]: the top probability, known before the draw, (sampling) the distribution drawn from
    [1, V], else None)."""
    if probs is None:
        c, pick = logits.float().softmax(-1).max(-1)
        return to_target_ids(pick, rows), c, None
    q = full_vocab(probs(logits), rows, vocab_size)
    return torch.multinomial(q, 1, generator=generator)[:, 0], q.max(-1).values, q


class Kind:
    name = "dflash"
    layer = DFlashDecoderLayer
    terms = SlotTerms
    chained = False  # whether a slot's draft reads the draft before it (DFlash: each slot's own argmax)
    reads_prefix = False  # whether `draft` takes the block's tokens from the anchor on as `prev` (Domino)
    whole_block = False  # whether `draft` reads every slot of the block at once (LiLiCorr's lattice)
    block_loss = None  # a loss over whole blocks beside the slots' (LiLiCorr: `block_loss(drafter, head, ...)`)

    def build(self, drafter: nn.Module) -> None:
        """Add the kind's modules beside the layers (its layer modules come with `layer`)."""

    @torch.no_grad()
    def reset_parameters(self, drafter: nn.Module) -> None:
        """Start the kind's own weights where the drafter computes the DFlash function of its backbone."""

    def slot_terms(self, drafter: nn.Module, head: Head, rows: torch.Tensor | None,
                   embed: Embed | None = None) -> SlotTerms:
        """`embed`: the target's embedding, for a kind whose terms read the tokens' rows (Domino)."""
        return self.terms(drafter, head, rows)

    def slot_prev(self, input_ids: torch.Tensor, anchors: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
        """Flat ids [T], anchors [N], supervised [N, B] -> what `SlotTerms` reads of the tokens before each
        supervised slot: here the one token before it (the data's, at its label position) [S]."""
        from ..blocks import label_positions

        return input_ids[label_positions(anchors, supervised.shape[1])[supervised]]

    def draft(self, drafter: nn.Module, head: Head, hidden: torch.Tensor, prev: int, rows: torch.Tensor | None,
              probs: Probs | None, generator: torch.Generator | None, embed: Embed | None = None,
              anchor: torch.Tensor | None = None) -> Drafted:
        """The drafts of final-normed rows `hidden` [s, Hd] (slots 1.. of the block, or some of them),
        `prev` the token before the first of them (`reads_prefix`: the block's tokens from the anchor up
        to it); `probs` None: greedy. What a kind may read besides: `embed` the target's embedding
        (Domino's GRU, LiLiCorr's candidates) and `anchor` the newest context row [Hd], None where there
        is none yet (LiLiCorr)."""
        logits = head(hidden)  # [s, Vd]
        V = drafter.config.vocab_size
        if probs is None:
            conf, picks = logits.float().softmax(-1).max(-1)
            return Drafted(to_target_ids(picks, rows), None, conf)
        q = full_vocab(probs(logits), rows, V)
        # the cut uses each slot's top probability, never the sampled token: a cut that depended on the
        # draw would bias the drafts that reach verification and break exactness
        return Drafted(torch.multinomial(q, 1, generator=generator)[:, 0], q, q.max(-1).values)


class DFlash(Kind):
    pass
