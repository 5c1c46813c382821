"""`blockdraft engine`: a vLLM server on an engine node, for `train --engine-endpoints` on other nodes.

It runs vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve`
runs) with the `extract_hidden_states` method for the run's layers, blockdraft's plugin (GLM-4.x MoE
and other classes without SupportsEagle3) and its Mooncake connector (`mooncake_connector.py`), which
puts each request's states into the store and gives this node's memory to it (`--segment-gib`).
`--print` shows the exact command and environment instead of running it, for a user's own launcher.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
from pathlib import Path
from dataclasses import dataclass

from ...options import opt
from .engine_options import check_master


@dataclass
class ServerOptions:
    """Where the server listens and what it gives the store."""

    mooncake_master: str | None = opt(None, "the Mooncake store's master, HOST:PORT (required; start it with mooncake_master "
                                   "--rpc_port=PORT on any node)", check=check_master)
    port: int = opt(8000, "the port the server listens on", min=1, max=65535)
    host: str = opt("0.0.0.0", "the address the server listens on")
    advertise: str | None = opt(None, "the address the trainers reach this node's store segment at (default: this "
                                      "host's name)")
    segment_gib: float = opt(16.0, "the memory this node gives the Mooncake store, GiB: the states wait there until "
                                   "a trainer reads them (above the trainers' --store-gib)", above=0)
    protocol: str = opt("tcp", "the store's transport: tcp, or rdma on a cluster with InfiniBand/RoCE",
                        choices=("tcp", "rdma"))
    max_model_len: int = opt(4096, "the longest document the server captures, tokens (the trainers' --max-length "
                                   "at least)", min=16)
    print_only: bool = opt(False, "print the command and its environment instead of running it")


def server_command(target_dir: str, aux_ids: list[int], architectures: list[str], server: ServerOptions,
                   engine, python: str | None = None) -> tuple[list[str], dict]:
    """The server's argv and the environment variables it needs (beside the caller's)."""
    from ...target.files import cache_dir
    from .launch import plugin_path
    from .plugin import ENV

    mooncake = {"master_server_address": server.mooncake_master, "protocol": server.protocol,
                "local_hostname": server.advertise or socket.gethostname(),
                "global_segment_size": int(server.segment_gib * 2**30), "local_buffer_size": 256 << 20}
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux_ids}}}
    # auto: the checkpoint's own on a GPU; fp32 on a CPU, as every CPU engine of blockdraft's runs
    dtype = engine.engine_dtype if engine.engine_dtype != "auto" else (None if gpu_here() else "float32")
    argv = [python or engine.engine_python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(target_dir), "--host", server.host, "--port", str(server.port),
            "--max-model-len", str(server.max_model_len), "--seed", "0", "--no-enable-prefix-caching",
            "--skip-tokenizer-init", "--tensor-parallel-size", str(engine.tensor_parallel_size),
            "--speculative-config", json.dumps(spec), "--kv-transfer-config", kv_transfer_config(mooncake)]
    argv += ["--dtype", dtype] if dtype else []
    argv += ["--data-parallel-size", str(engine.data_parallel_size)] if engine.data_parallel_size > 1 else []
    argv += ["--enable-expert-parallel"] if engine.expert_parallel else []
    if engine.engine_memory:
        argv += ["--gpu-memory-utilization", str(engine.engine_memory)]
    elif not gpu_here():  # a CPU server: its KV space in bytes, checked against the memory available now
        from .engine_options import cpu_kv_bytes

        itemsize = 2 if dtype in ("bfloat16", "float16") else 4
        kv = cpu_kv_bytes(target_dir, server.max_model_len, len(aux_ids), itemsize, length_flag="--max-model-len")
        argv += ["--kv-cache-memory-bytes", str(kv)]
    argv += ["--quantization", engine.quantization] if engine.quantization else []
    argv += ["--enforce-eager"] if engine.engine_eager else []
    pkg = plugin_path(cache_dir() / "engine")
    env = {"PYTHONPATH": os.pathsep.join([str(pkg)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                         if p]),
           ENV: json.dumps({"architectures": architectures})}
    return argv, env


def kv_transfer_config(mooncake: dict) -> str:
    """`--kv-transfer-config`'s value for blockdraft's Mooncake connector (`mooncake`: the store's settings,
    hs-connectors' `MooncakeStoreConfig` fields)."""
    return json.dumps({"kv_connector": "BlockdraftMooncakeConnector", "kv_role": "kv_producer",
                       "kv_connector_module_path": "blockdraft.engines.vllm.mooncake_connector",
                       "kv_connector_extra_config": {"mooncake": mooncake}})


# VllmOptions' flags `blockdraft engine` takes: how vLLM runs the target on this node
ENGINE_FLAGS = ("tensor_parallel_size", "expert_parallel", "data_parallel_size", "engine_memory", "engine_dtype",
                "quantization", "engine_eager", "engine_python")


def run_server(target_opts, server: ServerOptions, engine) -> int:
    """`blockdraft engine`: the server for the target's layers, run here (or printed: --print-only)."""
    import subprocess

    from ...config import default_target_layer_ids, validate_layer_ids
    from ...target.files import resolve_target
    from .capture import capture_ids
    from .engine_options import check_layout, refuse_pipeline

    if not server.mooncake_master:
        raise ValueError("blockdraft engine puts the states into a Mooncake store: give --mooncake-master HOST:PORT")
    refuse_pipeline(engine.pipeline_parallel_size)
    local, _ = resolve_target(target_opts.target)
    config = json.loads((Path(local) / "config.json").read_text())
    text = config.get("text_config", config)
    n = int(text["num_hidden_layers"])
    ids = target_opts.layer_ids or default_target_layer_ids(n, target_opts.num_features)
    check_layout(engine, local, on_gpu=gpu_here())
    argv, env = server_command(str(local), capture_ids(validate_layer_ids(ids, n), n),
                               config.get("architectures") or [], server, engine)
    print(describe(argv, env), flush=True)
    if server.print_only:
        return 0
    return subprocess.run(argv, env={**os.environ, **env}).returncode


def gpu_here() -> bool:
    import torch

    return torch.cuda.is_available()


def describe(argv: list[str], env: dict) -> str:
    """The command as a shell line a user can run or put in a launcher."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)
