"""Which targets SGLang can serve a DFlash drafter for (blockdraft.engines.sglang): the reader on a
small made-up SGLang tree (EntryClass -> class -> the method, its own or inherited across modules),
the committed table against architectures checked by hand, and the fallback without SGLang."""

from __future__ import annotations

import pytest

from blockdraft.engines import base as serving_base
from blockdraft.engines.sglang import SGLANG_CAPTURE, read_sglang_capture, sglang_capture

HAS = "    def set_dflash_layers_to_capture(self, layer_ids):\n        self.ids = layer_ids\n"


def write(tree, dotted, text):
    path = tree.joinpath(*dotted.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def make_tree(root):
    """A checkout's python/ folder: sglang/srt/models/* with one registry entry of each kind."""
    write(root, "sglang.__init__", "")
    write(root, "sglang.srt.models.registry", "class _ModelRegistry: pass\n")
    write(root, "sglang.srt.layers.mixins", f"class CaptureMixin:\n{HAS}")
    # A class with the method itself, another in the same module inheriting it, an alias that
    # renames nothing (the registry keys by the class's own name), and one without the method.
    write(root, "sglang.srt.models.alpha",
          f"import torch.nn as nn\nclass AlphaForCausalLM(nn.Module):\n{HAS}"
          "class AlphaChildForCausalLM(AlphaForCausalLM):\n    pass\n"
          "class AlphaModel(nn.Module):\n    pass\n"
          "Renamed = AlphaChildForCausalLM\n"
          "EntryClass = [AlphaForCausalLM, Renamed, AlphaModel]\n")
    # Inherited across modules: imported absolutely, relatively, and through a module alias.
    write(root, "sglang.srt.models.beta",
          "from sglang.srt.models.alpha import AlphaForCausalLM\nclass BetaForCausalLM(AlphaForCausalLM):\n"
          "    pass\nEntryClass = BetaForCausalLM\n")
    write(root, "sglang.srt.models.gamma",
          "from .alpha import AlphaForCausalLM as Base\nclass GammaForCausalLM(Base):\n    pass\n"
          "EntryClass = [GammaForCausalLM]\n")
    write(root, "sglang.srt.models.delta",
          "import sglang.srt.layers.mixins as mx\nimport torch.nn as nn\n"
          "class DeltaForCausalLM(nn.Module, mx.CaptureMixin):\n    pass\nEntryClass = DeltaForCausalLM\n")
    # Without it: another method of the same family (EAGLE3's), a base that lacks it, a base cycle,
    # a class whose base cannot be found, and a module with no EntryClass (not registered).
    write(root, "sglang.srt.models.eps",
          "import torch.nn as nn\nclass EpsForCausalLM(nn.Module):\n"
          "    def set_eagle3_layers_to_capture(self, layer_ids):\n        pass\n"
          "class EpsChild(EpsForCausalLM):\n    pass\nEntryClass = [EpsForCausalLM, EpsChild]\n")
    write(root, "sglang.srt.models.zeta",
          "from transformers import PreTrainedModel\nclass ZetaForCausalLM(PreTrainedModel):\n    pass\n"
          "from .zeta import Loop as Itself\nclass Loop(Itself):\n    pass\n"
          "EntryClass = [ZetaForCausalLM, Loop]\n")
    write(root, "sglang.srt.models.helpers", f"class HelperForCausalLM:\n{HAS}")


def test_the_reader_follows_entry_classes_and_bases(tmp_path):
    make_tree(tmp_path)
    expected = {"AlphaForCausalLM", "AlphaChildForCausalLM", "BetaForCausalLM", "GammaForCausalLM",
                "DeltaForCausalLM"}
    assert read_sglang_capture(tmp_path) == expected  # a checkout's python/ folder
    assert read_sglang_capture(tmp_path / "sglang") == expected  # the package folder itself
    assert read_sglang_capture(tmp_path, "set_eagle3_layers_to_capture") == {"EpsForCausalLM", "EpsChild"}


def test_the_reader_refuses_a_tree_without_models(tmp_path):
    (tmp_path / "sglang").mkdir()
    with pytest.raises(ValueError):
        read_sglang_capture(tmp_path)


def test_the_committed_table():
    # Checked by hand in sglang 0.5.23: each defines set_dflash_layers_to_capture in its own class
    # (llama.py, qwen3.py, qwen3_moe.py, qwen3_next.py, qwen3_5.py, deepseek_v2.py, gpt_oss.py,
    # nemotron_h.py) or inherits it from LlamaForCausalLM (mistral.py's MistralForCausalLM,
    # llama.py's Phi3ForCausalLM, llama4.py's Llama4ForCausalLM).
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
                 "Qwen3_5ForConditionalGeneration", "DeepseekV3ForCausalLM", "GptOssForCausalLM",
                 "NemotronHForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Llama4ForCausalLM"):
        assert arch in SGLANG_CAPTURE, arch
    # Checked by hand: no such method in qwen2.py, glm4_moe.py (Glm4MoeForCausalLM), minimax_m2.py,
    # gemma3_causal.py (these four have EAGLE3's set_eagle3_layers_to_capture only), mixtral.py,
    # gemma2.py, olmo2.py, granite.py, commandr.py, glm4.py, falcon_h1.py.
    for arch in ("Qwen2ForCausalLM", "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Gemma3ForCausalLM",
                 "MixtralForCausalLM", "Gemma2ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
                 "CohereForCausalLM", "Glm4ForCausalLM", "FalconH1ForCausalLM"):
        assert arch not in SGLANG_CAPTURE, arch
    assert len(SGLANG_CAPTURE) == 70


def test_without_sglang_the_table_is_used(monkeypatch):
    monkeypatch.setattr(serving_base.importlib.util, "find_spec", lambda name: None)
    known, source = sglang_capture()
    assert known is SGLANG_CAPTURE and "0.5.23" in source and "not installed" in source


def test_an_installed_sglang_is_read(tmp_path, monkeypatch):
    make_tree(tmp_path)

    class Spec:
        submodule_search_locations = [str(tmp_path / "sglang")]

    monkeypatch.setattr(serving_base.importlib.util, "find_spec", lambda name: Spec())
    known, source = sglang_capture()
    assert "DeltaForCausalLM" in known and "LlamaForCausalLM" not in known and "installed SGLang" in source
