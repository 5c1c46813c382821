"""Domino: the DFlash backbone + a GRU correction of each slot's logits from the block's tokens before it.

Slot k (k >= 1 + pure_draft_prefix_len) scores head(h_k) + embed_proj([h_k ; g_k]), where g_k is the
state of a bias-free GRU that has read the target's (raw) embedding rows of the block's tokens
a, a+1, ..., a+k-1 (the anchor first); slots 1..pure_draft_prefix_len keep the head's logits alone.
This is SpecForge's DominoDraftModel (the release in `releases.py`) with `shift_label: false` (slot k
predicts the token at a + k, slot 0 predicts nothing: blockdraft's convention). In training the tokens are the data's
(teacher forcing); when drafting, the verified token and then each slot's own draft (greedy: its
argmax; sampling: the token drawn from the corrected distribution), walked left to right.

Names and shapes are SpecForge's: `prefix_gru.weight_ih_l0` [3G, Ht], `prefix_gru.weight_hh_l0`
[3G, G], `embed_proj.0.weight` [E, Hd + G], `embed_proj.2.weight` [Vd, E] (Linear -> SiLU -> Linear,
no biases). Start: embed_proj.2 zero (the DFlash function), the rest at PyTorch's defaults.

The loss mixes the token loss of the corrected logits with that of the head's alone,
(1 - lambda) * final + lambda * base, lambda falling linearly from lambda_base_start to 0 over the
first lambda_base_decay_ratio of the run (SpecForge's schedule; `base_share`).

Legend: c slots, L prefix tokens, G GRU width, E projection width, Ht target hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Drafted, Embed, Kind, SlotTerms, pick_one

PAD = -1  # a prefix column past the slot's own prefix


def lambda_base(start: float, decay_ratio: float, progress: float | None) -> float:
    """SpecForge's base-loss weight at `progress` (steps done / total steps; None: no schedule, 0)."""
    if progress is None:
        return 0.0
    if decay_ratio <= 0:
        return 0.0
    return max(0.0, min(1.0, start * (1.0 - min(progress / decay_ratio, 1.0))))


def correction(drafter: nn.Module, h: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """[c, Hd], [c, G] -> the logits the GRU state adds [c, Vd]."""
    w = drafter.embed_proj[0].weight
    return drafter.embed_proj(torch.cat([h.to(w.dtype), states.to(w.dtype)], dim=-1))


def _gru_input(drafter: nn.Module, embed: Embed, ids: torch.Tensor) -> torch.Tensor:
    return embed(ids).to(drafter.prefix_gru.weight_ih_l0.dtype)


class DominoTerms(SlotTerms):
    """`prev` [c, B - 1]: each slot's block tokens a..a+k-1, PAD past them (`Domino.slot_prev`)."""

    def __init__(self, drafter, head, rows, embed: Embed | None = None):
        super().__init__(drafter, head, rows)
        self.embed = embed
        self._base = None

    @property
    def base_share(self) -> float:
        c = self.drafter.config
        if not self.drafter.training:  # held-out figures read the corrected logits alone
            return 0.0
        progress = getattr(self.drafter, "train_progress", None)  # the trainer's steps done / total
        return lambda_base(c.lambda_base_start, c.lambda_base_decay_ratio, progress)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head's logits alone (those `logits` made of the same rows, kept)."""
        return self._base[1] if self._base is not None and self._base[0] is h else self.head(h)

    def logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        base = self.head(h)
        self._base = (h, base)
        k = (prev != PAD).sum(-1)  # [c] the slot's place in its block
        on = k >= 1 + self.drafter.config.pure_draft_prefix_len
        if not bool(on.any()):
            return base
        add = correction(self.drafter, h, self._prefix_states(prev, k)) * on[:, None]
        return base + add.to(base.dtype)

    def _prefix_states(self, prev: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[c, B - 1] prefixes, [c] their lengths -> the GRU state after each [c, G]. The GRU runs once per
        run of slots whose prefixes extend each other (a block's slots, in order), on the run's longest:
        its output after j + 1 tokens is the state of every slot of the run with j + 1 tokens, where a
        GRU per slot would read the block's tokens again for each of its slots."""
        extends = (k[1:] > k[:-1]) & ((prev[1:] == prev[:-1]) | (prev[:-1] == PAD)).all(-1)
        first = torch.cat([extends.new_ones(1), ~extends])  # a slot that starts a run
        run = first.long().cumsum(0) - 1  # [c] each slot's run
        longest = prev[torch.cat([first[1:], first.new_ones(1)])]  # [runs, B - 1] each run's last slot
        seq = _gru_input(self.drafter, self.embed, longest[:, :int(k.max())].clamp(min=0))  # [runs, L, Ht]
        out = self.drafter.prefix_gru(seq)[0]  # [runs, L, G]: out[:, j] has read tokens a..a+j
        return out[run, (k - 1).clamp(min=0)]


class Domino(Kind):
    name = "domino"
    terms = DominoTerms
    chained = True  # each slot's correction reads the drafts before it
    reads_prefix = True  # `draft` takes the block's tokens from the anchor up to its first slot

    def build(self, drafter: nn.Module) -> None:
        cfg = drafter.config
        G, E = cfg.gru_hidden_dim, cfg.emb_dim
        drafter.prefix_gru = nn.GRU(cfg.hidden_size, G, num_layers=1, bias=False, batch_first=True)
        drafter.embed_proj = nn.Sequential(nn.Linear(cfg.hidden_size + G, E, bias=False), nn.SiLU(),
                                           nn.Linear(E, cfg.draft_vocab_size or cfg.vocab_size, bias=False))

    @torch.no_grad()
    def reset_parameters(self, drafter: nn.Module) -> None:
        drafter.prefix_gru.reset_parameters()
        drafter.embed_proj[0].reset_parameters()
        nn.init.zeros_(drafter.embed_proj[2].weight)

    def slot_terms(self, drafter, head, rows, embed: Embed | None = None) -> SlotTerms:
        return DominoTerms(drafter, head, rows, embed)

    def slot_prev(self, input_ids: torch.Tensor, anchors: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
        """Flat ids [T], anchors [N], supervised [N, B] -> each supervised slot's prefix [S, B - 1]."""
        B = supervised.shape[1]
        pos = (anchors[:, None] + torch.arange(B - 1, device=anchors.device)).clamp(0, input_ids.shape[0] - 1)
        tok = input_ids[pos]  # [N, B - 1] the tokens a..a+B-2
        mine = torch.arange(B - 1, device=anchors.device)[None, :] < torch.arange(B, device=anchors.device)[:, None]
        full = torch.where(mine[None], tok[:, None, :], torch.full_like(tok[:, None, :], PAD))  # [N, B, B - 1]
        return full[supervised]

    def draft(self, drafter, head, hidden, prev, rows, probs, generator, embed: Embed | None = None,
              anchor=None) -> Drafted:
        """Left to right from the block's tokens before the first row (`prev`: the anchor's token, or a
        list of the tokens from the anchor on): each slot's correction reads the drafts before it."""
        prefix = [int(prev)] if isinstance(prev, int) or torch.is_tensor(prev) and prev.dim() == 0 else list(prev)
        base = head(hidden)  # [s, Vd]
        V, start = drafter.config.vocab_size, 1 + drafter.config.pure_draft_prefix_len
        ids = torch.tensor(prefix, device=hidden.device)
        _, state = drafter.prefix_gru(_gru_input(drafter, embed, ids)[None])  # state [1, 1, G]
        tokens, qs, confs = [], [], []
        for j in range(hidden.shape[0]):
            logits = base[j:j + 1]
            if len(prefix) + j >= start:
                logits = logits + correction(drafter, hidden[j:j + 1], state[0]).to(logits.dtype)
            tok, c, q = pick_one(logits, rows, probs, V, generator)
            if q is not None:
                qs.append(q)
            tokens.append(tok)
            confs.append(c)
            if j + 1 < hidden.shape[0]:
                _, state = drafter.prefix_gru(_gru_input(drafter, embed, tok)[None], state)
        return Drafted(torch.cat(tokens), torch.cat(qs) if qs else None, torch.cat(confs))
