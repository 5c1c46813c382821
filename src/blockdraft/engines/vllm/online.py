"""`train --engine vllm` (`runner.VllmRunner.features`): the target's features streamed from vLLM engine
replicas as the trainer reaches each micro-batch, through a bounded spool, instead of read from a cache
that would not fit (60-86 TB per billion tokens for GLM-4.6 and Kimi-K2) or computed by a target the
trainers hold.

Per node, local rank 0 empties the node's spool and starts the replicas (`--data-parallel-size`, each on
`--tensor-parallel-size` of the node's first GPUs, or of all of them beside the ranks: `--share-gpus`);
the node's ranks then read only from them, so no state crosses the network. Each rank asks for its own
micro-batches in the order it trains them (the order offline training uses: `Trainer.batch_indices`), a
few ahead; every epoch asks again. Held-out rows are asked for at each evaluation. A resumed run starts
with an empty spool and new engines: their states are recomputed, not kept.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .engine_options import VllmOptions, engine_gpus, node_rank, spool_dir


@dataclass
class Online:
    """What a rank holds of an online run: its engines (started here on a node's local rank 0, or found
    running on the spool) and its readers of the spool."""

    engines: object
    train_features: object
    eval_features: object | None
    served: list  # per replica, what vLLM serves: dtype, quantization (the run's summary records it)

    def close(self, ok: bool) -> None:
        """Readers closed; engines this process started stopped, and their spool removed after a clean
        finish (a failure keeps the logs its error names)."""
        for f in (self.train_features, self.eval_features):
            if f is not None:
                f.close()
        for k, st in enumerate(self.engines.stop(remove=ok, timeout=120.0 if ok else 5.0)):
            figures = {key: st.get(key) for key in ("tokens", "items", "busy_s", "peak_bytes")}
            print(f"engine: replica {k} captured: {json.dumps(figures)}")


LOOKAHEAD = 32  # micro-batches a rank asks for ahead of the one it trains


def check_online(cfg) -> None:
    """What `train --engine vllm` refuses before it loads anything."""
    t, d = cfg.target, cfg.data
    if d.features_cache:
        raise ValueError("--engine vllm computes the features as it trains; --features-cache reads stored ones: "
                         "choose one")
    if t.target_fsdp or t.target_device_map:
        raise ValueError("--engine vllm runs the target in vLLM's own processes: drop --target-fsdp and "
                         "--target-device-map (vLLM's --tensor-parallel-size and --expert-parallel place it)")
    from .engine_options import require_vllm

    require_vllm(cfg.engine, "train")


def engine_dtype(opts: VllmOptions, on_gpu: bool) -> str:
    return opts.engine_dtype if opts.engine_dtype != "auto" else ("bfloat16" if on_gpu else "float32")


def start_online(cfg, target, train_rows: dict, eval_rows: dict | None, rank: int, world: int) -> Online:
    """Start this node's engines (or join the ones running on its spool) and make this rank's readers;
    with --engine-endpoints, the readers of servers on other nodes instead (`remote`)."""
    from .capture import (OnlineFeatures, SpoolReader, StateReader, StopGuard, capture_ids,
                                        check_can_capture)
    from .engine_options import spool_budget
    from .launch import attach_engines, budget_of, open_engines, running
    from .spool import Spool
    from ..base import architectures
    from ...target import final_norm_of
    from ...process_group import barrier

    opts = cfg.engine
    if opts.engine_endpoints:
        return start_remote(cfg, target, train_rows, eval_rows, rank, world)
    if getattr(target, "local_dir", None) is None:
        raise ValueError(f"--engine vllm needs the target as a local model directory, not {cfg.target.target}")
    check_can_capture(target, opts.engine_untested)
    dtype = engine_dtype(opts, target.device.type == "cuda")
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    root = spool_dir(opts, cfg.train.out, node_rank())
    want = {"target": str(target.local_dir), "aux_ids": capture_ids(target.layer_ids, target.num_layers),
            "dtype": dtype, "states": opts.engine_states}
    norm = final_norm_of(target.model)

    def state_reader(rows):
        return StateReader(target, rows, norm, itemsize, labels_only=True, fp8=opts.engine_states == "fp8")

    engines = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # the node's engines, started once per node
        if running(root, want) is None:  # new engines' budget: a micro-batch must fit, said before they start
            per_batch = max(1, cfg.train.batch_tokens // train_rows["input_ids"].shape[1])
            check_spool_fits([(state_reader(r), r) for r in (train_rows, eval_rows) if r is not None], per_batch,
                             spool_budget(opts, root))
        engines = open_engines(root, want, opts, max_model_len=train_rows["input_ids"].shape[1] + 8,
                               itemsize=itemsize, on_gpu=target.device.type == "cuda",
                               architectures=architectures(target))
    barrier()  # the node's spool is ready before any rank reads it
    if engines is None:
        engines = attach_engines(Spool(root), opts=opts)
    if node_rank() is not None:  # several nodes: an engine's failure names its own
        import socket

        engines.where = f"on node {node_rank()} ({socket.gethostname()}) "
    states = engines.wait_ready(progress=print if rank == 0 else (lambda s: None))
    if rank == 0:
        say_ready(engines, states)
    budget = budget_of(root)
    tag = hashlib.sha256(str(Path(cfg.train.out).resolve()).encode()).hexdigest()[:8]

    def reader(rows, suffix):
        return SpoolReader(state_reader(rows), engines.spool, engines, f"{tag}-r{rank}{suffix}", budget)

    # requests are small (token ids); the engines hold the spool to its budget however far ahead they go
    # a preemption that stops the engines mid-step throws that step away on every rank (StopGuard)
    train_f = StopGuard(OnlineFeatures(reader(train_rows, ""), lookahead=LOOKAHEAD))
    eval_f = StopGuard(OnlineFeatures(reader(eval_rows, "e"), lookahead=LOOKAHEAD)) if eval_rows is not None else None
    served = [{"dtype": st.get("dtype"), "quantization": st.get("quantization"), "layout": st.get("layout")}
              for st in states]
    return Online(engines, train_f, eval_f, served)


def say_ready(engines, states: list[dict]) -> None:
    """The line saying what every replica serves, once all are ready."""
    print("engine: ready (" + "; ".join(f"replica {r.index}: {st.get('dtype')}"
                                       + (f", {st['quantization']}" if st.get("quantization") else "")
                                       + (f", {describe_layout(st['layout'])}" if st.get("layout") else "")
                                       for r, st in zip(engines.replicas, states)) + ")")


def check_spool_fits(readers: list, per_batch: int, budget: int) -> None:
    """Even the smallest micro-batch (its `per_batch` smallest rows) of the training or held-out rows
    needs more spool than `budget`: one line now, not after the engines took minutes to start (a
    reader asks for a whole micro-batch at once: `SpoolReader.ask`)."""
    for reader, rows in readers:
        sizes = sorted(reader.nbytes(torch.tensor([i])) for i in range(rows["input_ids"].shape[0]))
        k = min(per_batch, len(sizes))
        least = sum(sizes[:k])
        if least > budget:
            raise ValueError(f"{k} rows of a micro-batch need at least {least / 2**30:.3f} GiB of states at once, "
                             f"more than the spool's {budget / 2**30:.3f} GiB: raise --spool-gib, or lower "
                             "--batch-tokens")


def start_remote(cfg, target, train_rows: dict, eval_rows: dict | None, rank: int, world: int) -> Online:
    """This rank's readers of the servers at --engine-endpoints, through the Mooncake store (`remote`)."""
    from ...target import final_norm_of
    from .capture import OnlineFeatures, StateReader, StopGuard, capture_ids, check_can_capture
    from .engine_options import parse_endpoints
    from .remote import RemoteEngines, RemoteReader, Servers, Store

    opts = cfg.engine
    check_can_capture(target, opts.engine_untested)
    stall_s = 60.0 * opts.engine_stall_min
    servers = Servers(parse_endpoints(opts.engine_endpoints), timeout_s=stall_s)
    servers.connect(wait_s=stall_s)
    out = Path(cfg.train.out)  # Mooncake's own log beside the run (as a spool is), the terminal kept for ours
    store = Store(opts.mooncake_master, timeout_s=stall_s, log=out.parent / f".{out.name}.mooncake-r{rank}.log")
    itemsize = torch.empty(0, dtype=target.dtype).element_size()
    budget = int(opts.store_gib * 2**30) // max(1, world)
    tag = hashlib.sha256(str(Path(cfg.train.out).resolve()).encode()).hexdigest()[:8]
    norm = final_norm_of(target.model)
    if rank == 0:
        print(f"engine: {len(servers.urls)} servers ({', '.join(servers.urls)}), states through the Mooncake store "
              f"at {opts.mooncake_master}, at most {opts.store_gib:g} GiB in it (aux ids "
              f"{capture_ids(target.layer_ids, target.num_layers)})")
    readers = []

    def reader(rows, suffix):
        readers.append(RemoteReader(StateReader(target, rows, norm, itemsize, labels_only=True), servers, store,
                                    f"{tag}-r{rank}{suffix}", budget // (2 if eval_rows is not None else 1), stall_s))
        return readers[-1]

    train_f = StopGuard(OnlineFeatures(reader(train_rows, ""), lookahead=LOOKAHEAD))
    eval_f = StopGuard(OnlineFeatures(reader(eval_rows, "e"), lookahead=LOOKAHEAD)) if eval_rows is not None else None
    served = [{"endpoint": u, "model": servers.model.get(u), "out": servers.out.get(u)} for u in servers.urls]
    return Online(RemoteEngines(servers, readers, store), train_f, eval_f, served)


def describe_layout(layout: dict) -> str:
    """A replica's layout in words, as vLLM reported it."""
    return (f"tensor parallel {layout.get('tensor_parallel', 1)}"
            + (" with experts spread" if layout.get("expert_parallel") else ""))


def node_split(opts: VllmOptions) -> int:
    """The GPU index training rank 0 of a node starts at: after the engine replicas' GPUs, or at the first
    of them when the ranks share them (--share-gpus)."""
    need = engine_gpus(opts)
    if not opts.share_gpus:
        return need
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if local > need:
        raise ValueError(f"--share-gpus puts one training rank on each engine GPU: {local} ranks a node, and the "
                         f"replicas take {need} GPUs (--nproc-per-node at most {need})")
    return 0
