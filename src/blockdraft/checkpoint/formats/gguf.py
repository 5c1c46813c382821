"""llama.cpp's DFlash drafter: one GGUF file of architecture `dflash` (read by `src/models/dflash.cpp`
and `common/speculative.cpp` of llama.cpp `releases.LLAMACPP_RELEASE`;
docs/consumers.md, "llama.cpp", has what they compute).

What the file says, and why:

- `dflash.target_layers`: llama.cpp hands the drafter each listed target layer's *input*, which is
  transformers' `hidden_states[id]`; clause 1's layer L is `hidden_states[L + 1]`, so the ids are
  written through `hidden_states_index`, clause 1's one owner of that shift.
- `dflash.block_size`, `tokenizer.ggml.mask_token_id` (clause 4), and the target's own tokenizer,
  copied from the target GGUF that llama-server loads beside it (the engine checks the two agree).
- `dflash.attention.causal`: one flag for every layer. Sliding layers causal in the block, full
  layers bidirectional: a drafter that mixes them cannot be written. Its window
  (`attention.sliding_window` + a per-layer pattern) masks a key when query - key >= W, which is
  the `query` rule; it never masks keys after the query, so a bidirectional window narrower than
  the block cannot be written either.
- Tensors: llama.cpp's names for the native ones. The target's embedding and head are not stored
  (llama.cpp takes the target's); a draft vocabulary is `d2t` (int64 *target ids*, which llama.cpp
  scatters the draft logits onto) with the head's draft rows as `output.weight`, read from the
  target GGUF itself. Norm gains are stored in fp32, matrices in the drafter's dtype.

The newer kinds are the same architecture with more tensors (docs/consumers.md; names from
`src/llama-arch.cpp:727-736`, shapes from `src/models/dflash.cpp` `load_arch_tensors`):

- DSpark (`markov_w1.weight` marks it, dflash.cpp:124-137): `markov_w1.weight` [V, r] (ggml
  {r, V}), `markov_w2.weight` [Vd, r] (its rows in `d2t`'s order: llama.cpp scatters the bias
  through `d2t` like the logits, dflash.cpp:352-360), `conf_proj.{weight,bias}` over [hidden; r].
  `dflash.sample_from_anchor` is written always, false: blockdraft's slot 0 is the anchor and slot
  k predicts anchor + k; llama.cpp reads a missing key as true (dflash.cpp:317-319,
  common/speculative.cpp:1046) and would read every draft one slot early. `dflash.has_confidence_head`
  says whether `conf_proj` is there (common/speculative.cpp:1058-1066). llama-server must run it
  with `--spec-type draft-dspark` (engines/llamacpp.py).
- DFlash2 (`selector_hidden.weight` marks it, dflash.cpp:139-160): per layer `blk.N.attn_conv_base`
  and `blk.N.ffn_conv_base` (no `.weight`; [2, k, hidden], ggml {hidden, k, 2}; fp32, as llama.cpp's
  own converter stores a tensor without `.weight`, and ggml's CPU add has no f32 + bf16) and
  `blk.N.{attn,ffn}_conv_proj.weight`; `selector_{predecessor,successor,hidden}.weight`; keys
  `dflash.conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ...config import SLIDING, DrafterConfig, kind_refusal

ARCH = "dflash"
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")  # what dflash.cpp's FFN accepts
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
        # DSpark
        "markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight",
        "confidence_head.proj.weight": "conf_proj.weight", "confidence_head.proj.bias": "conf_proj.bias",
        # DFlash2
        "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
        "candidate_selector.successor_codebook": "selector_successor.weight",
        "candidate_selector.hidden_projection.weight": "selector_hidden.weight"}
_KIND_LAYER = {"attention_conv.base_kernel": "attn_conv_base", "mlp_conv.base_kernel": "ffn_conv_base",
               "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
               "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight"}  # DFlash2


def tensor_name(native: str) -> str:
    """A native tensor's name in llama.cpp's DFlash GGUF (ValueError for one it has no place for)."""
    if native in _TOP:
        return _TOP[native]
    parts = native.split(".")
    if parts[0] == "layers" and len(parts) >= 4 and parts[1].isdecimal():
        module = ".".join(parts[2:-1])
        if parts[-1] == "weight" and module in _LAYER:
            return f"blk.{int(parts[1])}.{_LAYER[module]}.weight"
        rest = ".".join(parts[2:])
        if rest in _KIND_LAYER:
            return f"blk.{int(parts[1])}.{_KIND_LAYER[rest]}"
    raise ValueError(f"llama.cpp's DFlash GGUF has no tensor for {native}")


def causal_flag(cfg: DrafterConfig) -> bool:
    """llama.cpp's one `dflash.attention.causal` for this drafter (only meaningful when
    `engines.llamacpp.consumer.quirks` refuses nothing): causal exactly when every layer is a causal sliding one."""
    return cfg.has_sliding and cfg.sliding_causal_in_block and all(t == SLIDING for t in cfg.layer_types)


# ------------------------------------------------------------------------ the target's GGUF
def _fields(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e})") from None


def _target_arch(reader) -> str:
    f = reader.fields.get("general.architecture")
    if f is None:
        raise ValueError("the target GGUF has no general.architecture")
    return str(f.contents())


def _target_value(reader, key: str):
    f = reader.fields.get(f"{_target_arch(reader)}.{key}")
    return None if f is None else f.contents()


def check_target(reader, cfg: DrafterConfig, path: Path) -> None:
    """The target GGUF must be the target the drafter was trained for: its width, depth and vocabulary."""
    arch = _target_arch(reader)
    if arch == ARCH:
        raise ValueError(f"{path} is a DFlash drafter, not a target model")
    checks = (("embedding_length", cfg.target_hidden_size, "hidden size"),
              ("block_count", cfg.target_num_layers, "decoder layers"))
    for key, want, what in checks:
        got = _target_value(reader, key)
        if got is not None and int(got) != int(want):
            raise ValueError(f"{path} is not this drafter's target: {got} {what}, the drafter was trained on {want}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path} has no tokenizer (tokenizer.ggml.tokens); llama.cpp needs the target's own")
    if len(tokens.data) != cfg.vocab_size:
        raise ValueError(f"{path} has {len(tokens.data)} tokens, the drafter's vocabulary has {cfg.vocab_size}")
    check_logit_transform(reader, cfg, path)
    if cfg.tokenizer_hash:  # same shape, another tokenizer: the drafts would be other tokens' ids
        from ...target.files import tokens_hash

        got = tokens_hash(tokens.contents())
        if got != cfg.tokenizer_hash:
            raise ValueError(f"{path} holds another tokenizer than the drafter was trained with (hash {got}, the "
                             f"drafter's {cfg.tokenizer_hash}): pass the target's own GGUF as --target-gguf")


def check_logit_transform(reader, cfg: DrafterConfig, path: Path) -> None:
    """DSpark and DFlash2 add to the head's logits, so a target whose forward scales or soft-caps
    them (blockdraft's drafts read the transformed logits, `TargetModel.head`) would be drafted from
    other scores: llama.cpp adds DSpark's Markov bias to the raw head output (src/models/dflash.cpp:
    364, lines 814-851), and scores DFlash2's candidates after only the drafter file's own
    `logit_scale` / soft-cap (lines 816-827, which read them as DFlash2 multipliers, not as the
    target's own architecture does). Refused (DFlash's argmax does not change under them)."""
    if cfg.kind not in ("dspark", "dflash2"):
        return
    for key, neutral in (("final_logit_softcapping", 0.0), ("logit_scale", 1.0)):
        got = _target_value(reader, key)
        if got is not None and float(got) not in (0.0, neutral):
            raise ValueError(f"{path} transforms its logits ({_target_arch(reader)}.{key} = {float(got):g}): llama.cpp "
                             f"scores a {cfg.kind} drafter's additions against the raw head output, blockdraft "
                             f"against the transformed logits; the drafts would differ")


def head_rows(reader, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the target's output head as llama-server holds it (`output.weight`, else the tied
    `token_embd.weight`), dequantized to fp32. Only those rows are read and dequantized (a 150k x
    8k head would be 5 GB in fp32)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    by_name = {t.name: t for t in reader.tensors}
    t = by_name.get("output.weight") or by_name.get("token_embd.weight")
    if t is None:
        raise ValueError("the target GGUF has neither output.weight nor token_embd.weight")
    picked = np.asarray(t.data)[ids.numpy()]  # one row per vocabulary id, in bytes for quantized types
    rows = dequantize(picked, GGMLQuantizationType(int(t.tensor_type)))
    rows = np.asarray(rows, dtype=np.float32).reshape(-1, int(t.shape[0]))  # ggml ne[0] is the row length
    return torch.from_numpy(rows)


# ------------------------------------------------------------------------------ the writer
def _array(t: torch.Tensor, *, norm: bool):
    """(numpy array, raw dtype or None) as GGUFWriter.add_tensor takes them."""
    from gguf import GGMLQuantizationType

    t = t.detach().cpu().contiguous()
    if norm or t.dtype == torch.float32:
        return t.float().numpy(), None
    if t.dtype == torch.float16:
        return t.numpy(), None
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), GGMLQuantizationType.BF16
    raise ValueError(f"cannot store a {t.dtype} tensor in the GGUF")


OWNER_KEY = "blockdraft.owner"  # the ownership record (ownership.record) of the command that wrote the file


def written_by(path: Path, command: str) -> bool:
    """Whether `path` is a GGUF file whose ownership record names `command`."""
    import json

    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields.get(OWNER_KEY)
        return field is not None and json.loads(field.contents()).get("command") == command
    except (OSError, ValueError, KeyError, IndexError):
        return False


def check_destination(dst: Path, overwrite: bool) -> None:
    """The GGUF export writes a new file: an existing one is replaced only with `overwrite`, and only
    when `blockdraft convert` wrote it; a link is never followed."""
    if dst.is_symlink() or (dst.exists() and not dst.is_file()):
        raise ValueError(f"{dst} is a link or not a file; the GGUF export writes a new .gguf file")
    if not dst.exists():
        return
    if not overwrite:
        raise ValueError(f"{dst} exists; the GGUF export writes a new file (pass --overwrite to replace one that "
                         "blockdraft convert wrote)")
    if not written_by(dst, "convert"):
        raise ValueError(f"{dst} was not written by blockdraft convert and is never replaced; choose a new file")


def _entries(cfg: DrafterConfig, reader, name: str, owner: str) -> list:
    """The metadata the file holds, in order (gguf_file.Entry): the drafter's, then the target's tokenizer."""
    from gguf import GGUFValueType as T

    from ...target import hidden_states_index
    from .gguf_file import Entry

    a = ARCH
    out = [Entry("general.architecture", ARCH, T.STRING), Entry("general.name", name, T.STRING),
           Entry(OWNER_KEY, owner, T.STRING)]
    out += [Entry(f"{a}.{key}", value, T.UINT32) for key, value in (
        ("context_length", cfg.max_position_embeddings), ("embedding_length", cfg.hidden_size),
        ("block_count", cfg.num_hidden_layers), ("feed_forward_length", cfg.intermediate_size),
        ("attention.head_count", cfg.num_attention_heads), ("attention.head_count_kv", cfg.num_key_value_heads),
        ("attention.key_length", cfg.head_dim), ("attention.value_length", cfg.head_dim),
        ("rope.dimension_count", cfg.head_dim), ("vocab_size", cfg.vocab_size), ("block_size", cfg.block_size))]
    out += [Entry(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps, T.FLOAT32),
            Entry(f"{a}.rope.freq_base", cfg.rope_theta, T.FLOAT32)]
    if cfg.hidden_act != "silu":
        out.append(Entry(f"{a}.hidden_activation", cfg.hidden_act, T.STRING))
    out += [Entry(f"{a}.target_layers", [hidden_states_index(L) for L in cfg.target_layer_ids], T.ARRAY, T.INT32),
            Entry(f"{a}.attention.causal", causal_flag(cfg), T.BOOL)]
    if cfg.has_sliding:
        out += [Entry(f"{a}.attention.sliding_window", cfg.sliding_window, T.UINT32),
                Entry(f"{a}.attention.sliding_window_pattern", [t == SLIDING for t in cfg.layer_types], T.ARRAY,
                      T.BOOL)]
    out += _kind_entries(cfg)
    for key, field in reader.fields.items():  # the target's tokenizer, as the engine loads it
        if key.startswith("tokenizer.") and key != "tokenizer.ggml.mask_token_id":
            vtype = field.types[0]
            out.append(Entry(key, field.contents(), vtype, field.types[-1] if vtype == T.ARRAY else None))
    return out + [Entry("tokenizer.ggml.mask_token_id", cfg.mask_token_id, T.UINT32)]


def _kind_entries(cfg: DrafterConfig) -> list:
    """The keys a DSpark or DFlash2 drafter adds (none for DFlash: its files stay as they were)."""
    from gguf import GGUFValueType as T

    from .gguf_file import Entry

    a = ARCH
    if cfg.kind == "dspark":  # blockdraft's convention (slot k predicts anchor + k): never the reader's default
        return [Entry(f"{a}.sample_from_anchor", bool(cfg.sample_from_anchor), T.BOOL),
                Entry(f"{a}.has_confidence_head", bool(cfg.confidence_head), T.BOOL)]
    if cfg.kind == "dflash2":
        return [Entry(f"{a}.{key}", getattr(cfg, key), T.UINT32)
                for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")]
    return []


def _tensors(sd: dict, cfg: DrafterConfig, reader) -> list[tuple]:
    """(name, array, raw GGML type) of every tensor the file holds, in order; a draft vocabulary's head
    rows are read from the target GGUF. Vectors and tensors whose name has no `.weight` (DFlash2's
    convolution bases) in fp32, as llama.cpp's converter writes them (conversion/base.py:1084-1121)."""
    out = []
    for k, v in sd.items():
        if k != "draft_vocab":
            name = tensor_name(k)
            out.append((name, *_array(v, norm=v.dim() == 1 or not name.endswith(".weight"))))
    if cfg.draft_vocab_size:
        ids = sd["draft_vocab"].to(torch.long)
        out.append(("output.weight", *_array(head_rows(reader, ids).to(sd["fc.weight"].dtype), norm=False)))
        out.append(("d2t", ids.numpy().astype(np.int64), None))
    return out


def check_kind(cfg: DrafterConfig) -> None:
    """A kind llama.cpp has no drafter for is refused in one line (`config.kind_refusal`), before
    anything else is weighed."""
    refused = kind_refusal(cfg.kind, "gguf")
    if refused:
        raise ValueError(refused)


def write(sd: dict, cfg: DrafterConfig, dst: str | os.PathLike, target_gguf: str | os.PathLike,
          name: str = "blockdraft DFlash drafter", overwrite: bool = False) -> Path:
    """Write the drafter's native tensors `sd` (fc scale folded in) as llama.cpp's DFlash GGUF at
    `dst`, atomically (a crash leaves no half file; a killed writer's temporary is removed by the
    next one). The tokenizer and a draft vocabulary's head rows come from `target_gguf`."""
    import json

    from ...rundir.atomic import check_free_space
    from ...finite import require_finite

    from ...rundir.ownership import record, remove_leftovers, temp_path
    from .gguf_file import check_values, file_bytes, write_file

    check_kind(cfg)
    src = Path(target_gguf)
    if not src.is_file():
        raise ValueError(f"--target-gguf {src}: no such file")
    reader = _fields(src)
    check_target(reader, cfg, src)
    dst = Path(dst)
    if dst.is_dir():
        raise ValueError(f"{dst} is a directory; the GGUF export is one file (e.g. {dst / 'draft.gguf'})")
    if dst.suffix != ".gguf":
        raise ValueError(f"{dst}: name the GGUF file with a .gguf suffix")
    check_destination(dst, overwrite)
    require_finite(sd, f"the drafter to write as {dst}", "nothing was written; retrain it")
    entries = _entries(cfg, reader, name, json.dumps(record("convert")))
    tensors = _tensors(sd, cfg, reader)
    check_values(entries)  # a value out of its GGUF type's range: one line now, not a struct.error mid-file
    check_free_space(dst.parent, file_bytes(entries, tensors), "the GGUF file")  # the bytes written, exactly
    dst.parent.mkdir(parents=True, exist_ok=True)

    remove_leftovers(dst)
    w_tmp = temp_path(dst)
    try:
        write_file(w_tmp, ARCH, entries, tensors)
        os.replace(w_tmp, dst)
    finally:
        if w_tmp.exists():
            w_tmp.unlink()
    return dst
