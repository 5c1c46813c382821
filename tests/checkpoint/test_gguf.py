"""`convert --to gguf`: llama.cpp's DFlash GGUF, read back with the gguf package (llama.cpp's own
Python reader), against the drafter's tensors, clause 1's ids + 1, the target GGUF's tokenizer and
head, and the refusals where llama.cpp b11434 computes another function.

What llama.cpp itself computes from the file is checked by reference/test_llamacpp.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from blockdraft.checkpoint import load_drafter
from blockdraft.checkpoint.formats import gguf as fmt
from blockdraft.checkpoint.native import export_gguf
from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.target.files import target_gguf
from conftest import tiny_target

ROOT = Path(__file__).resolve().parents[2]


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
    # the directory holds the engines' draft-vocabulary tensors (d2t offsets, the head's rows as lm_head.weight)
    by_gguf = {fmt.tensor_name(k): v for k, v in native.items() if k not in ("d2t", "lm_head.weight")}
    for name, want in by_gguf.items():
        t = tensors[name]
        assert [int(x) for x in t.shape] == list(reversed(want.shape)), name  # ggml ne: input dim first
        got = as_torch(t).reshape(want.shape)
        assert torch.equal(got.to(want.dtype), want), name  # bit for bit (norm gains widened to fp32)
    assert tensors["d2t"].tensor_type.name == "I64"
    # llama.cpp scatters draft row i onto target id d2t[i]: absolute ids, not the offsets vLLM reads
    ids = native["d2t"] + torch.arange(native["d2t"].numel())
    assert torch.equal(as_torch(tensors["d2t"]), ids)
    head = as_torch(tensors["output.weight"]).reshape(native["lm_head.weight"].shape)
    assert torch.equal(head.to(torch.bfloat16), native["lm_head.weight"])  # the same target rows


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


def fake_target_gguf(path, *, hidden: int, layers: int, vocab: int, swap: bool = False):
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.embedding_length", hidden)
    w.add_uint32("llama.block_count", layers)
    tokens = [f"t{i}" for i in range(vocab)]
    if swap:  # another tokenizer of the same size: two ids exchanged
        tokens[1], tokens[2] = tokens[2], tokens[1]
    w.add_array("tokenizer.ggml.tokens", tokens)
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


def recorded_need(monkeypatch) -> list:
    """The bytes the GGUF writer's free-space check asks for (the check itself still runs)."""
    import blockdraft.atomic as atomic

    seen, real = [], atomic.check_free_space
    monkeypatch.setattr(atomic, "check_free_space", lambda p, need, what: seen.append(need) or real(p, need, what))
    return seen


def test_gguf_size_is_known_before_writing_exactly(tmp_path, monkeypatch):
    """The free-space check asks for the bytes the file will have: tensors as written, metadata and
    the target's tokenizer arrays (here most of a tiny drafter's file)."""
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, draft_vocab_size=16))
    d.set_draft_vocab(torch.arange(0, 32, 2))
    H, n, V = d.config.target_hidden_size, d.config.target_num_layers, d.config.vocab_size
    good = fake_target_gguf(tmp_path / "t.gguf", hidden=H, layers=n, vocab=V)
    need = recorded_need(monkeypatch)
    path, _ = export_gguf(d, tmp_path / "d.gguf", target_gguf=good)
    assert need == [path.stat().st_size]


def test_gguf_size_of_the_shipped_drafter_with_the_real_tokenizer(tmp_path, monkeypatch, smollm2_dir):
    need = recorded_need(monkeypatch)
    path, _ = export_gguf(load_drafter("default", dtype=torch.bfloat16), tmp_path / "d.gguf")
    assert abs(need[0] - path.stat().st_size) <= 0.01 * path.stat().st_size, (need, path.stat().st_size)


def test_gguf_refuses_out_of_range_values_in_one_line(tmp_path):
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, max_position_embeddings=2**33))
    H, n, V = d.config.target_hidden_size, d.config.target_num_layers, d.config.vocab_size
    good = fake_target_gguf(tmp_path / "t.gguf", hidden=H, layers=n, vocab=V)
    with pytest.raises(ValueError, match=r"dflash.context_length = 8589934592 does not fit its type UINT32"):
        export_gguf(d, tmp_path / "d.gguf", target_gguf=good)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.gguf"]


def test_gguf_refuses_a_target_with_another_tokenizer_of_the_same_shape(tmp_path):
    """The drafter's stored tokenizer hash (target.files.tokenizer_hash: the (token, id) pairs) against
    the target GGUF's tokens: the same count, hidden size and depth is not the same tokenizer."""
    from blockdraft.target.files import tokens_hash

    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    H, n, V = d.config.target_hidden_size, d.config.target_num_layers, d.config.vocab_size
    d.config.tokenizer_hash = tokens_hash([f"t{i}" for i in range(V)])
    good = fake_target_gguf(tmp_path / "t.gguf", hidden=H, layers=n, vocab=V)
    assert export_gguf(d, tmp_path / "d.gguf", target_gguf=good)[0].exists()
    other = fake_target_gguf(tmp_path / "o.gguf", hidden=H, layers=n, vocab=V, swap=True)
    with pytest.raises(ValueError, match="another tokenizer than the drafter was trained with"):
        export_gguf(d, tmp_path / "e.gguf", target_gguf=other)
    assert not (tmp_path / "e.gguf").exists()


def test_the_tokenizer_hash_of_a_gguf_is_the_one_of_its_transformers_tokenizer(smollm2_tokenizer):
    from blockdraft.target.files import tokenizer_hash, tokens_hash

    r, _ = values(target_gguf("smollm2"))
    assert tokens_hash(r.fields["tokenizer.ggml.tokens"].contents()) == tokenizer_hash(smollm2_tokenizer)


def tiny_gguf_case(tmp_path):
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    c = d.config
    return d, fake_target_gguf(tmp_path / "t.gguf", hidden=c.target_hidden_size, layers=c.target_num_layers,
                               vocab=c.vocab_size)


def test_gguf_export_never_replaces_a_file_it_did_not_write(tmp_path):
    d, target = tiny_gguf_case(tmp_path)
    theirs = tmp_path / "theirs.gguf"
    theirs.write_bytes(b"a user's file")
    (tmp_path / "link.gguf").symlink_to(theirs)
    for dst, says in ((theirs, "not written by blockdraft convert"), (target, "not written by blockdraft convert"),
                      (tmp_path / "link.gguf", "link")):
        before = dst.read_bytes()
        with pytest.raises(ValueError, match=says if dst.is_symlink() else "--overwrite"):
            export_gguf(d, dst, target_gguf=target, allow_mismatch=True)
        with pytest.raises(ValueError, match=says):
            export_gguf(d, dst, target_gguf=target, allow_mismatch=True, overwrite=True)
        assert dst.read_bytes() == before
    ours = tmp_path / "d.gguf"
    export_gguf(d, ours, target_gguf=target, allow_mismatch=True)
    with pytest.raises(ValueError, match=f"{ours} exists.*--overwrite"):
        export_gguf(d, ours, target_gguf=target, allow_mismatch=True)
    first = ours.stat().st_mtime_ns
    time.sleep(0.01)
    export_gguf(d, ours, target_gguf=target, allow_mismatch=True, overwrite=True)  # its own file, asked to
    assert ours.stat().st_mtime_ns != first and values(ours)[1]["dflash.block_size"] == 4


def test_convert_to_gguf_refuses_an_existing_destination(shipped, capsys):
    from blockdraft.cli import main

    before = shipped.read_bytes()
    assert main(["convert", "--to", "gguf", "default", str(shipped)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{shipped} exists" in err and "--overwrite" in err
    assert shipped.read_bytes() == before


KILLED_GGUF = """
import os, signal, sys
from gguf import GGUFWriter
from blockdraft.checkpoint import load_drafter
from blockdraft.checkpoint.native import export_gguf
def dying(self, *a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
GGUFWriter.write_tensors_to_file = dying
export_gguf(load_drafter(sys.argv[1]), sys.argv[2], target_gguf=sys.argv[3], allow_mismatch=True)
"""


def test_a_killed_gguf_export_leaves_what_the_next_one_removes_and_nothing_else(tmp_path):
    import os
    import signal

    from blockdraft.checkpoint import save_drafter
    from blockdraft.locks import host

    d, target = tiny_gguf_case(tmp_path)
    src, dst = save_drafter(d, tmp_path / "src"), tmp_path / "d.gguf"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-c", KILLED_GGUF, str(src), str(dst), str(target)], env=env)
    assert p.wait() == -signal.SIGKILL
    left = tmp_path / f".d.gguf.blockdraft-tmp-{host()}-{p.pid}"
    assert left.exists() and not dst.exists()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    busy, users = tmp_path / f".d.gguf.blockdraft-tmp-{host()}-{alive.pid}", tmp_path / ".d.gguf.tmp-123"
    try:
        busy.write_bytes(b"another export at work")
        users.write_bytes(b"a user's")
        export_gguf(d, dst, target_gguf=target, allow_mismatch=True)
        assert dst.exists() and not left.exists() and busy.exists() and users.exists()
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize("kind,kw", [("dspark", dict(markov_rank=8)),
                                     ("dflash2", dict(selector_rank=8, selector_top_k=4, conv_group_size=8))])
def test_gguf_export_of_a_kind_it_cannot_write_yet_is_refused(tmp_path, kind, kw):
    """The GGUF writer knows DFlash's tensors only: a DSpark or DFlash2 file would be served as the
    backbone alone, another function, so the export is refused with one line (and doctor says so)."""
    from blockdraft.checkpoint.formats import gguf as fmt
    from blockdraft.checkpoint.native import export_gguf
    from blockdraft.config import DrafterConfig
    from blockdraft.model import DFlashDrafter
    from conftest import tiny_target

    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, kind=kind, **kw))
    assert any(x.refuse and kind in x.what for x in fmt.differences(d.config))
    with pytest.raises(ValueError, match=f"serves {kind} drafters"):
        export_gguf(d, tmp_path / "d.gguf", target_gguf=tmp_path / "unused.gguf")
    assert not (tmp_path / "d.gguf").exists()
