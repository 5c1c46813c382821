"""DSpark: the DFlash backbone + a Markov bias on each slot's logits + a confidence head.

Slot k's logits are the head's + W2 W1[prev], where prev is the token before slot k: in training the
data's token (teacher forcing, as speculators trains it), when drafting the previous slot's own
draft, starting from the verified token (llama.cpp's greedy chain; a sampled draft when
sampling, as vLLM's V2 proposer does). The confidence head predicts each slot's acceptance,
sigmoid(proj [h; W1[prev]]), trained by BCE against 1 - TV(draft, target) with the target detached.

Names and shapes are speculators': `markov_head.markov_w1.weight` [V, r] (an embedding of the
target vocabulary), `markov_head.markov_w2.weight` [Vd, r], `confidence_head.proj.{weight,bias}`
[1, Hd + r], [1]. Start: W2 and the confidence projection zero (the DFlash function; confidence 0.5),
W1 ~ N(0, 0.01).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Drafted, Kind, SlotTerms, pick_one


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [...] target ids -> (bias [..., Vd], W1[prev] [..., r])."""
        e = self.markov_w1(prev.long())
        return self.markov_w2(e), e


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        """[..., Hd], [..., r] -> acceptance logits [...]."""
        x = h if e is None else torch.cat([h, e.to(h.dtype)], dim=-1)
        return self.proj(x)[..., 0]


def _markov(drafter):
    return getattr(drafter, "markov_head", None)


def _confidence(drafter):
    return getattr(drafter, "confidence_head", None)


class DSparkTerms(SlotTerms):
    @property
    def reads_label_rows(self) -> bool:  # the confidence head learns sum over v of min(p, q)
        return _confidence(self.drafter) is not None

    def logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        out = self.head(h)
        if _markov(self.drafter) is None:
            return out
        bias, _ = _markov(self.drafter)(prev)
        return out + bias.to(out.dtype)

    def added(self, draft, labels, h, prev, target_top):
        conf = _confidence(self.drafter)
        if conf is None:
            return None, None
        e = _markov(self.drafter).markov_w1(prev.long()) if _markov(self.drafter) is not None else None
        logit = conf(h, e)
        with torch.no_grad():  # the acceptance chance of a sampled draft: sum over v of min(p, q)
            agree = torch.minimum(labels.float().softmax(-1), draft.float().softmax(-1)).sum(-1)
        return F.binary_cross_entropy_with_logits(logit.float(), agree, reduction="none"), None


class DSpark(Kind):
    name = "dspark"
    terms = DSparkTerms
    chained = True  # the Markov bias reads the previous draft

    def build(self, drafter: nn.Module) -> None:
        cfg = drafter.config
        if cfg.markov_rank:
            drafter.markov_head = MarkovHead(cfg.vocab_size, cfg.draft_vocab_size or cfg.vocab_size, cfg.markov_rank)
        if cfg.confidence_head:
            drafter.confidence_head = ConfidenceHead(cfg.hidden_size + cfg.markov_rank)

    @torch.no_grad()
    def reset_parameters(self, drafter: nn.Module) -> None:
        if _markov(drafter) is not None:
            nn.init.normal_(drafter.markov_head.markov_w1.weight, std=0.01)
            nn.init.zeros_(drafter.markov_head.markov_w2.weight)
        if _confidence(drafter) is not None:
            nn.init.zeros_(drafter.confidence_head.proj.weight)
            nn.init.zeros_(drafter.confidence_head.proj.bias)

    def draft(self, drafter, head, hidden, prev, rows, probs, generator, embed=None, anchor=None) -> Drafted:
        """Left to right: each slot's bias reads the draft before it (the verified token first)."""
        markov, conf_head = _markov(drafter), _confidence(drafter)
        base = head(hidden)  # [s, Vd]
        V = drafter.config.vocab_size
        prev_t = torch.tensor([prev], device=hidden.device)
        tokens, qs, confs = [], [], []
        for k in range(hidden.shape[0]):
            logits, e = base[k:k + 1], None
            if markov is not None:
                bias, e = markov(prev_t)
                logits = logits + bias.to(logits.dtype)
            tok, c, q = pick_one(logits, rows, probs, V, generator)
            if q is not None:
                qs.append(q)
            if conf_head is not None:  # the head's own estimate, known before this slot's token is drawn
                c = torch.sigmoid(conf_head(hidden[k:k + 1], e).float())
            tokens.append(tok)
            confs.append(c)
            prev_t = tok
        return Drafted(torch.cat(tokens), torch.cat(qs) if qs else None, torch.cat(confs))
