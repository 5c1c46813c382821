"""Engines on other nodes, measured on this machine (ratios taken in one run; the machine is shared).

1. The transport alone: one document's states (SmolLM2's shape: 6 states of 576 at fp32, `--tokens` long)
   handed from a writer process to a reader process, `--n` times: through a Mooncake store over TCP (put
   by the writer, taken and deleted by the reader: `remote.Store`) against a shared directory (the spool's
   states file: `states.write_states`, then `read_states` and unlink). States per second and MB/s of each.
2. Training (`--train`): the same 2-rank run (`torchrun`, gloo) fed by two `blockdraft engine` servers
   through the store against two local engine replicas through a spool (`--data-parallel-size 2`), each
   engine on a core of its own: steps per second of each.

    python benchmarks/nodes.py --json benchmarks/results/nodes.json [--train]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master() -> tuple[subprocess.Popen, str]:
    import mooncake

    port = free_port()
    proc = subprocess.Popen([os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master"), f"--rpc_port={port}",
                             f"--metrics_port={free_port()}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"127.0.0.1:{port}"
        time.sleep(0.1)
    raise RuntimeError("mooncake_master did not start")


WRITER = r"""
import json, os, sys, time, torch
from hs_connectors.mooncake_store import VERSION, MooncakeHiddenStatesStore, MooncakeStoreConfig, packed_layout
from blockdraft.engines.vllm.remote import local_puts
from blockdraft.engines.vllm.states import write_states
mode, where, n, tokens, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
states, tok = torch.randn(tokens, 6, 576), torch.arange(tokens)
if mode == "store":
    store = MooncakeHiddenStatesStore(MooncakeStoreConfig(master_server_address=where, global_segment_size=1 << 30,
                                                          local_buffer_size=64 << 20)).setup()
    local_puts(store)
    spec, total = packed_layout({"hidden_states": (list(states.shape), states.dtype), "token_ids": ([tokens], tok.dtype)})
t0 = time.perf_counter()
for i in range(n):
    if mode == "store":
        m = {"handle": f"doc-{i}", "version": VERSION, "tensors": spec,
             "metadata": {"num_tokens": tokens, "total_aligned_bytes": total}}
        while True:  # the reader frees the store as it reads: a writer that runs ahead waits
            try:
                store.put_sample(m, {"hidden_states": states, "token_ids": tok})
                break
            except RuntimeError:
                time.sleep(0.01)
        with open(os.path.join(out, f"m-{i}.json.tmp"), "w") as f:
            json.dump(m, f)
        os.replace(os.path.join(out, f"m-{i}.json.tmp"), os.path.join(out, f"m-{i}.json"))
    else:
        write_states(os.path.join(where, f"d-{i}.tmp"), states, tok)
        os.replace(os.path.join(where, f"d-{i}.tmp"), os.path.join(where, f"d-{i}.safetensors"))
print(json.dumps({"writer_s": time.perf_counter() - t0}), flush=True)
while not os.path.exists(os.path.join(out, "done")):  # the store's states live in this process's segment
    time.sleep(0.05)
"""


def transport(n: int, tokens: int) -> dict:
    """States a second from a writer process to this one, through each way."""
    from blockdraft.engines.vllm.remote import Store
    from blockdraft.engines.vllm.states import read_states

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    nbytes = tokens * (6 * 576 * 4 + 8)
    out: dict = {"documents": n, "tokens": tokens, "mb_per_document": round(nbytes / 1e6, 2)}
    proc, master = start_master()
    try:
        for mode in ("store", "directory"):
            with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
                where = master if mode == "store" else d
                reader = Store(master, 60.0) if mode == "store" else None
                w = subprocess.Popen([sys.executable, "-c", WRITER, mode, where, str(n), str(tokens), d], env=env,
                                     stdout=subprocess.PIPE, text=True)
                t0, got = None, 0
                for i in range(n):
                    path = Path(d) / (f"m-{i}.json" if mode == "store" else f"d-{i}.safetensors")
                    while not path.exists():
                        time.sleep(0.0005)
                    t0 = t0 or time.perf_counter()
                    if mode == "store":
                        states = reader.take(json.loads(path.read_text()))
                    else:
                        states = {k: v.clone() for k, v in read_states(str(path)).items()}
                    path.unlink()
                    got += states["hidden_states"].numel()
                wall = time.perf_counter() - t0
                (Path(d) / "done").write_text("")
                w.wait()
                if reader is not None:
                    reader.close()
                out[mode] = {"states_per_s": round((n - 1) / wall, 1), "mb_per_s": round((n - 1) * nbytes / 1e6 / wall, 1)}
        out["store_over_directory"] = round(out["store"]["states_per_s"] / out["directory"]["states_per_s"], 3)
    finally:
        proc.kill()
    return out


def train_both(steps: int) -> dict:
    """Steps a second of one 2-rank run fed by remote servers, and of the same run fed by local engines."""
    import gzip

    from blockdraft.target import resolve_source

    py, vpy = sys.executable, str(ROOT / ".venv-ref-vllm" / "bin" / "python")
    tmp = Path(tempfile.mkdtemp(prefix="nodes-bench-"))
    with gzip.open(ROOT / "src" / "blockdraft" / "assets" / "data" / "default.jsonl.gz", "rt") as fh:
        (tmp / "train.jsonl").write_text("".join(next(fh) for _ in range(48)))
    common = ["-m", "blockdraft", "train", "--max-length", "384", "--layer-ids", "1,8,14,21,27", "--threads", "1",
              "--batch-tokens", "384", "--max-anchors", "32", "--max-rows", "0", "--draft-vocab", "2048", "--no-progress",
              "--steps", str(steps), "--eval-every", "1000", "--data", str(tmp / "train.jsonl")]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    res: dict = {}
    proc, master = start_master()
    servers = []
    try:
        urls = []
        for core in (0, 1):
            port = free_port()
            servers.append(subprocess.Popen(
                [vpy, "-m", "blockdraft", "engine", "--layer-ids", "1,8,14,21,27", "--mooncake-master", master,
                 "--port", str(port), "--host", "127.0.0.1", "--advertise", "127.0.0.1", "--segment-gib", "0.5",
                 "--max-model-len", "392"], env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(core)},
                stdout=open(tmp / f"server{core}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        runs = {"remote": ["--engine", "vllm", "--engine-endpoints", ",".join(urls), "--mooncake-master", master,
                           "--store-gib", "0.25"],
                "local": ["--engine", "vllm", "--engine-python", vpy, "--data-parallel-size", "2"]}  # compiled, as the servers
        for name, extra in runs.items():
            out = tmp / name
            with open(tmp / f"{name}.log", "w") as fh:
                rc = subprocess.run([py, *torchrun, *common, *extra, "--out", str(out)], env=env, stdout=fh,
                                    stderr=subprocess.STDOUT).returncode
            assert rc == 0, (tmp / f"{name}.log").read_text()[-3000:]
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            secs = [r["elapsed"] for r in rows if "elapsed" in r]  # from the first step to the last: the starts left out
            timed = secs[-1] - secs[0] if len(secs) > 1 else None
            res[name] = {"steps": len(rows), "steps_per_s": round((len(rows) - 1) / timed, 3) if timed else None}
        res["remote_over_local"] = (round(res["remote"]["steps_per_s"] / res["local"]["steps_per_s"], 3)
                                    if res["remote"]["steps_per_s"] and res["local"]["steps_per_s"] else None)
    finally:
        for s in servers:
            if s.poll() is None:
                os.killpg(s.pid, 9)
        proc.kill()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200, help="documents through each way")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--train", action="store_true", help="also time training from remote and local engines")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    res = {"transport": transport(args.n, args.tokens)}
    if args.train:
        res["train"] = train_both(args.steps)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
