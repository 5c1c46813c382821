"""The memory plan: peak bytes per rank of a training run, part by part, from the target's config and
the run's flags alone (no GPU, no weights): `benchmarks/memory_plan.py` prints it for the README's
commands, `doctor --plan` for a user's own (DESIGN.md section 5, rule 7).

Legend: T context tokens of a micro-batch (rows x max_length), N blocks, B block size, Q = N*B
block queries, S supervised slots, P distinct label positions, Hd drafter hidden, qd = Hq*D and
kvd = Hkv*D the attention widths, I the MLP width, V the vocabulary, Vd the draft vocabulary,
c the compute dtype's bytes (2 under CUDA's bf16 autocast, 4 in fp32 on a CPU).

The activation terms count the tensors autograd keeps for backward, layer by layer, as the code
makes them (fp32 residual stream and norms, the compute dtype elsewhere; under autocast each
linear keeps its own cast of its input). They are checked against autograd's saved tensors and
against the measured peak RSS of real steps at small shapes on the CPU
(tests/test_memory_plan.py); the flex-attention term (CUDA) follows the same count but can only
be measured on a GPU (benchmarks/gpu_check.py stores both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2**30
LOSS_CHUNK = 256  # train.loss.dflash_loss_chunked's slots per chunk


@dataclass
class Shapes:
    """The sizes a step's tensors take, from the flags (upper bounds: every row fully anchored)."""

    rows: int  # packed rows per micro-batch
    L: int  # tokens per row
    blocks: int
    B: int
    slots: int
    label_positions: int
    Hd: int
    qd: int
    kvd: int
    heads: int
    I: int
    layers: int
    features: int  # F * Ht
    V: int
    Vd: int
    target_hidden: int
    target_intermediate: int
    sliding_kinds: int = 1  # distinct layer kinds (one flex mask each)

    @property
    def T(self) -> int:
        return self.rows * self.L

    @property
    def Q(self) -> int:
        return self.blocks * self.B


def layer_activation_bytes(s: Shapes, c: int, backend: str, chunks: list[tuple[int, int]] | None = None) -> int:
    """What one drafter layer keeps for backward (module.layers.DFlashDecoderLayer). `chunks`: the
    chunked path's (queries, context keys) per chunk, when known (else estimated)."""
    amp = c < 4
    Q, T = s.Q, s.T
    block = (Q * s.Hd * 16  # residual and the two norms' inputs and outputs, fp32
             + Q * s.Hd * (5 if amp else 2) * c  # the linears' inputs (under autocast one cast per linear)
             + Q * s.qd * c  # o_proj's input
             + Q * s.qd * ((c + 8) if amp else 16)  # q_norm and RoPE
             + Q * s.kvd * ((c + 8) if amp else 16)  # k_norm and RoPE of the block rows
             + Q * s.I * 4 * c)  # the MLP: gate, up, silu, product
    ctx = T * s.kvd * ((c + 4) if amp else 8) + (T * s.Hd * 2 * c if amp else 0)  # context k/v path
    if backend == "flex":  # q, out, logsumexp; k and v over context + block keys
        attn = 2 * Q * s.qd * c + 2 * (T + Q) * s.kvd * c + Q * s.heads * 4
    else:  # chunked SDPA: per chunk its queries, its keys and values, its mask (in the query dtype)
        attn = int(1.25 * Q * s.qd * c)
        for nq, keys in chunks if chunks is not None else estimated_chunks(s):
            attn += 2 * (keys + nq) * s.kvd * c + nq * (keys + nq) * c
    return block + ctx + attn


def estimated_chunks(s: Shapes, chunk_blocks: int = 32) -> list[tuple[int, int]]:
    """(queries, context keys) of the chunked path's chunks, estimated: chunks of 32 blocks, each
    reading its row's prefix, on average half the row."""
    n = max(1, math.ceil(s.blocks / chunk_blocks))
    return [(min(s.Q, chunk_blocks * s.B), s.L // 2)] * n


def layout_chunks(layout, window=None) -> list[tuple[int, int]]:
    """(queries, context keys) of a real layout's chunks (model.attention.BlockLayout)."""
    return [((c.j1 - c.j0) * layout.block_size, c.hi - c.lo) for c in layout.chunks(window)]


def fixed_activation_bytes(s: Shapes, c: int) -> int:
    """What the step keeps outside the layers: fc's input features, the context path's norm, the
    final norm, the supervised slots' hidden states."""
    return s.T * s.features * c + s.T * s.Hd * (8 + c) + s.Q * s.Hd * 8 + s.slots * s.Hd * 4


def loss_chunk_bytes(s: Shapes, c_target: int) -> int:
    """One loss chunk's transient: its draft logits (and their fp32 softmax and gradient) and its
    label rows (gathered, upcast, softmaxed)."""
    return LOSS_CHUNK * (s.Vd * (c_target + 12) + s.V * (c_target + 12))


def target_forward_bytes(s: Shapes, c_target: int) -> int:
    """The frozen target's forward under no_grad: one layer's transients over T tokens, the
    per-row attention masks of packed documents, the captured feature layers."""
    return (s.T * (6 * s.target_hidden + 3 * s.target_intermediate) * c_target + s.rows * s.L * s.L
            + s.T * s.features * c_target)


@dataclass
class Plan:
    parts: dict = field(default_factory=dict)  # name -> bytes
    peak: int = 0
    notes: list = field(default_factory=list)

    def gib(self) -> dict:
        return {k: v / GIB for k, v in self.parts.items()} | {"peak": self.peak / GIB}

    def fits(self, gib: float) -> bool:
        return self.peak <= gib * GIB * 0.95  # 5% for the allocator's fragmentation and the CUDA context

    def table(self) -> str:
        rows = [f"  {k:<22} {v / GIB:8.2f} GiB" for k, v in self.parts.items()]
        return "\n".join(rows + [f"  {'peak per rank':<22} {self.peak / GIB:8.2f} GiB"] + [f"  note: {n}" for n in self.notes])


def step_plan(s: Shapes, *, target_params: int, head_only_params: int, drafter_params: int, unit_params: int,
              cuda: bool = True, world: int = 1, fsdp: bool = False, gradient_checkpointing: bool = False,
              features_cache: bool = False, backend: str | None = None,
              chunks: list[tuple[int, int]] | None = None, target_shards: int = 1, target_layer_params: int = 0,
              target_largest_layer: int = 0) -> Plan:
    """Peak bytes per rank of one training step and what makes them up. `target_shards` > 1: the
    target's decoder layers (`target_layer_params` in all) sharded over that many ranks, one
    layer (and the next, prefetched) gathered whole at a time (--target-fsdp)."""
    c = 2 if cuda else 4  # bf16 autocast on CUDA; fp32 on the CPU
    c_t = c  # the frozen target's dtype (target_files.default_dtype)
    backend = backend or ("flex" if cuda else "chunked")
    shard = world if fsdp else 1
    p = Plan()
    if features_cache:
        p.parts["target"] = head_only_params * c_t
    elif target_shards > 1:
        p.parts["target"] = (target_params - target_layer_params + target_layer_params // target_shards) * c_t
        p.parts["target gathers"] = 2 * target_largest_layer * c_t
    else:
        p.parts["target"] = target_params * c_t
    p.parts["drafter"] = drafter_params * 4 // shard
    p.parts["gradients"] = drafter_params * 4 // shard
    p.parts["optimizer"] = 2 * drafter_params * 4 // shard
    if fsdp:  # a unit gathered in fp32, the next one prefetched
        p.parts["fsdp gathers"] = 2 * unit_params * 4
    per_layer = layer_activation_bytes(s, c, backend, chunks)
    if gradient_checkpointing:  # each layer keeps its input; one layer's activations live at a time
        acts = s.layers * s.Q * s.Hd * 4 + per_layer
    else:
        acts = s.layers * per_layer
    p.parts["activations"] = acts + fixed_activation_bytes(s, c)
    labels = s.label_positions * s.V * c_t  # the target's logits once per distinct position, [P, V]
    if features_cache:  # the head runs on the stored final states [P, Ht]
        labels += s.label_positions * s.target_hidden * c_t
    p.parts["labels"] = labels
    p.parts["block inputs"] = s.Q * s.Hd * (c_t + 4)
    if backend == "flex":
        qt, kt = math.ceil(s.Q / 128), math.ceil((s.T + s.Q) / 128)
        p.parts["masks"] = s.sliding_kinds * qt * kt * 4 * 4
    else:
        p.parts["masks"] = 0  # the chunked path's masks are counted in its layers
    p.parts["loss chunk"] = loss_chunk_bytes(s, c_t)
    backward = per_layer // 2 + p.parts["loss chunk"]  # one layer's gradients in flight
    p.parts["backward transient"] = backward
    static = (sum(p.parts[k] for k in ("target", "drafter", "gradients", "optimizer")) + p.parts.get("fsdp gathers", 0)
              + p.parts.get("target gathers", 0))
    drafter_side = (p.parts["activations"] + labels + p.parts["block inputs"] + p.parts["masks"]
                    + max(p.parts["loss chunk"], backward))
    if not features_cache:
        p.parts["target forward"] = target_forward_bytes(s, c_t)
        p.peak = static + max(drafter_side, p.parts["target forward"] + labels)
    else:
        p.peak = static + drafter_side
    return p


# ------------------------------------------------------------------------ from configs and flags

def count_params(module) -> int:
    return sum(t.numel() for t in module.parameters())


def target_sizes(target_config) -> dict:
    """Parameter counts of a target, from its transformers config (built on the meta device: any
    architecture transformers knows, MoE included)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config)
    tc = getattr(target_config, "text_config", None) or target_config
    from .target import find_decoder_layers

    head = model.get_output_embeddings().weight
    emb = model.get_input_embeddings().weight
    head_only = emb.numel() + (0 if head is emb else head.numel())
    layers = [count_params(x) for x in find_decoder_layers(model, int(tc.num_hidden_layers))]
    return {"params": count_params(model), "head_only": head_only, "layer_params": sum(layers),
            "largest_layer": max(layers), "hidden": int(tc.hidden_size),
            "intermediate": int(getattr(tc, "intermediate_size", 4 * tc.hidden_size)), "vocab": int(head.shape[0]),
            "layers": int(tc.num_hidden_layers)}


def drafter_sizes(drafter_config) -> dict:
    import torch

    from .model import DFlashDrafter

    with torch.device("meta"):
        d = DFlashDrafter(drafter_config)
    unit = max([count_params(layer) for layer in d.layers] + [count_params(d) - sum(count_params(x) for x in d.layers)])
    return {"params": count_params(d), "unit": unit}


def plan_run(target_config, run, *, world: int = 1, cuda: bool = True, layer_ids: list[int] | None = None) -> Plan:
    """The plan of `blockdraft train` with this RunConfig on a target with this config."""
    from types import SimpleNamespace

    from .config import DrafterConfig, default_target_layer_ids

    t = target_sizes(target_config)
    ids = layer_ids or run.target.layer_ids or default_target_layer_ids(t["layers"], run.target.num_features)
    vocab = run.drafter.vocab_size("cuda" if cuda else "cpu", t["vocab"])
    fake = SimpleNamespace(model=SimpleNamespace(config=target_config), layer_ids=ids, vocab_size=t["vocab"],
                           mask_token_id=t["vocab"] - 1, name="plan", tokenizer_hash=None)
    dc = DrafterConfig.for_target(fake, draft_vocab_size=vocab, **run.drafter.layout())
    d = drafter_sizes(dc)
    L, B = run.data.max_length, dc.block_size
    rows = max(1, run.train.batch_tokens // L)
    anchors = min(run.train.max_anchors, L)
    kinds = len({(dc.layer_window(i), dc.layer_causal_in_block(i)) for i in range(dc.num_hidden_layers)})
    s = Shapes(rows=rows, L=L, blocks=rows * anchors, B=B, slots=rows * anchors * (B - 1),
               label_positions=rows * min(L, anchors * (B - 1)), Hd=dc.hidden_size,
               qd=dc.num_attention_heads * dc.head_dim, kvd=dc.num_key_value_heads * dc.head_dim,
               heads=dc.num_attention_heads, I=dc.intermediate_size, layers=dc.num_hidden_layers,
               features=len(ids) * t["hidden"], V=t["vocab"], Vd=vocab or t["vocab"], target_hidden=t["hidden"],
               target_intermediate=t["intermediate"], sliding_kinds=kinds)
    tr = run.train
    p = step_plan(s, target_params=t["params"], head_only_params=t["head_only"], drafter_params=d["params"],
                  unit_params=d["unit"], cuda=cuda, world=world, fsdp=tr.fsdp and world > 1,
                  gradient_checkpointing=tr.gradient_checkpointing, features_cache=bool(run.data.features_cache),
                  target_shards=world if run.target.target_fsdp else 1, target_layer_params=t["layer_params"],
                  target_largest_layer=t["largest_layer"])
    p.notes.append(f"{rows} rows x {L} tokens per micro-batch, {s.blocks} blocks of {B}, drafter "
                   f"{d['params'] / 1e9:.2f}B params, target {t['params'] / 1e9:.2f}B")
    return p
