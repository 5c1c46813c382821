"""The drafter kinds (DSpark, DFlash2) in both directory formats: round trips, the fields each
consumer reads, files from other tools (no blockdraft key), DFlash's files unchanged, refusals.

What the consumers compute from these files is checked with their own code by the reference
suite (`reference/test_speculators.py`).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from blockdraft.checkpoint import load_drafter, save_drafter
from blockdraft.checkpoint.formats import config_from_json
from blockdraft.checkpoint.formats.zlab import SPECFORGE_DSPARK
from blockdraft.engines.exports import convert, export_drafter
from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.train import Batch, compute_loss
from conftest import V, tiny_target

from .test_formats import fake_verifier

KINDS = {
    "dspark": dict(kind="dspark", markov_rank=8),
    "dspark-no-confidence": dict(kind="dspark", markov_rank=8, confidence_head=False),
    "dspark-no-heads": dict(kind="dspark", markov_rank=0, confidence_head=False),
    "dflash2": dict(kind="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4),
}
KIND_WEIGHTS = {
    "dspark": {"markov_head.markov_w1.weight": [V, 8], "markov_head.markov_w2.weight": [V, 8],
               "confidence_head.proj.weight": [1, 40], "confidence_head.proj.bias": [1]},
    "dspark-no-confidence": {"markov_head.markov_w1.weight": [V, 8], "markov_head.markov_w2.weight": [V, 8]},
    "dspark-no-heads": {},
    "dflash2": {"layers.0.attention_conv.base_kernel": [2, 2, 32], "layers.0.attention_conv.kernel_projection.weight":
                [16, 32], "layers.0.mlp_conv.base_kernel": [2, 2, 32], "layers.0.mlp_conv.kernel_projection.weight":
                [16, 32], "candidate_selector.predecessor_codebook": [V, 8],
                "candidate_selector.successor_codebook": [V, 8],
                "candidate_selector.hidden_projection.weight": [8, 32]},
}
DFLASH_WEIGHTS = {"fc.weight", "hidden_norm.weight", "norm.weight"}


def drafter(t, case: str, **kw) -> DFlashDrafter:
    """A drafter of the kind whose every weight is moved off its start (so the kind's additions matter)."""
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, **KINDS[case], **kw))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d


def files(path):
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


def same_loss(t, a, b):
    batch = Batch(torch.randint(0, V - 1, (1, 30), generator=torch.Generator().manual_seed(1)),
                  torch.ones(1, 30, dtype=torch.long))
    la, ma = compute_loss(t, a, batch, max_anchors=6, generator=torch.Generator().manual_seed(0))
    lb, mb = compute_loss(t, b, batch, max_anchors=6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(la, lb) and ma["slot_accuracy"] == mb["slot_accuracy"]


@pytest.mark.parametrize("case", sorted(KINDS))
@pytest.mark.parametrize("to", ["native", "zlab", "speculators"])
def test_a_kind_round_trips_through_each_format(tmp_path, case, to):
    """write -> read gives the same config and the same tensors (the kind's under speculators' names),
    and the fields each consumer reads are where it reads them."""
    t = tiny_target("qwen3")
    d = drafter(t, case)
    cfg = d.config
    if to == "native":
        path = save_drafter(d, tmp_path / "x")
    else:
        path, _ = export_drafter(d, tmp_path / "x", to, verifier=fake_verifier(tmp_path / "verifier", t))
    raw, sd = files(path)
    assert set(sd) - DFLASH_WEIGHTS - {k for k in sd if k.startswith("layers.0.") and "_conv." not in k} \
        == set(KIND_WEIGHTS[case])
    assert {k: list(sd[k].shape) for k in KIND_WEIGHTS[case]} == KIND_WEIGHTS[case]
    kind = cfg.kind
    if to == "speculators":
        assert raw["speculators_model_type"] == kind and raw["speculators_config"]["algorithm"] == kind
        assert raw["architectures"] == [{"dspark": "DSparkSpeculator", "dflash2": "DFlash2DraftModel"}[kind]]
        assert raw["sample_from_anchor"] is False
        assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3  # B - 1
        top = raw
    else:
        assert raw["architectures"] == [{"dspark": "DSparkDraftModel", "dflash2": "DFlash2DraftModel"}[kind]]
        top = raw if kind == "dspark" else raw["dflash_config"]  # where llama.cpp's converter (and vLLM) read them
    if kind == "dspark":
        assert {k: top[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                    "confidence_head_with_markov", "sample_from_anchor")} == {
            "markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": cfg.confidence_head, "confidence_head_with_markov": cfg.markov_rank > 0, "sample_from_anchor": False}
        if to != "speculators":  # again inside dflash_config, where SpecForge 0.2.0 reads them
            heads = "mha" if cfg.num_key_value_heads == cfg.num_attention_heads else "gqa"
            assert {k: v for k, v in raw["dflash_config"].items() if k not in ("mask_token_id", "target_layer_ids")} \
                == {**{k: top[k] for k in SPECFORGE_DSPARK}, "attention_mode": heads}
    else:
        assert {k: top[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
            "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
        assert "conv_kernel_size" not in raw or to == "speculators"  # z-lab: only inside dflash_config
    back = load_drafter(path)
    assert back.config == cfg
    ours = {k: v for k, v in d.folded_state_dict().items() if not k.startswith("rotary_emb")}
    theirs = back.folded_state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in ours.items())
    same_loss(t, d, back)


@pytest.mark.parametrize("case", ["dspark", "dflash2"])
@pytest.mark.parametrize("to", ["zlab", "speculators"])
def test_a_kind_config_from_another_tool_reads_back(tmp_path, case, to):
    """A file written by another tool has no blockdraft key: the format's own fields give the same
    kind and fields (provenance and the window rule take the format's defaults)."""
    t = tiny_target("qwen3")
    d = drafter(t, case)
    path, _ = export_drafter(d, tmp_path / "x", to, verifier=fake_verifier(tmp_path / "verifier", t))
    raw, _ = files(path)
    foreign = {k: v for k, v in raw.items() if k != "blockdraft"}
    got = config_from_json(foreign)
    want = dataclasses.replace(d.config, target_name=None, tokenizer_hash=None,
                               sliding_window_rule="anchor" if to == "speculators" else "query")
    assert got == want
    (path / "config.json").write_text(json.dumps(foreign))
    same_loss(t, d, load_drafter(path))


def test_a_dspark_drafter_with_a_draft_vocabulary_in_both_formats(tmp_path):
    """markov_w2 scores the draft vocabulary [Vd, r] (speculators' shape), beside d2t and the head rows."""
    t = tiny_target("qwen3")
    d = drafter(t, "dspark", draft_vocab_size=40)
    d.set_draft_vocab(torch.randperm(V - 1, generator=torch.Generator().manual_seed(0))[:40])
    save_drafter(d, tmp_path / "native", head_rows=t.head_rows(d.draft_vocab))
    verifier = fake_verifier(tmp_path / "verifier", t)
    for to in ("zlab", "speculators"):
        convert(tmp_path / "native", tmp_path / to, to, verifier=verifier)
        _, sd = files(tmp_path / to)
        assert list(sd["markov_head.markov_w2.weight"].shape) == [40, 8]
        assert list(sd["markov_head.markov_w1.weight"].shape) == [V, 8]
        assert "d2t" in sd and "lm_head.weight" in sd and ("t2d" in sd) == (to == "speculators")
        back = load_drafter(tmp_path / to)
        assert back.config == d.config and torch.equal(back.draft_vocab, d.draft_vocab)
        same_loss(t, d, back)


@pytest.mark.parametrize("to", ["zlab", "speculators"])
def test_dflash_files_are_unchanged(tmp_path, to):
    """A DFlash drafter's files carry none of the kinds' fields (outside blockdraft's own key): the
    keys are exactly those written before the kinds."""
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    path, _ = export_drafter(d, tmp_path / "x", to, verifier=fake_verifier(tmp_path / "verifier", t))
    raw, sd = files(path)
    qwen3 = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "attention_bias",
             "hidden_act", "layer_types", "sliding_window", "vocab_size", "model_type", "rope_parameters"}
    if to == "zlab":
        assert list(raw) == ["architectures", *qwen3_order(raw, qwen3), "block_size", "num_target_layers",
                             "dflash_config", "blockdraft"]
        assert raw["architectures"] == ["DFlashDraftModel"]
        assert list(raw["dflash_config"]) == ["mask_token_id", "target_layer_ids"]
    else:
        assert list(raw) == ["architectures", "speculators_model_type", "aux_hidden_state_layer_ids", "block_size",
                             "mask_token_id", "draft_vocab_size", "target_hidden_size", "num_target_layers",
                             "sample_from_anchor", "sliding_window_non_causal", "transformer_layer_config",
                             "speculators_config", "blockdraft"]
        assert raw["architectures"] == ["DFlashSpeculator"] and raw["speculators_model_type"] == "dflash"
        assert raw["speculators_config"]["algorithm"] == "dflash"
        assert set(raw["transformer_layer_config"]) == qwen3
    assert set(sd) == DFLASH_WEIGHTS | {k for k in sd if k.startswith("layers.0.") and "_conv." not in k}
    assert load_drafter(path).config == d.config


def qwen3_order(raw: dict, qwen3: set) -> list:
    keys = [k for k in raw if k in qwen3]
    assert set(keys) == qwen3
    return keys


def test_dflash2_with_a_draft_vocabulary_is_refused_for_speculators(tmp_path):
    """speculators' DFlash2 requires the full target vocabulary: one line says so and nothing is written."""
    t = tiny_target("qwen3")
    d = drafter(t, "dflash2", draft_vocab_size=40)
    d.set_draft_vocab(torch.randperm(V - 1, generator=torch.Generator().manual_seed(0))[:40])
    verifier = fake_verifier(tmp_path / "verifier", t)
    with pytest.raises(ValueError, match=r"^speculators' DFlash2 requires the full target vocabulary[^\n]*--to zlab"):
        export_drafter(d, tmp_path / "x", "speculators", verifier=verifier)
    assert not (tmp_path / "x").exists()
    save_drafter(d, tmp_path / "native", head_rows=t.head_rows(d.draft_vocab))
    with pytest.raises(ValueError, match="full target vocabulary"):
        convert(tmp_path / "native", tmp_path / "y", "speculators", verifier=verifier)
    convert(tmp_path / "native", tmp_path / "z", "zlab", verifier=verifier)  # the z-lab layout takes it
    assert load_drafter(tmp_path / "z").config == d.config


def _written(tmp_path, case: str, to: str) -> dict:
    t = tiny_target("qwen3")
    path, _ = export_drafter(drafter(t, case), tmp_path / "x", to, verifier=fake_verifier(tmp_path / "verifier", t))
    raw, _ = files(path)
    return {k: v for k, v in raw.items() if k != "blockdraft"}


@pytest.mark.parametrize("to", ["zlab", "speculators"])
@pytest.mark.parametrize("change, message", [
    ({"sample_from_anchor": True}, r"sample_from_anchor is true: slot 0 \(the anchor\) predicts"),
    ({"markov_head_type": "gated"}, "markov_head_type 'gated'.*only the vanilla"),
    ({"markov_head_type": "rnn"}, "markov_head_type 'rnn'"),
    ({"confidence_head_with_markov": False}, "confidence_head_with_markov false"),
])
def test_a_dspark_file_blockdraft_cannot_compute_is_refused(tmp_path, to, change, message):
    raw = _written(tmp_path, "dspark", to)
    with pytest.raises(ValueError, match=message):
        config_from_json({**raw, **change})


@pytest.mark.parametrize("to, reader", [("zlab", "llama.cpp's converter"), ("speculators", "speculators")])
def test_a_dspark_file_without_sample_from_anchor_is_read_as_its_readers_default(tmp_path, to, reader):
    """speculators' DSpark config defaults it to true, as llama.cpp's converter does for a z-lab file."""
    raw = _written(tmp_path, "dspark", to)
    del raw["sample_from_anchor"]
    with pytest.raises(ValueError, match=rf"sample_from_anchor is true \(absent, and {reader} reads it as true\)"):
        config_from_json(raw)


@pytest.mark.parametrize("case", ["dflash2", "dflash"])
def test_a_speculators_file_whose_slot_0_predicts_is_refused(tmp_path, case):
    raw = _written(tmp_path, "dflash2", "speculators") if case == "dflash2" else \
        {**_written(tmp_path, "dspark", "speculators"), "speculators_model_type": "dflash"}
    assert config_from_json(raw).kind == case  # absent there: speculators' DFlash and DFlash2 default to false
    with pytest.raises(ValueError, match="sample_from_anchor is true"):
        config_from_json({**raw, "sample_from_anchor": True})


@pytest.mark.parametrize("case", ["dspark", "dspark-no-confidence", "dspark-no-heads"])
def test_the_specforge_copy_of_the_dspark_fields_changes_nothing_blockdraft_reads(tmp_path, case):
    """A native DSpark directory carries the head fields twice (top: vLLM, llama.cpp's converter and
    blockdraft; dflash_config: SpecForge): without the copy, or with only blockdraft's key removed, it
    reads as before; a copy that disagrees with the top is refused, naming both values."""
    t = tiny_target("qwen3")
    d = drafter(t, case)
    raw, _ = files(save_drafter(d, tmp_path / "x"))
    bare = {**raw, "dflash_config": {k: v for k, v in raw["dflash_config"].items()
                                     if k in ("mask_token_id", "target_layer_ids")}}
    assert config_from_json(raw) == config_from_json(bare) == d.config
    foreign = [{k: v for k, v in c.items() if k != "blockdraft"} for c in (raw, bare)]
    assert config_from_json(foreign[0]) == config_from_json(foreign[1])
    for key, other in (("markov_rank", raw["markov_rank"] + 4), ("markov_head_type", "gated"),
                       ("enable_confidence_head", not raw["enable_confidence_head"]),
                       ("confidence_head_with_markov", not raw["confidence_head_with_markov"])):
        changed = {**raw, "dflash_config": {**raw["dflash_config"], key: other}}
        with pytest.raises(ValueError, match=rf"{key} is .* at the top of the config but .* in dflash_config"):
            config_from_json(changed)


@pytest.mark.parametrize("to", ["zlab", "speculators"])
def test_a_file_whose_kind_disagrees_with_blockdrafts_own_fields_is_refused(tmp_path, to):
    t = tiny_target("qwen3")
    path, _ = export_drafter(drafter(t, "dspark"), tmp_path / "x", to, verifier=fake_verifier(tmp_path / "v", t))
    raw, _ = files(path)
    raw["blockdraft"]["kind"] = "dflash"
    with pytest.raises(ValueError, match="blockdraft fields say kind 'dflash'"):
        config_from_json(raw)


def test_differences_name_the_consumers_that_cannot_serve_a_kind():
    """None refuses the export (the engines that serve the kinds read these files); each names what
    the consumer does instead."""
    from blockdraft.checkpoint.formats import FORMATS
    from blockdraft.engines import format_differences

    t = tiny_target("qwen3")
    found = {(case, name): [(f.consumer, f.refuse, f.what) for f in format_differences(name, drafter(t, case).config)]
             for case in ("dspark", "dflash2") for name in FORMATS}
    assert not any(refuse for diffs in found.values() for _, refuse, _ in diffs)
    consumers = {k: [c for c, _, _ in v] for k, v in found.items()}
    assert consumers == {("dspark", "zlab"): ["dflash", "SGLang", "vLLM"], ("dflash2", "zlab"): ["SGLang", "vLLM"],
                         ("dspark", "speculators"): ["vLLM"], ("dflash2", "speculators"): ["llama.cpp", "vLLM"]}
    assert "drops markov_head.* and confidence_head.*" in found[("dspark", "zlab")][0][2]
    assert all("V1 does not support: dspark speculative decoding" in w for c, _, w in found[("dspark", "zlab")]
               if c == "vLLM")
    assert any("V1 does not support: DFlash candidate-head drafts" in w for c, _, w in found[("dflash2", "zlab")])
    d = drafter(t, "dflash2", draft_vocab_size=40)
    assert [f.consumer for f in format_differences("speculators", d.config)][0] == "speculators"
    plain = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4)).config
    assert all(format_differences(name, plain) == [] for name in FORMATS)


def _domino(t, **kw) -> DFlashDrafter:
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, kind="domino", emb_dim=8,
                                               gru_hidden_dim=6, pure_draft_prefix_len=1, **kw))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d


def test_domino_writes_specforges_fields_and_names_and_reads_back(tmp_path):
    """The z-lab layout of a Domino drafter: SpecForge's architecture, its fields inside dflash_config (what its
    DominoDraftModel reads), its tensor names and shapes; read back (with or without blockdraft's own key) as the
    same drafter, computing the same loss."""
    t = tiny_target("qwen3")
    d = _domino(t)
    verifier = fake_verifier(tmp_path / "verifier", t)
    path, _ = export_drafter(d, tmp_path / "x", "zlab", verifier=verifier)
    raw, sd = files(path)
    assert raw["architectures"] == ["DominoDraftModel"]
    assert {k: raw["dflash_config"][k] for k in ("projector_type", "emb_dim", "gru_hidden_dim",
                                                  "pure_draft_prefix_len", "shift_label")} == \
        {"projector_type": "domino", "emb_dim": 8, "gru_hidden_dim": 6, "pure_draft_prefix_len": 1,
         "shift_label": False}
    assert {k: list(v.shape) for k, v in sd.items() if k.startswith(("prefix_gru", "embed_proj"))} == {
        "prefix_gru.weight_ih_l0": [18, 32], "prefix_gru.weight_hh_l0": [18, 6], "embed_proj.0.weight": [8, 38],
        "embed_proj.2.weight": [V, 8]}
    back = load_drafter(path)
    assert back.config == d.config
    foreign = config_from_json({k: v for k, v in raw.items() if k != "blockdraft"})
    assert (foreign.kind, foreign.emb_dim, foreign.gru_hidden_dim, foreign.pure_draft_prefix_len) == ("domino", 8, 6, 1)
    same_loss(t, d, back)
    save_drafter(d, tmp_path / "native")
    convert(tmp_path / "native", tmp_path / "y", "zlab", verifier=verifier)
    assert files(tmp_path / "y")[0]["dflash_config"] == raw["dflash_config"]


def test_domino_files_and_layouts_blockdraft_cannot_serve_are_refused_in_one_line(tmp_path):
    t = tiny_target("qwen3")
    d = _domino(t)
    verifier = fake_verifier(tmp_path / "v", t)
    raw, _ = files(export_drafter(d, tmp_path / "x", "zlab", verifier=verifier)[0])
    raw = {k: v for k, v in raw.items() if k != "blockdraft"}
    with pytest.raises(ValueError, match="shift_label is true: each block position predicts the token after"):
        config_from_json({**raw, "dflash_config": {**raw["dflash_config"], "shift_label": True}})
    with pytest.raises(ValueError, match=r"^speculators 0.9.0 has no Domino drafter[^\n]*--to zlab"):
        export_drafter(d, tmp_path / "s", "speculators", verifier=verifier)
    assert not (tmp_path / "s").exists()
    with pytest.raises(ValueError, match=r"^Domino's correction scores the full vocabulary[^\n]*--draft-vocab full"):
        _domino(t, draft_vocab_size=40)  # its config, before any drafter exists (config.FULL_VOCAB_ONLY)


# docs/kinds.md's promises, kind by format: True where `train`'s directory converts (a consumer reads it),
# else the one layout the refusal must send the drafter to. LiLiCorr: "vLLM's V2 GPU runner is its only
# server, and it reads the z-lab directory"; Domino: "written only in the z-lab/SpecForge layout ...
# speculators and llama.cpp have no Domino: those exports are refused".
DOCS_KINDS = {"dflash": {}, "dspark": dict(markov_rank=8),
              "dflash2": dict(conv_group_size=8, selector_rank=8, selector_top_k=4),
              "lilicorr": dict(lilicorr_candidate_topk=4, lilicorr_num_heads=2),
              "domino": dict(emb_dim=8, gru_hidden_dim=6)}
DOCS_PROMISE = {kind: {"zlab": True, "speculators": kind not in ("lilicorr", "domino"),
                       "gguf": kind not in ("lilicorr", "domino")} for kind in DOCS_KINDS}


@pytest.mark.parametrize("to", ["zlab", "speculators", "gguf"])
@pytest.mark.parametrize("kind", sorted(DOCS_KINDS))
def test_each_kind_converts_to_each_format_as_the_docs_say(tmp_path, kind, to):
    """`convert` of `train`'s directory for every kind and format (issue 58, item 7.2/7.3): it writes where
    docs/kinds.md says a consumer reads it; elsewhere one line sends it to a layout that converts, and the
    engines it names as reading that layout are the ones the registry says serve the kind from it."""
    from blockdraft.engines import CONSUMERS

    from .test_gguf import fake_target_gguf

    t = tiny_target("qwen3")
    src = save_drafter(DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, kind=kind,
                                                              **DOCS_KINDS[kind])), tmp_path / "native")
    verifier = fake_verifier(tmp_path / "verifier", t)
    gguf = fake_target_gguf(tmp_path / "t.gguf", hidden=32, layers=t.num_layers, vocab=V) if to == "gguf" else None
    dst = tmp_path / ("d.gguf" if to == "gguf" else "d")
    if DOCS_PROMISE[kind][to]:
        convert(src, dst, to, verifier=verifier, target_gguf=gguf)
        assert dst.exists()
        return
    with pytest.raises(ValueError) as e:
        convert(src, dst, to, verifier=verifier, target_gguf=gguf, allow_mismatch=True)  # no mismatch to allow
    said = str(e.value)
    assert "\n" not in said and not dst.exists() and "--window-rule" not in said, said
    advised = said.split("export it --to ", 1)[1].split(",")[0].split()[0]
    convert(src, tmp_path / "advised", advised, verifier=verifier)  # the advice holds
    before_not = said.split("export it --to ", 1)[1].split(" not ")[0]
    for e in CONSUMERS.values():
        if e.reads(advised) and not e.serves(kind):
            assert e.name not in before_not, (e.name, said)
        elif e.reads(advised):
            assert e.name in before_not, (e.name, said)
