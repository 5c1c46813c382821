"""The drafter a training run starts from: its layout (DrafterOptions), draft vocabulary and
initialisation from the target (through target/family.py, the quirks' one owner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import FULL_VOCAB_ONLY, KIND_FIELDS, KINDS, WINDOW_QUERY, WINDOW_RULES, full_vocab_refusal

# the kind fields `train` takes as flags
KIND_FLAGS = ("markov_rank", "selector_rank", "selector_top_k", "lilicorr_candidate_topk", "lilicorr_num_layers",
              "conv_kernel_size", "conv_group_size", "emb_dim", "gru_hidden_dim")
from ..options import existing, opt
from ..releases import VLLM_SERIES
from ..target.family import final_norm, mlp_activation, pre_mlp_norm, rms_norm_scale
from ..target.layers import find_decoder_layers
from ..target.shard import gathered


@dataclass
class DrafterOptions:
    """What drafter `blockdraft train` builds (the defaults are the README's main command)."""

    block_size: int = opt(16, "tokens per block: the anchor and B - 1 drafted slots", min=2)
    draft_layers: int = opt(1, "drafter decoder layers", min=1)
    sliding_window: int = opt(32, "make the first --sliding-layers layers sliding-window layers of this width "
                                  "(0: full attention only)")
    sliding_layers: int = opt(1, "how many of the drafter layers slide (from the first; at most --draft-layers; "
                                 "--sliding-window 0 for none)", min=1)
    bidirectional_sliding: bool = opt(False, "sliding layers bidirectional inside the block (else causal)")
    window_rule: str | None = opt(None, "how a sliding window is counted: from each query's own position, as "
                                        "dflash, vLLM and SGLang serve it (query), or from the anchor, as speculators "
                                        "trains; with --init-drafter the drafter keeps its own rule unless one is "
                                        "given (default: query)", choices=WINDOW_RULES)
    draft_vocab: str = opt("auto", "draft vocabulary size (most frequent training tokens), 'full', or 'auto' "
                                   "(8192 on a CPU; full for the kinds that need it: lilicorr, domino)",
                           check=lambda v: check_draft_vocab(v))
    init_from_target: bool = opt(True, "start the drafter layers from the target's top decoder layers, where a "
                                       "piece computes the same function")
    final_norm_init: str = opt("target", "drafter output norm: 0.1 (small: near-uniform first guesses) or the "
                                         "target's final-norm scale", choices=("small", "target"))
    context_init: str = opt("random", "fc/hidden_norm start: random, or passing the last captured target layer "
                                      "through with the top layer's input-norm scale",
                            choices=("random", "top-feature"))
    kind: str | None = opt(None, "drafter kind: dflash; dspark (+ a Markov bias on each slot from the token before "
                                 "it, + a confidence head); dflash2 (+ in-block convolutions, + a top-K candidate "
                                 "selector); lilicorr (+ a correlator over each slot's top-K candidates, walked as "
                                 f"vLLM {VLLM_SERIES} does; convolutions with --conv-kernel-size); domino (+ a GRU "
                                 "correction of each slot's logits from the block's tokens before it). With "
                                 "--init-drafter a DFlash drafter becomes this kind, starting as its exact function "
                                 "(default: dflash, or the drafter's own)", choices=KINDS)
    markov_rank: int | None = opt(None, "dspark: rank of the Markov bias (0: none) (default: 256)", min=0)
    selector_rank: int | None = opt(None, "dflash2: rank of the candidate selector (default: 256)", min=1)
    selector_top_k: int | None = opt(None, "dflash2: candidates per slot (default: 16)", min=1)
    lilicorr_candidate_topk: int | None = opt(None, "lilicorr: candidates per slot, a power of two <= 16 "
                                                    "(default: 8)", min=1)
    lilicorr_num_layers: int | None = opt(None, "lilicorr: the correlator's lattice layers (default: 2)", min=1)
    conv_kernel_size: int | None = opt(None, "dflash2, lilicorr: taps of the in-block convolutions (lilicorr: 0 = "
                                             "none; default: 2 for dflash2, 0 for lilicorr)", min=0)
    conv_group_size: int | None = opt(None, "dflash2, lilicorr: channels sharing one dynamic tap (default: 16 for "
                                            "dflash2, 0 for lilicorr; lilicorr with taps: 16)", min=0)
    emb_dim: int | None = opt(None, "domino: width of the correction's projection (default: 256)", min=1)
    gru_hidden_dim: int | None = opt(None, "domino: width of the GRU state (default: 1024)", min=1)
    init_drafter: str | None = opt(None, "go on training a saved drafter (a directory or 'default') with a fresh "
                                         "schedule; the layout options then come from it", metavar="DIR",
                                  check=existing("dir", names=("default",)))

    def check(self, target_vocab: int | None = None) -> None:
        """Settings that contradict each other (or the target's vocabulary) are refused, never clamped."""
        if self.sliding_window and self.sliding_layers > self.draft_layers:
            raise ValueError(f"--sliding-layers {self.sliding_layers} exceeds --draft-layers {self.draft_layers}; "
                             "give at most as many sliding layers as layers (--sliding-window 0 for none)")
        try:
            size = check_draft_vocab(self.draft_vocab)
        except ValueError as e:
            raise ValueError(f"--draft-vocab {e}") from None
        if target_vocab is not None and size not in ("auto", "full") and int(size) > target_vocab:
            raise ValueError(f"--draft-vocab {size} exceeds the target's vocabulary ({target_vocab}); use a smaller "
                             "size or --draft-vocab full")
        refused = full_vocab_refusal(self.kind or "dflash", 0 if size in ("auto", "full") else int(size))
        if refused and not self.init_drafter:  # with --init-drafter the drafter's own size (train.preflight)
            raise ValueError(f"--draft-vocab {size} --kind {self.kind}: {refused}")

    def layout(self) -> dict:
        """DrafterConfig.for_target keywords: layers, block, sliding windows and their rules."""
        self.check()
        kw = dict(num_layers=self.draft_layers, block_size=self.block_size, **self.kind_fields())
        if self.sliding_window:
            n = self.sliding_layers
            kw.update(layer_types=["sliding_attention"] * n + ["full_attention"] * (self.draft_layers - n),
                      sliding_window=int(self.sliding_window), sliding_causal_in_block=not self.bidirectional_sliding,
                      sliding_window_rule=self.window_rule or WINDOW_QUERY)
        return kw

    def kind_fields(self, kind: str | None = None) -> dict:
        """DrafterConfig's kind and the kind's fields given as flags (a flag of another kind is refused)."""
        kind = kind or self.kind or "dflash"
        given = {n: getattr(self, n) for n in KIND_FLAGS if getattr(self, n) is not None}
        if kind == "lilicorr" and given.get("conv_kernel_size") and "conv_group_size" not in given:
            given["conv_group_size"] = 16
        foreign = sorted(n for n in given if n not in KIND_FIELDS[kind])
        if foreign:
            raise ValueError(f"{', '.join('--' + n.replace('_', '-') for n in foreign)} do not apply to a {kind} "
                             f"drafter; give --kind")
        return {"kind": kind, **given}

    def vocab_size(self, device: str, target_vocab: int) -> int | None:
        self.check(target_vocab)
        v = check_draft_vocab(self.draft_vocab)
        if v == "auto" and self.kind in FULL_VOCAB_ONLY:  # config.FULL_VOCAB_ONLY says why
            return None
        if v == "auto":  # on a CPU the head is most of the drafter's cost
            return 8192 if device == "cpu" and target_vocab > 8192 else None
        return None if v == "full" or int(v) == 0 else int(v)


def check_draft_vocab(v) -> str:
    """--draft-vocab: 'auto', 'full', or a number of tokens (0: full), else a ValueError."""
    text = str(v).strip() if v is not None else "full"
    if text in ("auto", "full"):
        return text
    try:
        size = int(text)
    except ValueError:
        raise ValueError(f"must be a number, 'full' or 'auto', got {v!r}") from None
    if size < 0:
        raise ValueError(f"must be a number of tokens >= 0 (0: full), got {size}")
    return str(size)


def frequent_tokens(rows: dict, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent tokens under the loss mask (ties and unseen ids by id), sorted by id."""
    ids = rows["input_ids"][rows["loss_mask"].bool()]
    counts = torch.bincount(ids, minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.double) * 1e-9  # deterministic tie-break: lower id first
    top = torch.topk(counts, size).indices
    return torch.sort(top).values


def norm_scale(norm, what: str, fallback: str) -> torch.Tensor:
    """The effective scale of a target norm (family.rms_norm_scale: Gemma-style 1 + w measured, not
    guessed), or a ValueError naming the init flag to change."""
    scale = rms_norm_scale(norm) if norm is not None else None
    if scale is None:
        raise ValueError(f"the target's {what} is not an RMSNorm blockdraft can copy; use {fallback}")
    return scale


@torch.no_grad()
def init_final_norm_from_target(drafter, target) -> None:
    """Start the drafter's output scale at the target's own final-norm scale (Gemma norms scale by
    1 + w), or a ValueError saying why it cannot (a LayerNorm as Cohere's, no final norm of the
    drafter's width)."""
    norm = final_norm(target.model)
    w = None if norm is None else getattr(norm, "weight", None)
    if w is None or w.is_meta or w.shape != drafter.norm.weight.shape:
        raise ValueError("the target has no final norm of the drafter's width; use --final-norm-init small")
    drafter.norm.weight.copy_(norm_scale(norm, "final norm", "--final-norm-init small"))


@torch.no_grad()
def init_context_from_top_feature(drafter, target) -> None:
    """Start the context path as the target's top layer would see its own input: fc passes the
    last captured layer's hidden state through unchanged (the other layers start at zero) and
    hidden_norm takes the scale of the top layer's input norm. Train with the feature scale
    applied function-preservingly (the trainer's keep_function)."""
    cfg = drafter.config
    Ht = cfg.target_hidden_size
    if cfg.hidden_size != Ht:
        raise ValueError(f"--context-init top-feature needs the drafter's hidden size ({cfg.hidden_size}) to equal "
                         f"the target's ({Ht})")
    top = list(find_decoder_layers(target.model, target.num_layers))[-1]
    ln = getattr(top, "input_layernorm", None)
    if ln is None or ln.weight.is_meta or ln.weight.shape != drafter.hidden_norm.weight.shape:
        raise ValueError("the target's top layer has no input norm of the drafter's width; use --context-init random")
    w = torch.zeros_like(drafter.fc.weight)
    w[:, -Ht:] = torch.eye(Ht, dtype=w.dtype)
    drafter.fc.weight.copy_(w)
    drafter.hidden_norm.weight.copy_(norm_scale(ln, "top layer's input norm", "--context-init random"))


def _same_linear(src: nn.Module | None, dst: nn.Module) -> bool:
    """Whether copying `src` into `dst` gives `dst` src's function: equal weight shapes, and a bias
    where src has a nonzero one (a dropped bias, as gpt-oss's, would change it)."""
    w = getattr(src, "weight", None)
    if not isinstance(w, torch.Tensor) or w.shape != dst.weight.shape:
        return False
    b = getattr(src, "bias", None)
    if dst.bias is None:
        return b is None or not bool(b.detach().abs().max() > 0)
    return b is None or b.shape == dst.bias.shape


def _copy_linear(src: nn.Module, dst: nn.Module) -> list[str]:
    dst.weight.copy_(src.weight.to(dst.weight))
    names = ["weight"]
    if dst.bias is not None:
        b = getattr(src, "bias", None)
        dst.bias.copy_(b.to(dst.bias) if b is not None else torch.zeros_like(dst.bias))
        names.append("bias")
    return names


def _target_mlp_parts(t_mlp: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor, nn.Module] | None:
    """(gate, up, down) of a dense gated MLP, whether its gate and up projections are separate
    (Llama) or fused as gate_up_proj, gate first (Phi-3, GLM-4); None for a mixture of experts
    or another shape."""
    if t_mlp is None:
        return None
    down = getattr(t_mlp, "down_proj", None)
    if not isinstance(down, nn.Linear) or down.bias is not None:
        return None
    gate, up = getattr(t_mlp, "gate_proj", None), getattr(t_mlp, "up_proj", None)
    if isinstance(gate, nn.Linear) and isinstance(up, nn.Linear) and gate.bias is None and up.bias is None:
        return gate.weight, up.weight, down
    fused = getattr(t_mlp, "gate_up_proj", None)
    if isinstance(fused, nn.Linear) and fused.bias is None and fused.weight.shape[0] % 2 == 0:
        g, u = fused.weight.chunk(2, dim=0)
        return g, u, down
    return None


@torch.no_grad()
def init_from_target_layers(drafter, target_layers, target_config) -> list[str]:
    """Start the drafter layers from target decoder layers (e.g. its top ones), piece by piece by
    role, where the piece computes the same function in the drafter: the attention projections
    when all four (q, k, v, o) have the drafter's shapes and biases (not MLA's latent projections);
    norms as their measured effective scale (Gemma's 1 + w becomes the drafter's w; a LayerNorm is
    not copied); a dense MLP when the target's activation is the drafter's (silu), its gate and up
    projections split from a fused gate_up_proj where the family fuses them (not a mixture of
    experts). Returns the copied names (`layers.{i}.input_layernorm.weight`, ...); fc and the
    drafter's own norms keep their initialisation."""
    same_act = mlp_activation(target_config) == drafter.config.hidden_act
    copied = []
    for i, (d_layer, t_layer) in enumerate(zip(drafter.layers, target_layers)):
        t_attn = getattr(t_layer, "self_attn", None)
        norms = {"input_layernorm": getattr(t_layer, "input_layernorm", None),
                 "post_attention_layernorm": pre_mlp_norm(t_layer),
                 "self_attn.q_norm": getattr(t_attn, "q_norm", None), "self_attn.k_norm": getattr(t_attn, "k_norm", None)}
        for name, t_norm in norms.items():
            scale = None if t_norm is None else rms_norm_scale(t_norm)
            mine = d_layer.get_submodule(name).weight
            if scale is not None and scale.shape == mine.shape:
                mine.copy_(scale.to(mine))
                copied.append(f"layers.{i}.{name}.weight")
        projs = [f"{p}_proj" for p in "qkvo"]
        if t_attn is not None and all(_same_linear(getattr(t_attn, p, None), getattr(d_layer.self_attn, p))
                                      for p in projs):
            for p in projs:
                copied += [f"layers.{i}.self_attn.{p}.{n}" for n in _copy_linear(getattr(t_attn, p),
                                                                                  getattr(d_layer.self_attn, p))]
        parts = _target_mlp_parts(getattr(t_layer, "mlp", None)) if same_act else None
        mlp = d_layer.mlp
        if parts is not None and (parts[0].shape, parts[1].shape, parts[2].weight.shape) == \
                (mlp.gate_proj.weight.shape, mlp.up_proj.weight.shape, mlp.down_proj.weight.shape) \
                and mlp.gate_proj.bias is None and mlp.down_proj.bias is None:
            mlp.gate_proj.weight.copy_(parts[0].to(mlp.gate_proj.weight))
            mlp.up_proj.weight.copy_(parts[1].to(mlp.up_proj.weight))
            mlp.down_proj.weight.copy_(parts[2].weight.to(mlp.down_proj.weight))
            copied += [f"layers.{i}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    return copied


def _init_from_target(drafter, target, opts: DrafterOptions) -> None:
    """The structured initialisations; a sharded target's top layers are gathered whole for them."""
    top = list(find_decoder_layers(target.model, target.num_layers))[-max(1, opts.draft_layers):]
    with gathered(top):
        _init_pieces(drafter, target, opts)


def _init_pieces(drafter, target, opts: DrafterOptions) -> None:
    """Each initialisation that applies to this target's family; one that cannot (a LayerNorm, an
    MLA attention, a mixture of experts) leaves that piece at the drafter's own start and says so."""
    if opts.init_from_target:
        layers = find_decoder_layers(target.model, target.num_layers)
        top = list(layers)[target.num_layers - opts.draft_layers:]
        copied = init_from_target_layers(drafter, top, target.model.config.get_text_config())
        print("init: " + describe_layer_init(copied, opts.draft_layers))
    if opts.final_norm_init == "target":
        try:
            init_final_norm_from_target(drafter, target)
        except ValueError as e:  # the default must work on every family: fall back, named
            reason = str(e).split(";")[0]
            print(f"init: {reason}: the drafter's output norm starts small ({float(drafter.norm.weight[0].detach()):g}) "
                  "instead")
    if opts.context_init == "top-feature":
        init_context_from_top_feature(drafter, target)


LAYER_PIECES = {"input norm": ("input_layernorm",), "pre-MLP norm": ("post_attention_layernorm",),
                "q/k norms": ("self_attn.q_norm", "self_attn.k_norm"),
                "attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
                "MLP": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def describe_layer_init(copied: list[str], num_layers: int) -> str:
    """One line: which pieces of the drafter layers came from the target's top layers, which start random."""
    got = {n.split(".", 2)[2].rsplit(".", 1)[0] for n in copied}
    took = [k for k, mods in LAYER_PIECES.items() if all(m in got for m in mods)]
    left = [k for k in LAYER_PIECES if k not in took]
    if not took:
        return (f"no piece of the target's top {num_layers} layer(s) computes what a drafter layer's does (its norms, "
                "attention and MLP differ in kind or shape): the drafter layers start from random")
    tail = f"; {', '.join(left)} start(s) from random (not the same function in the target)" if left else ""
    return (f"copied {len(copied) // max(1, num_layers)} tensors per layer from the target's top {num_layers} "
            f"layer(s): {', '.join(took)}{tail}")


def build_drafter(opts: DrafterOptions, target, train_rows: dict, device: str):
    """The drafter the options describe: layers, sliding windows, draft vocabulary, initialisation."""
    from ..model import DFlashDrafter, DrafterConfig

    vocab = opts.vocab_size(device, target.vocab_size)
    with torch.device(device):  # made where it trains: no fp32 host copy of a 1B-parameter drafter
        drafter = DFlashDrafter(DrafterConfig.for_target(target, draft_vocab_size=vocab, **opts.layout()))
    if getattr(target, "head_only_loaded", False):
        if opts.context_init == "top-feature":
            raise ValueError("--context-init top-feature needs the target's layers; a feature cache or an engine "
                             "run (--engine vllm) loads none")
        if opts.init_from_target or opts.final_norm_init == "target":
            print("init: training from a feature cache or an engine (--engine vllm) loads no target layers; the "
                  "drafter starts from scratch")
    else:
        _init_from_target(drafter, target, opts)
    if vocab:
        drafter.set_draft_vocab(frequent_tokens(train_rows, target.vocab_size, vocab))
        ids = train_rows["input_ids"][train_rows["loss_mask"].bool()]
        cover = torch.isin(ids, drafter.draft_vocab).float().mean().item()
        print(f"draft vocabulary: {vocab} ids cover {100 * cover:.1f}% of the training tokens")
    return drafter.to(device)


def continue_drafter(name_or_dir: str, target, device: str, window_rule: str | None = None,
                     options: DrafterOptions | None = None):
    """A trained drafter to go on training (a fresh schedule, not --resume): its architecture, draft
    vocabulary and weights come from the checkpoint (a layout flag given beside it that differs is
    refused before anything loads: train.preflight.check_init_drafter), except a
    given `window_rule`: the same weights then train under that sliding-window rule (how an
    anchor-rule drafter becomes one the engines serve as trained)."""
    import dataclasses

    from ..checkpoint.native import load_drafter
    from ..model import DFlashDrafter
    from ..pairing import check_pair

    drafter = load_drafter(name_or_dir, device=device)
    check_pair(target, drafter)
    cfg = drafter.config
    print(f"init: continuing from the drafter in {name_or_dir} ({cfg.num_hidden_layers} layer(s), "
          f"block {cfg.block_size}, draft vocabulary {cfg.draft_vocab_size or 'full'}): its own layout")
    if window_rule and cfg.has_sliding and window_rule != cfg.sliding_window_rule:
        print(f"init: sliding window rule {cfg.sliding_window_rule} -> {window_rule} (weights kept)")
        moved = DFlashDrafter(dataclasses.replace(cfg, sliding_window_rule=window_rule), initialize=False)
        moved.load_state_dict(drafter.state_dict())
        drafter = moved.to(device)
    if options is not None and options.kind and options.kind != cfg.kind:
        drafter = change_kind(drafter, options.kind_fields(), device)
    return drafter


def change_kind(drafter, fields: dict, device):
    """A DFlash drafter as another kind (`fields`: kind + its flags): the backbone's weights kept, the kind's
    own weights at their start, where the drafter computes the same function (model/kinds/)."""
    import dataclasses

    from ..model import DFlashDrafter

    cfg = drafter.config
    if cfg.kind != "dflash":
        raise ValueError(f"--kind {fields['kind']}: only a dflash drafter changes kind; this one is a {cfg.kind}")
    new = DFlashDrafter(dataclasses.replace(cfg, **fields)).to(device)
    new.set_feature_scale(drafter.feature_scale, keep_function=False)
    result = new.load_state_dict(drafter.state_dict(), strict=False)
    if result.unexpected_keys:
        raise ValueError(f"the {fields['kind']} drafter has no place for {result.unexpected_keys[:4]}")
    print(f"init: the {cfg.kind} drafter becomes a {fields['kind']} drafter; its {len(result.missing_keys)} new "
          "tensors start where it computes the same function")
    return new
