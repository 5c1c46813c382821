"""`blockdraft extract`: the target's features and final states stored as cache shards for training
(`data.features.extract` writes them), computed by transformers here (one rank per shard set under
torchrun) or by vLLM engine replicas feeding a bounded spool (`engines.vllm`).

    from blockdraft.extract import ExtractOptions, run_extract
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from .data.pipeline import DataOptions, conversation_rows
from .engines.vllm.engine_options import EngineOptions
from .options import opt
from .target import TargetOptions, pick_device, spread_kwargs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # "auto" is absent


@dataclass
class ExtractOptions:
    """`blockdraft extract`: where the shards go and how they are cut."""

    out: str = opt("", "cache directory (new, or an unfinished cache to complete)", required=True)
    shard_rows: int = opt(0, "packed rows per shard file (0: about 1 GiB of outputs each, at most 64 rows; a shard "
                             "is held in host RAM while it is made)")
    dtype: str = opt("auto", "stored precision of features and final states (auto: the target's, bf16 on CUDA); "
                             "with --engine vllm also the precision the engine runs in",
                     choices=("auto", "float32", "bfloat16", "float16"))
    target_dtype: str = opt("auto", "precision the target runs in (auto: bf16 on CUDA, fp32 on a CPU, where bf16 "
                                    "products are slower without AMX; on a CPU with AMX bfloat16 runs about 2x "
                                    "faster); recorded in the cache's manifest",
                            choices=("auto", "float32", "bfloat16", "float16"))
    batch_tokens: int = opt(0, "tokens per target forward (whole rows; 0: 16384 on a GPU, 2048 on a CPU, where "
                               "16 rows of 1,024 ran 1.6x (fp32) to 1.9x (bf16) slower than 2)")
    seed: int = opt(0, "seed of the (unused) held-out split; kept so a cache's identity is stable")


# EngineOptions' flags extract takes (--dtype is the engine's precision; its GPUs are all the engine's)
ENGINE_FLAGS = ("engine", "tensor_parallel_size", "pipeline_parallel_size", "expert_parallel", "data_parallel_size",
                "engine_memory", "quantization", "engine_eager", "engine_states", "engine_start_min",
                "engine_stall_min", "engine_untested", "engine_python", "spool", "spool_gib")


def run_extract(target_opts: TargetOptions, data: DataOptions, opts: ExtractOptions,
                engine: EngineOptions | None = None) -> str:
    """`blockdraft extract`: --out claimed first (a new or empty directory or a cache extract wrote,
    locked by rank 0: ownership), then the shards; every rank writes its own."""
    from .data.features import OWNER
    from .rundir.directory import RunDir
    from .train.distributed import barrier, init_from_env

    from .data.chat import use_template

    from .engines.vllm.engine_options import check_engine_flags

    engine = engine or EngineOptions()
    check_engine_flags(engine, "extract")
    use_template(target_opts.chat_template, target_opts.thinking)
    if target_opts.target_fsdp:
        raise ValueError("extract splits its shards over the ranks, each running the whole target; --target-fsdp "
                         "is for training (drop it here, or extract with --target-device-map)")
    from .engines import runner

    elsewhere = runner(engine.engine)
    if not elsewhere.in_process:  # the engine's processes run the target: its own way to the shards
        return elsewhere.extract(target_opts, data, opts, engine)
    rank, world_size, device = init_from_env(pick_device(target_opts.device))
    with RunDir(opts.out, OWNER).claim(lead=rank == 0):
        barrier()  # the other ranks write their shards once rank 0 owns the directory
        return _extract_with_transformers(target_opts, data, opts, rank, world_size, device)


def _extract_with_transformers(target_opts: TargetOptions, data: DataOptions, opts: ExtractOptions, rank: int,
                               world_size: int, device: str) -> str:
    from .data.features import auto_shard_rows, extract, throughput
    from .target import TargetModel
    from .train.distributed import barrier

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


