"""Host reads of device tensors in a training step (each one a wait for the GPU on CUDA): a fixed
number per step, none per packed row or per block slot (tests/cuda_shim.py counts them)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.train import Batch, compute_loss
from conftest import tiny_rows, tiny_target
from cuda_shim import CudaPlacement


def syncs(rows: int, block: int, cached: bool, gamma=None, loss: str = "kl") -> dict:
    t = tiny_target("llama")
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=block, draft_vocab_size=64))
    d.set_draft_vocab(torch.arange(64))
    t.isolates_packed_documents()  # measured once per target, at its first packed forward: not per step
    with CudaPlacement() as mode:
        r = tiny_rows(rows)  # made under the shim: host tensors, as a data loader's are
        stored = None
        if cached:
            from blockdraft.data.features import FeatureMemo

            stored = FeatureMemo(t, r)(torch.arange(rows))
        batch = Batch(r["input_ids"], r["loss_mask"], r["position_ids"], r["document_ids"])
        mode.syncs.clear()
        loss, m = compute_loss(t, d, batch, max_anchors=8, generator=torch.Generator().manual_seed(0), cached=stored,
                               gamma=gamma, loss=loss)
        loss.backward()
    assert m["blocks"] >= rows  # every row anchored some blocks
    return mode.syncs


@pytest.mark.parametrize("cached", [False, True])
def test_a_step_reads_the_device_a_fixed_number_of_times(cached):
    small, large = syncs(1, 4, cached), syncs(4, 8, cached)
    assert small == large, (small, large)  # not per row, not per slot
    assert sum(large.values()) <= 7, large


@pytest.mark.parametrize("loss", ["kl", "hard"])
@pytest.mark.parametrize("weighting", ["gamma", "dpace"])
def test_nor_per_loss_chunk(loss, weighting, monkeypatch):
    """Chunks of 6 slots: the larger batch runs several times the smaller one's chunks (of whole
    blocks under D-PACE) and reads the device as often."""
    import blockdraft.train.step as step_mod
    from blockdraft.train.loss import DPace

    monkeypatch.setattr(step_mod, "loss_chunk_slots", lambda device, width: 6)
    gamma = DPace(0.5) if weighting == "dpace" else 3.0
    small, large = syncs(1, 4, False, gamma, loss), syncs(4, 8, False, gamma, loss)
    assert small == large, (small, large)
    assert sum(large.values()) <= 7, large


def test_a_checkpoint_copies_the_state_to_the_host_without_a_device_clone(tmp_path):
    """Saving copies each tensor to the host directly: a clone on the GPU first would hold a second
    drafter and optimizer state there while the file is written."""
    from blockdraft.rundir.state import save_state

    t = tiny_target("llama")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    opt = torch.optim.AdamW(d.parameters())
    d.fc.weight.sum().backward()
    opt.step()
    with CudaPlacement() as mode:
        save_state(tmp_path / "ck", drafter=d, optimizer=opt, progress={"step": 1})
    assert "clone" not in mode.device_calls, mode.device_calls
    assert mode.device_calls.get("to", 0) >= len(d.state_dict())
