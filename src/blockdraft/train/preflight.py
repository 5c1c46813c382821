"""What `blockdraft train` checks before any work: every setting against its constraint and the
files it names, settings against each other (sliding layers, FSDP without torchrun, a block longer
than a row, layout flags beside --init-drafter), the draft vocabulary against the target's, a row
against the machine's memory and the disk against the checkpoints (`check_before_loading`: from the
target's config and the drafter's, never their weights), and a resumed run's settings against
those it started with.

Nothing here is clamped or ignored with a print: a setting the run cannot honour is a one-line
error naming it, before the target loads.
"""

from __future__ import annotations

import os
import sys

# settings a resumed run may change: how it runs and reports, never what it computes
RESUMABLE = {
    "train": {"out", "resume", "overwrite", "progress", "eval_every", "save_every", "log_every", "eval_anchors",
              "dist_timeout_min", "gradient_checkpointing", "fsdp", "backend", "save_every_min", "keep_checkpoints",
              "save_best", "report_to", "report_required"},
    "target": {"device", "threads", "target_device_map", "offload_folder", "target_fsdp"},
    "data": {"skip_bad_lines", "memo_features", "max_eval_rows"},
    "drafter": set(),
    # where and how the engine runs, not what it computes (its dtype, quantization and states precision are)
    "engine": {"tensor_parallel_size", "pipeline_parallel_size", "expert_parallel", "data_parallel_size",
               "engine_memory", "engine_gpus", "share_gpus", "engine_eager", "engine_start_min", "engine_stall_min",
               "engine_untested", "engine_python", "spool", "spool_gib",
               # engines on other nodes: after a node is lost, the resumed run lists the servers it has
               "engine_endpoints", "mooncake_master", "store_gib"},
}


def preflight(cfg, engine=None) -> None:
    """Every check below, in order; the first that fails raises its ValueError. `engine`: the run's runner
    (default: the one cfg.engine names)."""
    from ..engines import runner
    from ..options import check_fields
    from ..rundir.trackers import check_installed

    engine = engine or runner(cfg.engine.engine)
    for name in cfg.PARTS:
        check_fields(getattr(cfg, name), where=f"{name}.")
    check_launch(cfg)
    check_installed(cfg.train.report_to, cfg.train.report_required)
    check_applied(cfg, engine)
    if not cfg.drafter.init_drafter:  # a continued drafter brings its own layout
        cfg.drafter.check(target_vocab(cfg.target.target) if _numeric(cfg.drafter.draft_vocab) else None)
    check_resumed_settings(cfg)
    check_before_loading(cfg)


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


def check_applied(cfg, engine) -> None:
    """A setting that the rest of the run makes moot is refused, not printed over and ignored: the
    runner's own settings against each other (`engine.check`); the target's layers are neither loaded nor
    run when a feature cache feeds the run, so they have nothing to shard and no outputs to keep; a
    sharded target runs every step, so nothing is kept."""
    engine.check(cfg.engine, "train")
    elsewhere = not engine.in_process
    memo_on = cfg.data.memo_features == "on"
    if cfg.train.save_best and not (cfg.data.eval_fraction > 0 or cfg.data.eval_data or cfg.data.eval_features_cache):
        raise ValueError("--save-best keeps the drafter of the best held-out tau, and this run holds no rows out "
                         "(--eval-fraction 0): drop --save-best, or hold rows out")
    if cfg.data.features_cache and cfg.target.target_fsdp:
        raise ValueError("--target-fsdp shards the target's layers, and with --features-cache they never load (the "
                         "cache holds their outputs): drop --target-fsdp")
    if memo_on and (cfg.data.features_cache or elsewhere):
        where = "--features-cache" if cfg.data.features_cache else f"--engine {cfg.engine.engine}"
        raise ValueError(f"--memo-features on keeps the target's outputs, and with {where} the target does not run "
                         "here: drop --memo-features")
    if memo_on and cfg.target.target_fsdp:
        raise ValueError("--memo-features on keeps the target's outputs, but a --target-fsdp target runs on every "
                         "rank every step (its forward is a collective): drop one of them, or `blockdraft extract` "
                         "once and train from the cache")


def _numeric(draft_vocab) -> bool:
    return str(draft_vocab).strip().isdigit()


def target_config(name: str):
    """The target's transformers config alone (no weights), None where it cannot be read (loading the
    target names the problem)."""
    from ..target.files import is_random, resolve_target

    if is_random(name):
        from ..target.tiny import random_config

        return random_config(name)
    local, _ = resolve_target(name)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(local)
    except (OSError, ValueError, KeyError):
        return None


def target_vocab(name: str) -> int | None:
    """The target's vocabulary from its config alone (no weights), None where the config cannot say."""
    cfg = target_config(name)
    vocab = getattr(getattr(cfg, "text_config", None) or cfg, "vocab_size", None)
    return int(vocab) if vocab else None


def check_resumed_settings(cfg) -> None:
    """--resume continues the run in --out exactly: a setting that would change what it computes
    (the learning rate, the schedule, the data, the drafter) must equal the one it started with,
    as its train_config.json records it (or, that file lost, the copy its checkpoint keeps)."""
    from ..rundir.directory import RunDir

    run = RunDir(cfg.train.out)
    if not cfg.train.resume or run.newest() is None and not run.settings_file.exists():
        return  # nothing to continue: check_resume says so
    saved, recovered = run.saved_settings()
    lead = os.environ.get("RANK", "0") == "0"
    if recovered and lead:
        print(f"blockdraft train: warning: {recovered}; --resume rewrites it from them", file=sys.stderr)
    now, changed, grown = cfg.to_dict(), [], []
    for part, values in saved.items():
        for key, was in values.items():
            if key in now.get(part, {}) and key not in RESUMABLE.get(part, set()) and now[part][key] != was:
                (grown if part == "train" and key in run.LENGTH else changed).append(
                    f"--{key.replace('_', '-')} {was} (now {now[part][key]})")
    if grown and not changed and lead:
        print(f"blockdraft train: warning: --resume with another run length, {', '.join(grown)}: the learning rate "
              "after the checkpoint follows the new length's schedule", file=sys.stderr)
    if changed:
        replay = "" if recovered else f" (blockdraft train --config {run.settings_file} --resume)"
        raise ValueError(f"--resume: this run was started with {', '.join(changed)}; resume it with its own settings"
                         f"{replay} or start a new --out")


def given(cfg, part: str) -> set[str]:
    """The settings of `part` the user set: the command line's flags (RunConfig.given), or for a
    RunConfig made in Python, those that differ from their defaults."""
    values = getattr(cfg, part)
    if cfg.given is not None:
        return {f for f in vars(values) if f in cfg.given}
    default = type(values)()
    return {f for f in vars(values) if getattr(values, f) != getattr(default, f)}


def _flag(name: str, cfg, part: str) -> str:
    """How a setting was given: its flag, or its entry in the --config file."""
    if cfg.source and (cfg.given is None or name not in cfg.given):
        return f"{part}.{name} in {cfg.source}"
    return "--" + name.replace("_", "-")


def check_before_loading(cfg) -> None:
    """What was found only after the target loaded and the data was tokenized: layout flags that a
    --init-drafter would not apply, a block longer than a row, a row that cannot fit in memory, a
    disk without room for the checkpoints. From the configs alone."""
    hf = target_config(cfg.target.target)
    dc = planned_drafter(cfg, hf)
    check_init_drafter(cfg, dc)
    L, block = cfg.data.max_length, dc.block_size if dc is not None else cfg.drafter.block_size
    if block > L:
        what = f"--init-drafter {cfg.drafter.init_drafter}'s block" if cfg.drafter.init_drafter else \
            _flag("block_size", cfg, "drafter")
        raise ValueError(f"{what} {block} exceeds {_flag('max_length', cfg, 'data')} {L}: a packed row must hold a "
                         "whole block")
    features = len(dc.target_layer_ids) * dc.target_hidden_size if dc is not None else 0
    hidden = dc.target_hidden_size if dc is not None else 0
    need, have = L * (4 * 8 + 4 * (features + hidden)), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ValueError(f"{_flag('max_length', cfg, 'data')} {L:,}: one packed row of that many tokens takes "
                         f"{need / 2**30:,.1f} GiB for its tokens and the target's features alone, more than this "
                         f"machine's {have / 2**30:,.1f} GiB of memory; use a smaller max_length")
    if dc is not None and os.environ.get("RANK", "0") == "0":
        from ..plan import drafter_sizes
        from ..rundir.directory import RunDir

        run = RunDir(cfg.train.out)
        run.check_space(run.run_bytes(drafter_sizes(dc)["params"], cfg.train.keep_checkpoints, cfg.train.save_best),
                        "the checkpoints and the final drafter")


def planned_drafter(cfg, hf):
    """The drafter's config before anything loads: the --init-drafter's own, else the one the flags
    describe on this target (None where the target's config cannot say)."""
    if cfg.drafter.init_drafter:
        from ..checkpoint.native import read_config, resolve_drafter

        return read_config(resolve_drafter(cfg.drafter.init_drafter))[1]
    if hf is None:
        return None
    from types import SimpleNamespace

    from ..config import DrafterConfig, default_target_layer_ids
    from ..target import pick_device

    try:
        tc = getattr(hf, "text_config", None) or hf
        V = int(tc.vocab_size)
        ids = cfg.target.layer_ids or default_target_layer_ids(int(tc.num_hidden_layers), cfg.target.num_features)
        fake = SimpleNamespace(model=SimpleNamespace(config=hf), layer_ids=ids, vocab_size=V, mask_token_id=V - 1,
                               name="preflight", tokenizer_hash=None)
        vocab = cfg.drafter.vocab_size(pick_device(cfg.target.device), V)
        return DrafterConfig.for_target(fake, draft_vocab_size=vocab, **cfg.drafter.layout())
    except (AttributeError, TypeError, KeyError):  # a config of unusual shape: building the drafter says more
        return None


INIT_ONLY = ("init_from_target", "final_norm_init", "context_init")  # how a new drafter starts


def check_init_drafter(cfg, dc) -> None:
    """--init-drafter brings its own layout and weights: a layout or start setting the user gave
    beside it, which the drafter does not have, is refused naming both (never ignored)."""
    d = cfg.drafter
    if not d.init_drafter:
        return
    sliding = [t == "sliding_attention" for t in dc.layer_types]
    has = {"block_size": dc.block_size, "draft_layers": dc.num_hidden_layers,
           "sliding_window": dc.sliding_window if any(sliding) else 0, "sliding_layers": sum(sliding),
           "bidirectional_sliding": not dc.sliding_causal_in_block, "draft_vocab": dc.draft_vocab_size or "full"}
    if not d.kind or d.kind == dc.kind:  # a kind's fields apply only where --kind changes it
        from .build import KIND_FLAGS

        has.update({n: getattr(dc, n, None) for n in KIND_FLAGS})
    wrong = []
    for name in sorted(given(cfg, "drafter") & (set(has) | set(INIT_ONLY))):
        now = getattr(d, name)
        if name in INIT_ONLY:
            wrong.append(f"{_flag(name, cfg, 'drafter')} {now} (it starts a new drafter)")
        elif not _same(name, now, has[name]):
            wrong.append(f"{_flag(name, cfg, 'drafter')} {now} (the drafter's: {has[name]})")
    if wrong:
        raise ValueError(f"--init-drafter {d.init_drafter} brings its own layout and weights, so {', '.join(wrong)} "
                         f"would not apply: drop {'them' if len(wrong) > 1 else 'it'}, or train a new drafter without "
                         "--init-drafter")
    check_kind_change(cfg, dc)


def check_kind_change(cfg, dc) -> None:
    """--init-drafter D --kind K: the drafter K would be (D's layout, K's fields) is checked as a config now,
    so what the kind refuses (a draft vocabulary: config.FULL_VOCAB_ONLY) is said before anything loads."""
    import dataclasses

    d = cfg.drafter
    if dc is None or not d.kind or d.kind == dc.kind:
        return
    if dc.kind != "dflash":
        raise ValueError(f"--kind {d.kind}: only a dflash drafter changes kind; --init-drafter {d.init_drafter} is a "
                         f"{dc.kind} drafter")
    try:
        dataclasses.replace(dc, **d.kind_fields())
    except ValueError as e:
        raise ValueError(f"--init-drafter {d.init_drafter} --kind {d.kind}: {e}") from None


def _same(name: str, now, has) -> bool:
    if name == "draft_vocab":
        v = str(now).strip()
        return (v in ("full", "0") and has == "full") or (v.isdigit() and int(v) == has)
    return now == has
