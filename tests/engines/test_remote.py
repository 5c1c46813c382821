"""Engines on other nodes, on the trainer's side (`engines.vllm.remote`), against a real Mooncake store
(its `mooncake_master`, a put in one client and a get in another) and stand-in servers that answer
vLLM's OpenAI request as blockdraft's Mooncake connector does: the states of each document, computed by
transformers' own model, put into the store under the manifest the response carries. The real vLLM
server is judged in the reference suite (reference/test_vllm_nodes.py).

What is held: the rows put together from the store equal `extract`'s (exact, labels too); the bytes in
the store never pass the reader's budget; a server that dies hands its documents to the other, and with
none left the run stops in one line; a full store makes the reader wait, never lose a document; a
master that dies is one line, not a hang; a server for other layers is refused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if not os.environ.get("BLOCKDRAFT_REQUIRE_MOONCAKE"):  # CI runs them always; elsewhere they need the system's
    pytest.importorskip("hs_connectors")           # libibverbs.so.1 (Debian: libibverbs1) for Mooncake's import
    try:  # a missing libibverbs.so.1 is an ImportError, not ModuleNotFoundError: importorskip (pytest 9) raises it
        import mooncake.store  # noqa: F401
    except ImportError as e:
        pytest.skip(f"Mooncake's store does not import here: {e}", allow_module_level=True)

from safetensors.torch import save_file  # noqa: E402

from blockdraft.data.features import DiskFeatures, extract  # noqa: E402
from blockdraft.engines.vllm.capture import OnlineFeatures, StateReader, capture_ids  # noqa: E402
from blockdraft.engines.vllm.job import EngineFailed  # noqa: E402
from blockdraft.engines.vllm.remote import RemoteReader, Servers, Store  # noqa: E402
from blockdraft.target import final_norm_of  # noqa: E402
from conftest import tiny_rows, tiny_target  # noqa: E402

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master() -> tuple[subprocess.Popen, str]:
    import mooncake

    binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    port = free_port()
    proc = subprocess.Popen([binary, f"--rpc_port={port}", f"--metrics_port={free_port()}", "--client_ttl=2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    pytest.fail("mooncake_master did not start")


@pytest.fixture
def master():
    proc, address = start_master()
    yield address
    proc.kill()
    proc.wait()


class StandIn:
    """A stand-in server in its own process (remote_standin.py: its own store client and segment, as an
    engine node has); `stats()` is what it wrote after its last answer."""

    def __init__(self, tmp_path, weights, master: str, aux: list[int], *, dies_after: int | None = None,
                 full: int = 0, claimed_aux: list[int] | None = None):
        self.dir = tmp_path / f"standin-{free_port()}"
        self.dir.mkdir()
        cfg = {"weights": str(weights), "master": master, "aux": aux, "claimed": claimed_aux or aux,
               "dies_after": dies_after, "full": full, "dir": str(self.dir)}
        (self.dir / "job.json").write_text(json.dumps(cfg))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "remote_standin.py"), str(self.dir / "job.json")],
                                     env=env, stdout=open(self.dir / "log", "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not (self.dir / "url").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the stand-in server did not start:\n" + (self.dir / "log").read_text()[-3000:])
            time.sleep(0.1)
        self.url = (self.dir / "url").read_text()

    def stats(self) -> dict:
        path = self.dir / "stats.json"
        return json.loads(path.read_text()) if path.exists() else {"answered": 0, "peak": 0, "stored": 0}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def rows_and_reference(tmp_path, n: int = 6):
    """The target (its weights saved for the stand-ins), rows, and extract's outputs for them."""
    t = tiny_target("llama", num_features=3)
    save_file({k: v.contiguous() for k, v in t.model.state_dict().items()}, str(tmp_path / "weights.safetensors"))
    rows = tiny_rows(n)
    extract(t, rows, tmp_path / "offline", shard_rows=2, progress=False)
    return t, rows, DiskFeatures(tmp_path / "offline")


def stand_in(tmp_path, t, master, **kw) -> StandIn:
    return StandIn(tmp_path, tmp_path / "weights.safetensors", master, capture_ids(t.layer_ids, t.num_layers), **kw)


def remote_source(t, rows, urls, master, *, budget: int, stall_s: float = 20.0, lookahead: int = 8):
    servers = Servers(urls, timeout_s=stall_s)
    servers.connect(wait_s=5)
    reader = RemoteReader(StateReader(t, rows, final_norm_of(t.model), 4), servers, Store(master, stall_s),
                          "test", budget, stall_s)
    OPEN.append(reader)
    return OnlineFeatures(reader, lookahead=lookahead), reader


OPEN: list = []  # the readers a test made: their store clients closed after it


@pytest.fixture(autouse=True)
def close_readers():
    yield
    while OPEN:
        r = OPEN.pop()
        r.close()
        r.store.close()


def read_all(source, n: int, per: int = 2):
    order = [(s, 0, torch.arange(s * per, min(n, (s + 1) * per))) for s in range((n + per - 1) // per)]
    source.begin(iter(order))
    return [source(idx) for _, _, idx in order], [idx for _, _, idx in order]


def same_as_offline(got, idxs, offline) -> None:
    for out, idx in zip(got, idxs):
        want = offline(idx)
        torch.testing.assert_close(out.features, want.features, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.final_hidden, want.final_hidden, rtol=1e-5, atol=1e-5)
        assert torch.equal(out.top, want.top)


def test_rows_from_the_store_equal_extracts_and_the_store_stays_within_the_budget(tmp_path, master):
    t, rows, offline = rows_and_reference(tmp_path)
    a, b = stand_in(tmp_path, t, master), stand_in(tmp_path, t, master)
    one_item = StateReader(t, rows, final_norm_of(t.model), 4).nbytes(torch.arange(2))
    budget = 2 * one_item  # two of the three micro-batches at most, though it looks 8 ahead
    try:
        source, reader = remote_source(t, rows, [a.url, b.url], master, budget=budget)
        got, idxs = read_all(source, 6)
        same_as_offline(got, idxs, offline)
        assert a.stats()["answered"] and b.stats()["answered"]  # both servers took documents
        assert 0 < reader.peak <= budget
        stored = max(a.stats()["peak"], b.stats()["peak"])  # what one server saw in the store at its puts
        assert 0 < stored <= budget, (stored, budget)
        handles = reader.store.store._require_store()
        assert handles.remove_by_regex("^cmpl-bd-test-") == 0  # every sample was deleted once read
    finally:
        a.stop()
        b.stop()


@pytest.mark.slow
def test_a_server_that_dies_hands_its_documents_to_the_other_and_none_left_is_one_line(tmp_path, master, capsys):
    t, rows, offline = rows_and_reference(tmp_path)
    a, b = stand_in(tmp_path, t, master, dies_after=3), stand_in(tmp_path, t, master)
    try:
        source, _ = remote_source(t, rows, [a.url, b.url], master, budget=1 << 30)
        got, idxs = read_all(source, 6)
        same_as_offline(got, idxs, offline)  # its documents, answered and lost with it too, came from b
        assert a.proc.wait(10) == 1 and f"{a.url} failed" in capsys.readouterr().out
        c = stand_in(tmp_path, t, master, dies_after=1)
        source, _ = remote_source(t, rows, [c.url], master, budget=1 << 30, stall_s=10.0)
        with pytest.raises(EngineFailed, match="every engine server failed") as e:
            read_all(source, 6)
        assert "\n" not in str(e.value) and c.url in str(e.value)
    finally:
        a.stop()
        b.stop()


def test_a_full_store_makes_the_reader_wait_and_ask_again(tmp_path, master):
    t, rows, offline = rows_and_reference(tmp_path, n=2)
    a = stand_in(tmp_path, t, master, full=2)
    try:
        source, _ = remote_source(t, rows, [a.url], master, budget=1 << 30)
        got, idxs = read_all(source, 2)
        same_as_offline(got, idxs, offline)
        assert a.stats()["full"] == 0  # both refusals were met, and asked again
    finally:
        a.stop()


def test_a_server_for_other_layers_is_refused_in_one_line(tmp_path, master):
    t, rows, _ = rows_and_reference(tmp_path, n=2)
    a = stand_in(tmp_path, t, master, claimed_aux=[x + 1 for x in capture_ids(t.layer_ids, t.num_layers)])
    try:
        source, _ = remote_source(t, rows, [a.url], master, budget=1 << 30)
        with pytest.raises(EngineFailed, match="captures hidden_states") as e:
            read_all(source, 2)
        assert "\n" not in str(e.value)
    finally:
        a.stop()


@pytest.mark.slow
def test_a_master_that_dies_is_one_line_not_a_hang(tmp_path):
    proc, master = start_master()
    t, rows, _ = rows_and_reference(tmp_path, n=2)
    a = stand_in(tmp_path, t, master)
    try:
        source, _ = remote_source(t, rows, [a.url], master, budget=1 << 30, stall_s=10.0)
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        with pytest.raises(EngineFailed, match="Mooncake store") as e:
            read_all(source, 2)
        assert "\n" not in str(e.value) and master in str(e.value)
        assert time.monotonic() - t0 < 60
    finally:
        a.stop()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("flags, says", [
    (dict(engine_endpoints="http://a:1"), "go together"),
    (dict(mooncake_master="a:1"), "go together"),
    (dict(engine_endpoints="http://a:1", mooncake_master="a:1", data_parallel_size=2), "--data-parallel-size"),
    (dict(engine_endpoints="a:1", mooncake_master="a:1"), "not a server's base URL"),
    (dict(engine_endpoints="http://a:1", mooncake_master="nowhere"), "HOST:PORT"),
])
def test_remote_flags_are_checked_in_one_line(flags, says):
    from blockdraft.engines.vllm.engine_options import VllmOptions, check_engine_flags

    with pytest.raises(ValueError, match=says) as e:
        check_engine_flags(VllmOptions(**flags), "train")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="runs its engines here"):
        check_engine_flags(VllmOptions(engine_endpoints="http://a:1", mooncake_master="a:1"),
                           "extract")


def test_the_engine_command_runs_vllms_server_with_the_runs_layers_and_the_connector():
    from blockdraft.engines.vllm.engine_options import VllmOptions
    from blockdraft.engines.vllm.serve import ServerOptions, server_command

    argv, env = server_command("/m", [2, 9, 30], ["Glm4MoeForCausalLM"],
                               ServerOptions(mooncake_master="10.0.0.1:50051", port=8123, advertise="node7"),
                               VllmOptions(tensor_parallel_size=8, expert_parallel=True,
                                             engine_memory=0.85), "py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    arg = dict(zip(argv, argv[1:]))
    spec = json.loads(arg["--speculative-config"])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 9, 30]
    kv = json.loads(arg["--kv-transfer-config"])
    assert kv["kv_connector"] == "BlockdraftMooncakeConnector"
    assert kv["kv_connector_module_path"] == "blockdraft.engines.vllm.mooncake_connector"
    mc = kv["kv_connector_extra_config"]["mooncake"]
    assert mc["master_server_address"] == "10.0.0.1:50051" and mc["local_hostname"] == "node7"
    assert "--no-enable-prefix-caching" in argv and arg["--tensor-parallel-size"] == "8"
    assert "--enable-expert-parallel" in argv and arg["--port"] == "8123"
    assert arg["--gpu-memory-utilization"] == "0.85"
    assert json.loads(env["BLOCKDRAFT_VLLM_PLUGIN"]) == {"architectures": ["Glm4MoeForCausalLM"]}


def test_a_listed_server_that_never_answers_is_taken_out_once_another_has():
    """A dead server in --engine-endpoints never holds a run back (a resumed run still lists one that
    died): once one server answers the others get a grace period; none answering is one line."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"data": [{"id": "m"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    alive, dead = f"http://127.0.0.1:{server.server_address[1]}", f"http://127.0.0.1:{free_port()}"
    try:
        s = Servers([dead, alive], timeout_s=5)
        t0 = time.monotonic()
        s.connect(wait_s=600, grace_s=1)
        assert time.monotonic() - t0 < 30 and s.model == {alive: "m"} and dead in s.out
        assert s.pick() == alive
        with pytest.raises(EngineFailed, match="did not answer") as e:
            Servers([dead], timeout_s=5).connect(wait_s=1)
        assert "\n" not in str(e.value) and dead in str(e.value)
    finally:
        server.shutdown()


def test_an_unreachable_master_is_one_line_at_once_and_mooncakes_own_log_stays_off_the_terminal(tmp_path, capfd):
    """Mooncake's client retries an unreachable master for about 108 s, logging 121 lines to the terminal:
    the master's port is tried first, and Mooncake's own log of its setup goes to the run's log file."""
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EngineFailed, match="master at .* could not be reached") as e:
        Store(dead, timeout_s=600.0, log=tmp_path / "mooncake.log")
    assert time.monotonic() - t0 < 15 and "\n" not in str(e.value) and dead in str(e.value)
    proc, master = start_master()
    try:
        Store(master, timeout_s=600.0, log=tmp_path / "mooncake.log").close()
    finally:
        proc.kill()
        proc.wait()
    said = capfd.readouterr()
    assert said.out + said.err == "", (said.out + said.err)[-2000:]
    assert (tmp_path / "mooncake.log").read_text().strip()  # what Mooncake said is kept


def test_a_dead_endpoint_says_what_it_waits_for_while_it_waits(capsys):
    """--engine-stall-min (10 minutes by default) bounds the wait for a server; a wait that long says at least
    once a minute which servers it waits for and why (here every 0.5 s)."""
    from concurrent.futures import ThreadPoolExecutor

    from blockdraft.engines.vllm.remote import result_saying

    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineFailed, match="did not answer"):
        Servers([dead], timeout_s=5.0).connect(wait_s=2.0, every_s=0.5)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "waited" in ln]
    assert len(lines) >= 2 and all(dead in ln and "--engine-stall-min" in ln for ln in lines), lines
    with ThreadPoolExecutor(1) as pool:
        assert result_saying(pool.submit(time.sleep, 1.2), "a slow document", every_s=0.5) is None
    assert "still waiting for a slow document" in capsys.readouterr().out
