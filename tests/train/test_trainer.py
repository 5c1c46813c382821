"""Trainer: exact resume, atomic checkpoints, drafter directories, draft vocabulary."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockdraft.checkpoint import load_drafter, save_drafter
from blockdraft.rundir.atomic import atomic_dir, recover_dir
from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.train import Batch, compute_loss, dflash_loss
from blockdraft.train.trainer import TrainConfig, Trainer, lr_at
from conftest import V, make, tiny_rows, tiny_target  # noqa: F401


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
    # killed between the two renames: only the swapped-out directory is left, and it is taken back
    from blockdraft.rundir.ownership import temp_path

    target.rename(temp_path(target, "old"))
    assert recover_dir(target) == target and (target / "x").read_text() == "old"


def test_saved_drafter_loads_back_identically_with_the_scale_folded(tmp_path):
    t = tiny_target("qwen3")
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=2, block_size=4, draft_vocab_size=50))
    d.set_draft_vocab(torch.arange(0, 100, 2))
    d.set_feature_scale(torch.rand(d.config.feature_size) * 10 + 0.1, keep_function=False)
    save_drafter(d, tmp_path / "d", head_rows=t.head_rows(d.draft_vocab))
    sd = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert "feature_scale" not in sd and "fc.weight" in sd and "hidden_norm.weight" in sd
    assert not any("embed" in k for k in sd) and sd["lm_head.weight"].shape == (50, d.config.hidden_size)
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
    from blockdraft.train.build import init_context_from_top_feature
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

    from blockdraft.data.pipeline import split_conversations

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


def test_gamma_follows_the_acceptance_when_asked(tmp_path):
    """gamma_schedule "acceptance": each step's gamma is the smoothed training tau - 1/2, clamped to
    [0.5, the paper's]; fixed keeps --gamma (None: the paper's) every step."""
    from blockdraft.train.loss import default_gamma

    tr = make(tmp_path / "a", steps=5, gamma_schedule="acceptance")
    tr.train()
    recs = records(tmp_path / "a")
    ema = None
    for r in recs:
        want = 0.5 if ema is None else min(default_gamma(4), max(0.5, ema - 0.5))
        assert r["gamma"] == pytest.approx(want)
        ema = r["tau"] if ema is None else 0.9 * ema + 0.1 * r["tau"]
    fixed = make(tmp_path / "b", steps=2, gamma=2.0, gamma_schedule="fixed")
    fixed.train()
    assert {r["gamma"] for r in records(tmp_path / "b")} == {2.0}


def test_dpace_schedule_trains_with_the_drafts_own_weights(tmp_path, monkeypatch):
    """gamma_schedule "dpace": every step's loss is weighted by D-PACE (logged as such) with the
    configured alpha; an alpha outside (0, 1] is refused before anything runs."""
    from blockdraft.train import loss as loss_mod

    seen = []
    real = loss_mod.dpace_weights
    monkeypatch.setattr(loss_mod, "dpace_weights", lambda q, s, a: seen.append(a) or real(q, s, a))
    tr = make(tmp_path / "d", steps=3, gamma_schedule="dpace", dpace_alpha=0.25)
    tr.train()
    recs = records(tmp_path / "d")
    assert [r["gamma"] for r in recs] == ["dpace"] * 3
    assert seen and set(seen) == {0.25}
    with pytest.raises(ValueError, match="dpace-alpha"):
        TrainConfig(gamma_schedule="dpace", dpace_alpha=1.5).validate()


@pytest.mark.parametrize("rule", [None, "query"])
def test_continuing_an_anchor_rule_drafter_can_move_it_to_the_query_window(tmp_path, rule):
    """--init-drafter with --window-rule: the same weights, the engines' window rule. Without the
    flag the drafter keeps the rule it was trained with (nothing changes silently)."""
    from blockdraft.train.build import continue_drafter

    t = tiny_target()
    cfg = DrafterConfig.for_target(t, num_layers=1, block_size=4, layer_types=["sliding_attention"],
                                   sliding_window=6, sliding_window_rule="anchor")
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), tmp_path / "old")
    old = load_drafter(tmp_path / "old")
    got = continue_drafter(str(tmp_path / "old"), t, "cpu", rule)
    assert got.config.sliding_window_rule == (rule or "anchor")
    for k, v in old.state_dict().items():
        torch.testing.assert_close(got.state_dict()[k], v, rtol=0, atol=0)
    from blockdraft.model import BlockLayout

    T = 40
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(T, cfg.feature_size, generator=g)
    embeds = torch.randn(2, 4, cfg.hidden_size, generator=g)
    # one anchor where the two rules agree (a < W - B + 1 = 3), one past it
    layout = BlockLayout(torch.zeros(T, dtype=torch.long), torch.arange(T), torch.tensor([2, 30]), 4)
    with torch.no_grad():
        a, b = (d(feats, embeds, layout) for d in (old, got))
    torch.testing.assert_close(b[0], a[0])
    assert bool((b[1] - a[1]).abs().max() > 1e-3) == (rule == "query")


def test_a_feature_cache_is_read_one_micro_batch_ahead_off_the_training_thread(tmp_path):
    """Training from a disk cache: every micro-batch after the first is read on the prefetch thread
    while the one before it trains, in the order training takes them, with the same losses as
    reading each on the training thread."""
    import threading

    from blockdraft.data.features import CacheView, DiskFeatures, extract

    t = tiny_target("llama", seed=1)
    rows = tiny_rows(12)
    extract(t, rows, tmp_path / "cache", shard_rows=4, progress=False)
    cache = DiskFeatures(tmp_path / "cache")
    reads = []

    class Recorded(CacheView):
        def __call__(self, i):
            reads.append((threading.current_thread().name, i.tolist()))
            return super().__call__(i)

    def run(out, source):
        torch.manual_seed(0)
        d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
        cfg = TrainConfig(out=str(tmp_path / out), steps=5, batch_tokens=80, grad_accum=2, max_anchors=8,
                          eval_every=100, save_every=100, progress=False)
        tr = Trainer(t, d, cache.rows, None, cfg, train_features=source)
        tr.train()
        order = [tr.batch_indices(s, m).tolist() for s in range(5) for m in range(2)]
        return records(tmp_path / out), order

    plain = lambda i: cache(i)  # noqa: E731  (no prefetch attribute: read on the training thread)
    base, _ = run("plain", plain)
    got, order = run("ahead", Recorded(cache, torch.arange(12)))
    train_reads = [r for r in reads if len(r[1]) == 2]  # the 4 feature-scale rows are read once, up front
    assert [i for _, i in train_reads] == order
    assert all(name.startswith("blockdraft-prefetch") for name, _ in train_reads[1:]), train_reads
    assert [m["loss"] for m in got] == [m["loss"] for m in base]
