"""`extract --engine vllm`: vLLM engine replicas capture each packed row's documents into a bounded spool a
few rows ahead of this process, which writes the same shards `blockdraft extract` writes (data.features),
taking the final state from the target's own final norm and the argmax from its own head. A restart
rewrites only the missing shards.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

from .engine_options import VllmOptions


def extract_with_vllm(target_opts, data, opts, engine: VllmOptions) -> str:
    """`extract --engine vllm`: vLLM engine replicas capture each row's documents, a few rows ahead of
    this process, through a bounded spool; this process writes the same shards as `extract`, taking
    the final state from the target's own final norm and the argmax from its own head
    (engines.vllm.capture). A restart rewrites only the missing shards."""
    from ...data.features import auto_shard_rows, extract, holds_other_files
    from ...data.pipeline import conversation_rows
    from ...target import TargetModel, pick_device
    from .capture import check_can_capture

    check_extract(target_opts, engine)
    device = pick_device(target_opts.device)
    dtype = (torch.bfloat16 if str(device).startswith("cuda") else torch.float32) if opts.dtype == "auto" else \
        getattr(torch, opts.dtype)
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
                    engine: VllmOptions) -> None:
    """The missing shards' rows (`order`), captured by engines started for them (or running on the spool)."""
    from ...data.features import extract, throughput
    from ...target import final_norm_of
    from ..base import architectures
    from .capture import RowsAhead, SpoolReader, StateReader, capture_ids
    from .launch import budget_of, open_engines, running
    from .engine_options import spool_budget, spool_dir

    L, ids = rows["input_ids"].shape[1], capture_ids(target.layer_ids, target.num_layers)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    root = spool_dir(engine, out)
    want = {"target": str(target.local_dir), "aux_ids": ids, "dtype": str(dtype).replace("torch.", ""),
            "states": engine.engine_states}
    print(f"extract: vLLM captures {len(order)} rows ({len(order) * L:,} tokens), layers {ids} (vLLM's aux ids: the "
          f"inputs of those layers, i.e. blockdraft's {list(target.layer_ids)} + 1, and the last layer's output)")
    if running(root, want) is None:  # each row is one item of the spool: the largest must fit new engines' budget
        sizer = StateReader(target, rows, final_norm_of(target.model), itemsize, fp8=engine.engine_states == "fp8")
        most, budget = max(sizer.nbytes(torch.tensor([i])) for i in order), spool_budget(engine, root)
        if most > budget:
            raise ValueError(f"a row needs {most / 2**30:.3f} GiB of states at once, more than the spool's "
                             f"{budget / 2**30:.3f} GiB: raise --spool-gib, or lower --max-length")
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


def vllm_identity(engine: VllmOptions) -> dict:
    """What a vLLM cache's shards must share to be completed together: fp8 states are a different capture."""
    return {"engine": "vllm", **({"engine_states": "fp8"} if engine.engine_states == "fp8" else {})}


def check_extract(target_opts, engine: VllmOptions) -> None:
    """What `extract --engine vllm` refuses before it loads anything: torchrun, a placed target, no vLLM."""
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise ValueError("extract --engine vllm runs vLLM's own parallelism: start it once, not under torchrun "
                         "(--tensor-parallel-size, --pipeline-parallel-size, --data-parallel-size)")
    if target_opts.target_device_map or target_opts.target_fsdp:
        raise ValueError("extract --engine vllm places the target itself: drop --target-device-map and --target-fsdp")
    from .engine_options import require_vllm

    require_vllm(engine, "extract")
