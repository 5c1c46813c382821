"""Targets that transformers ships only as a wrapper around a text decoder (target/classes.py): a
drafter is trained for the text decoder, as vLLM serves one. Each tiny wrapper (blockdraft.target.tiny,
WRAPPER_ARCHS) is saved with its own class's save_pretrained and loaded back by blockdraft as a user's
directory. The references are the wrapper itself, in memory: its own forward's logits, its text model's
`output_hidden_states` (clause 1: id L is hidden_states[L + 1]) and its own greedy `generate`.
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.target import TargetModel, TargetSource, hidden_states_index
from blockdraft.target.classes import TargetLoadError
from blockdraft.target.tiny import WRAPPER_CLASSES, tiny_causal_lm, wrapper_archs

V = 160
# the families whose decoder layers output one [T, H] state per token; GLM-5-Next's hold hc_mult streams
# (tests/target/test_streams.py)
ONE_STREAM = ("mistral4", "kimi_k25", "mistral_large4")


def present(arch: str):
    """`arch` as a parameter, skipped by name where this transformers lacks its class."""
    reason = f"transformers has no {WRAPPER_CLASSES[arch]}"
    return pytest.param(arch, marks=pytest.mark.skipif(arch not in wrapper_archs(), reason=reason), id=arch)


def saved(arch: str, path) -> torch.nn.Module:
    """The tiny wrapper of `arch` (its head scaled so greedy decoding has clear winners), saved to `path`."""
    model = tiny_causal_lm(arch, vocab=V, layers=4, max_positions=256)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    model.save_pretrained(path)
    return model


def loaded(path, layer_ids) -> TargetModel:
    """The target of the directory `path` as blockdraft's commands load it (load.resolve_source's second
    half: no tokenizer here, so MASK is the last id)."""
    return TargetModel.from_source(TargetSource(str(path), path, None), layer_ids=layer_ids, dtype=torch.float32)


def text_model(wrapper):
    """The wrapper's text decoder, by its own attribute (Mistral-4's causal LM holds it as `.model`)."""
    return getattr(wrapper.model, "language_model", wrapper.model)


@pytest.mark.parametrize("arch", [present(a) for a in ONE_STREAM])
def test_features_and_labels_are_the_wrappers_own(arch, tmp_path):
    ref = saved(arch, tmp_path)
    t = loaded(tmp_path, [0, 1, 2])
    assert type(t.model) is type(ref) and t.num_layers == 4 and t.hidden_size == 32
    ids = torch.randint(3, V - 1, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_logits = ref(input_ids=ids).logits
        text = text_model(ref)(input_ids=ids, output_hidden_states=True)
        # the wrapper's text logits are its text decoder's final state through its own head (Mistral-Large-4
        # soft-caps them, as its config says)
        head = ref.lm_head(text.last_hidden_state)
        cap = getattr(ref.config.get_text_config(), "final_logit_softcapping", None)
        torch.testing.assert_close(want_logits, torch.tanh(head / cap) * cap if cap else head)
    out = t(ids)
    torch.testing.assert_close(out.logits, want_logits, rtol=0, atol=0)
    states = text.hidden_states
    assert len(states) == 5
    for k, lid in enumerate(t.layer_ids):
        torch.testing.assert_close(out.features[..., k * 32:(k + 1) * 32], states[hidden_states_index(lid)],
                                   rtol=0, atol=0)
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, 5:] = True  # the labels' path: logits at chosen positions only
    torch.testing.assert_close(t(ids, logits_mask=keep).logits, want_logits[keep], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", [present(a) for a in ONE_STREAM])
def test_greedy_speculative_output_is_the_wrappers_own_greedy_decode(arch, tmp_path):
    ref = saved(arch, tmp_path)
    assert_greedy_identity(ref, loaded(tmp_path, [0, 2]))


def assert_greedy_identity(model, t) -> None:
    """blockdraft's speculative greedy decode with a random drafter on target `t` is `model`'s own greedy
    `generate` (`model`: the transformers model `t` was loaded from, or wraps)."""
    from blockdraft.generate import speculative_generate

    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4)).eval()
    ids = torch.randint(3, V - 1, (1, 9), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, max_new_tokens=14, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = speculative_generate(t, d, ids, max_new_tokens=14)
    assert got.tokens == want[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", [present(a) for a in ONE_STREAM])
def test_head_rows_and_a_head_only_target_read_the_wrappers_own_tensors(arch, tmp_path):
    """Stored in the wrapper's own layout (Mistral-Large-4: `output.weight`, `tok_embeddings.weight`; Kimi-K2.5:
    a tied head under `language_model.model.`), read back through transformers' renames."""
    from blockdraft.target.files import head_rows
    from blockdraft.target.load import load_head_only

    ref = saved(arch, tmp_path)
    rows = torch.tensor([0, 7, V - 1])
    torch.testing.assert_close(head_rows(str(tmp_path), rows), ref.lm_head.weight[rows], rtol=0, atol=0)
    m = load_head_only(TargetSource(str(tmp_path), tmp_path, None), dtype=torch.float32, final_norm=True)
    torch.testing.assert_close(m.get_output_embeddings().weight, ref.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(m.get_input_embeddings().weight, ref.get_input_embeddings().weight, rtol=0, atol=0)


@pytest.mark.parametrize("arch", [present("glm5_next")])
def test_a_saved_hyper_connection_wrapper_loads_and_reads_its_streams_mean(arch, tmp_path):
    """GLM-5-Next's decoder layers output hc_mult residual streams ([T, hc_mult, H]); loaded from its directory,
    id L is the mean of layer L's streams (clause 1; tests/target/test_streams.py compares it with vLLM's rule)
    and the labels are the wrapper's own logits."""
    ref = saved(arch, tmp_path)
    t = loaded(tmp_path, [0, 1])
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        states = text_model(ref)(ids, output_hidden_states=True).hidden_states
        want_logits = ref(input_ids=ids).logits
    assert states[1].dim() == 4 and states[1].shape[2] == 2
    out = t(ids)
    # float rounding apart on some CPUs: 7e-7 on an AMD EPYC (AVX2), equal on the machines before it
    torch.testing.assert_close(out.logits, want_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.features[..., 32:], states[hidden_states_index(1)].mean(dim=2), rtol=0, atol=1e-6)


def test_a_target_transformers_cannot_build_fails_to_load_naming_the_cause(tmp_path):
    """An unknown model type, and a known one with its weights missing: a TargetLoadError that names the
    target and transformers' own cause, never a layer-id problem."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_family", "num_hidden_layers": 4}))
    with pytest.raises(TargetLoadError, match=r"the target .* failed to load: ValueError: .*no_such_family"):
        loaded(tmp_path, None)
    cfg = tiny_causal_lm("llama", vocab=V, layers=2).config
    cfg.save_pretrained(tmp_path)
    with pytest.raises(TargetLoadError, match=r"the target .* failed to load: OSError: "):
        loaded(tmp_path, None)


def word_tokenizer(path) -> None:
    """A word-level tokenizer of V ids saved to `path`: enough for a target directory to resolve."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        path)


def run(capsys, *argv: str) -> tuple[int, str]:
    from blockdraft.cli import main

    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_doctor_and_train_say_the_target_failed_to_load(tmp_path, capsys):
    """The first step that fails is loading: doctor's one FAIL is `target` (with or without a drafter)
    and names transformers' cause; train stops with the same one-line error. Never `layer ids`."""
    import json

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "no_such_family", "num_hidden_layers": 4}))
    word_tokenizer(target)
    (tmp_path / "drafter").mkdir()
    for extra in ([], ["--drafter", str(tmp_path / "drafter")]):
        rc, out = run(capsys, "doctor", "--target", str(target), "--threads", "1", *extra)
        assert rc == 1 and "layer ids" not in out, out
        assert out.count("FAIL") == 1 and "FAIL  target " in out, out
        assert f"the target {target} failed to load: ValueError: " in out and "no_such_family" in out, out
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "w3 w4"},
                                             {"role": "assistant", "content": "w5 w6"}]}) + "\n")
    rc, out = run(capsys, "train", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "run"),
                  "--steps", "1", "--no-progress", "--threads", "1")
    assert rc == 2 and f"blockdraft train: error: the target {target} failed to load: ValueError: " in out, out
    assert "layer ids" not in out and len(out.strip().splitlines()) == 1, out


@pytest.mark.slow  # SmolLM2's tokenizer and a short training run: ~15 s a family
@pytest.mark.parametrize("arch", [present(a) for a in ONE_STREAM])
def test_doctor_and_a_short_train_pass_on_a_saved_wrapper(arch, tmp_path, capsys, smollm2_tokenizer, chat_data):
    target = tmp_path / arch
    model = tiny_causal_lm(arch, vocab=len(smollm2_tokenizer), layers=8, max_positions=1024)
    with torch.no_grad():  # clear winners: greedy decoding without near-ties
        model.get_output_embeddings().weight.mul_(8)
    model.save_pretrained(target)
    smollm2_tokenizer.save_pretrained(target)
    rc, out = run(capsys, "doctor", "--target", str(target), "--threads", "1")
    assert rc == 0 and "FAIL" not in out and "PASS  labels" in out and "PASS  greedy identity" in out, out
    out = train_then_doctor(capsys, target, chat_data, tmp_path / "run")
    assert "PASS  serving = training" in out, out


def train_then_doctor(capsys, target, chat_data: str, run_dir) -> str:
    """Two training steps on the saved target, then doctor with the drafter they wrote: doctor's output,
    held to no FAIL."""
    rc, out = run(capsys, "train", "--target", str(target), "--data", chat_data, "--out", str(run_dir), "--steps", "2",
                  "--max-length", "128", "--batch-tokens", "256", "--max-anchors", "16", "--eval-every", "2",
                  "--eval-fraction", "0.1", "--no-progress", "--threads", "1")
    assert rc == 0, out
    rc, out = run(capsys, "doctor", "--target", str(target), "--drafter", str(run_dir / "drafter"), "--threads", "1")
    assert rc == 0 and "FAIL" not in out, out
    return out
