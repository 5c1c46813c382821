"""`blockdraft train` and `blockdraft extract` as library calls on one typed configuration.

    from blockdraft.train.run import RunConfig, run_training
    summary = run_training(RunConfig())                 # what `blockdraft train` does with no flags

A run's configuration is saved as `train_config.json` in its directory and replays with
`blockdraft train --config FILE` (flags given beside it override it).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data.pipeline import DataOptions, bound_rows, check_cache_options, conversation_rows
from ..engines import runner_options
from ..engines.options import RunnerOptions
from ..finite import dumps_finite
from ..rundir.directory import RunDir
from ..target import TargetOptions, pick_device
from .build import DrafterOptions, build_drafter, continue_drafter
from .train_options import TrainConfig
from .preflight import preflight


@dataclass
class RunConfig:
    """Everything a training run is: its target, data, drafter and schedule."""

    target: TargetOptions = field(default_factory=TargetOptions)
    data: DataOptions = field(default_factory=DataOptions)
    drafter: DrafterOptions = field(default_factory=DrafterOptions)
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: RunnerOptions = field(default_factory=RunnerOptions)  # its runner's own options class
    # not settings of the run: which ones the command line set (None: unknown, as in Python, where
    # those that differ from their defaults count), and the --config file the others came from
    given: frozenset | None = field(default=None, repr=False, compare=False)
    source: str | None = field(default=None, repr=False, compare=False)

    PARTS = ("target", "data", "drafter", "train", "engine")

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in self.PARTS}

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        from ..options import check_fields

        if not isinstance(d, dict) or not all(isinstance(v, dict) for v in d.values()):
            raise ValueError(f"a run configuration is an object of sections {list(cls.PARTS)}, each an object")
        unknown = sorted(set(d) - set(cls.PARTS))
        if unknown:
            raise ValueError(f"unknown run configuration sections {unknown}; expected {list(cls.PARTS)}")
        parts = {}
        for name in cls.PARTS:
            kind = type(getattr(cls(), name))
            values = d.get(name, {})
            if name == "engine":  # the runner's own options class, named by its `engine`
                parts[name] = runner_options(values, "run")
                check_fields(parts[name], where=f"{name}.", environment=False)
                continue
            names = {f.name for f in dataclasses.fields(kind)}
            bad = sorted(set(values) - names)
            if bad:
                raise ValueError(f"unknown {name} settings {bad} in the run configuration")
            parts[name] = kind(**values)
            check_fields(parts[name], where=f"{name}.", environment=False)  # the files it names: preflight
        return cls(**parts)

    @classmethod
    def from_json(cls, path: str | Path) -> "RunConfig":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--config {path}: cannot read a run configuration ({e})") from None
        except ValueError as e:
            raise ValueError(f"--config {path}: {e}") from None


def check_resume(out: str | Path, resume: bool) -> None:
    """--resume needs a run to continue; say so before loading anything (and create nothing)."""
    run = RunDir(out)
    # checkpoint/ there (loading it names what is wrong with it), or a complete one kept
    if resume and run.recover() is None and run.newest() is None:
        raise ValueError(f"--resume: there is no checkpoint in {out}/checkpoint to continue; drop --resume to start "
                         "a new run there (with --overwrite where an earlier one is)")


def check_resumed_state(out: Path, report_to: str = "none", save_best: bool = False) -> None:
    """The checkpoint's record, the metrics, and (with trackers) trackers.json and (--save-best)
    best.json a resume reads, read now rather than after the target loaded: one line naming a damaged
    file (a torn last metrics line is repaired, and said, later)."""
    from ..rundir.trackers import parse_report_to, read_state

    run = RunDir(out)
    run.checked_meta()
    run.metrics_lines(say=False)
    if parse_report_to(report_to):
        read_state(out)
    if save_best:
        run.read_best()


def adopt_cache_length(cfg: RunConfig) -> None:
    """A feature cache's row length is --max-length's default when training from it: the length comes
    from the cache unless the user set one (the flag, a --config file, or in Python a value other than
    the default), which `check_cache` then holds to the cache's."""
    from ..data.features import DiskFeatures
    from .preflight import given

    cache = cfg.data.features_cache
    if not cache or cfg.source or "max_length" in given(cfg, "data"):
        return
    made = DiskFeatures(cache, rows=False).manifest.get("max_length")
    if isinstance(made, int) and made != cfg.data.max_length:
        cfg.data = dataclasses.replace(cfg.data, max_length=made)


def check_cache(path: str, max_length: int) -> None:
    """A feature cache's manifest and every shard's header (data.features.DiskFeatures), and its rows'
    length against --max-length, before the target loads."""
    from ..data.features import DiskFeatures

    made = DiskFeatures(path, rows=False).manifest.get("max_length")
    if made != max_length:
        raise ValueError(f"feature cache {path} holds rows of {made} tokens, and --max-length is {max_length}: "
                         f"pass --max-length {made}, or extract a cache of {max_length}")


def cached_rows(opts: DataOptions, target, seed: int):
    """Rows and stored outputs from a `blockdraft extract` directory, split by row for held-out eval."""
    from ..data.features import CacheView, DiskFeatures, cache_identity

    expect = cache_identity(target, opts.max_length, torch.float32)
    cache = DiskFeatures(opts.features_cache, expect=expect)
    R = cache.rows["input_ids"].shape[0]
    if opts.eval_features_cache:  # its own held-out cache: every row of the training cache trains
        held = DiskFeatures(opts.eval_features_cache, expect=expect)
        if held.manifest.get("rows_hash") == cache.manifest.get("rows_hash"):
            raise ValueError(f"--eval-features-cache {opts.eval_features_cache} holds the same rows as --features-cache:"
                             " extract the held-out conversations into their own cache")
        return (dict(cache.rows), dict(held.rows), CacheView(cache, torch.arange(R)),
                CacheView(held, torch.arange(held.rows["input_ids"].shape[0])))
    order = torch.randperm(R, generator=torch.Generator().manual_seed(seed))
    n_eval = min(R - 1, max(1, int(round(opts.eval_fraction * R)))) if opts.eval_fraction > 0 else 0
    ev, tr = order[:n_eval], order[n_eval:]

    def part(idx):
        return {k: v[idx] for k, v in cache.rows.items()}, CacheView(cache, idx)

    (train_rows, train_f), (eval_rows, eval_f) = part(tr), part(ev)
    return train_rows, (eval_rows if n_eval else None), train_f, (eval_f if n_eval else None)


def load_target(cfg: RunConfig, device: str, engine):
    """The target as the run needs it: with a feature cache only its embedding and head (it never runs;
    preflight refuses --target-fsdp there), else as its runner `engine` runs it."""
    from ..target import TargetModel

    t = cfg.target
    if cfg.data.features_cache:
        return TargetModel.head_only(t.target, layer_ids=t.layer_ids, num_features=t.num_features, device=device)
    return engine.load_target(cfg, device)


def training_data(cfg: RunConfig, target, engine, rank: int = 0, world: int = 1):
    """Train rows, held-out rows and what the trainer reads the target's outputs from (a cache, else the
    runner `engine`'s `Features`: a memo, an engine's stream, or none)."""
    from ..engines.runners import Features

    d, seed = cfg.data, cfg.train.seed
    if d.features_cache:
        train_rows, eval_rows, tf, ef = cached_rows(d, target, seed)
        train_rows, eval_rows = bound_rows(train_rows, eval_rows, d.max_rows, d.max_eval_rows)
        return train_rows, eval_rows, Features(tf, ef)
    train_rows, eval_rows = conversation_rows(target.tokenizer, d, seed)
    train_rows, eval_rows = bound_rows(train_rows, eval_rows, d.max_rows, d.max_eval_rows)
    return train_rows, eval_rows, engine.features(cfg, target, train_rows, eval_rows, rank, world)


def run_training(cfg: RunConfig) -> dict:
    """`blockdraft train`: the flags checked, then --out claimed before any work (`RunDir.claim`:
    checked whole, locked, marked; a refused run creates nothing), then the run."""
    tc = cfg.train
    tc.validate()
    if cfg.target.threads:  # set in a --config file as well as by the flag
        torch.set_num_threads(cfg.target.threads)
    check_cache_options(cfg.data)
    adopt_cache_length(cfg)
    from ..data.chat import use_template

    use_template(cfg.target.chat_template, cfg.target.thinking)  # recorded with the run: --resume renders alike
    from ..engines import runner

    engine = runner(cfg.engine.engine)  # the run's runner, resolved once and handed on
    if type(cfg.engine) is not engine.options:  # made in Python with another runner's class: its own, or refused
        cfg.engine = runner_options(dataclasses.asdict(cfg.engine), "train")
    engine.check_train(cfg)
    check_resume(tc.out, tc.resume)
    preflight(cfg, engine)  # flags against each other, the target's vocabulary and a resumed run's own settings
    if tc.resume:
        check_resumed_state(Path(tc.out), tc.report_to, tc.save_best)
    for cache in (cfg.data.features_cache, cfg.data.eval_features_cache):
        if cache:  # the manifest and every shard's header, before the target loads
            check_cache(cache, cfg.data.max_length)
    with RunDir(tc.out).claim(resume=tc.resume, overwrite=tc.overwrite):
        return _train(cfg, tc, engine)


def recorded(cfg: RunConfig) -> dict:
    """What train_config.json records: not --overwrite, which is what one command did, not a setting
    of the run (a replay with --config FILE must not replace the run again)."""
    d = cfg.to_dict()
    d["train"].pop("overwrite", None)
    return d


def _train(cfg: RunConfig, tc: TrainConfig, engine) -> dict:
    from .distributed import init_from_env

    torch.manual_seed(tc.seed)  # the same initial drafter on every rank
    # an engine on this node's first GPUs: the ranks take the next ones (or share them: --share-gpus)
    rank, world_size, device = init_from_env(pick_device(cfg.target.device), tc.dist_timeout_min,
                                             gpu_offset=engine.trainer_gpu_offset(cfg.engine))
    share = engine.trainer_memory_fraction(cfg.engine)
    if share is not None and device.startswith("cuda"):  # beside the engine on its GPU: keep to what it leaves
        torch.cuda.set_per_process_memory_fraction(share, torch.device(device))
    target = load_target(cfg, device, engine)
    train_rows, eval_rows, streams = training_data(cfg, target, engine, rank, world_size)
    feats = {"train_features": streams.train_features, "eval_features": streams.eval_features}
    ok = False
    try:
        summary = _run(cfg, tc, target, train_rows, eval_rows, feats, rank, world_size, device,
                       record=None if streams.served is None else {"engine": streams.served})
        ok = True
        return summary
    finally:
        streams.close(ok)


def _run(cfg: RunConfig, tc: TrainConfig, target, train_rows, eval_rows, feats, rank: int, world_size: int,
         device: str, record: dict | None = None) -> dict:
    """`record`: what summary.json adds about where the features came from (an online run's engines)."""
    from ..checkpoint.native import load_drafter
    from ..preempt import noted
    from .trainer import Trainer

    if cfg.drafter.init_drafter:
        drafter = continue_drafter(cfg.drafter.init_drafter, target, device, cfg.drafter.window_rule, cfg.drafter)
    else:
        drafter = build_drafter(cfg.drafter, target, train_rows, device)
    # a drafter that already computes something (loaded, or a structured init) keeps its function
    # when the trainer rescales its features
    keep = bool(cfg.drafter.init_drafter) or cfg.drafter.context_init == "top-feature"
    trainer = Trainer(target, drafter, train_rows, eval_rows, tc, keep_function=keep, run_config=recorded(cfg), **feats)
    print(f"train: {train_rows['input_ids'].shape[0]} rows x {train_rows['input_ids'].shape[1]} tokens, "
          f"{0 if eval_rows is None else eval_rows['input_ids'].shape[0]} held-out rows, {trainer.total} steps, "
          f"drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params, device {device}"
          + (f", rank {rank} of {world_size}" if world_size > 1 else ""))
    if tc.overwrite and rank == 0 and noted() is None:  # the earlier run goes only now that this one is ready
        RunDir(tc.out).clear()  # to start (not when a stop was asked while starting up: `Trainer.train`)
    summary = trainer.train(resume=tc.resume)
    if rank != 0:
        return summary
    run = RunDir(tc.out)
    run.plot()
    load_drafter(run.path / "drafter")  # the saved directory must load back
    summary = {**summary, **(record or {})}
    run.write_summary(dumps_finite(summary, "the run's summary", indent=1))
    return summary
