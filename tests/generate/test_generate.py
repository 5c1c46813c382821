"""Clause 8: speculative output equals the target's own decoding."""

from __future__ import annotations

import json
import math

import pytest
import torch

import blockdraft.generate.proposers as spec
from blockdraft.config import DrafterConfig
from blockdraft.generate import accept_greedy, speculative_generate
from blockdraft.model import BlockLayout, DFlashDrafter
from blockdraft.generate.recurrent import RecurrentRollback, recurrent_layers
from blockdraft.target.tiny import RECURRENT_ARCHS
from conftest import V, tiny_target


def pair(arch="llama", block_size=4, seed=0, **kw):
    t = tiny_target(arch, seed=seed)
    with torch.no_grad():  # a confident target: greedy decoding is then well defined (no near-ties)
        t.model.get_output_embeddings().weight.mul_(8)
    torch.manual_seed(seed)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=2, block_size=block_size, **kw))
    return t, d


def reference(t, ids, n, stop=None):
    out = t.model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def oracle(truth, corrupt_every):
    """A proposer that drafts the target's true continuation, wrong every `corrupt_every`-th slot."""
    calls = {"n": 0}

    def propose(self, block, new_feats, new_pos, anchor_pos):
        spec_real(self, block, new_feats, new_pos, anchor_pos)  # the drafter still takes its context rows
        start = anchor_pos + 1 - prompt_len[0]
        picks = []
        for k in range(1, block.shape[0]):
            calls["n"] += 1
            i = start + k - 1
            tok = truth[i] if i < len(truth) else 0
            picks.append((tok + 1) % V if calls["n"] % corrupt_every == 0 else tok)
        conf = torch.tensor([0.9 if (k % cut_every[0]) else 0.1 for k in range(1, block.shape[0])])
        return torch.tensor(picks), None, conf

    return propose


spec_real = spec.DrafterProposer._draft
prompt_len = [0]
cut_every = [1000]  # the oracle's confidence drops at every cut_every-th slot


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_greedy_equals_the_targets_own_decoding(arch, block_size):
    t, d = pair(arch, block_size)
    ids = torch.randint(0, V - 1, (1, 11))
    ref = reference(t, ids, 40)
    res = speculative_generate(t, d, ids, max_new_tokens=40)
    assert res.tokens == ref
    assert sum(res.accepted) == 39 and all(1 <= a <= block_size for a in res.accepted)  # + 1 from prefill


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("corrupt_every", [3, 7, 1000])
def test_greedy_with_accepted_drafts(monkeypatch, arch, corrupt_every):
    """Drafts that are mostly right exercise acceptance, the bonus token and cache cropping."""
    t, d = pair(arch, 6)
    ids = torch.randint(0, V - 1, (1, 9))
    ref = reference(t, ids, 50)
    prompt_len[0] = ids.shape[1]
    monkeypatch.setattr(spec.DrafterProposer, "_draft", oracle(ref, corrupt_every))
    res = speculative_generate(t, d, ids, max_new_tokens=50)
    assert res.tokens == ref
    if corrupt_every == 1000:
        assert all(a == 6 for a in res.accepted[:-1])  # 5 drafts + the target's token, every step but the last
    assert max(res.accepted) <= 6


@pytest.mark.parametrize("arch", ["gpt_oss", "llama4"])
def test_greedy_on_sliding_and_chunked_attention_targets(arch):
    """gpt-oss's 8-token sliding layers and Llama 4's 8-token attention chunks, rolled back after
    rejected drafts by transformers' recorded-past crop, past their window."""
    t, d = pair(arch, 4)
    ids = torch.randint(0, V - 1, (1, 11))
    assert speculative_generate(t, d, ids, max_new_tokens=30).tokens == reference(t, ids, 30)


@pytest.mark.parametrize("arch", ["llama", "gpt_oss", RECURRENT_ARCHS[0]])
@pytest.mark.parametrize("corrupt_every", [3, 1000])
@pytest.mark.parametrize("chunk", [1, 4])  # 4: a 6-token block verified as 4 + 2
def test_chunked_verification_gives_the_one_forward_result(monkeypatch, arch, corrupt_every, chunk):
    """`verify_chunk`: the block verified a few rows per target forward, up to the first rejected
    draft, with sliding-window and recurrent layers kept across the chunks: the target's own greedy
    decoding and the one-forward run's accepted lengths, with fewer rows run through the target."""
    t, d = pair(arch, 6)
    ids = torch.randint(0, V - 1, (1, 9))
    ref = reference(t, ids, 40)
    prompt_len[0] = ids.shape[1]
    rows, real = [], t.forward
    monkeypatch.setattr(t, "forward", lambda x, **kw: rows.append(x.shape[1]) or real(x, **kw))
    runs = {}
    for c in (0, chunk):
        rows.clear()
        monkeypatch.setattr(spec.DrafterProposer, "_draft", oracle(ref, corrupt_every))  # its count from 0
        res = speculative_generate(t, d, ids, max_new_tokens=40, verify_chunk=c)
        runs[c] = (res.tokens, res.accepted, res.verified, sum(rows[1:]))  # rows[0]: the prefill
    assert runs[0][0] == runs[chunk][0] == ref
    assert runs[chunk][1] == runs[0][1] and runs[chunk][2] == runs[0][2]  # accepted; the block each step
    if corrupt_every == 3:
        assert runs[chunk][3] < runs[0][3]  # the rows after a rejection were never run
    else:  # every draft right: every chunk runs
        assert runs[chunk][3] == runs[0][3]
    with pytest.raises(ValueError, match="verify_chunk"):
        speculative_generate(t, d, ids, max_new_tokens=4, verify_chunk=-1)


def _states(cache):
    return [s for layer in recurrent_layers(cache) for s in list(layer.recurrent_states.values())
            + list(layer.conv_states.values()) if s is not None]


@pytest.mark.parametrize("arch", RECURRENT_ARCHS)
@pytest.mark.parametrize("corrupt_every", [None, 3])
def test_recurrent_targets_roll_back_rejected_drafts(monkeypatch, arch, corrupt_every):
    """Mamba / Gated DeltaNet layers fold every verified token into their state, rejected ones too.
    With a random drafter (nearly every draft rejected) and an oracle wrong at every third slot
    (blocks partly accepted), the output is the target's own greedy decoding, and the final cache
    holds the states of a fresh cache fed the committed text."""
    t, d = pair(arch, 4)
    ids = torch.randint(0, V - 1, (1, 9), generator=torch.Generator().manual_seed(3))
    ref = reference(t, ids, 32)
    if corrupt_every:
        prompt_len[0] = ids.shape[1]
        monkeypatch.setattr(spec.DrafterProposer, "_draft", oracle(ref, corrupt_every))
    caches = []
    real_new = t.new_cache
    monkeypatch.setattr(t, "new_cache", lambda **kw: caches.append(real_new(**kw)) or caches[-1])
    res = speculative_generate(t, d, ids, max_new_tokens=32)
    assert res.tokens == ref
    assert any(v > a for v, a in zip(res.verified, res.accepted))  # some drafts were rejected
    if corrupt_every:
        assert max(res.accepted) > 1  # and some accepted
    fresh = real_new()
    n = caches[0].get_seq_length()  # the committed text but its last token (unless the length cut the last step)
    text = torch.cat([ids, torch.tensor([res.tokens])], 1)[:, :n]
    assert n in (ids.shape[1] + 31, ids.shape[1] + 32)
    t(text, position_ids=torch.arange(n)[None], cache=fresh)
    t.crop_cache(fresh, n)  # conv states cut back to their kernel, as in the generation's cache
    got, want = _states(caches[0]), _states(fresh)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g[..., -w.shape[-1]:] if g.dim() == 3 else g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_recurrent_rollback_refuses_a_cache_that_records_nothing(arch):
    """A cache made without `rollback` (or by a transformers before 5.25) cannot take rejected drafts
    out of its recurrent layers: refused with the fix, not rolled back wrong."""
    t, _ = pair(arch, 4)
    with pytest.raises(RuntimeError, match="recurrent layers.*new_cache\\(rollback=block_size\\)"):
        RecurrentRollback(t, t.new_cache())
    RecurrentRollback(t, t.new_cache(rollback=4))
    RecurrentRollback(pair("llama", 4)[0], pair("llama", 4)[0].new_cache())  # nothing recurrent: nothing to refuse


@pytest.mark.parametrize("cut", [2, 3])
def test_draft_threshold_verifies_fewer_tokens_with_the_same_output(monkeypatch, cut):
    t, d = pair("llama", 8)
    ids = torch.randint(0, V - 1, (1, 9))
    ref = reference(t, ids, 40)
    prompt_len[0], cut_every[0] = ids.shape[1], cut
    monkeypatch.setattr(spec.DrafterProposer, "_draft", oracle(ref, 1000))
    full = speculative_generate(t, d, ids, max_new_tokens=40)
    short = speculative_generate(t, d, ids, max_new_tokens=40, draft_threshold=0.5)
    cut_every[0] = 1000
    assert full.tokens == short.tokens == ref
    assert max(full.verified) == 8 and max(short.verified) == cut  # anchor + the drafts before the cut
    assert all(a <= v for a, v in zip(short.accepted, short.verified))
    with pytest.raises(ValueError, match="draft_threshold"):
        speculative_generate(t, d, ids, max_new_tokens=4, draft_threshold=1.0)


@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.3])
def test_real_drafter_with_threshold_is_lossless(threshold):
    t, d = pair("qwen3", 6)
    ids = torch.randint(0, V - 1, (1, 10))
    assert speculative_generate(t, d, ids, max_new_tokens=30, draft_threshold=threshold).tokens == reference(t, ids, 30)


@pytest.mark.parametrize("causal", [True, False])
def test_threshold_drafts_a_few_slots_at_a_time_with_the_full_blocks_results(causal):
    """With a threshold, the first FIRST_SLOTS slots are scored first (an in-block-causal drafter also
    runs only those rows), the rest only if none of them is low; what comes back equals the whole
    block's drafts."""
    import copy

    t, d = pair("llama", 12, layer_types=["sliding_attention"] * 2, sliding_window=8, sliding_causal_in_block=causal)
    assert d.causal_in_block is causal
    feats, T = torch.randn(15, d.config.feature_size), 15
    block = torch.full((12,), d.mask_token_id)
    block[0] = 3
    base = d.new_context_cache()
    with torch.no_grad():
        d.draft_hidden(feats[:10], torch.arange(10), t.embed(block), 10, base)  # some context already cached
        def run(threshold):
            proposer = spec.DrafterProposer(t, d, spec.Sampling(0.0, 1.0, None), threshold)
            proposer.cache = copy.deepcopy(base)
            return spec_real(proposer, block, feats[10:], torch.arange(10, T), T), len(proposer.cache)

        (picks, _, conf), n_ctx = run(0.0)
        assert len(picks) == 11 and n_ctx == T
        order = conf.sort().values
        for j in range(11):  # first low slot at j
            thr = float(conf[j]) + 1e-6
            first_low = int((conf < thr).nonzero()[0, 0])
            got, _, got_conf = (r := run(thr))[0]
            n = spec.FIRST_SLOTS if first_low < spec.FIRST_SLOTS else 11
            assert r[1] == T  # the new context rows went into the cache once
            assert torch.equal(got, picks[:n])
            torch.testing.assert_close(got_conf, conf[:n], rtol=1e-4, atol=1e-6)
        assert len(run(float(order[0]) / 2)[0][0]) == 11  # no slot below: every slot scored


def test_ngram_index_finds_the_latest_earlier_occurrence():
    """Against a brute-force backward search, as tokens are appended one by one and in chunks."""
    from blockdraft.generate.lookup import NgramIndex

    def brute(seq, k, max_n):
        L = len(seq)
        for n in range(min(max_n, L), 0, -1):
            for start in range(L - n - 1, -1, -1):  # the match must end before the last token
                if seq[start:start + n] == seq[L - n:]:
                    return seq[start + n:start + n + k]
        return []

    g = torch.Generator().manual_seed(0)
    for max_n in (1, 2, 3):
        seq = torch.randint(0, 6, (5,), generator=g).tolist()
        idx = NgramIndex(seq, max_n)
        hits = 0
        while len(seq) < 120:
            for k in (1, 3):
                got = idx.propose(k)
                assert got == brute(seq, k, max_n)
                hits += bool(got)
            new = torch.randint(0, 6, (int(torch.randint(1, 4, (), generator=g)),), generator=g).tolist()
            seq += new
            idx.extend(new)
        assert hits > 50
    assert NgramIndex([7], 3).propose(4) == [] and NgramIndex([7, 7], 3).propose(4) == [7]
    with pytest.raises(ValueError, match="n-gram"):
        NgramIndex([1], 0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("lookup,threshold", [(1, 0.0), (3, 0.0), (8, 0.3)])
def test_greedy_with_prompt_lookup_equals_the_targets_own_decoding(monkeypatch, arch, lookup, threshold):
    t, d = pair(arch, 6)
    base = torch.randint(0, V - 1, (1, 8))
    ids = torch.cat([base, base, base[:, :5]], 1)  # repeats: the lookup finds matches
    ref = reference(t, ids, 40)
    fed = []  # context positions handed to the drafter, step by step

    def recording(self, block, new_feats, new_pos, anchor_pos):
        assert new_feats.shape[0] == new_pos.shape[0]
        fed.extend(new_pos.tolist())
        return spec_real(self, block, new_feats, new_pos, anchor_pos)

    monkeypatch.setattr(spec.DrafterProposer, "_draft", recording)
    res = speculative_generate(t, d, ids, max_new_tokens=40, lookup=lookup, draft_threshold=threshold)
    assert res.tokens == ref
    assert res.lookup_steps > 0 and max(res.verified) <= 6
    assert 0 < res.lookup_steps < len(res.verified)  # both proposers were used
    # rows committed during copied steps wait for the drafter's next step: each position once, in order
    assert fed == list(range(len(fed)))
    with pytest.raises(ValueError, match="lookup"):
        speculative_generate(t, d, ids, max_new_tokens=4, lookup=-1)


def test_stop_tokens_and_length():
    t, d = pair("qwen3", 4)
    ids = torch.randint(0, V - 1, (1, 7))
    ref = reference(t, ids, 30)
    stop = ref[12]
    res = speculative_generate(t, d, ids, max_new_tokens=30, stop_token_ids=[stop])
    assert res.tokens == ref[: ref.index(stop) + 1]
    for n in (1, 2, 5):
        assert speculative_generate(t, d, ids, max_new_tokens=n).tokens == ref[:n]


def test_cached_drafting_equals_the_training_forward():
    t, d = pair("llama", 5, layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                sliding_causal_in_block=True)
    T = 20
    feats = torch.randn(T, d.config.feature_size)
    embeds = torch.randn(d.block_size, d.config.hidden_size)
    a = T  # block anchored right after the context
    ctx = d.new_context_cache()
    with torch.no_grad():
        # feed the context in three uneven pieces, drafting after each
        d.draft_hidden(feats[:7], torch.arange(7), embeds, 7, ctx)
        d.draft_hidden(feats[7:12], torch.arange(7, 12), embeds, 12, ctx)
        cached = d.draft_hidden(feats[12:], torch.arange(12, T), embeds, a, ctx)
        all_feats = torch.cat([feats, torch.zeros(1, feats.shape[1])])  # row a exists but is not visible
        layout = BlockLayout(torch.zeros(T + 1, dtype=torch.long), torch.arange(T + 1), torch.tensor([a]), 5)
        ref = d(all_feats, embeds[None], layout, "dense")[0]
    torch.testing.assert_close(cached, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lookup", [0, 2])
def test_sampling_follows_the_targets_distribution(lookup):
    """Chi-square test of the second generated token (the first one drafted) against the target's own
    marginal sum_f p(f | prompt) p(. | prompt, f). With lookup, the prompt holds every token, so
    the second token is always a copied (one-hot) draft."""
    t, d = pair("llama", 4, seed=3)
    with torch.no_grad():
        t.model.get_output_embeddings().weight.div_(4)  # a flatter target: many tokens with real mass
        d.norm.weight.mul_(300)  # a sharp drafter, far from the target: a wrong acceptance rule shows
    ids = torch.randint(0, V - 1, (1, 6)) if not lookup else torch.randperm(V)[None]
    temp, n = 1.0, 1500
    counts = torch.zeros(V)
    for i in range(n):
        res = speculative_generate(t, d, ids, max_new_tokens=2, temperature=temp, seed=i, lookup=lookup)
        assert res.lookup_steps == (1 if lookup else 0)
        counts[res.tokens[1]] += 1
    with torch.no_grad():
        p_first = torch.softmax(t.model(ids).logits[0, -1] / temp, -1)  # [V]
        both = torch.cat([ids.expand(V, -1), torch.arange(V)[:, None]], 1)  # every possible first token
        p_second = torch.softmax(t.model(both).logits[:, -1] / temp, -1)  # [V, V]
    expected = (p_first[:, None] * p_second).sum(0) * n
    keep = expected >= 5
    chi2 = float((((counts - expected) ** 2) / expected)[keep].sum())
    dof = int(keep.sum()) - 1
    z = 3.09  # 99.9% quantile of chi-square, Wilson-Hilferty approximation
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, (chi2, crit, dof)


def test_accept_greedy_rule():
    logits = torch.full((4, 10), -1.0)
    for k, tok in enumerate([3, 5, 7, 9]):
        logits[k, tok] = 1.0
    assert accept_greedy(torch.tensor([3, 5, 7]), logits) == (3, 9)
    assert accept_greedy(torch.tensor([3, 6, 7]), logits) == (1, 5)
    assert accept_greedy(torch.tensor([0, 5, 7]), logits) == (0, 3)


def test_bad_requests():
    t, d = pair("llama", 4)
    ids = torch.randint(0, V - 1, (1, 5))
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(t, d, ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="context"):
        speculative_generate(t, d, ids, max_new_tokens=10_000)
    with pytest.warns(UserWarning, match="larger than the drafter"):
        speculative_generate(t, d, ids, max_new_tokens=3, block_size=6)
    other = tiny_target("llama", layer_ids=[0, 2, 4])
    with pytest.raises(ValueError, match="feature layers"):
        speculative_generate(other, d, ids, max_new_tokens=3)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_identity_on_smollm2(smollm2_dir, block_size):
    from blockdraft.data.chat import encode_prompt as encode
    from blockdraft.target import TargetModel

    t = TargetModel.from_pretrained("smollm2")
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=16))
    ids = encode(t.tokenizer, [{"role": "user", "content": "Write a haiku about speculative decoding."}])
    ref = t.model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=t.tokenizer.pad_token_id)
    from blockdraft.target import stop_token_ids as stop_ids

    got = speculative_generate(t, d, ids, max_new_tokens=40, block_size=block_size, stop_token_ids=stop_ids(t.tokenizer))
    assert got.tokens == ref[0, ids.shape[1]:].tolist()  # generate stops at <|im_end|> too


@pytest.mark.slow
def test_bench_reports_identical_outputs(smollm2_dir, tmp_path):
    from blockdraft.bench.runner import run_bench
    from blockdraft.target import TargetModel

    t = TargetModel.from_pretrained("smollm2")
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=8, draft_vocab_size=2048))
    res = run_bench(t, d, ["gsm8k"], 1, max_new_tokens=12, json_path=tmp_path / "b.json", plot_path=tmp_path / "b.png",
                    progress=False)
    row = json.loads((tmp_path / "b.json").read_text())[0]
    for key in ("set", "n_prompts", "block_size", "tau", "target_tok_s", "spec_tok_s", "speedup", "identical",
                "hf_lookup_speedup"):
        assert key in row
    assert row["identical"] is True and row["n_prompts"] == 1 and res[0]["tau"] >= 1.0
    assert (tmp_path / "b.png").stat().st_size > 0


@pytest.mark.slow
def test_the_default_drafter_loads_and_is_lossless(smollm2_dir):
    from blockdraft.data.chat import encode_prompt as encode
    from blockdraft.target import stop_token_ids as stop_ids
    from blockdraft.checkpoint import load_drafter
    from blockdraft.generate.baseline import target_greedy
    from blockdraft.target import TargetModel

    d = load_drafter("default")
    t = TargetModel.from_pretrained("smollm2", layer_ids=d.config.target_layer_ids)
    ids = encode(t.tokenizer, [{"role": "user", "content": "Write a Python function that reverses a string."}])
    ref = target_greedy(t, ids, max_new_tokens=48, stop_token_ids=stop_ids(t.tokenizer))
    got = speculative_generate(t, d, ids, max_new_tokens=48, stop_token_ids=stop_ids(t.tokenizer))
    assert got.tokens == ref.tokens
    both = speculative_generate(t, d, ids, max_new_tokens=48, stop_token_ids=stop_ids(t.tokenizer), lookup=3,
                                draft_threshold=0.3)
    assert both.tokens == ref.tokens and both.lookup_steps > 0
    assert got.tau > 1.0  # a trained drafter gets some drafts accepted


def test_baseline_greedy_equals_transformers_generate():
    from blockdraft.generate.baseline import target_greedy

    t, _ = pair("gemma3", 4)
    ids = torch.randint(0, V - 1, (1, 9))
    assert target_greedy(t, ids, max_new_tokens=30).tokens == reference(t, ids, 30)


def test_timings_read_the_clock_after_the_device_finished(monkeypatch):
    """A CUDA run queues work ahead of the host: every clock read in generation and in the target-only
    baseline syncs the target's device first (stubbed here: the sync is recorded, the device is the CPU)."""
    import blockdraft.generate.baseline as baseline
    import blockdraft.generate.speculative as speculative

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    speculative.now(torch.device("cuda", 0))
    assert synced == [torch.device("cuda", 0)]
    speculative.now(torch.device("cpu"))
    assert len(synced) == 1
    reads = []
    real = speculative.now
    spy = lambda device: reads.append(device) or real(device)  # noqa: E731
    monkeypatch.setattr(speculative, "now", spy)
    monkeypatch.setattr(baseline, "now", spy)
    t, d = pair()
    ids = torch.tensor([[1, 5, 7, 9]])
    res = speculative_generate(t, d, ids, max_new_tokens=6)
    assert len(reads) == 3 + 3 * len(res.accepted) and set(reads) == {t.device}  # start, prefill, end; 3 a step
    reads.clear()
    base = baseline.target_greedy(t, ids, max_new_tokens=6)
    assert len(reads) == 3 + 2 * (len(base.tokens) - 1)


def test_greedy_decoding_ignores_top_p_and_seed():
    """Why the CLI refuses --top-p and --seed at --temperature 0 (cli.unused_sampling): they change nothing."""
    t, d = pair()
    ids = torch.tensor([[1, 5, 9, 3]])
    want = reference(t, ids, 24)
    for kw in ({}, {"top_p": 0.5}, {"seed": 3}, {"top_p": 0.2, "seed": 11}):
        assert speculative_generate(t, d, ids, max_new_tokens=24, **kw).tokens == want
