"""Proposers: what the speculative loop verifies each step, behind one small interface.

`propose(state, room)` returns a Proposal: up to `room` draft tokens after the last committed
one, their draft distributions when sampling (None when greedy), and whether the drafter ran
(it then took the pending context rows into its cache). Three are composed:

- DrafterProposer: the DFlash drafter's block ([last, MASK x (B-1)]); with a draft threshold,
  only the drafts up to the first slot whose top draft probability is below it (at least one).
  The cut depends only on the drafter's distributions (all computed before any draw), so the
  output is unchanged (greedy: still the target's tokens; sampling: still exact).
- LookupProposer: prompt lookup (`lookup.py`); a copied token's draft distribution is one-hot.
- FirstOf: the first proposer with a proposal (lookup, then the drafter).

Legend: B block size, V target vocabulary, Vd draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import sampling_probs
from .lookup import NgramIndex

# With a draft threshold, these slots are drafted and scored before the others: the cut usually comes
# in the first few (mean verified ~2 for the default drafter), so scoring all 15 slots against the
# draft vocabulary, and for an in-block-causal drafter even running its layers on them, is wasted.
FIRST_SLOTS = 4


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k] drafts (k may be 0)
    q: torch.Tensor | None  # [k, V] draft distributions (sampling only)
    drafted: bool = False  # the drafter ran this step
    copied: bool = False  # the drafts were copied from the text


@dataclass
class Sampling:
    temperature: float
    top_p: float
    generator: torch.Generator


class DrafterProposer:
    def __init__(self, target, drafter, sampling: Sampling, draft_threshold: float = 0.0):
        self.target, self.drafter, self.s, self.threshold = target, drafter, sampling, draft_threshold
        self.cache = drafter.new_context_cache()

    def propose(self, st, room: int) -> Proposal:
        """Drafts for the block at the last committed token (position st.length - 1)."""
        b = room + 1
        block = torch.full((b,), self.drafter.mask_token_id, dtype=torch.long, device=st.device)
        block[0] = st.committed[-1]
        drafts, q, conf = self._draft(block, st.pending_features, st.pending_positions, st.length - 1)
        if self.threshold > 0:
            low = (conf < self.threshold).nonzero()
            keep = max(1, int(low[0, 0]) if len(low) else b - 1)
            drafts, q = drafts[:keep], None if q is None else q[:keep]
        return Proposal(drafts, q, drafted=True)

    def _draft(self, block, new_feats, new_pos, anchor_pos):
        """Drafts for slots 1.. of `block` [b], (sampling) their distributions, and each slot's top
        draft probability. With a threshold the first FIRST_SLOTS slots are scored first and the
        rest only if none of them is below it: fewer than b - 1 drafts may come back, always up to
        and including the cut."""
        d, dt = self.drafter, self.drafter.fc.weight.dtype
        b = block.shape[0]
        embeds = self.target.embed(block).to(dt)
        # a kind that drafts the block at once (LiLiCorr's lattice) is cut after all of it is drafted
        n = b if self.threshold <= 0 or d.kind.whole_block else min(b, 1 + FIRST_SLOTS)  # block rows needed so far
        # a drafter whose block attention is not causal must see the whole block at once
        rows_run = n if d.causal_in_block else b
        hidden = d.draft_hidden(new_feats.to(dt), new_pos, embeds[:rows_run], anchor_pos, self.cache)
        first = self._score(hidden[1:n], [int(block[0])])
        if n == b or bool((first[2] < self.threshold).any()):
            return first
        if hidden.shape[0] < b:  # the context rows are already in the cache: none are added again
            hidden = d.draft_hidden(new_feats[:0].to(dt), new_pos[:0], embeds, anchor_pos, self.cache)
        rest = self._score(hidden[n:], [int(block[0]), *first[0].tolist()])
        return tuple(None if a is None else torch.cat([a, c]) for a, c in zip(first, rest))

    def _score(self, hidden, prefix: list[int]):
        """Normed drafter rows [s, Hd] and the block's tokens before the first (the anchor's, then the
        drafts) -> drafted ids [s], (sampling) their distributions [s, V], and the confidence a threshold
        cuts on [s]: the drafter's kind reads them (model/kinds/: DSpark and DFlash2 walk left to right
        from the last of them, Domino from all of them)."""
        rows = self.drafter.vocab_rows
        s = self.s

        def head(h):
            return self.target.head(h.to(self.target.dtype), rows)  # [s, Vd]

        probs = (lambda x: sampling_probs(x, s.temperature, s.top_p)) if s.temperature > 0 else None
        kind = self.drafter.kind
        prev = prefix if kind.reads_prefix else prefix[-1]
        out = kind.draft(self.drafter, head, hidden, prev, rows, probs, s.generator, embed=self.target.embed,
                         anchor=self.cache.anchor)
        return out.tokens, out.q, out.conf


class LookupProposer:
    def __init__(self, tokens: list[int], lookup: int, ngram: int, vocab_size: int, sampling: Sampling):
        self.index, self.k, self.V, self.s = NgramIndex(tokens, ngram), lookup, vocab_size, sampling

    def propose(self, st, room: int) -> Proposal:
        copied = self.index.propose(min(self.k, room))
        t = torch.tensor(copied, dtype=torch.long, device=st.device)
        q = torch.nn.functional.one_hot(t, self.V).float() if copied and self.s.temperature > 0 else None
        return Proposal(t, q, copied=bool(copied))

    def commit(self, tokens: list[int]) -> None:
        self.index.extend(tokens)


class FirstOf:
    """The first proposer with a proposal."""

    def __init__(self, *proposers):
        self.proposers = proposers

    def propose(self, st, room: int) -> Proposal:
        for p in self.proposers:
            prop = p.propose(st, room)
            if len(prop.tokens):
                return prop
        return prop

    def commit(self, tokens: list[int]) -> None:
        for p in self.proposers:
            if hasattr(p, "commit"):
                p.commit(tokens)
