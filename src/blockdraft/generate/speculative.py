"""Lossless speculative generation (clause 8).

Legend: P prompt tokens, B block size, V target vocabulary, Vd draft vocabulary.

Prefill the target on the prompt (features + first token). Then repeat: the drafter
proposes [last, MASK x (B-1)] from its cached context; the target verifies the B tokens in
one forward; the longest prefix the target agrees with is accepted (greedy: equal to its
argmax; sampling: speculative sampling), the target's own next token is appended, the
target cache is cropped to the committed length and the committed tokens' features become
new drafter context.

`draft_threshold` > 0 verifies only the drafts up to the first slot whose top draft probability
falls below it (at least one): verifying fewer tokens is cheaper, and since the cut depends only
on the drafter's distributions (all computed before any draw), the output is unchanged (greedy:
still the target's own tokens; sampling: still exact speculative sampling over a shorter draft).

`lookup` > 0 adds prompt lookup (`lookup.py`): when the last few committed tokens occurred
earlier, up to `lookup` tokens that followed them are verified instead of the drafter's block,
and the drafter is not run that step (its new context rows wait for its next step). The draft
distribution of a copied token is one-hot, so speculative sampling stays exact.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from .acceptance import accept_greedy, accept_sampled, sampling_probs
from ..pairing import check_pair
from .lookup import NgramIndex


@dataclass
class GenerationResult:
    tokens: list[int]  # the new token ids
    accepted: list[int] = field(default_factory=list)  # tokens committed per verify step (incl. the target's own)
    verified: list[int] = field(default_factory=list)  # tokens the target verified per step (anchor + drafts)
    drafts: list[list[int]] = field(default_factory=list)  # the drafter's proposals per step ([] on lookup steps)
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_prefill: float = 0.0
    time_total: float = 0.0
    lookup_steps: int = 0  # verify steps whose drafts were copied from the text (prompt lookup)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step (accepted drafts + the target's own token)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


def _validate(target, drafter, input_ids, max_new_tokens, block_size, temperature, top_p) -> int:
    check_pair(target, drafter)
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("input_ids must be [1, P]: batch size 1")
    limit = getattr(target.model.config, "max_position_embeddings", None)
    if limit and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the target's "
                         f"context of {limit} tokens")
    B = block_size or drafter.block_size
    if B < 1:
        raise ValueError(f"block_size must be >= 1, got {B}")
    if B > drafter.block_size:
        warnings.warn(f"block size {B} is larger than the drafter was trained for ({drafter.block_size}): "
                      "acceptance of the extra slots will be poor", stacklevel=3)
    return B


@torch.no_grad()
def speculative_generate(target, drafter, input_ids: torch.Tensor, *, max_new_tokens: int, temperature: float = 0.0,
                         top_p: float = 1.0, stop_token_ids=None, block_size: int | None = None,
                         seed: int | None = None, on_tokens=None, draft_threshold: float = 0.0,
                         lookup: int = 0, lookup_ngram: int = 3) -> GenerationResult:
    """Generate with the drafter; the output follows the target exactly (greedy: token for token).
    `lookup`: most tokens copied per step by prompt lookup (0: off), matching the last
    `lookup_ngram` tokens first, then shorter suffixes down to one token."""
    B = _validate(target, drafter, input_ids, max_new_tokens, block_size, temperature, top_p)
    if not 0.0 <= draft_threshold < 1.0:
        raise ValueError(f"draft_threshold must be in [0, 1), got {draft_threshold}")
    if lookup < 0:
        raise ValueError(f"lookup must be >= 0 tokens, got {lookup}")
    gen = torch.Generator(device=target.device)
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
    stops = set(stop_token_ids or [])
    dev = target.device
    drafter.eval()
    t_start = time.perf_counter()
    res = GenerationResult(tokens=[])
    ids = input_ids.to(dev)
    P = ids.shape[1]
    cache = target.new_cache()
    out = target(ids, position_ids=torch.arange(P, device=dev)[None], cache=cache)  # prefill
    first = _pick(out.logits[0, -1:], temperature, top_p, gen)[0]
    res.time_prefill = time.perf_counter() - t_start
    committed = [int(first)]
    if on_tokens:
        on_tokens(committed[:])
    new_feats, new_pos = out.features[0], torch.arange(P, device=dev)  # context rows not yet in the drafter
    ctx = drafter.new_context_cache()
    index = NgramIndex(ids[0].tolist() + committed, lookup_ngram) if lookup > 0 else None
    mask_id = drafter.mask_token_id
    while len(committed) < max_new_tokens and committed[-1] not in stops:
        L = P + len(committed)  # tokens so far; the last one (position L-1) has no features yet
        b = min(B, max_new_tokens - len(committed) + 1)
        t0 = time.perf_counter()
        block = torch.full((b,), mask_id, dtype=torch.long, device=dev)
        block[0] = committed[-1]
        draft_q = None
        copied = index.propose(min(lookup, b - 1)) if index is not None and b > 1 else []
        drafted = b > 1 and not copied
        if copied:
            b = 1 + len(copied)
            block = block[:b]
            block[1:] = torch.tensor(copied, device=dev)
            if temperature > 0:
                draft_q = torch.nn.functional.one_hot(block[1:], target.vocab_size).float()
            res.lookup_steps += 1
        elif drafted:
            drafts, draft_q, conf = _propose(target, drafter, block, new_feats, new_pos, L - 1, ctx,
                                             temperature, top_p, gen, draft_threshold)
            if draft_threshold > 0:
                low = (conf < draft_threshold).nonzero()
                keep = int(low[0, 0]) if len(low) else b - 1
                b = 1 + max(1, keep)
                drafts = drafts[:b - 1]
                draft_q = None if draft_q is None else draft_q[:b - 1]
            block = block[:b]
            block[1:] = drafts
        t1 = time.perf_counter()
        out = target(block[None], position_ids=torch.arange(L - 1, L - 1 + b, device=dev)[None], cache=cache)
        t2 = time.perf_counter()
        if temperature > 0:
            p = sampling_probs(out.logits[0], temperature, top_p)
            m, nxt = accept_sampled(block[1:], draft_q, p, gen)
        else:
            m, nxt = accept_greedy(block[1:], out.logits[0])
        new = block[1:1 + m].tolist() + [int(nxt)]
        target.crop_cache(cache, L + m)  # keep positions 0 .. L-1+m: the anchor and the accepted drafts
        fresh, fresh_pos = out.features[0, :m + 1], torch.arange(L - 1, L + m, device=dev)
        if drafted:  # the drafter took the earlier rows into its cache this step
            new_feats, new_pos = fresh, fresh_pos
        else:
            new_feats, new_pos = torch.cat([new_feats, fresh]), torch.cat([new_pos, fresh_pos])
        new = _truncate(new, stops, max_new_tokens - len(committed))
        committed += new
        if index is not None:
            index.extend(new)
        res.accepted.append(len(new))
        res.verified.append(b)
        res.drafts.append(block[1:].tolist() if drafted else [])
        if on_tokens:
            on_tokens(new)
        res.time_draft += t1 - t0
        res.time_verify += t2 - t1
    res.tokens = committed[:max_new_tokens]
    res.time_total = time.perf_counter() - t_start
    return res


# With a draft threshold, these slots are drafted and scored before the others: the cut usually comes
# in the first few (mean verified ~2 for the default drafter), so scoring all 15 slots against the
# draft vocabulary, and for an in-block-causal drafter even running its layers on them, is wasted.
FIRST_SLOTS = 4


def _propose(target, drafter, block, new_feats, new_pos, anchor_pos, ctx, temperature, top_p, gen,
             draft_threshold: float = 0.0):
    """Draft tokens for slots 1.. of `block` [b], (sampling) their distributions, and each slot's
    top draft probability. With `draft_threshold` > 0 the first FIRST_SLOTS slots are scored first
    and the rest only if none of them is below it: the caller cuts at the first low slot, so fewer
    than b - 1 drafts may come back, always up to and including the cut."""
    dt = drafter.fc.weight.dtype
    b = block.shape[0]
    embeds = target.embed(block).to(dt)
    n = b if draft_threshold <= 0 else min(b, 1 + FIRST_SLOTS)  # block rows needed so far
    # a drafter whose block attention is not causal must see the whole block at once
    rows_run = n if drafter.causal_in_block else b
    hidden = drafter.draft_hidden(new_feats.to(dt), new_pos, embeds[:rows_run], anchor_pos, ctx)
    first = _score(target, drafter, hidden[1:n], temperature, top_p, gen)
    if n == b or bool((first[2] < draft_threshold).any()):
        return first
    if hidden.shape[0] < b:  # the context rows are already in `ctx`: none are added again
        hidden = drafter.draft_hidden(new_feats[:0].to(dt), new_pos[:0], embeds, anchor_pos, ctx)
    rest = _score(target, drafter, hidden[n:], temperature, top_p, gen)
    return tuple(None if a is None else torch.cat([a, c]) for a, c in zip(first, rest))


def _score(target, drafter, hidden, temperature, top_p, gen):
    """Normed drafter rows [s, Hd] -> drafted ids [s], (sampling) distributions [s, V], top probs [s]."""
    rows = drafter.vocab_rows
    logits = target.head(hidden.to(target.dtype), rows)  # [s, Vd]
    if temperature > 0:
        q = _full_vocab(sampling_probs(logits, temperature, top_p), rows, target.vocab_size)
        # the cut uses each slot's top probability, never the sampled token: a cut that depended on
        # the draw would bias the drafts that reach verification and break exactness
        return torch.multinomial(q, 1, generator=gen)[:, 0], q, q.max(-1).values
    probs = logits.float().softmax(-1)
    conf, picks = probs.max(-1)
    return (rows[picks] if rows is not None else picks), None, conf


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=gen)[:, 0]


def _full_vocab(probs: torch.Tensor, rows, vocab_size: int) -> torch.Tensor:
    if rows is None:
        return probs
    full = probs.new_zeros(probs.shape[0], vocab_size)
    full[:, rows] = probs
    return full


def _truncate(new: list[int], stops: set, room: int) -> list[int]:
    new = new[:room]
    for i, t in enumerate(new):
        if t in stops:
            return new[:i + 1]
    return new
