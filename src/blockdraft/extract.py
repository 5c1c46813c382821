"""`blockdraft extract`: the target's features and final states stored as cache shards for training
(`data.features.extract` writes them), computed by transformers here (one rank per shard set under
torchrun) or by vLLM engine replicas feeding a bounded spool: the runner's own way (`Runner.extract`).

    from blockdraft.extract import ExtractOptions, run_extract
"""

from __future__ import annotations

from dataclasses import dataclass

from .data.pipeline import DataOptions
from .engines.options import RunnerOptions
from .options import opt
from .target import TargetOptions


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


def run_extract(target_opts: TargetOptions, data: DataOptions, opts: ExtractOptions,
                engine: RunnerOptions | None = None) -> str:
    """`blockdraft extract`: the runner's flags checked, then its shards (transformers: --out claimed first,
    a new or empty directory or a cache extract wrote, locked by rank 0; every rank writes its own)."""
    from .data.chat import use_template
    from .engines import runner
    from .train.distributed import init_from_env

    engine = engine or RunnerOptions()
    runs = runner(engine.engine)
    runs.check(engine, "extract")
    use_template(target_opts.chat_template, target_opts.thinking)
    if target_opts.target_fsdp:
        raise ValueError("extract splits its shards over the ranks, each running the whole target; --target-fsdp "
                         "is for training (drop it here, or extract with --target-device-map)")
    return runs.extract(target_opts, data, opts, engine, join=init_from_env)
