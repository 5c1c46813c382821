"""Lossless speculative generation (clause 8).

Legend: P prompt tokens, B block size, V target vocabulary, Vd draft vocabulary.

Prefill the target on the prompt (features + first token). Then repeat: the drafter
proposes [last, MASK x (B-1)] from its cached context; the target verifies the B tokens in
one forward; the longest prefix the target agrees with is accepted (greedy: equal to its
argmax; sampling: speculative sampling), the target's own next token is appended, the
target cache is cropped to the committed length (recurrent layers too, from the states the cache
recorded: `recurrent.py`) and the committed tokens' features become
new drafter context.

`draft_threshold` > 0 verifies only the drafts up to the first slot whose top draft probability
falls below it (at least one): verifying fewer tokens is cheaper, and since the cut depends only
on the drafter's distributions (all computed before any draw), the output is unchanged (greedy:
still the target's own tokens; sampling: still exact speculative sampling over a shorter draft).

`lookup` > 0 adds prompt lookup (`lookup.py`): when the last few committed tokens occurred
earlier, up to `lookup` tokens that followed them are verified instead of the drafter's block,
and the drafter is not run that step (its new context rows wait for its next step). The draft
distribution of a copied token is one-hot, so speculative sampling stays exact.

The loop is `step` over a proposer (`proposers.py`: drafter, threshold cut, prompt lookup).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from ..pairing import check_pair
from .acceptance import accept_greedy, accept_sampled, sampling_probs
from .proposers import DrafterProposer, FirstOf, LookupProposer, Proposal, Sampling
from .recurrent import RecurrentRollback


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


@dataclass
class State:
    """What one sequence's generation has committed, and the context rows the drafter has not seen."""

    committed: list[int]
    length: int  # tokens so far, prompt included; the last one (position length - 1) has no features yet
    pending_features: torch.Tensor  # [n, F*Ht] target features of committed rows the drafter has not taken
    pending_positions: torch.Tensor  # [n]
    device: torch.device

    def add_context(self, feats: torch.Tensor, positions: torch.Tensor, drafter_took_pending: bool) -> None:
        if drafter_took_pending:
            self.pending_features, self.pending_positions = feats, positions
        else:
            self.pending_features = torch.cat([self.pending_features, feats])
            self.pending_positions = torch.cat([self.pending_positions, positions])


def now(device: torch.device) -> float:
    """The wall clock after the device's queued work: CUDA runs ahead of the host, so an unsynced
    clock gives a verify's time to whatever reads the device next."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def step(target, proposer, st: State, cache, s: Sampling, room: int, res: GenerationResult,
         rollback: RecurrentRollback | None = None) -> list[int]:
    """One draft-verify-accept step: verify the proposal after the last token in one target forward,
    keep the agreed prefix and the target's own next token, crop the cache (with `rollback`, recurrent
    layers too, checked: recurrent.py), queue the features."""
    t0 = now(st.device)
    prop = proposer.propose(st, room) if room > 0 else Proposal(torch.empty(0, dtype=torch.long, device=st.device),
                                                                None)
    block = torch.cat([torch.tensor([st.committed[-1]], device=st.device), prop.tokens.to(st.device)])
    t1 = now(st.device)
    L, b = st.length, block.shape[0]
    out = target(block[None], position_ids=torch.arange(L - 1, L - 1 + b, device=st.device)[None], cache=cache)
    t2 = now(st.device)
    if s.temperature > 0:
        m, nxt = accept_sampled(block[1:], prop.q, sampling_probs(out.logits[0], s.temperature, s.top_p), s.generator)
    else:
        m, nxt = accept_greedy(block[1:], out.logits[0])
    if rollback is not None:
        rollback.keep(L + m, block, m + 1)
    else:
        target.crop_cache(cache, L + m)  # keep positions 0 .. L-1+m: the anchor and the accepted drafts
    st.add_context(out.features[0, :m + 1], torch.arange(L - 1, L + m, device=st.device), prop.drafted)
    res.verified.append(b)
    res.drafts.append(block[1:].tolist() if prop.drafted else [])
    res.lookup_steps += prop.copied
    res.time_draft += t1 - t0
    res.time_verify += t2 - t1
    return block[1:1 + m].tolist() + [int(nxt)]


@torch.no_grad()
def speculative_generate(target, drafter, input_ids: torch.Tensor, *, max_new_tokens: int, temperature: float = 0.0,
                         top_p: float = 1.0, stop_token_ids=None, block_size: int | None = None,
                         seed: int | None = None, on_tokens=None, draft_threshold: float = 0.0,
                         lookup: int = 0, lookup_ngram: int = 3) -> GenerationResult:
    """Generate with the drafter; the output follows the target exactly (greedy: token for token).
    `lookup`: most tokens copied per step by prompt lookup (0: off), matching the last
    `lookup_ngram` tokens first, then shorter suffixes down to one token."""
    B = _validate(target, drafter, input_ids, max_new_tokens, block_size, temperature, top_p)
    _check_speed_settings(draft_threshold, lookup)
    gen = torch.Generator(device=target.device)
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
    s, stops, dev = Sampling(temperature, top_p, gen), set(stop_token_ids or []), target.device
    drafter.eval()
    t_start = now(dev)
    res, ids, cache = GenerationResult(tokens=[]), input_ids.to(dev), target.new_cache(rollback=B)
    rollback = RecurrentRollback(target, cache)
    P = ids.shape[1]
    out = target(ids, position_ids=torch.arange(P, device=dev)[None], cache=cache)  # prefill
    target.crop_cache(cache, P)  # drops what the prefill recorded: each verify starts with none
    st = State([int(_pick(out.logits[0, -1:], temperature, top_p, gen)[0])], P + 1, out.features[0],
               torch.arange(P, device=dev), dev)
    res.time_prefill = now(dev) - t_start
    proposer = DrafterProposer(target, drafter, s, draft_threshold)
    if lookup > 0:  # copies from the text first, the drafter when there is nothing to copy
        proposer = FirstOf(LookupProposer(ids[0].tolist() + st.committed, lookup, lookup_ngram, target.vocab_size, s),
                           proposer)
    if on_tokens:
        on_tokens(st.committed[:])
    while len(st.committed) < max_new_tokens and st.committed[-1] not in stops:
        room = min(B, max_new_tokens - len(st.committed) + 1) - 1  # drafts this step can still use
        new = _truncate(step(target, proposer, st, cache, s, room, res, rollback), stops,
                        max_new_tokens - len(st.committed))
        st.committed += new
        st.length += len(new)
        if hasattr(proposer, "commit"):
            proposer.commit(new)
        res.accepted.append(len(new))
        if on_tokens:
            on_tokens(new)
    res.tokens = st.committed[:max_new_tokens]
    res.time_total = now(dev) - t_start
    return res


def _check_speed_settings(draft_threshold: float, lookup: int) -> None:
    if not 0.0 <= draft_threshold < 1.0:
        raise ValueError(f"draft_threshold must be in [0, 1), got {draft_threshold}")
    if lookup < 0:
        raise ValueError(f"lookup must be >= 0 tokens, got {lookup}")


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=gen)[:, 0]


def _truncate(new: list[int], stops: set, room: int) -> list[int]:
    new = new[:room]
    for i, t in enumerate(new):
        if t in stops:
            return new[:i + 1]
    return new
