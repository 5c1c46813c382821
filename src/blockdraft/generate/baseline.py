"""The target's own greedy decoding, one token per forward, through the same forward code
(`TargetModel.__call__` with a KV cache) as the verifier, so a faster forward helps both."""

from __future__ import annotations


import torch

from .speculative import GenerationResult, now


@torch.no_grad()
def target_greedy(target, input_ids: torch.Tensor, *, max_new_tokens: int, stop_token_ids=None,
                  on_tokens=None) -> GenerationResult:
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    stops = set(stop_token_ids or [])
    dev = target.device
    t0 = now(dev)
    ids = input_ids.to(dev)
    P = ids.shape[1]
    cache = target.new_cache()
    logits = target.model(ids, position_ids=torch.arange(P, device=dev)[None], use_cache=True,
                          logits_to_keep=1, **{target._cache_kwarg(): cache}).logits
    res = GenerationResult(tokens=[int(logits[0, -1].argmax())])
    res.time_prefill = now(dev) - t0
    if on_tokens:
        on_tokens(res.tokens[:])
    while len(res.tokens) < max_new_tokens and res.tokens[-1] not in stops:
        t1 = now(dev)
        pos = P + len(res.tokens) - 1
        tok = torch.tensor([[res.tokens[-1]]], device=dev)
        out = target(tok, position_ids=torch.tensor([[pos]], device=dev), cache=cache)
        res.tokens.append(int(out.logits[0, -1].argmax()))
        res.accepted.append(1)
        res.time_verify += now(dev) - t1
        if on_tokens:
            on_tokens(res.tokens[-1:])
    res.time_total = now(dev) - t0
    return res
