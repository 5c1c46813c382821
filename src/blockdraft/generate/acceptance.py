"""Acceptance rules of the verify step (clause 8).

Legend: K = B - 1 drafted tokens, V vocabulary.

Greedy: accept the longest prefix with draft[k] == argmax of the target at the previous
position, then append the target's own argmax. Sampling (speculative sampling): accept
draft token x with probability min(1, p(x) / q(x)); at the first rejection draw from
norm(max(0, p - q)); when all are accepted draw the extra token from p. The committed
tokens are then distributed exactly as the target's samples.
"""

from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> probabilities at `temperature`, restricted to the top-p nucleus."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft [K], target_logits [K+1, V] -> (accepted count m, the target's token after them)."""
    choice = target_logits.argmax(-1)  # [K+1]
    agree = (draft == choice[:-1]).long()
    m = int(agree.cumprod(0).sum())
    return m, int(choice[m])


def accept_sampled(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, gen: torch.Generator) -> tuple[int, int]:
    """draft [K], q [K, V] draft probabilities, p [K+1, V] target probabilities -> (m, next token)."""
    K = draft.shape[0]
    for k in range(K):
        x = int(draft[k])
        px, qx = float(p[k, x]), float(q[k, x])
        u = float(torch.rand((), generator=gen, device=p.device))
        if qx > 0 and u * qx < px:
            continue
        residual = (p[k] - q[k]).clamp(min=0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[k]
        return k, int(torch.multinomial(dist, 1, generator=gen))
    return K, int(torch.multinomial(p[K], 1, generator=gen))
