"""DFlash2: the DFlash backbone + in-block causal convolutions + a candidate selector.

Convolutions: around each attention and MLP sublayer, one on its normed input (side 0) and one on
its output (side 1, before the residual add): y[t] = sum over taps j of w_j[t] * x[t - j], inside the
block only (zero before slot 0), with w_j[t] = base[side, j] (per channel) + a dynamic term per group
of `conv_group_size` channels, projected from the sublayer's normed input. Causal, so a slot's row
never reads a later slot's.

Selector: each slot's K candidates are the top K of its draft logits; a candidate's score is its logit
+ <P[prev] * G h, S[candidate]>, P and S codebooks over the target vocabulary [V, r], G a projection
[r, Hd] of the slot's final-normed row. Drafting walks it greedily from the verified token (llama.cpp's
walk); sampling draws from the softmax of the K scores, the distribution verification then uses.
Training adds a K-way cross-entropy over the candidates with the data's previous tokens, the
target's argmax put in place of the K-th candidate when it is not among them (speculators').

Names and shapes are speculators': `layers.N.{attention,mlp}_conv.base_kernel` [2, k, Hd] and
`.kernel_projection.weight` [2 k Hd/g, Hd], `candidate_selector.{predecessor,successor}_codebook`
[V, r], `candidate_selector.hidden_projection.weight` [r, Hd]. Start: identity convolutions (tap 0 = 1,
the rest and the projection 0) and a zero hidden projection, so the walk picks each slot's argmax:
the DFlash function (speculators starts the projection random; the drafts then differ at step 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import DFlashDecoderLayer
from .base import Drafted, Kind, SlotTerms, full_vocab, to_target_ids


class GroupedConv(nn.Module):
    """The two convolutions of one sublayer; one projection gives both sides' dynamic terms."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.groups = kernel, hidden // group
        self.base_kernel = nn.Parameter(torch.empty(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def _conv(self, x: torch.Tensor, side: int, dyn: torch.Tensor) -> torch.Tensor:
        """x [..., B, Hd] rows of blocks, dyn [..., B, 2, k, G] -> [..., B, Hd]."""
        B, H = x.shape[-2], x.shape[-1]
        out = torch.zeros_like(x)
        for j in range(min(self.kernel, B)):
            w = self.base_kernel[side, j].to(x.dtype) + dyn[..., side, j, :].repeat_interleave(H // self.groups, -1)
            shifted = x if j == 0 else F.pad(x, (0, 0, j, 0))[..., :B, :]  # slot t reads slot t - j
            out = out + w * shifted
        return out

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed sublayer input [..., B, Hd] -> (its convolution, the dynamic terms for `finish`)."""
        dyn = self.kernel_projection(x).unflatten(-1, (2, self.kernel, self.groups)).to(x.dtype)
        return self._conv(x, 0, dyn), dyn

    def finish(self, y: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        return self._conv(y, 1, dyn.to(y.dtype))


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, cfg, layer_idx: int, qwen3_cfg):
        super().__init__(cfg, layer_idx, qwen3_cfg)
        self.attention_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, h: torch.Tensor, ctx_kv, blk_rope, attend) -> torch.Tensor:
        """DFlashDecoderLayer's, with each sublayer between its two convolutions (the context rows'
        keys and values are the backbone's: they do not pass through the block's convolutions)."""
        at = self.self_attn
        k_ctx, v_ctx = ctx_kv(at)
        x, dyn = self.attention_conv.prepare(self.input_layernorm(h))
        q, k_blk, v_blk = at.block_qkv(x, *blk_rope)
        h = h + self.attention_conv.finish(at.o_proj(attend(q, k_ctx, v_ctx, k_blk, v_blk).flatten(-2)), dyn)
        x, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), dyn)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def edges(self, h: torch.Tensor, prev: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """h [c, Hd], prev [c] and candidates [c, K] target ids -> edge scores [c, K]."""
        ctx = self.predecessor_codebook[prev.long()] * self.hidden_projection(h).to(self.predecessor_codebook.dtype)
        return torch.einsum("cr,ckr->ck", ctx, self.successor_codebook[candidates.long()])


def _in_draft_vocab(top: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids [c] -> (their index in the draft vocabulary [c], whether they are in it [c])."""
    if rows is None:
        return top, torch.ones_like(top, dtype=torch.bool)
    at = torch.searchsorted(rows, top).clamp(max=len(rows) - 1)
    return at, rows[at] == top


class DFlash2Terms(SlotTerms):
    def added(self, draft, labels, h, prev, target_top):
        sel, K = self.drafter.candidate_selector, self.drafter.config.selector_top_k
        with torch.no_grad():
            cand = draft.topk(K, dim=-1).indices  # [c, K] draft-vocabulary indices
            at, inside = _in_draft_vocab(target_top, self.rows)
            hit = cand == at[:, None]
            contains = hit.any(-1)
            train_cand = torch.where(contains[:, None], cand, torch.cat([cand[:, :-1], at[:, None]], 1))
            label = torch.where(contains, hit.float().argmax(-1), torch.full_like(at, K - 1))
        scores = draft.gather(1, train_cand) + sel.edges(h, prev, to_target_ids(train_cand, self.rows)).to(draft.dtype)
        ce = F.cross_entropy(scores.float(), label, reduction="none") * inside
        with torch.no_grad():  # what the selector drafts (before the target is put among the candidates)
            walk = draft.gather(1, cand) + sel.edges(h, prev, to_target_ids(cand, self.rows)).to(draft.dtype)
            picked = to_target_ids(cand.gather(1, walk.argmax(-1, keepdim=True))[:, 0], self.rows)
        return ce, picked


class DFlash2(Kind):
    name = "dflash2"
    layer = DFlash2DecoderLayer
    terms = DFlash2Terms
    chained = True  # the selector scores each candidate against the previous draft

    def build(self, drafter: nn.Module) -> None:
        cfg = drafter.config
        drafter.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank)

    @torch.no_grad()
    def reset_parameters(self, drafter: nn.Module) -> None:
        for layer in drafter.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        sel = drafter.candidate_selector
        nn.init.normal_(sel.predecessor_codebook, std=0.02)
        nn.init.normal_(sel.successor_codebook, std=0.02)
        nn.init.zeros_(sel.hidden_projection.weight)

    def draft(self, drafter, head, hidden, prev, rows, probs, generator, embed=None, anchor=None) -> Drafted:
        """Greedy walk from the verified token over each slot's K candidates (sampling: a draw from
        the candidates' scores)."""
        sel, K, V = drafter.candidate_selector, drafter.config.selector_top_k, drafter.config.vocab_size
        unary = head(hidden)  # [s, Vd]
        cand = unary.topk(K, dim=-1).indices  # [s, K]
        ids = to_target_ids(cand, rows)
        prev_t = torch.tensor([prev], device=hidden.device)
        tokens, qs, confs = [], [], []
        for k in range(hidden.shape[0]):
            scores = unary[k:k + 1].gather(1, cand[k:k + 1]) + sel.edges(hidden[k:k + 1], prev_t,
                                                                          ids[k:k + 1]).to(unary.dtype)  # [1, K]
            if probs is None:
                c, j = scores.float().softmax(-1).max(-1)
                tok = ids[k].gather(0, j)
            else:
                p = probs(scores)  # [1, K]
                j = torch.multinomial(p, 1, generator=generator)[:, 0]
                tok, c = ids[k].gather(0, j), p.max(-1).values
                qs.append(full_vocab(p, ids[k], V))
            tokens.append(tok)
            confs.append(c)
            prev_t = tok
        return Drafted(torch.cat(tokens), torch.cat(qs) if qs else None, torch.cat(confs))
