"""Slots per loss chunk (train.loss.loss_chunk_slots, issue 32): 256 on a CPU, whatever the memory;
on CUDA sized from the free device memory (~12 bytes per slot and vocabulary entry, 1/32 of it),
within [256, 8192], a multiple of 256; and compute_loss runs the chunk it gives."""

from __future__ import annotations

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.train import Batch, compute_loss
from blockdraft.train import loss as loss_mod
from blockdraft.train import step as step_mod
from blockdraft.train.loss import loss_chunk_slots
from conftest import V, tiny_rows, tiny_target

GIB = 2**30


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
@pytest.mark.parametrize("vocab", [1, 1000, 151936])
@pytest.mark.parametrize("free", [None, 0, 10**15])
def test_a_cpu_keeps_256_slots(device, vocab, free):
    assert loss_chunk_slots(device, vocab, free) == 256


@pytest.mark.parametrize("free, vocab, slots", [
    (0, 1000, 256),  # nothing free: the floor
    (32 * 12 * 1000 * 100, 1000, 256),  # 100 slots' worth: the floor
    (10**15, 1000, 8192),  # ~1 PB: the cap
    (32 * 12 * 1000 * 1000, 1000, 768),  # 1000 slots' worth, rounded down to a multiple of 256
    (32 * 12 * 1000 * 2048, 1000, 2048),  # exactly 2048
    (32 * 12 * 1000 * 2048 - 1, 1000, 1792),  # a byte less: 2047 -> 1792
    (139 * GIB, 151936, 2304),  # an empty H200 and Qwen3's vocabulary: 2558 slots' worth
])
def test_cuda_sizes_the_chunk_from_the_free_memory(free, vocab, slots):
    assert loss_chunk_slots("cuda", vocab, free) == slots
    assert loss_chunk_slots(torch.device("cuda", 0), vocab, free) == slots


def test_cuda_asks_the_device_for_its_free_memory(monkeypatch):
    """The driver's free memory plus what the caching allocator holds unused (after a first step the
    allocator keeps its peak reserved: the driver's figure alone would drop later steps to 256)."""
    seen = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (seen.append(d) or (32 * 12 * 1000 * 512, 80 * GIB)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 32 * 12 * 1000 * 1600)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 32 * 12 * 1000 * 100)
    assert loss_chunk_slots("cuda:0", 1000) == 1792  # 512 + 1600 - 100 = 2012 slots' worth
    assert seen == ["cuda:0"]


def _step_inputs(draft_vocab: int | None):
    t = tiny_target("llama")
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, draft_vocab_size=draft_vocab))
    if draft_vocab:
        d.set_draft_vocab(torch.arange(draft_vocab))
    r = tiny_rows(3)
    return t, d, Batch(r["input_ids"], r["loss_mask"], r["position_ids"], r["document_ids"])


@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_compute_loss_runs_the_chunk_sized_for_its_device(monkeypatch, draft_vocab):
    """compute_loss asks loss_chunk_slots with the hidden states' device and the widest rows a chunk
    makes (the draft head's, or the label rows': the target's full head, whose argmax the labels
    need, with or without a draft vocabulary), and runs that chunk: 256 on a CPU; any other chunk
    gives the same loss."""
    t, d, batch = _step_inputs(draft_vocab)
    asked, ran = [], []
    real_slots, real_loss = step_mod.loss_chunk_slots, step_mod.dflash_loss_chunked

    def slots(device, vocab, free_bytes=None):
        asked.append((torch.device(device).type, vocab))
        return real_slots(device, vocab, free_bytes)

    def chunked(*a, **kw):
        ran.append(kw.get("chunk"))
        return real_loss(*a, **kw)

    monkeypatch.setattr(step_mod, "loss_chunk_slots", slots)
    monkeypatch.setattr(step_mod, "dflash_loss_chunked", chunked)
    kw = dict(max_anchors=6, generator=torch.Generator().manual_seed(0))
    loss, m = compute_loss(t, d, batch, **kw)
    assert asked == [("cpu", V)] and ran == [256]
    assert m["supervised_slots"] > 5
    monkeypatch.setattr(step_mod, "loss_chunk_slots", lambda device, vocab, free_bytes=None: 5)
    kw["generator"] = torch.Generator().manual_seed(0)
    loss5, _ = compute_loss(t, d, batch, **kw)
    assert ran[-1] == 5
    torch.testing.assert_close(loss5, loss, rtol=1e-5, atol=1e-6)


def test_the_chunk_constants_are_the_documented_ones():
    assert (loss_mod.LOSS_CHUNK_MIN, loss_mod.LOSS_CHUNK_MAX) == (256, 8192)
    assert (loss_mod.LOSS_MEMORY_SHARE, loss_mod.LOSS_BYTES_PER_ENTRY) == (32, 12)
