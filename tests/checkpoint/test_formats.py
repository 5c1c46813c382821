"""Formats: round trips, published layouts, the draft vocabulary in the engines' form, refusals.

These check blockdraft's own writer and reader; what the consumers compute from the files is
checked with their own code by the reference suite (`reference/`).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockdraft.checkpoint import load_drafter, save_drafter
from blockdraft.engines.exports import convert, export_drafter
from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.train import Batch, compute_loss
from conftest import V, tiny_target


def fake_verifier(path, target):
    """A target directory as engines read it: config.json and the head in safetensors."""
    path.mkdir()
    (path / "config.json").write_text("{}")
    save_file({"lm_head.weight": target.model.get_output_embeddings().weight.detach().clone()},
              str(path / "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("causal", [False, True])
def test_convert_round_trips_are_bit_identical(tmp_path, causal):
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=2, block_size=5, sliding_window=8,
                                               layer_types=["sliding_attention", "full_attention"],
                                               sliding_causal_in_block=causal))
    save_drafter(d, tmp_path / "native")
    zl = json.loads((tmp_path / "native" / "config.json").read_text())
    assert zl["architectures"] == ["DFlashDraftModel"]
    assert zl["dflash_config"] == {"mask_token_id": d.config.mask_token_id, "target_layer_ids": t.layer_ids}
    assert zl["num_target_layers"] == t.num_layers and zl["block_size"] == 5
    assert zl["use_sliding_window"] is True and zl["sliding_window"] == 8  # transformers keeps the window
    verifier = fake_verifier(tmp_path / "verifier", t)
    convert(tmp_path / "native", tmp_path / "spec", "speculators", verifier=verifier, allow_mismatch=True)
    sp = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert sp["aux_hidden_state_layer_ids"] == [i + 1 for i in t.layer_ids]  # the input of the next layer
    assert sp["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert sp["speculators_config"]["verifier"]["name_or_path"] == str((tmp_path / "verifier").resolve())
    assert sp["sliding_window_non_causal"] is (not causal)
    assert sp["transformer_layer_config"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert sp["transformer_layer_config"]["use_sliding_window"] is True
    convert(tmp_path / "spec", tmp_path / "back", "zlab", allow_mismatch=True)
    a, b = load_drafter(tmp_path / "native"), load_drafter(tmp_path / "back")
    assert a.config == b.config
    sa = load_file(str(tmp_path / "native" / "model.safetensors"))
    sb = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    batch = Batch(torch.randint(0, V - 1, (1, 30)), torch.ones(1, 30, dtype=torch.long))
    la, _ = compute_loss(t, a, batch, max_anchors=6, generator=torch.Generator().manual_seed(0))
    lb, _ = compute_loss(t, b, batch, max_anchors=6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(la, lb)


@pytest.mark.parametrize("to", ["zlab", "speculators"])
def test_a_draft_vocabulary_leaves_as_d2t_and_the_targets_head_rows(tmp_path, to):
    t = tiny_target("llama")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, draft_vocab_size=40))
    ids = torch.randperm(V - 1, generator=torch.Generator().manual_seed(0))[:40]
    d.set_draft_vocab(ids)
    save_drafter(d, tmp_path / "d", head_rows=t.head_rows(d.draft_vocab))
    verifier = fake_verifier(tmp_path / "verifier", t)
    convert(tmp_path / "d", tmp_path / "x", to, verifier=verifier)
    sd = load_file(str(tmp_path / "x" / "model.safetensors"))
    assert "draft_vocab" not in sd
    want = torch.sort(ids).values
    assert torch.equal(torch.arange(40) + sd["d2t"], want)  # target id = i + d2t[i]
    assert torch.equal(sd["lm_head.weight"], t.model.get_output_embeddings().weight[want])
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 40
    if to == "speculators":
        assert sd["t2d"].dtype == torch.bool and torch.equal(sd["t2d"].nonzero()[:, 0], want)
    back = load_drafter(tmp_path / "x")
    assert torch.equal(back.draft_vocab, want) and back.config == d.config


def test_a_draft_vocabulary_cannot_be_exported_without_the_head(tmp_path):
    t = tiny_target("llama")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, draft_vocab_size=40))
    with pytest.raises(ValueError, match="--verifier"):
        export_drafter(d, tmp_path / "x", "zlab")


@pytest.mark.parametrize("to", ["zlab", "speculators"])
def test_an_anchor_window_drafter_is_refused_for_the_engines(tmp_path, to):
    """vLLM (and dflash, SGLang) window each query from its own position: an anchor-rule drafter
    would be served as another function, so export stops and says why."""
    t = tiny_target("qwen3")
    verifier = fake_verifier(tmp_path / "verifier", t)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, sliding_window=8,
                                               layer_types=["sliding_attention"], sliding_window_rule="anchor"))
    with pytest.raises(ValueError, match="vLLM.*own position"):
        export_drafter(d, tmp_path / "x", to, verifier=verifier)
    _, found = export_drafter(d, tmp_path / "x", to, verifier=verifier, allow_mismatch=True)
    assert any(f.consumer == "vLLM" and f.refuse for f in found)
    q = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, sliding_window=8,
                                               layer_types=["sliding_attention"], sliding_window_rule="query"))
    _, found = export_drafter(q, tmp_path / "y", to, verifier=verifier)
    assert not any(f.refuse for f in found)
    assert [f.consumer for f in found] == (["speculators"] if to == "speculators" else [])


def test_a_destination_with_other_files_is_refused(tmp_path):
    t = tiny_target("llama")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    run = tmp_path / "run"
    save_drafter(d, run / "drafter")
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="metrics.jsonl"):
        convert(run / "drafter", run, "zlab")
    assert (run / "metrics.jsonl").exists() and (run / "drafter" / "config.json").exists()
    with pytest.raises(ValueError, match="source"):
        convert(run / "drafter", run / "drafter", "zlab")
    convert(run / "drafter", run / "zlab", "zlab")
    convert(run / "drafter", run / "zlab", "zlab")  # its own earlier output may be replaced


def test_imports_a_published_zlab_directory(tmp_path):
    """A directory shaped like the reference release: Qwen3 fields, dflash_config, no blockdraft key."""
    t = tiny_target("llama")
    H, heads, kv, hd, inter = 32, 4, 2, 8, 64
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 1,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": inter,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512, "vocab_size": V,
           "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "block_size": 4, "num_target_layers": 6,
           "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": t.layer_ids}}
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    sd = {"fc.weight": w(H, 3 * H), "hidden_norm.weight": ones(H), "norm.weight": ones(H)}
    p = "layers.0."
    sd.update({p + "self_attn.q_proj.weight": w(heads * hd, H), p + "self_attn.k_proj.weight": w(kv * hd, H),
               p + "self_attn.v_proj.weight": w(kv * hd, H), p + "self_attn.o_proj.weight": w(H, heads * hd),
               p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
               p + "mlp.gate_proj.weight": w(inter, H), p + "mlp.up_proj.weight": w(inter, H),
               p + "mlp.down_proj.weight": w(H, inter), p + "input_layernorm.weight": ones(H),
               p + "post_attention_layernorm.weight": ones(H)})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp_path / "model.safetensors"))
    d = load_drafter(tmp_path)
    assert d.config.target_layer_ids == t.layer_ids and d.config.block_size == 4
    assert d.config.sliding_window_rule == "query"  # z-lab's own readers' rule
    assert torch.equal(d.fc.weight, sd["fc.weight"].float())
    from blockdraft.generate import speculative_generate

    ids = torch.randint(0, V - 1, (1, 8))
    ref = t.model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    assert speculative_generate(t, d, ids, max_new_tokens=12).tokens == ref


def published_speculators(cfg, layer_ids, **extra):
    return {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "aux_hidden_state_layer_ids": [i + 1 for i in layer_ids], "block_size": 4,
        "mask_token_id": cfg.mask_token_id, "draft_vocab_size": cfg.vocab_size,
        "target_hidden_size": cfg.target_hidden_size, "sample_from_anchor": False,
        "transformer_layer_config": {"model_type": "qwen3", "hidden_size": cfg.hidden_size, "num_hidden_layers": 1,
                                     "num_attention_heads": cfg.num_attention_heads,
                                     "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                                     "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
                                     "rope_theta": cfg.rope_theta, "max_position_embeddings": 512,
                                     "vocab_size": cfg.vocab_size, "hidden_act": "silu", "attention_bias": False},
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "some/target", "architectures": ["Qwen3ForCausalLM"]}},
        **extra,
    }


def test_imports_a_published_speculators_directory(tmp_path):
    """vLLM's speculators layout: ids one higher, the layer config nested, no target layer count."""
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    save_drafter(d, tmp_path / "native")
    published = published_speculators(d.config, t.layer_ids, sliding_window_non_causal=True)
    (tmp_path / "pub").mkdir()
    (tmp_path / "pub" / "config.json").write_text(json.dumps(published))
    (tmp_path / "pub" / "model.safetensors").write_bytes((tmp_path / "native" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="num_target_layers"):
        load_drafter(tmp_path / "pub")
    back = load_drafter(tmp_path / "pub", num_target_layers=t.num_layers)
    assert back.config.target_layer_ids == t.layer_ids and back.config.block_size == 4
    from blockdraft.generate import speculative_generate

    ids = torch.randint(0, V - 1, (1, 8))
    ref = t.model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    assert speculative_generate(t, back, ids, max_new_tokens=10).tokens == ref


def test_a_sliding_speculators_drafter_without_its_causal_flag_is_an_error(tmp_path):
    """speculators reads a missing sliding_window_non_causal as causal, vLLM as bidirectional."""
    from blockdraft.checkpoint.formats import config_from_json

    t = tiny_target("qwen3")
    cfg = DrafterConfig.for_target(t, num_layers=1, block_size=4)
    pub = published_speculators(cfg, t.layer_ids)
    pub["transformer_layer_config"].update(layer_types=["sliding_attention"], sliding_window=8)
    with pytest.raises(ValueError, match="speculators reads that as causal and vLLM as bidirectional"):
        config_from_json(pub, t.num_layers)
    got = config_from_json({**pub, "sliding_window_non_causal": False}, t.num_layers)
    assert got.sliding_causal_in_block and got.sliding_window_rule == "anchor"  # speculators' training rule


def test_a_speculators_directory_saved_by_speculators_itself_is_read_as_speculators():
    """speculators' own save_pretrained also writes architectures ["DFlashDraftModel"] (z-lab's name):
    its `speculators_model_type` decides, so its ids are read one lower, not as clause-1 ids."""
    from blockdraft.checkpoint.formats import config_from_json, detect

    t = tiny_target("qwen3")
    cfg = DrafterConfig.for_target(t, num_layers=1, block_size=4)
    pub = {**published_speculators(cfg, t.layer_ids), "architectures": ["DFlashDraftModel"]}
    assert detect(pub) == "speculators"
    assert config_from_json(pub, t.num_layers).target_layer_ids == t.layer_ids
