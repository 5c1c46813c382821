"""What a vLLM capture engine takes on each of its GPUs, from the target's config alone: an estimate for
planning how to split a node between the engine replicas and the training ranks (`train --engine vllm
--engine-gpus N`). Figures from this plan are estimates, not measurements: no GPU ran them.

Per engine GPU (tensor parallel size tp, pipeline stages pp):

* weights: every parameter in the checkpoint's precision (`SCHEMES`: bf16; FP8 linear layers; INT4
  routed experts with a bf16 scale per group of 32, the rest bf16), spread over tp x pp GPUs (routed
  experts split across the tensor-parallel group as vLLM shards them);
* the KV cache for `sequences` sequences of the row length, which `extract_hidden_states` needs only for
  prefill: grouped-query keys and values split across tp by KV head (down to one head a GPU), MLA's
  compressed latent and rope key kept whole on every tp rank, layers split across pp; plus the
  hidden-states layer the method adds (the asked states, each `hidden` wide);
* vLLM's own working memory (activations of a prefill chunk, CUDA graphs, the CUDA context):
  `ENGINE_OVERHEAD`, an assumption;

and the engine takes `util` (vLLM's gpu_memory_utilization) of each card.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
ENGINE_OVERHEAD = 6 * GIB  # activations of a prefill chunk, CUDA graphs, context: an assumption
SCHEMES = ("bf16", "fp8", "int4-experts")


@dataclass
class EnginePlan:
    tp: int
    pp: int
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

    def gib(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "weights": round(self.weights / GIB, 1), "kv": round(self.kv / GIB, 1),
                "states": round(self.states / GIB, 1), "overhead": round(self.overhead / GIB, 1),
                "total": round(self.total / GIB, 1), "usable": round(self.util * self.card / GIB, 1),
                "fits": self.fits}


def weight_bytes(config, scheme: str) -> int:
    """The checkpoint's bytes for a scheme, from the parameters of the model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; one of {SCHEMES}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if p is emb or p is head or p.dim() < 2:  # embeddings, head, norms and biases stay bf16
            total += 2 * n
        elif scheme == "fp8":
            total += n + 4 * n // (128 * 128)  # one fp32 scale per 128 x 128 block
        elif scheme == "int4-experts" and ".experts." in name and "shared" not in name:
            total += n // 2 + 2 * n // 32  # int4 with a bf16 scale per group of 32
        else:
            total += 2 * n
    return total


def kv_bytes_per_token(config, tp: int, pp: int) -> int:
    """One token's KV cache on one engine GPU, in bf16."""
    text = getattr(config, "text_config", None) or config
    layers = -(-int(text.num_hidden_layers) // pp)
    if getattr(text, "kv_lora_rank", None):  # MLA: the latent and the rope key, whole on each tp rank
        return layers * (int(text.kv_lora_rank) + int(text.qk_rope_head_dim)) * 2
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return layers * 2 * max(1, kv // tp) * head_dim * 2


def engine_plan(config, *, scheme: str, tp: int, pp: int, card_bytes: int, max_length: int, sequences: int = 32,
                n_states: int = 6, util: float = 0.9, weights: int | None = None) -> EnginePlan:
    text = getattr(config, "text_config", None) or config
    w = weight_bytes(config, scheme) if weights is None else weights
    tokens = sequences * max_length
    return EnginePlan(tp, pp, w // (tp * pp), tokens * kv_bytes_per_token(config, tp, pp),
                      tokens * n_states * int(text.hidden_size) * 2, ENGINE_OVERHEAD, card_bytes, util)


def smallest_engine(config, *, scheme: str, card_bytes: int, gpus: int, max_length: int, **kw) -> EnginePlan | None:
    """The engine on the fewest of a node's GPUs that fits (tensor parallel over powers of two that divide
    the attention heads, then pipeline stages); None when the whole node is not enough."""
    text = getattr(config, "text_config", None) or config
    heads = int(text.num_attention_heads)
    w = weight_bytes(config, scheme)
    for n in range(1, gpus + 1):
        for tp in (8, 4, 2, 1):
            if n % tp or heads % tp:
                continue
            p = engine_plan(config, scheme=scheme, tp=tp, pp=n // tp, card_bytes=card_bytes, max_length=max_length,
                            weights=w, **kw)
            if p.fits:
                return p
    return None
