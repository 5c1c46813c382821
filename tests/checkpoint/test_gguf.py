"""`convert --to gguf`: llama.cpp's DFlash GGUF, read back with the gguf package (llama.cpp's own
Python reader), against the drafter's tensors, clause 1's ids + 1, the target GGUF's tokenizer and
head, and the refusals where llama.cpp b11434 computes another function.

What llama.cpp itself computes from the file is checked by reference/test_llamacpp.py.
"""

from __future__ import annotations

import re
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
from blockdraft.engines import format_differences
from blockdraft.engines.exports import export_gguf
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
    found = format_differences("gguf", tiny_cfg(**kw))
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
    assert format_differences("gguf", cfg) == []
    assert fmt.causal_flag(cfg) is causal


def fake_target_gguf(path, *, hidden: int, layers: int, vocab: int, swap: bool = False, extra: dict | None = None):
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.embedding_length", hidden)
    w.add_uint32("llama.block_count", layers)
    for key, value in (extra or {}).items():
        w.add_float32(key, value)
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
    import blockdraft.rundir.atomic as atomic

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
from blockdraft.engines.exports import export_gguf
def dying(self, *a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
GGUFWriter.write_tensors_to_file = dying
export_gguf(load_drafter(sys.argv[1]), sys.argv[2], target_gguf=sys.argv[3], allow_mismatch=True)
"""


def test_a_killed_gguf_export_leaves_what_the_next_one_removes_and_nothing_else(tmp_path):
    import os
    import signal

    from blockdraft.checkpoint import save_drafter
    from blockdraft.rundir.locks import host

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


# ------------------------------------------------------------------ the newer kinds: DSpark, DFlash2
# Each kind tensor's GGUF name (src/llama-arch.cpp:727-736) and ggml shape {ne0, ne1, ...} as
# src/models/dflash.cpp load_arch_tensors creates it (lines 124-160 and 250-258), from the drafter's
# sizes: H hidden, V target vocabulary, Vd draft vocabulary (d2t's length), r rank, k taps, g group.
def kind_tensors(cfg: DrafterConfig) -> dict:
    """GGUF name -> (native name, ggml ne) of the tensors a kind adds."""
    H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    if cfg.kind == "dspark":
        r, Vd = cfg.markov_rank, cfg.draft_vocab_size or cfg.vocab_size
        out = {"markov_w1.weight": ("markov_head.markov_w1.weight", [r, V]),
               "markov_w2.weight": ("markov_head.markov_w2.weight", [r, Vd])}
        if cfg.confidence_head:
            out |= {"conf_proj.weight": ("confidence_head.proj.weight", [H + r, 1]),
                    "conf_proj.bias": ("confidence_head.proj.bias", [1])}
        return out
    r, k, proj = cfg.selector_rank, cfg.conv_kernel_size, 2 * cfg.conv_kernel_size * (H // cfg.conv_group_size)
    out = {"selector_predecessor.weight": ("candidate_selector.predecessor_codebook", [r, V]),
           "selector_successor.weight": ("candidate_selector.successor_codebook", [r, V]),
           "selector_hidden.weight": ("candidate_selector.hidden_projection.weight", [H, r])}
    for i in range(L):
        out |= {f"blk.{i}.attn_conv_base": (f"layers.{i}.attention_conv.base_kernel", [H, k, 2]),
                f"blk.{i}.attn_conv_proj.weight": (f"layers.{i}.attention_conv.kernel_projection.weight", [H, proj]),
                f"blk.{i}.ffn_conv_base": (f"layers.{i}.mlp_conv.base_kernel", [H, k, 2]),
                f"blk.{i}.ffn_conv_proj.weight": (f"layers.{i}.mlp_conv.kernel_projection.weight", [H, proj])}
    return out


KIND_CASES = {
    "dspark": dict(kind="dspark", markov_rank=6, draft_vocab_size=24),
    "dspark-no-confidence": dict(kind="dspark", markov_rank=6, confidence_head=False),
    "dflash2": dict(kind="dflash2", selector_rank=5, selector_top_k=4, conv_group_size=8, conv_kernel_size=3),
}
DSPARK_KEYS = ("dflash.sample_from_anchor", "dflash.has_confidence_head")
DFLASH2_KEYS = ("dflash.conv_kernel_size", "dflash.conv_group_size", "dflash.selector_rank", "dflash.selector_top_k")


def kind_drafter(case: str, dtype=torch.float32) -> DFlashDrafter:
    """A tiny drafter of the kind, every weight random (so a transposed or swapped tensor shows)."""
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(tiny_target("qwen3"), num_layers=2, block_size=4,
                                               **KIND_CASES[case]))
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p))
    if d.config.draft_vocab_size:
        d.set_draft_vocab(torch.randperm(d.config.vocab_size - 1, generator=torch.Generator().manual_seed(1))
                          [: d.config.draft_vocab_size].sort().values)
    return d.to(dtype)


def written(d: DFlashDrafter, tmp_path):
    c = d.config
    target = fake_target_gguf(tmp_path / "t.gguf", hidden=c.target_hidden_size, layers=c.target_num_layers,
                              vocab=c.vocab_size)
    path, found = export_gguf(d, tmp_path / "d.gguf", target_gguf=target)
    assert found == []
    r, kv = values(path)
    return {t.name: t for t in r.tensors}, kv


DFLASH_NAMES = {"fc.weight", "enc.output_norm.weight", "output_norm.weight"} | {
    f"blk.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                       "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate",
                                                       "ffn_up", "ffn_down")}


@pytest.mark.parametrize("case", list(KIND_CASES))
def test_gguf_of_each_kind_holds_llamacpps_tensors_shapes_values_and_keys(case, tmp_path):
    d = kind_drafter(case)
    cfg = d.config
    tensors, kv = written(d, tmp_path)
    added = kind_tensors(cfg)
    vocab = {"output.weight", "d2t"} if cfg.draft_vocab_size else set()
    assert set(tensors) == DFLASH_NAMES | set(added) | vocab  # nothing missing, nothing extra
    native = d.folded_state_dict()
    for name, (src, ne) in added.items():
        t, want = tensors[name], native[src]
        assert [int(x) for x in t.shape] == ne == list(reversed(want.shape)), name
        assert t.tensor_type.name == "F32", name
        assert torch.equal(as_torch(t).reshape(want.shape), want), name  # bit for bit
    if cfg.kind == "dspark":
        assert kv["dflash.sample_from_anchor"] is False  # slot k predicts anchor + k; absent reads as true
        assert kv["dflash.has_confidence_head"] is bool(cfg.confidence_head)
        assert not any(k in kv for k in DFLASH2_KEYS)
    else:
        assert [kv[k] for k in DFLASH2_KEYS] == [3, 8, 5, 4]
        assert not any(k in kv for k in DSPARK_KEYS)
    if cfg.draft_vocab_size:  # markov_w2's rows are the draft vocabulary's, in d2t's order
        assert torch.equal(as_torch(tensors["d2t"]), d.draft_vocab.long())
        assert int(tensors["markov_w2.weight"].shape[1]) == int(tensors["d2t"].shape[0]) == cfg.draft_vocab_size


def test_gguf_of_a_bf16_kind_keeps_the_convolution_bases_in_fp32(tmp_path):
    """llama.cpp adds the base kernel to fp32 dynamic taps (dflash.cpp build_dflash2_conv); ggml's CPU
    add has no f32 + bf16 (ggml-cpu/binary-ops.cpp), and llama.cpp's own converter writes a tensor
    without `.weight` in fp32 (conversion/base.py:1119-1121). The matrices stay bf16."""
    d = kind_drafter("dflash2", torch.bfloat16)
    tensors, _ = written(d, tmp_path)
    native = d.folded_state_dict()
    for name, (src, _) in kind_tensors(d.config).items():
        want = "F32" if name.endswith("_conv_base") else "BF16"
        assert tensors[name].tensor_type.name == want, name
        assert torch.equal(as_torch(tensors[name]).reshape(native[src].shape).to(torch.bfloat16), native[src]), name


def test_gguf_of_a_dflash_drafter_has_no_kind_keys_or_tensors(tmp_path):
    d, target = tiny_gguf_case(tmp_path)
    path, _ = export_gguf(d, tmp_path / "d.gguf", target_gguf=target)
    r, kv = values(path)
    assert not any(k in kv for k in DSPARK_KEYS + DFLASH2_KEYS)
    assert all(not t.name.startswith(("markov", "conf_proj", "selector")) and "_conv_" not in t.name for t in r.tensors)


@pytest.mark.parametrize("change, says", [
    (dict(selector_top_k=6), "hidden size 32 < K(K+1) = 42"),  # K candidates + K x K scores in one row
    (dict(conv_group_size=12), "divisible by conv_group_size"),
])
def test_gguf_refuses_a_dflash2_drafter_llamacpp_will_not_load(change, says, tmp_path):
    """dflash.cpp load_arch_tensors throws on these (lines 145-150): one line, nothing written."""
    import dataclasses

    cfg = kind_drafter("dflash2").config
    if "selector_top_k" in change:
        d = DFlashDrafter(dataclasses.replace(cfg, **change))
        found = format_differences("gguf", d.config)
        c = d.config
        target = fake_target_gguf(tmp_path / "t.gguf", hidden=c.target_hidden_size, layers=c.target_num_layers,
                                  vocab=c.vocab_size)
        with pytest.raises(ValueError, match=re.escape(says)) as e:
            export_gguf(d, tmp_path / "d.gguf", target_gguf=target)
        assert "\n" not in str(e.value) and not (tmp_path / "d.gguf").exists()
    else:  # the config itself refuses it; a config changed after its checks still meets the writer's
        for k, v in change.items():
            setattr(cfg, k, v)
        found = format_differences("gguf", cfg)
    assert found and all(d.refuse for d in found) and any(says in d.what for d in found), found


@pytest.mark.parametrize("key", ["llama.final_logit_softcapping", "llama.logit_scale"])
def test_gguf_refuses_a_kind_whose_target_transforms_its_logits(key, tmp_path):
    """llama.cpp adds DSpark's bias to (and scores DFlash2's candidates on) the head's raw output;
    blockdraft on the target's transformed logits. A DFlash drafter's argmax is the same: written."""
    for case in ("dspark", "dflash2", None):
        d = kind_drafter(case) if case else tiny_gguf_case(tmp_path)[0]
        c = d.config
        target = fake_target_gguf(tmp_path / "t.gguf", hidden=c.target_hidden_size, layers=c.target_num_layers,
                                  vocab=c.vocab_size, extra={key: 30.0})
        if case is None:
            assert export_gguf(d, tmp_path / "d.gguf", target_gguf=target)[0].exists()
            continue
        with pytest.raises(ValueError, match=re.escape(f"({key} = 30)") + ".*raw head output") as e:
            export_gguf(d, tmp_path / "e.gguf", target_gguf=target)
        assert "\n" not in str(e.value) and not (tmp_path / "e.gguf").exists()


def test_dflash2_and_dspark_sizes_llamacpp_loads_are_written():
    cfg = kind_drafter("dflash2").config
    assert format_differences("gguf", cfg) == []  # K = 4: 4 x 5 = 20 <= 32, 32 % 8 == 0
    assert format_differences("gguf", kind_drafter("dspark").config) == []


# ------------------------------------------------- what the llama.cpp wrapper reads and compares
DSPARK_LOG = """\
0.05.375.630 I slot   operator(): id  0 | task 0 | new prompt, n_ctx_slot = 4096, n_keep = 0, task.n_tokens = 6
0.07.945.154 D  - seq_id 0, draft candidate   0, pos   1:   1603 (   0.164) ' non'
0.07.945.155 D  - seq_id 0, draft candidate   1, pos   1:     12 (   0.100) ' x'
0.07.949.278 D  - seq_id 0, draft candidate   0, pos   2:    338 (   0.345) ' that'
0.11.822.417 D  - seq_id 0, draft candidate   0, pos   1:    282 (   0.258) ' of'
0.11.822.436 D  - seq_id 0, draft candidate   0, pos   2:    338 (   0.271) ' that'
0.11.822.438 D  - seq_id 0, draft candidate   0, pos   3:    617 (   0.264) ' who'
"""
BATCH_LOG = """\
0.01.652.094 I slot   operator(): id  0 | task 0 | new prompt, n_ctx_slot = 4096, n_keep = 0, task.n_tokens = 2
0.01.652.182 D init: input batch info:
0.01.652.221 D ubatch_print:   token     = [
0.01.652.223 D ubatch_print:     0: id =      1 (    <|im_start|>), pos =    0, n_seq_id =  1, seq_id = [0], output = 0
0.01.652.225 D ubatch_print:     1: id =    504 (             The), pos =    1, n_seq_id =  1, seq_id = [0], output = 1
0.01.652.230 D ubatch_print:   ]
0.01.781.595 D init: input batch info:
0.01.781.612 D ubatch_print:     0: id =    253 (               a), pos =    2, n_seq_id =  1, seq_id = [0], output = 0
0.01.781.613 D ubatch_print:     1: id =     16 (  <empty_output>), pos =    3, n_seq_id =  1, seq_id = [0], output = 0
0.01.781.613 D ubatch_print:     2: id =     16 (  <empty_output>), pos =    4, n_seq_id =  1, seq_id = [0], output = 0
0.01.781.630 D ubatch_print:   ]
0.01.798.350 D init: input batch info:
0.01.798.372 D ubatch_print:     0: id =    253 (               a), pos =    2, n_seq_id =  1, seq_id = [0], output = 1
0.01.798.373 D ubatch_print:     1: id =    198 (               
), pos =    3, n_seq_id =  1, seq_id = [0], output = 1
0.01.798.374 D ubatch_print:     2: id =    428 (               R), pos =    4, n_seq_id =  1, seq_id = [0], output = 1
0.01.798.380 D ubatch_print:   ]
0.01.798.393 D ubatch_add: added ubatch to split:
0.01.798.396 D ubatch_print:     0: id =    253 (               a), pos =    2, n_seq_id =  1, seq_id = [0], output = 1
0.01.798.397 D ubatch_print:     1: id =    198 (               
), pos =    3, n_seq_id =  1, seq_id = [0], output = 1
"""


def test_llamacpp_drafts_are_read_per_call_from_the_log_for_each_kind():
    """DSpark logs its drafting slots from 1 (DFlash from 0): a call starts where the position falls.
    DFlash2 logs no candidates: its drafts are the target's verify batches (every token an output),
    not the drafter's noise block ([anchor, mask...]) nor the prompt (one output); a token's text may
    hold a newline."""
    from blockdraft.engines.llamacpp import server as llamacpp

    assert llamacpp.drafts_from_log(DSPARK_LOG) == [[[1603, 338], [282, 338, 617]]]
    assert llamacpp.drafts_from_batches(BATCH_LOG, mask_token_id=16) == [[(2, [198, 428])]]
    from blockdraft.engines.llamacpp.consumer import SPEC_TYPES

    assert SPEC_TYPES == {"dflash": "draft-dflash", "dspark": "draft-dspark", "dflash2": "draft-dflash"}


@pytest.mark.parametrize("case", ["dspark", "dflash2"])
def test_llamacpp_replay_walks_the_kind_from_the_anchor_token(case):
    """The slot agreement compares llama.cpp's drafts with the kind's own walk (DSpark's Markov chain,
    DFlash2's selector) from the anchor token, not with each slot's argmax."""
    from blockdraft.engines.llamacpp import server as llamacpp

    torch.manual_seed(0)
    kw = {k: v for k, v in KIND_CASES[case].items() if k != "draft_vocab_size"}
    t = tiny_target("qwen3", num_features=2)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, **kw)).eval()
    with torch.no_grad():
        for n, p in d.named_parameters():
            if n.startswith(("markov", "confidence", "candidate")) or "_conv" in n:
                p.add_(torch.randn_like(p) * 3)  # the walk moves off the argmax
    prompt, output = list(range(3, 11)), list(range(20, 40))
    seq = prompt + output
    feats = t(torch.tensor([seq]), position_ids=torch.arange(len(seq))[None]).features[0]
    walks, argmaxes, anchors = [], [], list(range(len(prompt), len(seq) - 3, 3))
    with torch.no_grad():
        for a in anchors:
            block = torch.full((4,), d.mask_token_id)
            block[0] = seq[a]
            h = d.draft_hidden(feats[:a], torch.arange(a), t.embed(block), a, d.new_context_cache())[1:]
            walks.append(d.kind.draft(d, lambda x: t.head(x), h, seq[a], None, None, None).tokens.tolist())
            argmaxes.append(t.head(h).argmax(-1).tolist())
    assert walks != argmaxes
    same = llamacpp.replay(t, d, prompt, output, walks, anchors)
    assert same["agree"] == same["slots"] == 3 * len(anchors) and same["unmatched"] == 0
    other = llamacpp.replay(t, d, prompt, output, argmaxes, anchors)
    assert other["agree"] < other["slots"]


def test_gguf_refuses_a_domino_drafter_in_one_line(tmp_path):
    """llama.cpp b11434 has no Domino: nothing is written, and one line names the layout that serves it."""
    d = DFlashDrafter(tiny_cfg(kind="domino", emb_dim=8, gru_hidden_dim=6))
    c = d.config
    target = fake_target_gguf(tmp_path / "t.gguf", hidden=c.target_hidden_size, layers=c.target_num_layers,
                              vocab=c.vocab_size)
    with pytest.raises(ValueError, match=r"^llama.cpp b11434 has no Domino drafter[^\n]*--to zlab") as e:
        export_gguf(d, tmp_path / "d.gguf", target_gguf=target)
    assert "\n" not in str(e.value) and not (tmp_path / "d.gguf").exists()
