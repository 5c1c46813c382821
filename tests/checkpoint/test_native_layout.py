"""The native directory is what engines load unchanged: a draft vocabulary is stored as `d2t`
offsets and the target head's rows (`lm_head.weight`), the bytes `convert --to zlab` writes, and
it reads back as the same drafter (as do older directories that stored the ids as `draft_vocab`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockdraft.checkpoint import load_drafter, save_drafter
from blockdraft.checkpoint.formats import Export, zlab
from blockdraft.checkpoint.native import state_tensors
from blockdraft.engines.exports import convert
from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.train import Batch, compute_loss
from conftest import V, make, tiny_target

Vd = 40


def draft_vocab_pair(tmp_path, *, bf16_target: bool = False):
    """A tiny target whose head lives in an fp32 safetensors file (its local directory, as
    from_pretrained leaves it), and a drafter of random weights with a shuffled draft vocabulary.
    `bf16_target`: the loaded target is bf16 (training on a GPU), its file fp32."""
    t = tiny_target("llama")
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text("{}")
    save_file({"lm_head.weight": t.model.get_output_embeddings().weight.detach().float().clone()},
              str(verifier / "model.safetensors"))
    t.local_dir = verifier
    if bf16_target:
        t.model.to(torch.bfloat16)
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, draft_vocab_size=Vd))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    d.set_draft_vocab(torch.randperm(V - 1, generator=torch.Generator().manual_seed(0))[:Vd])
    return t, d.eval(), str(verifier)


def tensors(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


def same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype, bf16_target", [(None, False), (torch.bfloat16, False), (None, True)])
def test_a_draft_vocabulary_is_saved_as_the_engines_load_it(tmp_path, dtype, bf16_target):
    t, d, verifier = draft_vocab_pair(tmp_path, bf16_target=bf16_target)
    path = save_drafter(d, tmp_path / "native", head_rows=t.head_rows(d.draft_vocab), dtype=dtype)
    sd = tensors(path)
    assert "draft_vocab" not in sd and "t2d" not in sd
    ids = torch.sort(d.draft_vocab).values
    assert sd["d2t"].dtype == torch.int64 and torch.equal(torch.arange(Vd) + sd["d2t"], ids)  # id = i + d2t[i]
    want = load_file(str(Path(verifier) / "model.safetensors"))["lm_head.weight"][ids]  # the file's rows
    assert sd["lm_head.weight"].dtype == sd["fc.weight"].dtype == (dtype or torch.float32)
    assert torch.equal(sd["lm_head.weight"], want.to(sd["fc.weight"].dtype))
    assert json.loads((path / "config.json").read_text())["draft_vocab_size"] == Vd
    # the z-lab format's own writer, and `convert --to zlab` of the directory: the same bytes
    rows = t.head_rows(d.draft_vocab).to(sd["fc.weight"].dtype)
    by_format = zlab.FORMAT.write_weights(state_tensors(d, dtype), d.config, Export(head_rows=rows))
    assert same_bytes(sd, {k: v.contiguous() for k, v in by_format.items()})
    convert(path, tmp_path / "zlab", "zlab", verifier=verifier)
    assert same_bytes(sd, tensors(tmp_path / "zlab"))
    assert (path / "config.json").read_text() == (tmp_path / "zlab" / "config.json").read_text()


def test_the_saved_directory_reads_back_as_the_same_drafter(tmp_path):
    t, d, _ = draft_vocab_pair(tmp_path)
    path = save_drafter(d, tmp_path / "native", head_rows=t.head_rows(d.draft_vocab))
    back = load_drafter(path)
    assert back.config == d.config and torch.equal(back.draft_vocab, d.draft_vocab)
    assert torch.equal(back.draft_vocab, torch.sort(d.draft_vocab).values)
    batch = Batch(torch.randint(0, V - 1, (1, 30), generator=torch.Generator().manual_seed(1)),
                  torch.ones(1, 30, dtype=torch.long))
    la, ma = compute_loss(t, d, batch, max_anchors=6, generator=torch.Generator().manual_seed(0))
    lb, mb = compute_loss(t, back, batch, max_anchors=6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(la, lb) and ma["slot_counts"] == mb["slot_counts"]
    feats = t(batch.input_ids[:, :12], return_logits=False).features[0]  # the drafting step at anchor 12
    block = torch.full((4,), d.mask_token_id, dtype=torch.long)
    block[0] = batch.input_ids[0, 12]
    with torch.no_grad():
        a, b = (t.head(x.draft_hidden(feats, torch.arange(12), t.embed(block), 12, x.new_context_cache()),
                       x.vocab_rows) for x in (d, back))
    assert a.shape == (4, Vd) and torch.equal(a, b)  # the same draft logits over the same draft ids
    # an older directory (the ids as `draft_vocab`, no head rows) still loads as the same drafter
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in state_tensors(d, None).items()}, str(old / "model.safetensors"))
    assert "draft_vocab" in tensors(old) and "d2t" not in tensors(old)
    was = load_drafter(old)
    assert torch.equal(was.draft_vocab, d.draft_vocab)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in was.state_dict().items())


def test_a_draft_vocabulary_without_head_rows_is_refused_and_nothing_written(tmp_path):
    t, d, _ = draft_vocab_pair(tmp_path)
    with pytest.raises(ValueError, match=r"40-token draft vocabulary.*head_rows=target\.head_rows\("
                                         r"drafter\.draft_vocab\)"):
        save_drafter(d, tmp_path / "d")
    assert not (tmp_path / "d").exists()
    with pytest.raises(ValueError, match=r"head_rows is \[39, 32\]"):
        save_drafter(d, tmp_path / "d", head_rows=t.head_rows(d.draft_vocab[1:]))
    assert not (tmp_path / "d").exists()


def test_a_full_vocabulary_drafter_is_saved_as_before(tmp_path):
    t = tiny_target("llama")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    sd = tensors(save_drafter(d, tmp_path / "d"))
    assert not {"d2t", "lm_head.weight", "draft_vocab", "t2d"} & set(sd)
    assert same_bytes(sd, {k: v.contiguous() for k, v in state_tensors(d, None).items()})
    with pytest.raises(ValueError, match="full head"):
        save_drafter(d, tmp_path / "e", head_rows=torch.zeros(0, t.hidden_size))


def test_train_writes_the_engines_layout(tmp_path):
    """`train`'s final drafter directory carries the target's head rows (a target built in code:
    from its loaded head)."""
    tr = make(tmp_path, steps=2, vocab=Vd)
    tr.train()
    sd = tensors(tmp_path / "drafter")
    ids = tr.drafter.draft_vocab
    assert "draft_vocab" not in sd and torch.equal(torch.arange(Vd) + sd["d2t"], ids)
    assert torch.equal(sd["lm_head.weight"], tr.target.model.get_output_embeddings().weight[ids].float())
    assert torch.equal(load_drafter(tmp_path / "drafter").draft_vocab, ids)


# ------------------------------------------- a load while a save swaps (issue 43, item 4.6)
def _two_versions():
    t = tiny_target("llama")
    a = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    b = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    with torch.no_grad():
        b.fc.weight.add_(1.0)  # a later save: the same layout, other weights
    return a, b


def test_a_load_during_a_save_waits_for_the_swap_and_reads_one_whole_version(tmp_path, monkeypatch):
    import threading

    a, b = _two_versions()
    path = save_drafter(a, tmp_path / "d")
    moved, release, real = threading.Event(), threading.Event(), Path.rename

    def slow_rename(self, target):  # the save stops between moving the old version aside and the new in
        out = real(self, target)
        if ".blockdraft-old-" in str(target):
            moved.set()
            release.wait(10)
        return out

    monkeypatch.setattr(Path, "rename", slow_rename)
    saver = threading.Thread(target=save_drafter, args=(b, path))
    saver.start()
    assert moved.wait(10) and not path.exists()
    got = []
    loader = threading.Thread(target=lambda: got.append(load_drafter(path)))
    loader.start()
    loader.join(0.5)
    assert loader.is_alive() and not got  # waiting on the swap, not failing
    release.set()
    saver.join(10), loader.join(10)
    assert torch.equal(got[0].fc.weight, load_drafter(path).fc.weight)
    assert not torch.equal(got[0].fc.weight, a.fc.weight)  # the new version, whole



def test_a_loaded_drafter_saves_back_as_it_was_without_its_target(tmp_path):
    """The Python API's round trip: save_drafter(load_drafter(D), DIR) writes D's tensors again."""
    src = load_drafter("default")
    assert src.config.draft_vocab_size  # a draft vocabulary: the head rows come from the loaded directory
    out = save_drafter(src, tmp_path / "again", dtype=torch.bfloat16)
    from blockdraft.checkpoint.native import DEFAULT_DRAFTER

    a, b = tensors(DEFAULT_DRAFTER), tensors(out)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():  # another draft vocabulary than the one loaded: the rows no longer fit
        src.draft_vocab[0] = (src.draft_vocab[0] + 1) % src.config.vocab_size
    with pytest.raises(ValueError, match="head_rows"):
        save_drafter(src, tmp_path / "changed")
