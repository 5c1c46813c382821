"""Trainer: exact resume, atomic checkpoints, drafter directories, draft vocabulary."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockdraft.checkpoint import load_drafter, save_drafter
from blockdraft.checkpoint.native import atomic_dir, recover_dir
from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.train import Batch, compute_loss, dflash_loss
from blockdraft.train.trainer import TrainConfig, Trainer, lr_at
from conftest import V, tiny_target


def tiny_rows(n=12, L=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (n, L), generator=g)
    doc = (torch.arange(L) >= L // 2).long().expand(n, L).clone()
    pos = torch.where(doc == 0, torch.arange(L), torch.arange(L) - L // 2)
    lm = torch.ones(n, L, dtype=torch.long)
    lm[:, :4] = 0
    return {"input_ids": ids, "loss_mask": lm, "position_ids": pos, "document_ids": doc}


def make(tmp_path, steps=6, **kw):
    t = tiny_target("llama", seed=1)
    with torch.no_grad():
        t.model.get_output_embeddings().weight.mul_(20)
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, draft_vocab_size=kw.pop("vocab", None)))
    cfg = TrainConfig(out=str(tmp_path), steps=steps, batch_tokens=80, max_anchors=8, eval_every=3, save_every=2,
                      lr=3e-3, warmup=2, progress=False, **kw)
    return Trainer(t, d, tiny_rows(), tiny_rows(4, seed=1), cfg)


def records(path):
    return [json.loads(ln) for ln in (path / "metrics.jsonl").read_text().splitlines()]


def test_resume_continues_exactly(tmp_path):
    full = make(tmp_path / "full", steps=6)
    full.train()
    ref = [r["loss"] for r in records(tmp_path / "full")]
    part = make(tmp_path / "part", steps=6)
    real_step = part.step

    def killed_at_step_6():
        if part.progress["step"] == 5:  # step 5 is logged but not checkpointed (save_every=2)
            raise KeyboardInterrupt
        return real_step()

    part.step = killed_at_step_6
    with pytest.raises(KeyboardInterrupt):
        part.train()
    assert len(records(tmp_path / "part")) == 5
    again = make(tmp_path / "part", steps=6)
    again.train(resume=True)
    got = [r["loss"] for r in records(tmp_path / "part")]
    assert len(got) == 6
    assert got == pytest.approx(ref, rel=1e-6, abs=1e-7)
    assert torch.equal(again.drafter.fc.weight, full.drafter.fc.weight)


def test_resume_refuses_other_settings(tmp_path):
    a = make(tmp_path, steps=2)
    a.train()
    t = a.target
    other = DFlashDrafter(DrafterConfig.for_target(t, num_layers=2, block_size=4))
    b = Trainer(t, other, tiny_rows(), None, TrainConfig(out=str(tmp_path), steps=4, progress=False))
    with pytest.raises(ValueError, match="other drafter settings"):
        b.train(resume=True)
    with pytest.raises(ValueError, match="no checkpoint"):
        Trainer(t, other, tiny_rows(), None, TrainConfig(out=str(tmp_path / "none"), progress=False)).resume()


def test_atomic_dir_survives_a_crash_at_any_point(tmp_path):
    target = tmp_path / "ckpt"
    atomic_dir(target, lambda d: (d / "x").write_text("old"))

    def crash(d):
        (d / "x").write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_dir(target, crash)
    assert (target / "x").read_text() == "old"
    # killed between the two renames: only `.old` is left, and it is taken back
    target.rename(target.with_name("ckpt.old"))
    assert recover_dir(target) == target and (target / "x").read_text() == "old"


def test_saved_drafter_loads_back_identically_with_the_scale_folded(tmp_path):
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=2, block_size=4, draft_vocab_size=50))
    d.set_draft_vocab(torch.arange(0, 100, 2))
    d.set_feature_scale(torch.rand(d.config.feature_size) * 10 + 0.1, keep_function=False)
    save_drafter(d, tmp_path / "d")
    sd = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert "feature_scale" not in sd and "fc.weight" in sd and "hidden_norm.weight" in sd
    assert not any("embed" in k or "lm_head" in k for k in sd)
    back = load_drafter(tmp_path / "d")
    assert torch.equal(back.feature_scale, torch.ones_like(back.feature_scale))
    batch = Batch(torch.randint(0, V - 1, (1, 30)), torch.ones(1, 30, dtype=torch.long))
    la, ma = compute_loss(t, d.eval(), batch, max_anchors=6, generator=torch.Generator().manual_seed(0))
    lb, mb = compute_loss(t, back, batch, max_anchors=6, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    assert torch.equal(back.draft_vocab, torch.arange(0, 100, 2))


def test_loading_refuses_unknown_or_missing_weights(tmp_path):
    t = tiny_target("llama")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    save_drafter(d, tmp_path / "d")
    path = tmp_path / "d" / "model.safetensors"
    sd = load_file(str(path))
    sd["extra.weight"] = torch.zeros(2)
    del sd["norm.weight"]
    save_file(sd, str(path))
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\], unknown \['extra.weight'\]"):
        load_drafter(tmp_path / "d")
    with pytest.raises(ValueError, match="not a drafter directory"):
        load_drafter(tmp_path / "nothing")


def test_draft_vocabulary_misses_count_in_the_metrics():
    sup = torch.tensor([[False, True, True]])
    target_logits = torch.full((2, 6), -5.0)
    target_logits[0, 1] = 5.0  # inside the draft vocabulary
    target_logits[1, 4] = 5.0  # outside it
    vocab = torch.tensor([0, 1, 2])
    draft = torch.full((2, 3), -5.0)
    draft[:, 1] = 5.0  # always proposes token 1
    loss, m = dflash_loss(draft, target_logits, sup, gamma=2.0, kind="hard", draft_vocab=vocab)
    assert m["slot_accuracy"][1:] == [1.0, 0.0]
    assert m["accepted_lengths"] == [2]
    assert float(loss) < 0.01  # the out-of-vocabulary slot is left out of the hard loss


def test_learning_rate_schedule():
    cfg = TrainConfig(lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(0.1) and lr_at(9, 100, cfg) == pytest.approx(1.0)
    assert lr_at(10, 100, cfg) == pytest.approx(1.0) and lr_at(100, 100, cfg) == pytest.approx(0.1)
    assert lr_at(55, 100, cfg) == pytest.approx(0.55)


def test_training_lowers_the_held_out_loss(tmp_path):
    tr = make(tmp_path, steps=12)
    summary = tr.train()
    recs = records(tmp_path)
    evals = [r for r in recs if "eval_loss" in r]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert (tmp_path / "drafter" / "config.json").exists() and summary["step"] == 12


@pytest.mark.parametrize("causal", [False, True])
def test_convert_round_trips_are_bit_identical(tmp_path, causal):
    from blockdraft.checkpoint.native import convert

    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=2, block_size=5, sliding_window=8,
                                               layer_types=["sliding_attention", "full_attention"],
                                               sliding_causal_in_block=causal))
    save_drafter(d, tmp_path / "native")
    zl = json.loads((tmp_path / "native" / "config.json").read_text())
    assert zl["architectures"] == ["DFlashDraftModel"]
    assert zl["dflash_config"] == {"mask_token_id": d.config.mask_token_id, "target_layer_ids": t.layer_ids}
    assert zl["num_target_layers"] == t.num_layers and zl["block_size"] == 5
    convert(tmp_path / "native", tmp_path / "spec", "speculators")
    sp = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert sp["aux_hidden_state_layer_ids"] == [i + 1 for i in t.layer_ids]  # the input of the next layer
    assert sp["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert sp["sliding_window_non_causal"] is (not causal)
    assert sp["transformer_layer_config"]["layer_types"] == ["sliding_attention", "full_attention"]
    convert(tmp_path / "spec", tmp_path / "back", "zlab")
    a, b = load_drafter(tmp_path / "native"), load_drafter(tmp_path / "back")
    assert a.config == b.config
    sa = load_file(str(tmp_path / "native" / "model.safetensors"))
    sb = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    batch = Batch(torch.randint(0, V - 1, (1, 30)), torch.ones(1, 30, dtype=torch.long))
    la, _ = compute_loss(t, a, batch, max_anchors=6, generator=torch.Generator().manual_seed(0))
    lb, _ = compute_loss(t, b, batch, max_anchors=6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(la, lb)


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

    sd = {"fc.weight": w(H, 3 * H), "hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
          "norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    p = "layers.0."
    sd.update({p + "self_attn.q_proj.weight": w(heads * hd, H), p + "self_attn.k_proj.weight": w(kv * hd, H),
               p + "self_attn.v_proj.weight": w(kv * hd, H), p + "self_attn.o_proj.weight": w(H, heads * hd),
               p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
               p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
               p + "mlp.gate_proj.weight": w(inter, H), p + "mlp.up_proj.weight": w(inter, H),
               p + "mlp.down_proj.weight": w(H, inter), p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
               p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16)})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp_path / "model.safetensors"))
    d = load_drafter(tmp_path)
    assert d.config.target_layer_ids == t.layer_ids and d.config.block_size == 4
    assert torch.equal(d.fc.weight, sd["fc.weight"].float())
    from blockdraft.generate import speculative_generate

    ids = torch.randint(0, V - 1, (1, 8))
    ref = t.model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    assert speculative_generate(t, d, ids, max_new_tokens=12).tokens == ref


def test_imports_a_published_speculators_directory(tmp_path):
    """vLLM's speculators layout: ids one higher, the layer config nested, no target layer count."""
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    save_drafter(d, tmp_path / "native")
    cfg = d.config
    published = {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "aux_hidden_state_layer_ids": [i + 1 for i in t.layer_ids], "block_size": 4,
        "mask_token_id": cfg.mask_token_id, "draft_vocab_size": cfg.vocab_size,
        "target_hidden_size": cfg.target_hidden_size, "sample_from_anchor": False, "sliding_window_non_causal": True,
        "transformer_layer_config": {"model_type": "qwen3", "hidden_size": cfg.hidden_size, "num_hidden_layers": 1,
                                     "num_attention_heads": cfg.num_attention_heads,
                                     "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                                     "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
                                     "rope_theta": cfg.rope_theta, "max_position_embeddings": 512,
                                     "vocab_size": cfg.vocab_size, "hidden_act": "silu", "attention_bias": False},
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "some/target", "architectures": ["Qwen3ForCausalLM"]}},
    }
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


def test_converting_a_draft_vocabulary_warns(tmp_path):
    from blockdraft.checkpoint.native import convert

    t = tiny_target("llama")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, draft_vocab_size=40))
    save_drafter(d, tmp_path / "d")
    with pytest.warns(UserWarning, match="full head"):
        convert(tmp_path / "d", tmp_path / "s", "speculators")


@pytest.mark.parametrize("keep", [True, False])
def test_continuing_a_saved_drafter_starts_from_its_function(tmp_path, keep):
    """--init-drafter: a saved drafter has its feature scale folded into fc; going on training
    rescales the features for the optimiser, which must leave what the drafter computes unchanged."""
    first = make(tmp_path / "a", steps=4)
    first.train()
    t = first.target
    with torch.no_grad():  # a few outlier feature dimensions, as real targets have
        t.model.get_input_embeddings().weight[:, :3].mul_(200)
    x = torch.randn(2, 9, first.drafter.config.feature_size)
    x[..., :3] *= 300
    before = load_drafter(tmp_path / "a" / "drafter").context(x)
    cfg = TrainConfig(out=str(tmp_path / "b"), steps=1, batch_tokens=80, max_anchors=8, eval_every=100,
                      lr=1e-12, warmup=0, progress=False)
    tr = Trainer(t, load_drafter(tmp_path / "a" / "drafter"), tiny_rows(), None, cfg, keep_function=keep)
    tr.train()
    assert (tr.drafter.feature_scale - 1).abs().max() > 0.5  # the optimiser sees rescaled features
    after = load_drafter(tmp_path / "b" / "drafter").context(x)
    if keep:
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    else:  # the contrast: rescaling without compensating fc changes the drafter
        assert (after - before).abs().max() > 0.1


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_top_feature_context_init_is_the_top_layers_input_norm_of_the_last_feature(arch):
    """--context-init top-feature: before training, and after the trainer rescales the features
    keeping the function, the context rows are exactly the target's top-layer input norm applied
    to the last captured layer's hidden state."""
    from blockdraft.train.run import init_context_from_top_feature
    from blockdraft.train.trainer import feature_scale_from

    t = tiny_target(arch)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    init_context_from_top_feature(d, t)
    ids = tiny_rows(2)["input_ids"]
    feats = t(ids, return_logits=False).features
    top = t.model.model.layers[-1]
    ref = top.input_layernorm(feats[..., -t.hidden_size:])  # the model's own norm module
    with torch.no_grad():
        torch.testing.assert_close(d.context(feats), ref, rtol=1e-5, atol=1e-5)
        d.set_feature_scale(feature_scale_from(feats), keep_function=True)
        torch.testing.assert_close(d.context(feats), ref, rtol=1e-4, atol=1e-4)


def test_held_out_split_is_stable_when_the_data_grows():
    import random

    from blockdraft.train.run import split_conversations

    def conv(i):
        return [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]

    first = [conv(i) for i in range(300)]
    tr, ev = split_conversations(first, 0.1, seed=0)
    assert len(tr) + len(ev) == 300 and not any(c in tr for c in ev)
    assert 15 <= len(ev) <= 45  # about 10 %
    grown = first + [conv(i) for i in range(300, 600)]
    random.Random(1).shuffle(grown)
    tr2, ev2 = split_conversations(grown, 0.1, seed=0)
    assert [c for c in ev2 if c in first] == [c for c in ev2 if c in ev] and sum(c in ev2 for c in ev) == len(ev)
    assert not any(c in tr2 for c in ev)  # nothing held out before is trained on now
    assert split_conversations(first, 0.1, seed=1)[1] != ev  # the seed picks another split
    assert split_conversations(first[:3], 0.01, seed=0)[1]  # at least one held out
