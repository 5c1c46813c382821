"""What `blockdraft train` checks before any work: every setting against its constraint and the
files it names, settings against each other (sliding layers, FSDP without torchrun), the draft
vocabulary against the target's, and a resumed run's settings against those it started with.

Nothing here is clamped or ignored with a print: a setting the run cannot honour is a one-line
error naming it, before the target loads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# settings a resumed run may change: how it runs and reports, never what it computes
RESUMABLE = {
    "train": {"out", "resume", "overwrite", "progress", "eval_every", "save_every", "log_every", "eval_anchors",
              "dist_timeout_min", "gradient_checkpointing", "fsdp", "backend"},
    "target": {"device", "threads", "target_device_map", "offload_folder", "target_fsdp"},
    "data": {"skip_bad_lines", "memo_features", "max_eval_rows"},
    "drafter": set(),
}


def preflight(cfg) -> None:
    """Every check below, in order; the first that fails raises its ValueError."""
    from ..options import check_fields

    for name in cfg.PARTS:
        check_fields(getattr(cfg, name), where=f"{name}.")
    check_launch(cfg)
    if not cfg.drafter.init_drafter:  # a continued drafter brings its own layout
        cfg.drafter.check(target_vocab(cfg.target.target) if _numeric(cfg.drafter.draft_vocab) else None)
    check_resumed_settings(cfg)


def launched() -> bool:
    """Whether this process was started by torchrun (or joined a process group already)."""
    from .distributed import grouped

    return ("WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ) or grouped()


def check_launch(cfg) -> None:
    """--fsdp and --target-fsdp shard over the ranks of a torchrun launch; without one they would do nothing."""
    if launched():
        return
    if cfg.train.fsdp:
        raise ValueError("--fsdp shards the drafter over the ranks of a torchrun launch, and this is none: run under "
                         "torchrun (one GPU: torchrun --nproc-per-node 1 -m blockdraft train ...) or drop --fsdp")
    if cfg.target.target_fsdp and not cfg.data.features_cache:
        raise ValueError("--target-fsdp shards the target over the ranks of a torchrun launch, and this is none: run "
                         "under torchrun or drop --target-fsdp")


def _numeric(draft_vocab) -> bool:
    return str(draft_vocab).strip().isdigit()


def target_vocab(name: str) -> int | None:
    """The target's vocabulary from its config alone (no weights), None where the config cannot say."""
    from ..target.files import is_random, resolve_target

    if is_random(name):
        from ..target.tiny import random_preset

        return int(random_preset(name)["vocab"])
    local, _ = resolve_target(name)
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(local)
    except (OSError, ValueError, KeyError):
        return None  # loading the target names the problem
    vocab = getattr(getattr(cfg, "text_config", None) or cfg, "vocab_size", None)
    return int(vocab) if vocab else None


def check_resumed_settings(cfg) -> None:
    """--resume continues the run in --out exactly: a setting that would change what it computes
    (the learning rate, the schedule, the data, the drafter) must equal the one it started with,
    as its train_config.json records it (or, that file lost, the copy its checkpoint keeps)."""
    from .rundir import CONFIG_FILE, LENGTH, saved_settings
    from .state import find_checkpoint

    out = Path(cfg.train.out)
    if not cfg.train.resume or find_checkpoint(out / "checkpoint") is None and not (out / CONFIG_FILE).exists():
        return  # nothing to continue: check_resume says so
    saved, recovered = saved_settings(out)
    lead = os.environ.get("RANK", "0") == "0"
    if recovered and lead:
        print(f"blockdraft train: warning: {recovered}; --resume rewrites it from them", file=sys.stderr)
    now, changed, grown = cfg.to_dict(), [], []
    for part, values in saved.items():
        for key, was in values.items():
            if key in now.get(part, {}) and key not in RESUMABLE.get(part, set()) and now[part][key] != was:
                (grown if part == "train" and key in LENGTH else changed).append(
                    f"--{key.replace('_', '-')} {was} (now {now[part][key]})")
    if grown and not changed and lead:
        print(f"blockdraft train: warning: --resume with another run length, {', '.join(grown)}: the learning rate "
              "after the checkpoint follows the new length's schedule", file=sys.stderr)
    if changed:
        replay = "" if recovered else f" (blockdraft train --config {out / CONFIG_FILE} --resume)"
        raise ValueError(f"--resume: this run was started with {', '.join(changed)}; resume it with its own settings"
                         f"{replay} or start a new --out")
