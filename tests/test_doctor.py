"""Each doctor check fails on the bug it exists to catch (planted here), and passes otherwise."""

from __future__ import annotations

import json

import pytest
import torch

import blockdraft.generate.speculative as spec
import blockdraft.model.blocks as blocks
import blockdraft.model.masks as masks
from blockdraft import doctor
from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from conftest import V, tiny_causal_lm, tiny_target


def setup(**kw):
    t = tiny_target("llama")
    with torch.no_grad():
        t.model.get_output_embeddings().weight.mul_(8)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4, **kw))
    return t, d, torch.randint(0, V - 1, (1, 40), generator=torch.Generator().manual_seed(0))


def statuses(checks):
    return {c.name: c.status for c in checks}


def test_all_pass_on_a_sound_setup():
    t, d, ids = setup()
    s = statuses(doctor.run_doctor(t, d, None, ids))
    assert s.pop("data") == "WARN"  # no data given
    assert set(s.values()) == {"PASS"}, s
    assert "serving = training" in s and "serving engines" in s


def test_without_a_drafter_the_target_is_checked_and_the_rest_named_as_skipped():
    t, _, ids = setup()
    checks = doctor.run_doctor(t, None, None, ids)
    s = statuses(checks)
    assert s.pop("data") == "WARN"
    skipped = {n for n, v in s.items() if v == "SKIP"}
    assert skipped == set(doctor.NEEDS_CHECKPOINT)
    assert {v for n, v in s.items() if n not in skipped} == {"PASS"}, s
    assert "probe drafter" in next(c for c in checks if c.name == "mask").message


@pytest.mark.parametrize("sliding", [False, True])
def test_serving_check_catches_a_training_path_that_is_not_the_served_one(monkeypatch, sliding):
    """The drafter trained (packed layout, chunked attention) must be the one generation runs
    (cached drafting): a window counted differently in training only is caught."""
    kw = dict(layer_types=["sliding_attention"], sliding_window=3, sliding_causal_in_block=True) if sliding else {}
    t, d, ids = setup(**kw)
    with torch.no_grad():  # weights far from their initialisation, so every slot's draft depends on its keys
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    ids = ids[:, :24]
    assert doctor.check_serving(t, d, ids).status == "PASS"
    import blockdraft.model.attention as attention

    real = attention.anchor_block_attention

    def other_rule(q, kc, vc, kb, vb, layout, vis, **k):  # training flips the in-block causality
        return real(q, kc, vc, kb, vb, layout, attention.LayerVisibility(vis.window, not vis.causal, vis.rule), **k)

    monkeypatch.setattr("blockdraft.model.layers.anchor_block_attention", other_rule)
    assert doctor.check_serving(t, d, ids).status == "FAIL"


def test_engines_check_warns_on_an_anchor_window_drafter():
    _, d, _ = setup(layer_types=["sliding_attention"], sliding_window=8, sliding_window_rule="anchor")
    c = doctor.check_engines(d)
    assert c.status == "WARN" and "vLLM" in c.message and "own position" in c.message
    _, q, _ = setup(layer_types=["sliding_attention"], sliding_window=8)
    assert doctor.check_engines(q).status == "PASS"


def test_labels_check_catches_an_off_by_one(monkeypatch):
    t, d, ids = setup()
    monkeypatch.setattr("blockdraft.train.step.label_positions", lambda a, B: blocks.slot_token_positions(a, B))
    assert doctor.check_labels(t, d, ids).status == "FAIL"


def test_labels_check_catches_a_doubled_norm(monkeypatch):
    t, d, ids = setup()
    real = t.forward

    def doubled(*a, **k):  # labels from the head applied to an already normed state, normed again
        out = real(*a, **k)
        final = t.model.model(a[0], position_ids=k.get("position_ids")).last_hidden_state
        keep = k.get("logits_mask")
        out.logits = t.head(t.model.model.norm(final))[keep] if keep is not None else out.logits
        if out.final_hidden is not None:  # the states training's labels are the head of
            out.final_hidden = t.model.model.norm(out.final_hidden)
        return out

    monkeypatch.setattr(t, "forward", doubled)
    assert doctor.check_labels(t, d, ids).status == "FAIL"


def test_mask_check_catches_a_leak(monkeypatch):
    _, d, _ = setup()
    real = masks.visible

    def leaky(*a, **k):
        v = real(*a, **k)
        return v | (a[2] == k["anchors"][a[0]])  # a block sees its own anchor's row (not known at inference)

    monkeypatch.setattr(masks, "visible", leaky)
    assert doctor.check_mask(d).status == "FAIL"


def test_mask_token_check():
    t, d, _ = setup()
    bad = torch.full_like(t.model.get_input_embeddings().weight[0], float("nan"))
    with torch.no_grad():
        t.model.get_input_embeddings().weight[d.config.mask_token_id] = bad
    assert doctor.check_mask_token(t, d).status == "FAIL"


def test_mask_token_equal_to_eos_fails(smollm2_tokenizer):
    from blockdraft.target import TargetModel

    tok = smollm2_tokenizer
    t = TargetModel(tiny_causal_lm("llama", vocab=len(tok)), tok, num_features=3)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4))
    d.config.mask_token_id = tok.eos_token_id  # a checkpoint that chose eos as MASK
    assert doctor.check_mask_token(t, d).status == "FAIL"


def test_pairing_and_layer_ids_checks():
    t, d, _ = setup()
    other = tiny_target("llama", layer_ids=[0, 2, 4])
    assert doctor.check_pairing(other, d).status == "FAIL"
    assert doctor.check_layer_ids(other, d).status == "FAIL"
    wide = tiny_target("llama", hidden=48)
    assert doctor.check_pairing(wide, d).status == "FAIL"


def test_greedy_check_catches_a_broken_acceptance(monkeypatch):
    t, d, ids = setup()
    assert doctor.check_greedy(t, d, ids).status == "PASS"
    monkeypatch.setattr(spec, "accept_greedy", lambda draft, logits: (len(draft), int(logits[-1].argmax())))
    assert doctor.check_greedy(t, d, ids).status == "FAIL"


def vllm_standin(t, d, prompts, change):
    """run_job's stand-in for vLLM: serves what speculative_generate does on each prompt, then `change`s it."""
    rs = [spec.speculative_generate(t, d, torch.tensor([p]), max_new_tokens=96, stop_token_ids=[]) for p in prompts]
    return change({"tokens": [r.tokens for r in rs], "accepted": sum(a - 1 for r in rs for a in r.accepted),
                   "drafts": sum(len(r.accepted) for r in rs)})


@pytest.mark.parametrize("change,status", [
    (lambda out: out, "PASS"),
    (lambda out: {**out, "tokens": [out["tokens"][0], out["tokens"][1][:-1] + [out["tokens"][1][-1] + 1]]}, "FAIL"),
    (lambda out: {**out, "accepted": out["accepted"] + out["drafts"] // 5}, "FAIL")])
def test_vllm_acceptance_check_holds_every_prompts_output_and_the_mean_acceptance(monkeypatch, tmp_path, change,
                                                                                status):
    """`doctor --vllm` on several prompts: one output that differs, or vLLM's acceptance 5% off ours over
    all of them, fails (the real engine: reference/test_vllm.py)."""
    import blockdraft.target
    from blockdraft.checkpoint import native
    from blockdraft.engines import exports
    from blockdraft.engines.vllm import doctor as vllm_doctor, job

    t, d, ids = setup()
    prompts = [ids[0, :20].tolist(), ids[0, 5:40].tolist()]
    monkeypatch.setattr(native, "default_verifier", lambda name: str(tmp_path))
    monkeypatch.setattr(blockdraft.target, "stop_token_ids", lambda tokenizer: [])  # the tiny target has none
    monkeypatch.setattr(exports, "export_drafter", lambda *a, **k: (tmp_path, []))
    monkeypatch.setattr(job, "run_job", lambda spec_job, workdir: vllm_standin(t, d, spec_job["prompts"], change))
    check = vllm_doctor.check_acceptance(t, d, prompts)
    assert check.status == status, check.message


def test_data_check_catches_user_tokens_in_the_loss(monkeypatch, tmp_path, smollm2_tokenizer):
    from blockdraft.target import TargetModel

    tok = smollm2_tokenizer
    t = TargetModel(tiny_causal_lm("llama", vocab=len(tok)), tok, num_features=3)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Please list three prime numbers."},
                                             {"role": "assistant", "content": "2, 3 and 5."}]}) + "\n")
    assert doctor.check_data(t, str(path)).status == "PASS"
    import blockdraft.data as data

    real = data.render
    monkeypatch.setattr(data, "render", lambda tk, m: {**real(tk, m), "loss_mask": [1] * len(real(tk, m)["loss_mask"])})
    assert doctor.check_data(t, str(path)).status == "FAIL"


def test_data_check_fails_a_file_train_refuses(tmp_path, smollm2_tokenizer):
    """doctor reads --data as train does: a malformed record is train's error, so never a PASS."""
    from blockdraft.data import load_conversations
    from blockdraft.target import TargetModel

    tok = smollm2_tokenizer
    t = TargetModel(tiny_causal_lm("llama", vocab=len(tok)), tok, num_features=3)
    path = tmp_path / "d.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "Name a prime."},
                                    {"role": "assistant", "content": "7."}]})
    path.write_text(good + "\n" + '{"messages": [{"role": "user"' + "\n")
    with pytest.raises(ValueError) as refused:  # what train's loader says of it
        load_conversations(str(path))
    got = doctor.check_data(t, str(path))
    assert got.status == "FAIL" and str(refused.value) in got.message


def test_cli_exit_code(tmp_path):
    from blockdraft.cli import main

    (tmp_path / "not-a-drafter").mkdir()
    assert main(["doctor", "--drafter", str(tmp_path / "not-a-drafter")]) == 1  # a FAIL line
    with pytest.raises(SystemExit) as e:  # a path that does not exist is a mistaken flag: exit 2
        main(["doctor", "--drafter", str(tmp_path / "missing")])
    assert e.value.code == 2


KIND_KW = {"dspark": dict(kind="dspark", markov_rank=8),
           "dflash2": dict(kind="dflash2", selector_rank=8, selector_top_k=4, conv_group_size=8),
           "domino": dict(kind="domino", emb_dim=8, gru_hidden_dim=6)}


@pytest.mark.parametrize("kind", ["dspark", "dflash2", "domino"])
def test_serving_check_reads_each_kind_by_its_walk(monkeypatch, kind):
    """For DSpark and DFlash2 the served drafts come from the kind's walk (each slot reads the draft
    before it, from the verified token on): the training path's rows walked the same way give the
    same drafts; generation walking from another token is caught."""
    import blockdraft.generate.proposers as proposers

    t, d, ids = setup(**KIND_KW[kind])
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    ids = ids[:, :24]
    assert doctor.check_serving(t, d, ids).status == "PASS"
    real = proposers.DrafterProposer._score

    def off_by_one(self, hidden, prefix):  # generation's walk starts from the token after the verified one
        return real(self, hidden, [*prefix[:-1], (prefix[-1] + 1) % V])

    monkeypatch.setattr(proposers.DrafterProposer, "_score", off_by_one)
    assert doctor.check_serving(t, d, ids).status == "FAIL"


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_kind_check_passes_each_sound_kind_and_names_its_engines(kind):
    _, d, _ = setup(**KIND_KW.get(kind, {}))
    c = doctor.check_kind(d)
    assert c.status in ("PASS", "WARN") and "llama.cpp" in c.message, c
    assert ("V2 GPU runner only" in c.message) == (kind != "dflash")


def test_kind_check_holds_dominos_tensors_to_specforges_shapes():
    """A sound Domino passes, naming the engines that do not serve it; a GRU with biases (SpecForge's checkpoint
    has none) or a projection of another width than its field fails, naming the tensor."""
    from torch import nn

    _, d, _ = setup(**KIND_KW["domino"])
    c = doctor.check_kind(d)
    assert c.status in ("PASS", "WARN") and "no Domino" in c.message, c
    d.prefix_gru = nn.GRU(32, 6, bias=True, batch_first=True)
    assert "carry biases" in doctor.check_kind(d).message
    _, d, _ = setup(**KIND_KW["domino"])
    d.embed_proj[0] = nn.Linear(38, 9, bias=False)
    c = doctor.check_kind(d)
    assert c.status == "FAIL" and "embed_proj.0.weight is (9, 38), its fields say (8, 38)" in c.message, c


def test_kind_check_catches_a_convolution_that_reaches_back_in_the_block(monkeypatch):
    from blockdraft.model.kinds.dflash2 import GroupedConv

    _, d, _ = setup(**KIND_KW["dflash2"])
    assert doctor.check_kind(d).status in ("PASS", "WARN")
    real = GroupedConv._conv

    def leaky(self, x, side, dyn):  # each row also reads the next one
        return real(self, x, side, dyn) + torch.roll(x, -1, dims=-2)

    monkeypatch.setattr(GroupedConv, "_conv", leaky)
    c = doctor.check_kind(d)
    assert c.status == "FAIL" and "later block row" in c.message


def test_kind_check_catches_a_selector_too_wide_for_llama_cpp():
    _, d, _ = setup(kind="dflash2", selector_rank=8, selector_top_k=8, conv_group_size=8)  # 8 * 9 > 32
    c = doctor.check_kind(d)
    assert c.status == "FAIL" and "K (K + 1)" in c.message
