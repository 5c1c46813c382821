"""The memory plan: peak bytes per rank of a training run, part by part, from the target's config and
the run's flags alone (no GPU, no weights): `benchmarks/memory_plan.py` prints it for the README's
commands, `doctor --plan` for a user's own (docs/scale.md, rule 7).

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
MIB = 2**20
# Slots per chunk of train.loss.dflash_loss_chunked (train.loss.loss_chunk_slots asks `chunk_slots` on CUDA)
LOSS_CHUNK_MIN = 256  # slots per loss chunk off CUDA, and the floor on CUDA
LOSS_CHUNK = LOSS_CHUNK_MIN
LOSS_CHUNK_MAX = 8192
LOSS_MEMORY_SHARE = 32  # one chunk's transient tensors may take 1/32 of the free device memory
# Bytes one chunk holds per slot and vocabulary entry, estimated: the [chunk, Vd] draft logits in
# the compute dtype (2), their fp32 log-softmax (4) and its gradient (4), the [chunk, V'] gathered
# label rows (2): ~12. An estimate for sizing only; `loss_chunk_bytes` counts each tensor.
LOSS_BYTES_PER_ENTRY = 12


def chunk_slots(free_bytes: int, vocab: int) -> int:
    """Slots per loss chunk on CUDA: a 256-slot chunk is bound by kernel launches (~120 chunks for 30k
    slots), so a chunk takes as many slots as keep its transient tensors (LOSS_BYTES_PER_ENTRY per slot
    and vocabulary entry) near 1/32 of the free memory, within [256, 8192], rounded down to a multiple
    of 256."""
    slots = max(0, int(free_bytes)) // LOSS_MEMORY_SHARE // (LOSS_BYTES_PER_ENTRY * max(1, int(vocab)))
    return max(LOSS_CHUNK_MIN, min(LOSS_CHUNK_MAX, slots) // LOSS_CHUNK_MIN * LOSS_CHUNK_MIN)
H200_BYTES = 139 * GIB  # the device memory a CUDA plan assumes unless told (an H200)

# What a CUDA rank holds besides its tensors (assumptions, not measurements):
# - the CUDA context (runtime, driver state, the kernels of torch, cuBLAS and NCCL as they load, lazily):
#   ~0.6 GiB per rank, outside torch's caching allocator;
# - cuBLAS's workspace: 32 MiB per stream that runs GEMMs (torch's default CUBLAS_WORKSPACE_CONFIG
#   on Hopper, :4096:8), allocated through the caching allocator; a step's GEMMs all run on the
#   current stream (FSDP's and NCCL's side streams run none): one stream;
# - NCCL's buffers once there is a process group (world > 1, or torchrun with one GPU, which still
#   makes a group): NCCL_BUFFSIZE's default 4 MiB for each of up to 32 channels (NCCL's ceiling on
#   NVLink nodes), one communicator, outside torch's allocator.
CUDA_CONTEXT = 600 * MIB
CUBLAS_WORKSPACE = 32 * MIB
CUBLAS_STREAMS = 1
NCCL_BUFFER = 4 * MIB
NCCL_CHANNELS = 32
# The caching allocator reserves more than it hands out: rounding and fragmentation (~10% of the
# allocated peak) and, at worst, one fresh segment for the largest tensor a step frees and makes again.
RESERVE_FACTOR = 1.1


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


def loss_chunk_bytes(s: Shapes, c_target: int, chunk: int = LOSS_CHUNK, label_width: int | None = None) -> int:
    """One loss chunk's transient: its draft logits (and their fp32 softmax and gradient) and its
    label rows (the target's head on the span of final states the chunk reads, gathered per slot,
    and freed before the draft logits are made; then upcast, softmaxed; `label_width` wide,
    default V); a chunk holds at most the step's S slots."""
    lw = s.V if label_width is None else label_width
    return min(chunk, max(1, s.slots)) * (s.Vd * (c_target + 12) + lw * (c_target + 12))


def plan_loss_chunk(s: Shapes, cuda: bool, free_bytes: int, label_width: int | None = None) -> int:
    """The chunk train.loss.loss_chunk_slots picks: 256 on a CPU; on CUDA from the memory free when
    the loss runs (`free_bytes`), for the wider of the draft rows (Vd) and the label rows
    (`label_width`, default V: the target's full head, unless a feature cache's argmax lets it run on
    the draft vocabulary alone)."""
    return chunk_slots(free_bytes, max(s.Vd, s.V if label_width is None else label_width)) if cuda else LOSS_CHUNK


def target_forward_bytes(s: Shapes, c_target: int) -> int:
    """The frozen target's forward under no_grad: one layer's transients over T tokens, the
    per-row attention masks of packed documents, the captured feature layers, the final normed
    states of every position (its head does not run: the loss runs it on the label rows)."""
    return (s.T * (6 * s.target_hidden + 3 * s.target_intermediate) * c_target + s.rows * s.L * s.L
            + s.T * s.features * c_target + s.T * s.target_hidden * c_target)


@dataclass
class Plan:
    """Bytes per rank, part by part (parts overlap in time: the peak is not their sum). `peak`: what
    torch's allocator hands out at the step's worst moment (torch.cuda.max_memory_allocated);
    `reserved`: what the caching allocator holds from the device for it (an estimate); `total`:
    reserved plus what lives outside the allocator (the CUDA context, NCCL's buffers), what the
    card must have. On a CPU all three are the peak. `loss_chunk`: slots per loss chunk."""

    parts: dict = field(default_factory=dict)  # name -> bytes
    peak: int = 0
    notes: list = field(default_factory=list)
    reserved: int = 0
    total: int = 0
    loss_chunk: int = LOSS_CHUNK
    drafter_params: int = 0  # the drafter's parameters (its checkpoint's size follows from them)

    def gib(self) -> dict:
        return {k: v / GIB for k, v in self.parts.items()} | {"peak": self.peak / GIB, "reserved": self.reserved / GIB,
                                                              "total": self.total / GIB}

    def fits(self, gib: float) -> bool:
        """Whether a device of `gib` GiB holds it all (the allocator's reserve, the CUDA context and
        NCCL's buffers are counted in the total, so no margin is added)."""
        return (self.total or self.peak) <= gib * GIB

    def table(self) -> str:
        rows = [f"  {k:<22} {v / GIB:8.2f} GiB" for k, v in self.parts.items()]
        ends = [("peak per rank", self.peak), ("reserved per rank", self.reserved), ("device per rank", self.total)]
        rows += [f"  {k:<22} {v / GIB:8.2f} GiB" for k, v in ends]
        return "\n".join(rows + [f"  note: {n}" for n in self.notes])


# Parts held through the whole step, and parts outside torch's allocator (not in the peak).
STATIC_PARTS = ("target", "target gathers", "drafter", "gradients", "optimizer", "fsdp gathers", "bf16 gathers",
                "unsharded gradients", "cublas workspace")
OUTSIDE_PARTS = ("cuda context", "nccl buffers")


def step_plan(s: Shapes, *, target_params: int, head_only_params: int, drafter_params: int, unit_params: int,
              cuda: bool = True, world: int = 1, fsdp: bool = False, gradient_checkpointing: bool = False,
              features_cache: bool = False, backend: str | None = None,
              chunks: list[tuple[int, int]] | None = None, target_shards: int = 1, target_layer_params: int = 0,
              target_largest_layer: int = 0, grad_accum: int = 1, grouped: bool | None = None,
              device_bytes: int = H200_BYTES) -> Plan:
    """Peak bytes per rank of one training step and what makes them up. `target_shards` > 1: the
    target's decoder layers (`target_layer_params` in all) sharded over that many ranks, one
    layer (and the next, prefetched) gathered whole at a time (--target-fsdp). `fsdp`: the drafter
    runs under FSDP2 (also on one rank, under torchrun); `grad_accum` micro-batches per optimizer
    step; `grouped`: a process group exists (default: world > 1); `device_bytes`: the device's
    memory (sizes the CUDA loss chunk). No [P, V] or [T, V] tensor is counted: the labels are the
    target's final states at the P label positions, its head run in each loss chunk."""
    c = 2 if cuda else 4  # bf16 autocast on CUDA; fp32 on the CPU
    c_t = c  # the frozen target's dtype (target/files.py: default_dtype)
    backend = backend or ("flex" if cuda else "chunked")
    p = Plan()
    _target_parts(p, target_params, head_only_params, features_cache, target_shards, target_layer_params,
                  target_largest_layer, c_t)
    _drafter_parts(p, drafter_params, unit_params, cuda, world, fsdp, grad_accum, gradient_checkpointing)
    per_layer = layer_activation_bytes(s, c, backend, chunks)
    if gradient_checkpointing:  # each layer keeps its input; one layer's activations live at a time
        acts = s.layers * s.Q * s.Hd * 4 + per_layer
    else:
        acts = s.layers * per_layer
    p.parts["activations"] = acts + fixed_activation_bytes(s, c)
    p.parts["labels"] = s.label_positions * s.target_hidden * c_t  # the final states [P, Ht] the loss's head reads
    p.parts["block inputs"] = s.Q * s.Hd * (c_t + 4)
    if backend == "flex":
        qt, kt = math.ceil(s.Q / 128), math.ceil((s.T + s.Q) / 128)
        p.parts["masks"] = s.sliding_kinds * qt * kt * 4 * 4
    else:
        p.parts["masks"] = 0  # the chunked path's masks are counted in its layers
    if not features_cache:
        p.parts["target forward"] = target_forward_bytes(s, c_t)
    if cuda:
        _cuda_parts(p, world > 1 if grouped is None else grouped)
    _finish(p, s, cuda, c_t, per_layer, device_bytes, s.Vd if features_cache else s.V)
    return p


def _target_parts(p: Plan, target_params, head_only_params, features_cache, target_shards, target_layer_params,
                  target_largest_layer, c_t) -> None:
    """The frozen target's weights: whole, head and embedding only (a feature cache), or its layers
    sharded (--target-fsdp) with two of them gathered."""
    if features_cache:
        p.parts["target"] = head_only_params * c_t
    elif target_shards > 1:
        p.parts["target"] = (target_params - target_layer_params + target_layer_params // target_shards) * c_t
        p.parts["target gathers"] = 2 * target_largest_layer * c_t
    else:
        p.parts["target"] = target_params * c_t


def _drafter_parts(p: Plan, drafter_params, unit_params, cuda, world, fsdp, grad_accum, checkpointing) -> None:
    """The drafter's fp32 weights, gradients and AdamW state (sharded under FSDP), and the copies its
    forward makes: FSDP's gathered units, or autocast's bf16 casts."""
    whole = drafter_params * 4
    # FSDP2 pads each parameter's shards: a rank holds at least 1/world of it, all of it on one rank
    per_rank = -(-whole // max(1, world)) if fsdp else whole
    p.parts["drafter"] = per_rank
    p.parts["gradients"] = per_rank
    p.parts["optimizer"] = 2 * per_rank
    if fsdp and grad_accum > 1:  # without gradient sync FSDP2 keeps every unit's unsharded fp32 gradient
        p.parts["unsharded gradients"] = whole
    if fsdp and cuda:  # MixedPrecisionPolicy gathers bf16 params (autocast has nothing left to cast): a unit and the next
        p.parts["bf16 gathers"] = 2 * unit_params * 2
    elif fsdp:  # a unit gathered in fp32, the next one prefetched
        p.parts["fsdp gathers"] = 2 * unit_params * 4
    elif cuda:  # autocast's bf16 copy of every weight, held from the forward into the backward (the linears
        # save it), and one layer's again in a gradient-checkpoint recompute
        p.parts["autocast cache"] = drafter_params * 2 + (unit_params * 2 if checkpointing else 0)


def _cuda_parts(p: Plan, grouped: bool) -> None:
    """What a CUDA rank holds besides its tensors (the constants' comments give the assumptions)."""
    p.parts["cuda context"] = CUDA_CONTEXT
    p.parts["cublas workspace"] = CUBLAS_WORKSPACE * CUBLAS_STREAMS
    if grouped:
        p.parts["nccl buffers"] = NCCL_BUFFER * NCCL_CHANNELS


def _finish(p: Plan, s: Shapes, cuda: bool, c_t: int, per_layer: int, device_bytes: int, label_width: int) -> None:
    """The loss chunk (sized from the memory left when the loss runs), the backward's transient, and
    the peak, reserved and total figures."""
    def total(names) -> int:
        return sum(p.parts.get(k, 0) for k in names)

    static, outside = total(STATIC_PARTS), total(OUTSIDE_PARTS)
    held = static + total(("activations", "labels", "block inputs", "masks", "autocast cache"))
    p.loss_chunk = plan_loss_chunk(s, cuda, device_bytes - outside - held, label_width)
    p.parts["loss chunk"] = loss_chunk_bytes(s, c_t, p.loss_chunk, label_width)
    backward = per_layer // 2 + p.parts["loss chunk"]  # one layer's gradients in flight
    p.parts["backward transient"] = backward
    drafter_side = held - static + max(p.parts["loss chunk"], backward)
    target_side = total(("target forward", "labels")) if "target forward" in p.parts else 0
    p.peak = static + max(drafter_side, target_side)
    p.reserved = int(p.peak * RESERVE_FACTOR) + largest_block_bytes(p, s, c_t) if cuda else p.peak
    p.total = p.reserved + outside


def largest_block_bytes(p: Plan, s: Shapes, c_t: int) -> int:
    """The largest tensor a step frees and makes again, for which the caching allocator may have to
    reserve a fresh segment: fc's input features or a loss chunk's rows (fp32 draft rows, or the label
    rows)."""
    chunk = min(p.loss_chunk, max(1, s.slots))
    return max(s.T * s.features * c_t, chunk * max(s.Vd * 4, s.V * c_t))


# ------------------------------------------------------------------------ from configs and flags

def count_params(module) -> int:
    return sum(t.numel() for t in module.parameters())


def target_sizes(target_config) -> dict:
    """Parameter counts of a target, from its transformers config (built on the meta device: any
    architecture transformers knows, MoE included)."""
    import torch

    from .target.classes import auto_class

    with torch.device("meta"):  # a causal LM, or the wrapper of a text decoder (target/classes.py)
        model = auto_class(target_config).from_config(target_config)
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


def plan_run(target_config, run, *, world: int = 1, cuda: bool = True, layer_ids: list[int] | None = None,
             torchrun: bool = False, device_bytes: int = H200_BYTES) -> Plan:
    """The plan of `blockdraft train` with this RunConfig on a target with this config. `torchrun`:
    launched by torchrun, which makes a process group even for one GPU (NCCL's buffers; --fsdp
    shards over that one rank); `device_bytes`: each GPU's memory (default an H200's)."""
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
    tr, grouped = run.train, world > 1 or torchrun
    p = step_plan(s, target_params=t["params"], head_only_params=t["head_only"], drafter_params=d["params"],
                  unit_params=d["unit"], cuda=cuda, world=world, fsdp=tr.fsdp and grouped,
                  gradient_checkpointing=tr.gradient_checkpointing, features_cache=bool(run.data.features_cache),
                  target_shards=world if run.target.target_fsdp else 1, target_layer_params=t["layer_params"],
                  target_largest_layer=t["largest_layer"], grad_accum=tr.grad_accum, grouped=grouped,
                  device_bytes=device_bytes)
    p.drafter_params = d["params"]
    p.notes.append(f"{rows} rows x {L} tokens per micro-batch, {s.blocks} blocks of {B}, drafter "
                   f"{d['params'] / 1e9:.2f}B params, target {t['params'] / 1e9:.2f}B")
    return p


# ------------------------------------------------------------------ published targets (benchmarks/online.py)

@dataclass(frozen=True)
class Published:
    """A published target the node plan covers: its transformers config (`config`: a class of transformers,
    built with `overrides`, or a JSON file under assets/plan), the checkpoint's scheme (engine_plan.SCHEMES),
    its published total in billions (None: not published) and where each figure comes from."""

    config: str
    scheme: str
    total_b: float | None
    sources: str
    overrides: dict = field(default_factory=dict)


PUBLISHED = {
    "GLM-5 (FP8)": Published(
        "GlmMoeDsaConfig", "fp8", 744,
        "shapes: transformers 5.25's GlmMoeDsaConfig defaults (its docstring's checkpoint zai-org/GLM-5; NVIDIA "
        "NeMo's GLM-5 page: 78 layers, hidden 6144, 256 experts top-8, kv_lora_rank 512); 744B total, 40B active: "
        "the GLM-5 technical report (table quoted at glennklockwood.com/garden/GLM-5); FP8: zai-org's -FP8 releases"),
    "GLM-5-Next (bf16)": Published(
        "Glm5NextConfig", "bf16", None,
        "shapes: transformers 5.25's Glm5NextConfig defaults (its docstring's checkpoint zai-org/GLM-5.3-Flash); "
        "total and released quantizations: not available here, so bf16"),
    "DeepSeek-V4-Flash (FP4 experts, FP8)": Published(
        "DeepseekV4Config", "mxfp4-experts-fp8", 284,
        "shapes: transformers 5.25's DeepseekV4Config defaults (its docstring's checkpoint "
        "deepseek-ai/DeepSeek-V4-Flash-Base); 284B total, 13B active: OpenRouter's and Venice's model pages; FP4 "
        "experts, FP8 elsewhere: vLLM's DeepSeek-V4 recipe"),
    "DeepSeek-V4-Pro (FP4 experts, FP8)": Published(
        "DeepseekV4Config", "mxfp4-experts-fp8", 1600,
        "1.6T total, 49B active, 61 layers, hidden 7168, 128 heads, q_lora_rank 1536, 16 output groups of "
        "o_lora_rank 1024, 384 experts top-6 of width 3072, vocabulary 129280: glennklockwood.com/garden/"
        "DeepSeek-V4-Pro and apxml.com; the rest as V4-Flash's defaults (assumed); FP4 experts, FP8 elsewhere: "
        "vLLM's DeepSeek-V4-Pro recipe",
        dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
             o_lora_rank=1024, n_routed_experts=384, num_experts_per_tok=6, moe_intermediate_size=3072,
             vocab_size=129280)),
    "MiniMax-M3 (bf16)": Published(
        "MiniMaxM3VLConfig", "bf16", 428,
        "shapes: transformers 5.25's MiniMaxM3VLConfig defaults (its docstring's checkpoint MiniMaxAI/MiniMax-M3; "
        "NVIDIA Megatron Bridge's page: 60 layers, 3 dense, 128 experts top-4, 64 query and 4 KV heads, bf16 "
        "weights); 428B total, 23B active: that page and Xinference's"),
    "MiniMax-M3 (MXFP8)": Published(
        "MiniMaxM3VLConfig", "mxfp8", 428,
        "as MiniMax-M3 (bf16); MXFP8: the MiniMaxAI/MiniMax-M3-MXFP8 release (its name; its scale layout, one "
        "8-bit scale per 32 weights, is MXFP8's)"),
    "Kimi-K3 (MXFP4 experts)": Published(
        "kimi-k3.json", "mxfp4-experts", 2800,
        "assets/plan/kimi-k3.json (its _about says which figures are published, by the Kimi-K3 card on Baidu "
        "AIHC, and which are assumed); MXFP4 weights: that card (the experts only assumed, as Kimi-K2-Thinking's "
        "INT4)"),
}


def published_config(name: str):
    """(the transformers config, the scheme) of a PUBLISHED target."""
    import transformers

    pub = PUBLISHED[name]
    if pub.config.endswith(".json"):
        from pathlib import Path

        return config_file(Path(__file__).parent / "assets" / "plan" / pub.config), pub.scheme
    return getattr(transformers, pub.config)(**pub.overrides), pub.scheme


def config_file(path):
    """A target's transformers config from a JSON file (a checkpoint's config.json, or a family transformers
    lacks written as a type it has; keys starting with '_' are comments). A model type transformers does not
    know is refused in one line: the plan counts the target's parameters with transformers' own class."""
    import json
    from pathlib import Path

    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    d = {k: v for k, v in json.loads(Path(path).read_text()).items() if not k.startswith("_")}
    kind = d.pop("model_type", None)
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"{path}: transformers {transformers.__version__} has no model type {kind!r}, so the plan "
                         "cannot build the target to count it; write its text part as a type transformers has "
                         "(Kimi-K3: kimi_linear, as vLLM's own KimiK3Config holds it)")
    return AutoConfig.for_model(kind, **d)
