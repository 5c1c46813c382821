"""A stand-in for a vLLM server with blockdraft's Mooncake connector, in its own process (test_remote.py):
`POST /v1/completions` with a document's token ids puts the document's states into the Mooncake store and
answers with their manifest, as the connector does; `GET /v1/models` names a model.

    python remote_standin.py JOB.json

JOB: the tiny target's weights, the master, the ids it captures and the ids it says it captures,
`dies_after` (the process exits when asked for one document more: its segment, and the states in it,
go with it) and `full` (puts that fail as on a full store: an error marker instead). It writes its URL
to DIR/url once listening, and DIR/stats.json after each answer: documents answered, and the bytes of
its samples the store held at its fullest (checked at each put)."""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from hs_connectors.mooncake_store import VERSION, MooncakeHiddenStatesStore, MooncakeStoreConfig, packed_layout
from safetensors.torch import load_file

from blockdraft.engines.vllm.remote import local_puts
from blockdraft.engines.vllm.states import AUX_KEY
from conftest import tiny_target
from engine_stub import document_states


def main(path: str) -> None:
    job = json.loads(open(path).read())
    target = tiny_target("llama", num_features=3)
    target.model.load_state_dict(load_file(job["weights"]))
    store = MooncakeHiddenStatesStore(MooncakeStoreConfig(
        master_server_address=job["master"], global_segment_size=64 << 20, local_buffer_size=16 << 20)).setup()
    local_puts(store)  # as blockdraft's connector places its puts
    lock = threading.Lock()
    state = {"answered": 0, "peak": 0, "full": int(job["full"])}
    live: dict[str, int] = {}

    def stored() -> int:
        return sum(b for h, b in live.items() if store._store.is_exist(h) == 1)

    def answer(request_id: str, ids: list[int]) -> dict:
        with lock:
            if job["dies_after"] is not None and state["answered"] >= job["dies_after"]:
                os._exit(1)  # a server that dies, and the store's segment on its node with it
            state["answered"] += 1
            n = target.num_layers
            states, tok = document_states(target.model, target._layers[n - 1], n, ids, job["aux"]), torch.tensor(ids)
            spec, total = packed_layout({"hidden_states": (list(states.shape), states.dtype),
                                         "token_ids": (list(tok.shape), tok.dtype)})
            handle = f"cmpl-{request_id}-0-abc".replace(".", "_")
            manifest = {"handle": handle, "version": VERSION, "tensors": spec,
                        "metadata": {"num_tokens": len(ids), "total_aligned_bytes": total, AUX_KEY: job["claimed"]}}
            if state["full"] > 0:
                state["full"] -= 1
                store.put_error(manifest, "Mooncake put_from failed with status=-200")
            else:
                try:
                    store.put_sample(manifest, {"hidden_states": states, "token_ids": tok})
                except RuntimeError as e:  # as the connector does: an error marker, and the reader asks again
                    try:  # (a put into a dead server's segment fails so, and the marker's put may too)
                        store.put_error(manifest, str(e))
                    except RuntimeError:
                        pass  # the connector logs it; its response has gone already
                else:
                    live[handle] = total
                    state["peak"] = max(state["peak"], stored())
            tmp = os.path.join(job["dir"], "stats.tmp")
            with open(tmp, "w") as f:
                json.dump({"answered": state["answered"], "peak": state["peak"], "full": state["full"]}, f)
            os.replace(tmp, os.path.join(job["dir"], "stats.json"))
            return manifest

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"data": [{"id": "stand-in"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._send({"kv_transfer_params": answer(self.headers["X-Request-Id"], body["prompt"])})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    tmp = os.path.join(job["dir"], "url.tmp")
    with open(tmp, "w") as f:
        f.write(f"http://127.0.0.1:{server.server_address[1]}")
    os.replace(tmp, os.path.join(job["dir"], "url"))
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1])
