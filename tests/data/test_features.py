"""Stored target outputs: the same labels and features as the online path, refusal of a foreign cache."""

from __future__ import annotations

import os

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.data.features import DiskFeatures, FeatureMemo, cache_identity, extract
from blockdraft.model import DFlashDrafter
from blockdraft.train import compute_loss, prepare
from blockdraft.train.trainer import rows_batch
from conftest import ARCHS, tiny_target
from conftest import tiny_rows


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_outputs_give_the_online_labels_and_features(arch):
    t = tiny_target(arch)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    rows = tiny_rows(4)
    idx = torch.tensor([2, 0])
    b = rows_batch(rows, idx)
    online = prepare(t, d, b, max_anchors=6, generator=torch.Generator().manual_seed(0))
    memo = FeatureMemo(t, rows)
    stored = prepare(t, d, b, max_anchors=6, generator=torch.Generator().manual_seed(0), cached=memo(idx))
    torch.testing.assert_close(stored.target_logits.per_slot(), online.target_logits.per_slot(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stored.features, online.features, rtol=0, atol=0)


@pytest.mark.parametrize("loss", ["kl", "hard"])
def test_memo_with_a_draft_vocabulary_gives_the_online_loss_and_metrics(loss):
    """The memo keeps the target's full-vocabulary argmax, so steps with a draft vocabulary run the
    head on the draft rows only; loss and metrics must equal the online path's (the target's own
    full logits), including a target argmax outside the draft vocabulary."""
    from blockdraft.train import compute_loss

    t = tiny_target("qwen3")
    with torch.no_grad():
        t.model.get_output_embeddings().weight.mul_(5)
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, draft_vocab_size=40))
    d.set_draft_vocab(torch.arange(0, 80, 2))  # half the target's likely picks lie outside
    rows = tiny_rows(4)
    idx = torch.tensor([3, 1])
    b = rows_batch(rows, idx)
    online = compute_loss(t, d, b, max_anchors=6, loss=loss, generator=torch.Generator().manual_seed(0))
    cached = FeatureMemo(t, rows)(idx)
    assert cached.top is not None and not torch.isin(cached.top, d.draft_vocab).all()
    stored = compute_loss(t, d, b, max_anchors=6, loss=loss, generator=torch.Generator().manual_seed(0), cached=cached)
    torch.testing.assert_close(stored[0], online[0], rtol=1e-5, atol=1e-6)
    for key in ("accepted_lengths", "slot_counts", "supervised_slots"):
        assert stored[1][key] == online[1][key]
    assert stored[1]["accuracy"] == pytest.approx(online[1]["accuracy"])


def test_extract_resumes_and_refuses_a_foreign_cache(tmp_path):
    t = tiny_target("llama")
    rows = tiny_rows(10)
    out = tmp_path / "cache"
    extract(t, rows, out, shard_rows=3, progress=False)
    shards = sorted(out.glob("shard-*.safetensors"))
    assert len(shards) == 4
    # a restart after a kill redoes only the missing shard
    mtimes = {p.name: p.stat().st_mtime_ns for p in shards}
    os.remove(shards[2])
    extract(t, rows, out, shard_rows=3, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in sorted(out.glob("shard-*.safetensors"))
            if p.name != shards[2].name} == {k: v for k, v in mtimes.items() if k != shards[2].name}
    cache = DiskFeatures(out, expect=cache_identity(t, 40, torch.float32))
    idx = torch.tensor([7, 0, 9, 3, 2])  # rows of every shard (3 per shard), in mixed order
    got, ref = cache(idx), FeatureMemo(t, rows)(idx)
    torch.testing.assert_close(got.features, ref.features, rtol=0, atol=0)
    torch.testing.assert_close(got.final_hidden, ref.final_hidden, rtol=0, atol=0)
    assert torch.equal(got.top, ref.top)  # the full-vocabulary argmax travels with the cache
    with pytest.raises(IndexError, match="outside"):
        cache(torch.tensor([10]))
    assert torch.equal(cache.rows["input_ids"], rows["input_ids"])
    other = tiny_target("llama", layer_ids=[0, 2, 4])
    with pytest.raises(ValueError, match="layer_ids"):
        DiskFeatures(out, expect=cache_identity(other, 40, torch.float32))
    with pytest.raises(ValueError, match="other settings"):
        extract(other, rows, out, shard_rows=3, progress=False)
    os.remove(shards[0])
    with pytest.raises(ValueError, match="incomplete"):
        DiskFeatures(out)


def test_a_peer_rank_sees_a_cache_being_made_while_the_manifest_is_written(tmp_path, monkeypatch):
    """Rank 0 writes the manifest through a temporary file; a peer that looks at the directory in
    that instant (CI caught one) must see a cache being made, not a foreign directory."""
    from blockdraft.data import features

    out = tmp_path / "cache"
    seen, real = [], os.replace

    def replace(src, dst):  # the instant between the temporary's write and its rename
        seen.append((os.path.basename(src), features.holds_other_files(out)))
        real(src, dst)

    monkeypatch.setattr(features.os, "replace", replace)
    extract(tiny_target("llama"), tiny_rows(4), out, shard_rows=2, progress=False)
    assert len(seen) == 3 and not any(other for _, other in seen), seen
    # and the check still fires on a directory that holds something else
    (out / "notes.txt").write_text("x")
    os.remove(out / features.MANIFEST)
    assert features.holds_other_files(out)


def test_a_bf16_cache_reads_back_the_rounded_outputs_in_bf16(tmp_path):
    """A bf16 cache is read as bf16 (the drafter and head cast where they use it): an upcast on the
    reading thread would double the bytes every step copies to the device."""
    t = tiny_target("qwen3")
    rows = tiny_rows(5)
    extract(t, rows, tmp_path / "c", shard_rows=2, dtype=torch.bfloat16, progress=False)
    got = DiskFeatures(tmp_path / "c")(torch.tensor([4, 1]))
    ref = FeatureMemo(t, rows)(torch.tensor([4, 1]))
    assert got.features.dtype == got.final_hidden.dtype == torch.bfloat16
    assert torch.equal(got.features, ref.features.bfloat16())
    assert torch.equal(got.final_hidden, ref.final_hidden.bfloat16())


def test_a_cache_is_bound_to_its_data_and_shard_layout(tmp_path):
    """Other data (or another shard size) in the same directory is refused, never mixed in."""
    t = tiny_target("llama")
    a, b = tiny_rows(4), tiny_rows(4, seed=7)
    extract(t, a, tmp_path / "c", shard_rows=1, progress=False)
    with pytest.raises(ValueError, match="other data"):
        extract(t, b, tmp_path / "c", shard_rows=1, progress=False)
    with pytest.raises(ValueError, match="shard_rows"):
        extract(t, a, tmp_path / "c", shard_rows=2, progress=False)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        extract(t, a, tmp_path / "x", shard_rows=1, progress=False)


def test_a_disk_cache_scores_only_the_draft_rows(tmp_path, monkeypatch):
    """Training from `blockdraft extract` shards with a draft vocabulary runs the head on the draft
    rows only (the stored argmax stands in for the full head), with the memo's loss."""
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, draft_vocab_size=40))
    d.set_draft_vocab(torch.arange(0, 80, 2))
    rows = tiny_rows(4)
    extract(t, rows, tmp_path / "c", shard_rows=2, progress=False)
    idx = torch.tensor([3, 1])
    b = rows_batch(rows, idx)
    calls = []
    real = t.head
    monkeypatch.setattr(t, "head", lambda h, r=None: calls.append(r is None) or real(h, r))
    disk = compute_loss(t, d, b, max_anchors=6, loss="kl", generator=torch.Generator().manual_seed(0),
                        cached=DiskFeatures(tmp_path / "c")(idx))
    assert calls and not any(calls)  # never the full head
    memo = compute_loss(t, d, b, max_anchors=6, loss="kl", generator=torch.Generator().manual_seed(0),
                        cached=FeatureMemo(t, rows)(idx))
    torch.testing.assert_close(disk[0], memo[0], rtol=1e-6, atol=1e-6)


def test_extract_runs_the_target_a_bounded_batch_at_a_time_and_stores_its_dtype(tmp_path, monkeypatch):
    """A shard of 6 rows of 40 tokens goes through the target 2 rows (80 tokens) at a time, with
    the same outputs as one forward of each row; the cache stores the target's own precision."""
    t = tiny_target("llama")
    rows = tiny_rows(8)
    seen = []
    real = type(t).forward

    def forward(self, input_ids, **kw):
        seen.append(input_ids.numel())
        return real(self, input_ids, **kw)

    monkeypatch.setattr(type(t), "forward", forward)
    extract(t, rows, tmp_path / "c", shard_rows=6, batch_tokens=80, progress=False)
    assert seen and max(seen) <= 80, seen
    got = DiskFeatures(tmp_path / "c")(torch.arange(8))
    ref = FeatureMemo(t, rows)(torch.arange(8))
    assert got.features.dtype == torch.float32  # the target's
    torch.testing.assert_close(got.features, ref.features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.final_hidden, ref.final_hidden, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.top, ref.top)
    t16 = tiny_target("llama")
    t16.model.to(torch.bfloat16)
    extract(t16, rows, tmp_path / "b", shard_rows=6, progress=False)
    assert DiskFeatures(tmp_path / "b")(torch.arange(2)).features.dtype == torch.bfloat16


def test_the_default_shard_holds_about_a_gibibyte():
    from blockdraft.data.features import auto_shard_rows, row_bytes

    t = tiny_target("llama")  # 3 feature layers + the final state of width 32
    assert row_bytes(t, 1024, torch.bfloat16) == 1024 * (4 * 32 * 2 + 8)
    assert auto_shard_rows(t, 1024, torch.float32) == 64  # small rows: the cap
    assert auto_shard_rows(t, 1024, torch.float32, budget=10 * row_bytes(t, 1024, torch.float32)) == 10


def test_extract_checks_the_bytes_its_shards_take_before_the_first(tmp_path, monkeypatch):
    """The feature cache's size, computed as the writer writes it (rows, features, final states and
    argmax per shard, safetensors headers), is checked before the first shard: a disk one byte short
    is refused with nothing written, and the estimate is the bytes written."""
    import shutil

    import blockdraft.data.features as features

    t = tiny_target("llama")
    rows = tiny_rows(5)
    seen, check = [], features.check_free_space
    monkeypatch.setattr(features, "check_free_space", lambda p, need, what: seen.append(need) or check(p, need, what))
    out = extract(t, rows, tmp_path / "c", shard_rows=2, dtype=torch.float32, progress=False)
    written = sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))
    assert abs(seen[0] - written) <= 0.01 * written, (seen, written)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=written - 1))
    with pytest.raises(ValueError, match="not enough disk space for the feature cache"):
        extract(t, rows, tmp_path / "d", shard_rows=2, dtype=torch.float32,
                progress=False)
    assert not list((tmp_path / "d").glob("shard-*"))
