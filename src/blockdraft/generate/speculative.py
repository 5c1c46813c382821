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
         rollback: RecurrentRollback | None = None, chunk: int = 0) -> list[int]:
    """One draft-verify-accept step: verify the proposal after the last token in one target forward
    (greedy with `chunk` > 0: `chunk` tokens a forward, up to the first rejected one), keep the agreed prefix and the target's own next token, crop the cache (with `rollback`, recurrent
    layers too, checked: recurrent.py), queue the features."""
    t0 = now(st.device)
    prop = proposer.propose(st, room) if room > 0 else Proposal(torch.empty(0, dtype=torch.long, device=st.device),
                                                                None)
    block = torch.cat([torch.tensor([st.committed[-1]], device=st.device), prop.tokens.to(st.device)])
    t1 = now(st.device)
    L, b = st.length, block.shape[0]
    logits, feats, start = _verify(target, block, L, cache, chunk if s.temperature == 0 else 0)
    t2 = now(st.device)
    if s.temperature > 0:
        m, nxt = accept_sampled(block[1:], prop.q, sampling_probs(logits, s.temperature, s.top_p), s.generator)
    else:
        m, nxt = accept_greedy(block[1:logits.shape[0]], logits)
    if rollback is not None:  # the last forward's rows: its recurrent record
        rollback.keep(L + m, block[start:logits.shape[0]], m + 1 - start)
    else:
        target.crop_cache(cache, L + m)  # keep positions 0 .. L-1+m: the anchor and the accepted drafts
    st.add_context(feats[:m + 1], torch.arange(L - 1, L + m, device=st.device), prop.drafted)
    res.verified.append(b)
    res.drafts.append(block[1:].tolist() if prop.drafted else [])
    res.lookup_steps += prop.copied
    res.time_draft += t1 - t0
    res.time_verify += t2 - t1
    return block[1:1 + m].tolist() + [int(nxt)]


def _verify(target, block: torch.Tensor, L: int, cache, chunk: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The target's logits and features for the block at positions L-1 .., and the offset of the last
    forward's first row. `chunk` > 0 (greedy only) verifies `chunk` rows per forward and stops at the
    first row whose argmax is not the next draft: the rows after it cannot change what is accepted,
    so the result is the one-forward result (up to float rounding) with fewer rows computed."""
    b, dev = block.shape[0], block.device
    step_rows = b if chunk <= 0 else chunk
    logits, feats, start = [], [], 0
    while True:
        n = min(step_rows, b - start)
        out = target(block[None, start:start + n], position_ids=torch.arange(L - 1 + start, L - 1 + start + n,
                                                                              device=dev)[None], cache=cache)
        logits.append(out.logits[0])
        feats.append(out.features[0])
        end = start + n
        if end >= b or not torch.equal(out.logits[0].argmax(-1), block[start + 1:end + 1]):
            break
        start = end  # the cache holds the chunk: its tokens are all accepted
    return torch.cat(logits), torch.cat(feats), start


# `verify_chunk` where a forward's cost grows with its rows (fp32 on a CPU): SmolLM2 with the shipped drafter's
# whole 16-token blocks at one thread, the same tokens and acceptance, 0.68 of one forward's time at 2 or 4 rows
# (benchmarks/verify_chunk.py, benchmarks/results/verify-chunk-1thread.json); 4 was the best of 2, 3, 4 and 6 on
# 9 prompts (136 s one forward, 97, 96, 94, 107 s)
CPU_VERIFY_CHUNK = 4


@torch.no_grad()
def speculative_generate(target, drafter, input_ids: torch.Tensor, *, max_new_tokens: int, temperature: float = 0.0,
                         top_p: float = 1.0, stop_token_ids=None, block_size: int | None = None,
                         seed: int | None = None, on_tokens=None, draft_threshold: float = 0.0,
                         lookup: int = 0, lookup_ngram: int = 3, verify_chunk: int = 0) -> GenerationResult:
    """Generate with the drafter; the output follows the target exactly (greedy: token for token).
    `lookup`: most tokens copied per step by prompt lookup (0: off), matching the last
    `lookup_ngram` tokens first, then shorter suffixes down to one token. `verify_chunk` > 0 (greedy):
    verify that many tokens per target forward, up to the first rejected one (`_verify`): the same
    tokens and acceptance, fewer rows computed where a forward's cost grows with its rows (a CPU)."""
    B = _validate(target, drafter, input_ids, max_new_tokens, block_size, temperature, top_p)
    _check_speed_settings(draft_threshold, lookup, verify_chunk)
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
        new = _truncate(step(target, proposer, st, cache, s, room, res, rollback, verify_chunk), stops,
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


def _check_speed_settings(draft_threshold: float, lookup: int, verify_chunk: int) -> None:
    if not 0.0 <= draft_threshold < 1.0:
        raise ValueError(f"draft_threshold must be in [0, 1), got {draft_threshold}")
    if lookup < 0:
        raise ValueError(f"lookup must be >= 0 tokens, got {lookup}")
    if verify_chunk < 0:
        raise ValueError(f"verify_chunk must be >= 0 tokens (0: the whole block in one forward), got {verify_chunk}")


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
