"""`convert --to gguf`: llama.cpp's DFlash GGUF, read back with the gguf package (llama.cpp's own
Python reader), against the drafter's tensors, clause 1's ids + 1, the target GGUF's tokenizer and
head, and the refusals where llama.cpp b11434 computes another function.

What llama.cpp itself computes from the file is checked by reference/test_llamacpp.py.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from blockdraft.checkpoint import load_drafter
from blockdraft.checkpoint.formats import gguf as fmt
from blockdraft.checkpoint.native import export_gguf
from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.target_files import target_gguf
from conftest import tiny_target


def values(path):
    r = GGUFReader(str(path))
    return r, {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def as_torch(t) -> torch.Tensor:
    """A ReaderTensor's values (BF16 comes back from the reader as raw bytes)."""
    a = np.ascontiguousarray(t.data)
    if t.tensor_type.name == "BF16":
        return torch.from_numpy(a.reshape(-1).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, smollm2_dir):
    out = tmp_path_factory.mktemp("gguf") / "draft.gguf"
    rc = subprocess.run([sys.executable, "-m", "blockdraft", "convert", "--to", "gguf", "default", str(out)],
                        capture_output=True, text=True, timeout=600)
    assert rc.returncode == 0, rc.stderr[-2000:]
    return out


def test_gguf_holds_the_drafters_tensors_under_llamacpps_names(shipped):
    from safetensors.torch import load_file

    from blockdraft.checkpoint.native import DEFAULT_DRAFTER

    native = load_file(str(DEFAULT_DRAFTER / "model.safetensors"))
    r, _ = values(shipped)
    tensors = {t.name: t for t in r.tensors}
    expect = {"fc.weight", "enc.output_norm.weight", "output_norm.weight", "output.weight", "d2t"} | {
        f"blk.0.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                                      "attn_k_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(tensors) == expect  # no token_embd: llama.cpp takes the target's
    by_gguf = {fmt.tensor_name(k): v for k, v in native.items() if k != "draft_vocab"}
    for name, want in by_gguf.items():
        t = tensors[name]
        assert [int(x) for x in t.shape] == list(reversed(want.shape)), name  # ggml ne: input dim first
        got = as_torch(t).reshape(want.shape)
        assert torch.equal(got.to(want.dtype), want), name  # bit for bit (norm gains widened to fp32)
    assert tensors["d2t"].tensor_type.name == "I64"
    # llama.cpp scatters draft row i onto target id d2t[i]: absolute ids, not the offsets vLLM reads
    assert torch.equal(as_torch(tensors["d2t"]), native["draft_vocab"])


def test_gguf_metadata_is_clause_one_plus_one_and_the_targets_tokenizer(shipped):
    drafter = load_drafter("default")
    cfg = drafter.config
    _, kv = values(shipped)
    assert kv["general.architecture"] == "dflash"
    # llama.cpp hands the drafter each listed layer's input: transformers' hidden_states[id]
    assert kv["dflash.target_layers"] == [L + 1 for L in cfg.target_layer_ids] == [2, 9, 15, 22, 28]
    assert kv["dflash.block_size"] == cfg.block_size == 16
    assert kv["tokenizer.ggml.mask_token_id"] == cfg.mask_token_id
    assert kv["dflash.attention.causal"] is True  # its one sliding layer is causal in the block
    assert kv["dflash.attention.sliding_window"] == 32 and kv["dflash.attention.sliding_window_pattern"] == [True]
    assert kv["dflash.embedding_length"] == 576 and kv["dflash.attention.head_count_kv"] == 3
    _, tv = values(target_gguf("smollm2"))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.model", "tokenizer.ggml.eos_token_id",
                "tokenizer.chat_template"):
        assert kv[key] == tv[key], key


def test_gguf_head_rows_are_the_targets_own(shipped, smollm2_dir):
    """output.weight: the target's head at the draft ids, as llama-server holds it (dequantized Q4_1),
    against transformers' own reading of the same GGUF."""
    from blockdraft.target import TargetModel

    r, _ = values(shipped)
    tensors = {t.name: t for t in r.tensors}
    ids = as_torch(tensors["d2t"])
    head = as_torch(tensors["output.weight"]).reshape(ids.numel(), -1).float()
    target = TargetModel.from_pretrained("smollm2")
    want = target.model.get_output_embeddings().weight.detach()[ids].to(torch.bfloat16).float()
    assert torch.equal(head, want)


def tiny_cfg(**kw) -> DrafterConfig:
    return DrafterConfig.for_target(tiny_target("qwen3"), block_size=8, **kw)


@pytest.mark.parametrize("kw, says", [
    (dict(num_layers=1, layer_types=["sliding_attention"], sliding_window=16, sliding_window_rule="anchor"),
     "anchor rule"),
    (dict(num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
          sliding_causal_in_block=True), "one causality flag"),
    (dict(num_layers=1, layer_types=["sliding_attention"], sliding_window=4, sliding_causal_in_block=False),
     "narrower than its 8-token block"),
    (dict(num_layers=1, attention_bias=True), "attention biases"),
])
def test_gguf_refuses_what_llamacpp_computes_otherwise(kw, says):
    found = fmt.differences(tiny_cfg(**kw))
    assert found and all(d.refuse for d in found)
    assert any(says in d.what for d in found), found


@pytest.mark.parametrize("kw, causal", [
    (dict(num_layers=2), False),  # full layers: bidirectional in the block
    (dict(num_layers=1, layer_types=["sliding_attention"], sliding_window=4, sliding_causal_in_block=True), True),
    (dict(num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
          sliding_causal_in_block=False), False),  # bidirectional, window wider than the block
])
def test_gguf_writes_what_llamacpp_computes_the_same(kw, causal):
    cfg = tiny_cfg(**kw)
    assert fmt.differences(cfg) == []
    assert fmt.causal_flag(cfg) is causal


def fake_target_gguf(path, *, hidden: int, layers: int, vocab: int):
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.embedding_length", hidden)
    w.add_uint32("llama.block_count", layers)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_tensor("token_embd.weight", np.arange(vocab * hidden, dtype=np.float32).reshape(vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_export_refuses_a_mismatch_and_another_target(tmp_path):
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, layer_types=["sliding_attention"],
                                               sliding_window=16, sliding_window_rule="anchor"))
    H, n, V = d.config.target_hidden_size, d.config.target_num_layers, d.config.vocab_size
    good = fake_target_gguf(tmp_path / "t.gguf", hidden=H, layers=n, vocab=V)
    with pytest.raises(ValueError, match="anchor rule.*--allow-mismatch"):
        export_gguf(d, tmp_path / "d.gguf", target_gguf=good)
    assert not (tmp_path / "d.gguf").exists()
    path, found = export_gguf(d, tmp_path / "d.gguf", target_gguf=good, allow_mismatch=True)
    assert found and path.exists()
    _, kv = values(path)
    assert kv["dflash.target_layers"] == [L + 1 for L in d.config.target_layer_ids]
    assert kv["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(V)]
    other = fake_target_gguf(tmp_path / "o.gguf", hidden=H * 2, layers=n, vocab=V)
    with pytest.raises(ValueError, match="not this drafter's target"):
        export_gguf(d, tmp_path / "e.gguf", target_gguf=other, allow_mismatch=True)
    with pytest.raises(ValueError, match="pass --target-gguf"):
        export_gguf(d, tmp_path / "e.gguf", allow_mismatch=True)
    with pytest.raises(ValueError, match="is a directory"):
        export_gguf(d, tmp_path, target_gguf=good, allow_mismatch=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "o.gguf", "t.gguf"]  # no partial files
