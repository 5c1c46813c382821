"""`blockdraft train` as a library call: target, data, drafter, trainer, plots."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

DEFAULT_DATA_FILE = Path(__file__).resolve().parent.parent / "assets" / "data" / "default.jsonl"


def resolve_data(data: str) -> str:
    if data == "default":
        if not DEFAULT_DATA_FILE.exists():
            raise ValueError("the bundled default dataset is missing from this installation; pass --data FILE")
        return str(DEFAULT_DATA_FILE)
    if not Path(data).exists():
        raise ValueError(f"--data {data}: no such file")
    return data


def split_conversations(convs: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Held-out split by conversation (never inside one). A conversation is held out when a hash
    of its content (and the seed) falls below the fraction, so the split does not move when the
    data grows or is reordered: continuing a drafter on a larger file never trains on what was
    held out before."""
    import hashlib

    if not 0 <= eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction == 0:
        return list(convs), []

    def u(c) -> float:
        key = f"{seed}\n{json.dumps(c, sort_keys=True, default=str)}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64

    us = [u(c) for c in convs]
    ev = {i for i, x in enumerate(us) if x < eval_fraction}
    if not ev and convs:
        ev = {min(range(len(convs)), key=us.__getitem__)}  # at least one held out
    if len(ev) >= len(convs):
        raise ValueError(f"only {len(convs)} conversations: too few to hold any out; lower --eval-fraction")
    return [c for i, c in enumerate(convs) if i not in ev], [c for i, c in enumerate(convs) if i in ev]


def frequent_tokens(rows: dict, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent tokens under the loss mask (ties and unseen ids by id), sorted by id."""
    ids = rows["input_ids"][rows["loss_mask"].bool()]
    counts = torch.bincount(ids, minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.double) * 1e-9  # deterministic tie-break: lower id first
    top = torch.topk(counts, size).indices
    return torch.sort(top).values


def pick_device(device: str | None) -> str:
    if device:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


SPREAD_NAMES = ("auto", "balanced", "balanced_low_0", "sequential")


def spread_kwargs(args) -> dict:
    """--target-device-map: spread a target too big for one device with transformers' `device_map`
    (auto, balanced, sequential, or a JSON object / file of module -> device; "disk" entries need
    --offload-folder). The drafter stays on --device, the target's outputs are moved there."""
    spec = getattr(args, "target_device_map", None)
    if not spec:
        return {}
    if spec in SPREAD_NAMES:
        device_map = spec
    else:
        text = spec if spec.lstrip().startswith("{") else Path(spec).read_text() if Path(spec).is_file() else spec
        try:
            device_map = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--target-device-map must be one of {', '.join(SPREAD_NAMES)} or a JSON object of "
                             f"module -> device (inline or a file): {e}") from None
        if not isinstance(device_map, dict):
            raise ValueError("--target-device-map JSON must be an object of module -> device")
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        raise ValueError("--target-device-map spreads the target over this node's devices: run one process "
                         "per node (torchrun --nproc-per-node 1)")
    kw = {"device_map": device_map}
    if getattr(args, "offload_folder", None):
        kw["offload_folder"] = args.offload_folder
    return kw


def conversation_rows(target, args) -> tuple[dict, dict | None]:
    """Render and pack --data (and --eval-data or a held-out split of it) into rows."""
    from ..data import load_conversations, pack, render

    convs, stats = load_conversations(resolve_data(args.data), skip_bad_lines=args.skip_bad_lines)
    if stats.bad_lines or stats.no_assistant:
        print(f"data: skipped {stats.bad_lines} bad lines and {stats.no_assistant} conversations without an "
              f"assistant turn")
    if getattr(args, "eval_data", None):
        train_c, eval_c = convs, load_conversations(resolve_data(args.eval_data))[0]
    else:
        train_c, eval_c = split_conversations(convs, getattr(args, "eval_fraction", 0.0), args.seed)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0

    def rows(cs):
        return pack([render(target.tokenizer, c) for c in cs], args.max_length, pad) if cs else None

    return rows(train_c), rows(eval_c)


def cached_rows(args, target) -> tuple[dict, dict | None, object, object]:
    """Rows and stored outputs from a `blockdraft extract` directory, split by row for held-out eval."""
    from ..data.features import DiskFeatures, cache_identity

    cache = DiskFeatures(args.features_cache, expect=cache_identity(target, args.max_length, torch.float32))
    R = cache.rows["input_ids"].shape[0]
    order = torch.randperm(R, generator=torch.Generator().manual_seed(args.seed))
    n_eval = min(R - 1, max(1, int(round(args.eval_fraction * R)))) if args.eval_fraction > 0 else 0
    ev, tr = order[:n_eval], order[n_eval:]

    def part(idx):
        return {k: v[idx] for k, v in cache.rows.items()}, (lambda i: cache(idx[i]))

    (train_rows, train_f), (eval_rows, eval_f) = part(tr), part(ev)
    return train_rows, (eval_rows if n_eval else None), train_f, (eval_f if n_eval else None)


def run_extract(args) -> str:
    from ..data.features import extract
    from ..target import TargetModel
    from .distributed import barrier, init_from_env

    rank, world_size, device = init_from_env(pick_device(args.device))
    target = TargetModel.from_pretrained(args.target, layer_ids=args.layer_ids, num_features=args.num_features,
                                         device=device, **spread_kwargs(args))
    args.eval_fraction = 0.0
    rows, _ = conversation_rows(target, args)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    out = extract(target, rows, args.out, shard_rows=args.shard_rows, dtype=dtype, rank=rank, world=world_size)
    barrier()  # the cache is complete once every rank has written its shards
    return str(out)


def norm_scale(norm, what: str, fallback: str) -> torch.Tensor:
    """The effective scale of a target norm (family.rms_norm_scale: Gemma-style 1 + w measured, not
    guessed), or a ValueError naming the init flag to change."""
    from ..family import rms_norm_scale

    scale = rms_norm_scale(norm) if norm is not None else None
    if scale is None:
        raise ValueError(f"the target's {what} is not an RMSNorm blockdraft can copy; use {fallback}")
    return scale


@torch.no_grad()
def init_final_norm_from_target(drafter, target) -> None:
    """Start the drafter's output scale at the target's own final-norm scale (Gemma norms scale by 1 + w)."""
    norm = getattr(target._base(), "norm", None)
    if norm is None or norm.weight.is_meta or norm.weight.shape != drafter.norm.weight.shape:
        raise ValueError("the target has no final norm of the drafter's width; use --final-norm-init small")
    drafter.norm.weight.copy_(norm_scale(norm, "final norm", "--final-norm-init small"))


@torch.no_grad()
def init_context_from_top_feature(drafter, target) -> None:
    """Start the context path as the target's top layer would see its own input: fc passes the
    last captured layer's hidden state through unchanged (the other layers start at zero) and
    hidden_norm takes the scale of the top layer's input norm. Train with the feature scale
    applied function-preservingly (the trainer's keep_function)."""
    from ..target import find_decoder_layers

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


def layer_layout(args) -> dict:
    """layer_types / sliding_window / causal flag from --sliding-window and --sliding-layers."""
    w = getattr(args, "sliding_window", None)
    if not w:
        return {}
    n = min(max(1, args.sliding_layers), args.draft_layers)
    types = ["sliding_attention"] * n + ["full_attention"] * (args.draft_layers - n)
    return {"layer_types": types, "sliding_window": int(w),
            "sliding_causal_in_block": not getattr(args, "bidirectional_sliding", False),
            "sliding_window_rule": args.window_rule}


def default_train_layout() -> dict:
    """DrafterConfig.for_target keywords of the drafter `blockdraft train` builds with no flags."""
    from ..cli import build_parser

    args = build_parser().parse_args(["train"])
    return dict(num_layers=args.draft_layers, block_size=args.block_size, **layer_layout(args))


def first_rows(rows: dict, max_rows: int) -> dict:
    """The first `max_rows` packed rows (all when max_rows is 0); stored-output indices stay valid."""
    if max_rows and rows["input_ids"].shape[0] > max_rows:
        print(f"data: training on the first {max_rows} of {rows['input_ids'].shape[0]} packed rows "
              "(--max-rows 0 for all)")
        return {k: v[:max_rows] for k, v in rows.items()}
    return rows


def build_drafter(args, target, train_rows: dict, device: str):
    """The drafter the flags describe: layers, sliding windows, draft vocabulary, initialisation."""
    from ..model import DFlashDrafter, DrafterConfig

    vocab = args.draft_vocab
    if vocab == "auto":
        vocab = 8192 if device == "cpu" else None  # on CPU the head is most of the drafter's cost
    vocab = None if vocab in (None, "full", "0", 0) else min(int(vocab), target.vocab_size)
    cfg = DrafterConfig.for_target(target, num_layers=args.draft_layers, block_size=args.block_size,
                                   draft_vocab_size=vocab, **layer_layout(args))
    drafter = DFlashDrafter(cfg)
    head_only = getattr(target, "head_only_loaded", False)
    if head_only and (getattr(args, "init_from_target", False) or getattr(args, "final_norm_init", "") == "target"):
        print("init: training from a feature cache loads no target layers; the drafter starts from scratch")
    elif getattr(args, "init_from_target", False):
        from ..model.drafter import init_from_target_layers
        from ..target import find_decoder_layers

        layers = find_decoder_layers(target.model, target.num_layers)
        top = list(layers)[target.num_layers - args.draft_layers:]
        copied = init_from_target_layers(drafter, top, target.model.config.get_text_config())
        print(f"init: copied {len(copied) // max(1, args.draft_layers)} tensors per layer from the target's top "
              f"{args.draft_layers} layer(s)")
    if getattr(args, "final_norm_init", "small") == "target" and not head_only:
        init_final_norm_from_target(drafter, target)
    if getattr(args, "context_init", "random") == "top-feature":
        if head_only:
            raise ValueError("--context-init top-feature needs the target's layers; a feature cache loads none")
        init_context_from_top_feature(drafter, target)
    if vocab:
        drafter.set_draft_vocab(frequent_tokens(train_rows, target.vocab_size, vocab))
        ids = train_rows["input_ids"][train_rows["loss_mask"].bool()]
        cover = torch.isin(ids, drafter.draft_vocab).float().mean().item()
        print(f"draft vocabulary: {vocab} ids cover {100 * cover:.1f}% of the training tokens")
    return drafter.to(device)


def continue_drafter(name_or_dir: str, target, device: str):
    """A trained drafter to go on training (a fresh schedule, not --resume): its architecture, draft
    vocabulary and weights come from the checkpoint, so the layout flags do not apply."""
    from ..checkpoint.native import load_drafter
    from ..pairing import check_pair

    drafter = load_drafter(name_or_dir, device=device)
    check_pair(target, drafter)
    cfg = drafter.config
    print(f"init: continuing from the drafter in {name_or_dir} ({cfg.num_hidden_layers} layer(s), "
          f"block {cfg.block_size}, draft vocabulary {cfg.draft_vocab_size or 'full'}); layout flags are ignored")
    return drafter


def run_training(args) -> dict:
    from ..checkpoint.native import load_drafter
    from ..data.features import FeatureMemo, memo_bytes
    from ..target import TargetModel
    from .plots import plot_run
    from .trainer import TrainConfig, Trainer

    from .distributed import init_from_env

    torch.manual_seed(args.seed)  # the same initial drafter on every rank
    rank, world_size, device = init_from_env(pick_device(args.device))
    feats: dict = {}
    if args.features_cache:  # the target never runs: only its embedding and head are loaded
        target = TargetModel.head_only(args.target, layer_ids=args.layer_ids, num_features=args.num_features,
                                       device=device)
        train_rows, eval_rows, tf, ef = cached_rows(args, target)
        train_rows = first_rows(train_rows, args.max_rows)
        feats = {"train_features": tf, "eval_features": ef}
    else:
        target = TargetModel.from_pretrained(args.target, layer_ids=args.layer_ids, num_features=args.num_features,
                                             device=device, **spread_kwargs(args))
        train_rows, eval_rows = conversation_rows(target, args)
        train_rows = first_rows(train_rows, args.max_rows)
        if args.memo_features == "on" or (args.memo_features == "auto" and memo_bytes(target, train_rows) < 4 * 2**30):
            # compute the target's outputs once, reuse them every epoch
            feats = {"train_features": FeatureMemo(target, train_rows),
                     "eval_features": FeatureMemo(target, eval_rows) if eval_rows is not None else None}
    if getattr(args, "init_drafter", None):
        drafter = continue_drafter(args.init_drafter, target, device)
    else:
        drafter = build_drafter(args, target, train_rows, device)
    tc = TrainConfig(out=args.out, steps=args.steps, epochs=args.epochs, lr=args.lr, warmup=args.warmup,
                     grad_accum=args.grad_accum, batch_tokens=args.batch_tokens, max_anchors=args.max_anchors,
                     loss=args.loss, gamma=args.gamma, seed=args.seed, eval_every=args.eval_every,
                     save_every=args.save_every, gradient_checkpointing=args.gradient_checkpointing,
                     fsdp=getattr(args, "fsdp", False),
                     progress=not args.no_progress)
    # a drafter that already computes something (loaded, or a structured init) keeps its function
    # when the trainer rescales its features
    keep = bool(getattr(args, "init_drafter", None)) or getattr(args, "context_init", "random") == "top-feature"
    trainer = Trainer(target, drafter, train_rows, eval_rows, tc, keep_function=keep, **feats)
    print(f"train: {train_rows['input_ids'].shape[0]} rows x {train_rows['input_ids'].shape[1]} tokens, "
          f"{0 if eval_rows is None else eval_rows['input_ids'].shape[0]} held-out rows, {trainer.total} steps, "
          f"drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params, device {device}"
          + (f", rank {rank} of {world_size}" if world_size > 1 else ""))
    summary = trainer.train(resume=args.resume)
    if rank != 0:
        return summary
    out = Path(args.out)
    plot_run(out / "metrics.jsonl", out)
    load_drafter(out / "drafter")  # the saved directory must load back
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
