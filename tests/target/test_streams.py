"""Targets with hyper-connections (DeepSeek-V4; GLM-5-Next's text decoder): every decoder layer outputs
hc_mult residual streams, [Bz, T, hc_mult, H]. Clause 1's state for layer id L is what vLLM 0.33 records
as the aux hidden state a DFlash, DSpark or EAGLE-3 drafter reads: the plain mean over the streams of layer
L's output after its output mixing (post-mHC). The reference here is a transcription of vLLM's aux loop,
run on the transformers model's own modules through hooks written in this file; labels stay the model's
own logits (clause 3).
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.config import DrafterConfig
from blockdraft.model import DFlashDrafter
from blockdraft.target import TargetModel
from blockdraft.target.tiny import STREAM_CLASSES, WRAPPER_CLASSES, stream_archs, tiny_causal_lm, wrapper_archs

V = 160


def present(arch: str):
    """`arch` as a parameter, skipped by name where this transformers lacks its class."""
    have = arch in stream_archs() + wrapper_archs()
    reason = f"transformers has no {({**STREAM_CLASSES, **WRAPPER_CLASSES})[arch]}"
    return pytest.param(arch, marks=pytest.mark.skipif(not have, reason=reason), id=arch)


FAMILIES = [present("deepseek_v4"), present("glm5_next")]


def tiny(arch: str, layers: int = 4) -> torch.nn.Module:
    model = tiny_causal_lm(arch, vocab=V, layers=layers, max_positions=256)
    with torch.no_grad():  # clear winners: greedy decoding without near-ties
        model.get_output_embeddings().weight.mul_(8)
    return model


def decoder(model):
    """The text decoder (a wrapper's language model, else the causal LM's base)."""
    return getattr(model.model, "language_model", model.model)


@torch.no_grad()
def vllm_streams(model, ids) -> list[torch.Tensor]:
    """vLLM 0.33's aux loop, transcribed (deepseek_v4/cpu/model.py and glm5next/common/model.py, the models'
    forward): after decoder layer idx, the stream its FFN hyper-connection completes, hc_post(x, residual,
    post, comb) with stream j = post_j * x + sum_i comb_ij * residual_i, where residual holds the streams
    entering that FFN, x is the FFN's output and post, comb are the weights the hyper-connection computed
    from residual. Returned per layer idx: [Bz, T, hc_mult, H], the streams vLLM records for aux id idx + 1
    before it averages them."""
    seen, hooks = {}, []
    for idx, layer in enumerate(decoder(model).layers):
        def ffn_hc(_m, args, out, idx=idx):
            seen[idx, "hc"] = (args[0], out[0], out[1])  # residual streams, post [.., n], comb [.., n, n]

        def mlp(_m, _args, out, idx=idx):
            seen[idx, "x"] = out

        hooks += [layer.ffn_hc.register_forward_hook(ffn_hc), layer.mlp.register_forward_hook(mlp)]
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for idx in range(len(decoder(model).layers)):
        residual, post, comb = seen[idx, "hc"]
        x = seen[idx, "x"]
        out.append(post.unsqueeze(-1) * x.unsqueeze(-2) + torch.einsum("btij,btid->btjd", comb, residual))
    return out


def vllm_aux(model, ids, layer_ids) -> list[torch.Tensor]:
    """The aux states vLLM 0.33 hands a drafter with these target_layer_ids (aux ids L + 1): the streams'
    mean (`mean(dim=1)` of [T, hc_mult, H]; hc_contract)."""
    streams = vllm_streams(model, ids)
    aux_ids = [L + 1 for L in layer_ids]  # gpu_model_runner: `i + 1 for i in target_layer_ids`
    return [streams[idx].mean(dim=2) for idx in range(len(streams)) if idx + 1 in aux_ids]


@pytest.mark.parametrize("arch", FAMILIES)
def test_features_are_the_aux_states_vllm_records(arch):
    model = tiny(arch)
    t = TargetModel(model, None, [0, 1, 2])
    ids = torch.randint(3, V - 1, (2, 14), generator=torch.Generator().manual_seed(0))
    out = t(ids)
    with torch.no_grad():
        torch.testing.assert_close(out.logits, model(input_ids=ids).logits, rtol=0, atol=0)  # clause 3
    want = vllm_aux(model, ids, t.layer_ids)
    streams = vllm_streams(model, ids)
    H = t.hidden_size
    for k, L in enumerate(t.layer_ids):
        got = out.features[..., k * H:(k + 1) * H]
        torch.testing.assert_close(got, want[k], rtol=0, atol=1e-5)
        # not a neighbour layer's state, and not any one stream of this layer's
        for other in (L - 1, L + 1):
            if 0 <= other < t.num_layers:
                assert (got - streams[other].mean(dim=2)).abs().max() > 1e-3, (L, other)
        for s in range(streams[L].shape[2]):
            assert (got - streams[L][:, :, s]).abs().max() > 1e-3, (L, s)


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_final_state_is_the_final_norm_of_the_last_mean_only_for_glm5_next(arch):
    """What an engine's capture reads the labels from (id n and the target's final norm): GLM-5-Next's final
    state is that (its hc_head is a plain mean); DeepSeek-V4's hc_head weighs the streams by learned gates,
    so `--engine vllm` is refused for it in one line."""
    from blockdraft.engines.vllm.capture import check_can_capture
    from blockdraft.target.layers import final_from_mean_state

    model = tiny(arch)
    t = TargetModel(model, None, [1])
    ids = torch.randint(3, V - 1, (1, 12), generator=torch.Generator().manual_seed(2))
    final = t(ids, return_final_hidden=True).final_hidden
    with torch.no_grad():
        from_mean = decoder(model).norm(vllm_streams(model, ids)[-1].mean(dim=2))
    same = bool(torch.allclose(final, from_mean, rtol=0, atol=1e-5))
    assert same == final_from_mean_state(model.config) == (arch == "glm5_next")
    if not same:
        with pytest.raises(ValueError, match="cannot give .* labels: its last layer's state") as e:
            check_can_capture(t)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch", [present("glm5_next")])
def test_greedy_speculative_output_is_the_targets_own_greedy_decode(arch):
    from .test_wrappers import assert_greedy_identity

    model = tiny(arch)
    assert_greedy_identity(model, TargetModel(model, None, [0, 2]))


@pytest.mark.parametrize("arch", [present("deepseek_v4")])
def test_deepseek_v4_generation_is_refused_in_one_line(arch):
    """transformers' DeepSeek-V4 cache layers for compressed attention cannot be cropped (their compressor
    state is not rolled back), so the rejected drafts of a verification could not be taken back. Its plain
    greedy decoding (a cache that only grows) is still the model's own."""
    from blockdraft.generate import speculative_generate
    from blockdraft.generate.baseline import target_greedy
    from blockdraft.target.model import CropRefused

    model = tiny(arch)
    t = TargetModel(model, None, [0, 2])
    d = DFlashDrafter(DrafterConfig.for_target(t, num_layers=1, block_size=4)).eval()
    ids = torch.randint(3, V - 1, (1, 9), generator=torch.Generator().manual_seed(1))
    with pytest.raises(CropRefused, match=r"DeepseekV4CSACache\) cannot be cropped \(its compressor") as e:
        speculative_generate(t, d, ids, max_new_tokens=8)
    assert "\n" not in str(e.value)
    want = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert target_greedy(t, ids, max_new_tokens=8).tokens == want[0, ids.shape[1]:].tolist()


def test_a_hyper_connection_family_vllm_records_nothing_for_is_refused_in_one_line():
    """HY-V4 (hc_mult streams too): vLLM 0.33's HYV4ForCausalLM gives no aux states, so there is no served
    definition to match; the target is refused after loading, naming why."""
    import transformers as tf

    if not hasattr(tf, "HYV4Config"):
        pytest.skip("transformers has no HYV4Config")
    cfg = tf.HYV4Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, hc_mult=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"output 2 residual streams per token \(hyper-connections\), and vLLM 0.33 "
                                         r"records no layer states for it") as e:
        TargetModel(model, None, [0])
    assert "\n" not in str(e.value)


def run(capsys, *argv: str) -> tuple[int, str]:
    from blockdraft.cli import main

    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.slow  # SmolLM2's tokenizer, doctor twice and a short training run
@pytest.mark.parametrize("arch", FAMILIES)
def test_doctor_and_a_short_train_on_a_saved_hyper_connection_target(arch, tmp_path, capsys, smollm2_tokenizer,
                                                                     chat_data):
    """Doctor's labels and greedy identity pass (DeepSeek-V4's generation is skipped, naming why), a short run
    trains, and its drafter serves what it trained (serving = training) where blockdraft can generate."""
    target = tmp_path / arch
    model = tiny_causal_lm(arch, vocab=len(smollm2_tokenizer), layers=8, max_positions=1024)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    model.save_pretrained(target)
    smollm2_tokenizer.save_pretrained(target)
    generates = arch != "deepseek_v4"
    rc, out = run(capsys, "doctor", "--target", str(target), "--threads", "1")
    assert rc == 0 and "FAIL" not in out and "PASS  labels" in out, out
    assert ("PASS  greedy identity" if generates else "SKIP  greedy identity") in out, out
    assert generates or "(DeepseekV4CSACache) cannot be cropped" in out, out
    from .test_wrappers import train_then_doctor

    out = train_then_doctor(capsys, target, chat_data, tmp_path / "run")
    assert ("PASS  serving = training" if generates else "SKIP  serving = training") in out, out
