"""LiLiCorr: the DFlash backbone (optionally with DFlash2's convolutions) + a candidate-lattice correlator.

Each drafted slot keeps the top K candidates of its own head (K = lilicorr_candidate_topk, a power
of two <= 16). The correlator reads, for every candidate of every slot of the block, the target's
embedding of the candidate, the slot's final-normed drafter row, five features of the candidate's
full-vocabulary log-probability (itself, its probability, its gap to the slot's best, its rank / (K-1),
whether it is rank 0), a slot embedding and a rank embedding. These S*K rows pass through
lilicorr_num_layers pre-norm transformer layers over the whole lattice (multi-head attention with a
learned per-head bias by slot distance and for the same slot, no mask; a non-gated SiLU MLP), then a
final norm. The anchor (the drafter's context row of the last accepted token: hidden_norm(fc(
features)), zero when there is none) is projected and normed; each candidate's factor row is
silu(W [x, a, x*a] + b), from which an outgoing and an incoming unit vector are read. Scores:
start[j] = <anchor_out, in[slot 1, j]>, pair[s, i, j] = <out[s, i], in[s + 1, j]>, times
lilicorr_logit_scale. The walk (vLLM's candidate walk, shared with DFlash2) picks slot 1's
candidate by the start scores alone, then each next slot's by the pair row of the candidate just
picked: the unary log-probabilities enter only through the features.

Names and shapes are vLLM's (model_executor/models/lilicorr.py, LiLiCorrHead; the release in `releases.py`)
under `lilicorr.`; every Linear has a bias there (ReplicatedLinear's and NemotronHMLP(bias=True)'s default).

Start (the DFlash function): the pass-hidden, feature and (if any) token projections and every
lattice layer's output zero, rank r's embedding RANK_START on channel r, the factor projection the
identity on the row, the incoming head's first output channel 0 minus channels 1..K-1 (positive for
rank 0, negative for the others, while the token embeddings' entries stay far below RANK_START /
sqrt(h)), and the outgoing and anchor heads' first bias sqrt(h): every vector is within a small angle
(the other outputs' random 0.02 weights, ~0.16 of the first) of +e0 (outgoing, anchor; incoming at rank
0) or -e0 (incoming, other ranks), so every score row is positive at rank 0 only, and the greedy walk
picks each slot's argmax. Exactly aligned vectors would start at a stationary point (the unit
vectors' gradient along themselves is zero): the random outputs are what lets the correlator learn.
(With lilicorr_hidden_size == hidden_size vLLM has no token_proj: the candidates' embeddings enter
unprojected, hence the large rank channel.)

Training (`block_loss`): no published loss text was found (Model-Optimizer PR #2342, the training half,
describes the architecture only in what is stored here), so a documented choice: teacher-forced path
cross-entropy over each slot's K candidates on the data's tokens, the token put in place of the K-th
candidate when absent (as the DFlash2 selector's loss does), slot 1 over the start scores, slot s over
the pair row of the data's candidate at s - 1; the candidates and their log-probabilities carry no
gradient (the backbone learns from the token loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import DFlashDecoderLayer
from .base import Drafted, Kind, SlotTerms, full_vocab
from .dflash2 import DFlash2DecoderLayer

NUM_FEATURES = 5
# rank r's start embedding on channel r: large beside a token embedding (entries << 1 in trained LMs),
# so after the output norm each candidate's row is its rank channel plus a residual ~|e| sqrt(h) / 100
RANK_START = 100.0


class PlainMLP(nn.Module):
    """down(silu(up(x))), both with bias (vLLM's NemotronHMLP with hidden_act silu, bias=True)."""

    def __init__(self, inp: int, mid: int, out: int):
        super().__init__()
        self.up_proj = nn.Linear(inp, mid)
        self.down_proj = nn.Linear(mid, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * hidden))
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [N, L, h], bias [heads, L, L] added to the attention logits -> [N, L, h]."""
        N, L, h = x.shape
        q, k, v = (t.view(N, L, self.heads, h // self.heads).transpose(1, 2)
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, -1))
        att = (q @ k.transpose(-1, -2)) / (h // self.heads) ** 0.5 + bias.to(x.dtype)  # [N, heads, L, L]
        return self.out_proj((att.softmax(-1) @ v).transpose(1, 2).reshape(N, L, h))


class LatticeLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden, eps=eps)
        self.attn = LatticeAttention(hidden, heads)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.mlp = PlainMLP(hidden, int(hidden * mlp_ratio), hidden)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class Correlator(nn.Module):
    """vLLM's LiLiCorrHead, its parameters by the same names; `scores` computes its `score`."""

    def __init__(self, cfg):
        super().__init__()
        H, h = cfg.hidden_size, cfg.lilicorr_hidden_size or cfg.hidden_size
        B, K, heads = cfg.block_size, cfg.lilicorr_candidate_topk, cfg.lilicorr_num_heads
        self.hidden, self.block, self.topk, self.heads = h, B, K, heads
        self.eps, self.scale = cfg.lilicorr_vector_eps, cfg.lilicorr_logit_scale
        if h != H:
            self.token_proj = nn.Linear(H, h)
        self.pass_hidden_proj = nn.Linear(H, h)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = PlainMLP(NUM_FEATURES, h, h)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, B - 1, 1, h))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, K, h))
        self.relative_slot_bias = nn.Parameter(torch.zeros(heads, 2 * B - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(heads))
        self.context_proj = nn.Linear(H, h)
        self.layers = nn.ModuleList(LatticeLayer(h, heads, cfg.lilicorr_mlp_ratio, cfg.rms_norm_eps)
                                    for _ in range(cfg.lilicorr_num_layers))
        self.output_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.anchor_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * h, h)
        f = cfg.lilicorr_factor_dim
        self.out_head, self.in_head, self.anchor_out_head = nn.Linear(h, f), nn.Linear(h, f), nn.Linear(h, f)

    def attention_bias(self, S: int) -> torch.Tensor:
        """[heads, S*K, S*K]: relative_slot_bias[slot(q) - slot(k) + B - 1] + same_slot_bias if same slot."""
        slot = torch.arange(S, device=self.same_slot_bias.device).repeat_interleave(self.topk)
        d = slot[:, None] - slot[None, :]
        return self.relative_slot_bias[:, d + self.block - 1] + (d == 0) * self.same_slot_bias[:, None, None]

    def features(self, logp: torch.Tensor) -> torch.Tensor:
        """[N, S, K] log-probabilities (rank order) -> [N, S, K, 5]."""
        K = logp.shape[-1]
        rank = torch.arange(K, device=logp.device, dtype=torch.float32) / max(K - 1, 1)
        first = (torch.arange(K, device=logp.device) == 0).float()
        return torch.stack([logp, logp.exp(), logp - logp.max(-1, keepdim=True).values,
                            rank.expand_as(logp), first.expand_as(logp)], -1)

    def scores(self, tok: torch.Tensor, logp: torch.Tensor, rows: torch.Tensor, anchor: torch.Tensor,
               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tok [N, S, K, H] target embeddings of the candidates, logp [N, S, K] their log-probabilities,
        rows [N, S, H] the slots' final-normed drafter rows, anchor [N, H], valid [N] -> unscaled
        start scores [N, K] and pair scores [N, S-1, K, K]."""
        N, S, K = logp.shape
        dt = self.slot_embedding.dtype
        x = self.token_proj(tok.to(dt)) if hasattr(self, "token_proj") else tok.to(dt)
        x = x + self.pass_hidden_proj(rows.to(dt))[:, :, None]
        x = x + self.feature_mlp(self.feature_norm(self.features(logp.float()).to(x.dtype)))
        x = (x + self.slot_embedding[0, :, :S] + self.rank_embedding[0]).reshape(N, S * K, self.hidden)
        bias = self.attention_bias(S)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).reshape(N, S, K, self.hidden)
        a = self.anchor_norm(self.context_proj(anchor.to(dt)) * valid[:, None].to(dt))  # [N, h]
        a4 = a[:, None, None, :].expand_as(x)
        factor = F.silu(self.factor_input_proj(torch.cat([x, a4, x * a4], -1)))
        out_v = F.normalize(self.out_head(factor), dim=-1, eps=self.eps)
        in_v = F.normalize(self.in_head(factor), dim=-1, eps=self.eps)
        a_out = F.normalize(self.anchor_out_head(a), dim=-1, eps=self.eps)
        start = torch.einsum("nf,nkf->nk", a_out, in_v[:, 0])
        return start, out_v[:, :-1] @ in_v[:, 1:].transpose(-1, -2)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """The DFlash function: the walk picks rank 0 at every slot (module docstring)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.RMSNorm, nn.LayerNorm)):
                m.reset_parameters()
        for layer in self.layers:
            nn.init.normal_(layer.attn.in_proj_weight, std=std)
            nn.init.zeros_(layer.attn.in_proj_bias)
            nn.init.zeros_(layer.attn.out_proj.weight)
            nn.init.zeros_(layer.mlp.down_proj.weight)
        zero = [self.pass_hidden_proj, self.feature_mlp.down_proj] + ([self.token_proj] if hasattr(self, "token_proj")
                                                                       else [])
        for m in zero:
            nn.init.zeros_(m.weight)
        for p in (self.slot_embedding, self.rank_embedding, self.relative_slot_bias, self.same_slot_bias):
            nn.init.zeros_(p)
        h, K = self.hidden, self.topk
        ranks = torch.arange(K) % h
        self.rank_embedding[0, 0, 0, torch.arange(K), ranks] = RANK_START
        self.factor_input_proj.weight.zero_()
        self.factor_input_proj.weight[:, :h].copy_(torch.eye(h))
        self.in_head.weight[0].zero_()
        self.in_head.weight[0, ranks[1:]] = -1.0
        self.in_head.weight[0, 0] = 1.0
        self.out_head.bias[0] = self.anchor_out_head.bias[0] = h ** 0.5


def candidates(head, hidden: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-normed rows [S, Hd] -> top-K target ids [S, K] and their full-vocabulary log-probs [S, K]."""
    logits = head(hidden).float()
    logp = logits.log_softmax(-1)
    top = logp.topk(K, dim=-1)
    return top.indices, top.values


def lilicorr_layer(cfg, i: int, q3) -> nn.Module:
    """DFlash2's convolution layer when conv_kernel_size > 0 (LiLiCorr + conv), else DFlash's."""
    return (DFlash2DecoderLayer if cfg.conv_kernel_size else DFlashDecoderLayer)(cfg, i, q3)


class LiLiCorrTerms(SlotTerms):
    """The token loss as DFlash's; the correlator's loss is over whole blocks (`LiLiCorr.block_loss`)."""


@torch.no_grad()
def train_candidates(head, rows: torch.Tensor, truth: torch.Tensor, K: int, chunk: int = 256):
    """rows [M, Hd], the data's tokens [M] -> candidates [M, K] and log-probs [M, K] (top K of the head,
    the data's token put in place of the K-th when it is not among them), and its index [M]."""
    ids, logp, at = [], [], []
    for i in range(0, rows.shape[0], chunk):
        lp = head(rows[i:i + chunk]).float().log_softmax(-1)  # [c, V]
        top = lp.topk(K, dim=-1)
        y = truth[i:i + chunk]
        hit = top.indices == y[:, None]
        inside = hit.any(-1)
        c_ids = torch.where(inside[:, None], top.indices, torch.cat([top.indices[:, :-1], y[:, None]], 1))
        c_lp = torch.where(inside[:, None], top.values,
                           torch.cat([top.values[:, :-1], lp.gather(1, y[:, None])], 1))
        ids.append(c_ids)
        logp.append(c_lp)
        at.append(torch.where(inside, hit.float().argmax(-1), torch.full_like(y, K - 1)))
    return torch.cat(ids), torch.cat(logp), torch.cat(at)


def path_loss(start: torch.Tensor, pairs: torch.Tensor, at: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """Teacher-forced path cross-entropy: scaled start [N, K] and pairs [N, S-1, K, K], the data's candidate
    index per slot [N, S], which slots count [N, S] -> the sum of their cross-entropies: slot 1 over the
    start scores, slot s over the pair row of the data's candidate at slot s - 1."""
    N, S = at.shape
    rows = [start] + [pairs[:, s - 1].gather(1, at[:, s - 1, None, None].expand(-1, 1, pairs.shape[-1]))[:, 0]
                      for s in range(1, S)]
    logits = torch.stack(rows, 1)  # [N, S, K]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), at.flatten(), reduction="none").view(N, S)
    return (ce * counted).sum()


class LiLiCorr(Kind):
    name = "lilicorr"
    layer = staticmethod(lilicorr_layer)
    terms = LiLiCorrTerms
    chained = True
    whole_block = True  # the lattice attention reads every slot: the block's drafts come at once

    def build(self, drafter: nn.Module) -> None:
        drafter.lilicorr = Correlator(drafter.config)

    @torch.no_grad()
    def reset_parameters(self, drafter: nn.Module) -> None:
        if drafter.config.conv_kernel_size:
            for layer in drafter.layers:
                layer.attention_conv.reset_parameters()
                layer.mlp_conv.reset_parameters()
        drafter.lilicorr.reset_parameters()

    def block_loss(self, drafter, head, embed, hidden, tokens, supervised, anchor, valid) -> torch.Tensor:
        """The correlator's loss over whole blocks: hidden [N, B, Hd] the drafter's final rows, tokens
        [N, B] the data's tokens at a + k, supervised [N, B], anchor [N, Hd] the context row at a - 1 (valid
        [N]) -> the mean of `path_loss` over the counted slots (a supervised slot whose slots before it
        are supervised). Candidates and their log-probabilities are read without gradient: the
        backbone learns from the token loss, the correlator from this one."""
        cor = drafter.lilicorr
        N, B, H = hidden.shape
        rows = hidden[:, 1:]  # [N, S, Hd]
        ids, logp, at = train_candidates(head, rows.reshape(-1, H).detach(), tokens[:, 1:].reshape(-1), cor.topk)
        S, K = B - 1, cor.topk
        start, pairs = cor.scores(embed(ids).view(N, S, K, -1), logp.view(N, S, K), rows, anchor, valid)
        counted = supervised[:, 1:].long().cumprod(1).to(start.dtype)  # [N, S]
        total = path_loss(cor.scale * start.float(), cor.scale * pairs.float(), at.view(N, S), counted)
        return total / counted.sum().clamp(min=1)

    def draft(self, drafter, head, hidden, prev, rows, probs, generator, embed=None, anchor=None):
        """The walk over the block's lattice, from the anchor row (None: no accepted context row yet;
        sampling: each slot's candidate drawn from the softmax of its score row, the distribution
        verification then uses)."""
        if embed is None:
            raise ValueError("a LiLiCorr drafter drafts with the target's embedding of its candidates")
        cor, V = drafter.lilicorr, drafter.config.vocab_size
        ids, logp = candidates(head, hidden, cor.topk)  # [S, K] x2
        valid = torch.tensor([anchor is not None], device=hidden.device)
        row = anchor if anchor is not None else hidden.new_zeros(hidden.shape[-1])
        start, pairs = cor.scores(embed(ids)[None], logp[None], hidden[None], row[None], valid)
        start, pairs = cor.scale * start[0].float(), cor.scale * pairs[0].float()
        tokens, qs, confs, j = [], [], [], None
        for s in range(hidden.shape[0]):
            row = start if s == 0 else pairs[s - 1, j]  # [K]
            if probs is None:
                c, j = row.softmax(-1).max(-1)
            else:
                p = probs(row[None])[0]
                j = torch.multinomial(p, 1, generator=generator)[0]
                c = p.max()
                qs.append(full_vocab(p[None], ids[s], V))
            tokens.append(ids[s, j])
            confs.append(c)
        return Drafted(torch.stack(tokens), torch.cat(qs) if qs else None, torch.stack(confs))
