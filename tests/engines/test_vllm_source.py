"""The reader of vLLM's model source (engines/vllm/source.py) on small trees laid out as vLLM's two layouts:
one module per family under model_executor/models/ (named relative to it in the registry), and vLLM 0.33's
family packages under vllm/models/<family>/ (named in full, "vllm.models.<family>"), whose __init__ imports
the class of the platform it runs on, or declares it for type checkers and hands it out lazily."""

from __future__ import annotations

from pathlib import Path

from blockdraft.engines.vllm.source import Plan, Source, read_tables, registry

WRAPPER = '''
class {name}(nn.Module{bases}):
    def __init__(self, *, vllm_config, prefix=""):
        self.model = {inner}(vllm_config=vllm_config)

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)
'''
DECODER = '''
class {name}(nn.Module):
    def forward(self, input_ids, positions):
        hidden_states, residual = self.embed(input_ids), None
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        return self.norm(hidden_states, residual)
'''
EAGLE = "from vllm.model_executor.models.interfaces import SupportsEagle3\n"
LAZY = '''from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from .model import LazyForCausalLM

def __getattr__(name):
    from . import model
    return getattr(model, name)
'''
PACKAGE = '''from vllm.platforms import current_platform
if current_platform.is_rocm():
    from .amd.model import FamForCausalLM
elif current_platform.is_cpu() or current_platform.device_type == "tpu":
    raise NotImplementedError("no")
else:
    from .nvidia.model import FamForCausalLM
    from .nvidia.model import FamForCausalLM as FamAliasForCausalLM
'''


def write(root: Path, rel: str, text: str) -> None:
    path = root / "vllm" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def tree(tmp_path: Path) -> Path:
    """Both layouts in one vLLM tree: `old` (a family module), `vllm.models.fam` (a family package whose
    NVIDIA class declares SupportsEagle3 and whose AMD class is a plain wrapper the plugin plans),
    `vllm.models.lazy` (declared under TYPE_CHECKING only), `vllm.models.mixed` (a wrapper of its own around
    a decoder of the first layout, imported absolutely and two levels up)."""
    write(tmp_path, "model_executor/models/registry.py", '''_TEXT_GENERATION_MODELS = {
    "OldForCausalLM": ("old", "OldForCausalLM"),
    "FamForCausalLM": ("vllm.models.fam", "FamForCausalLM"),
    "FamAliasForCausalLM": ("vllm.models.fam", "FamAliasForCausalLM"),
    "LazyForCausalLM": ("vllm.models.lazy", "LazyForCausalLM"),
    "MixedForCausalLM": ("vllm.model_executor.models.mixed_old", "MixedForCausalLM"),
    "PkgMixedForCausalLM": ("vllm.models.mixed", "PkgMixedForCausalLM"),
}
''')
    write(tmp_path, "model_executor/models/interfaces.py", "class SupportsEagle3: pass\n")
    write(tmp_path, "model_executor/models/old.py", DECODER.format(name="OldModel")
          + WRAPPER.format(name="OldForCausalLM", bases="", inner="OldModel"))
    write(tmp_path, "model_executor/models/mixed_old.py", "from .old import OldModel\n"
          + WRAPPER.format(name="MixedForCausalLM", bases="", inner="OldModel"))
    write(tmp_path, "models/fam/__init__.py", PACKAGE)
    write(tmp_path, "models/fam/nvidia/model.py", EAGLE + DECODER.format(name="FamModel")
          + WRAPPER.format(name="FamForCausalLM", bases=", SupportsEagle3", inner="FamModel"))
    write(tmp_path, "models/fam/amd/model.py", "from ..common.layers import FamModel\n"
          + WRAPPER.format(name="FamForCausalLM", bases="", inner="FamModel"))
    write(tmp_path, "models/fam/common/layers.py", DECODER.format(name="FamModel"))
    write(tmp_path, "models/lazy/__init__.py", LAZY)
    write(tmp_path, "models/lazy/model.py", EAGLE + "class LazyForCausalLM(nn.Module, SupportsEagle3): pass\n")
    write(tmp_path, "models/mixed/__init__.py", "from .nvidia.model import PkgMixedForCausalLM\n")
    write(tmp_path, "models/mixed/nvidia/model.py", "from vllm.model_executor.models.old import OldModel\n"
          + WRAPPER.format(name="PkgMixedForCausalLM", bases="", inner="OldModel"))
    return tmp_path / "vllm"


def test_the_registry_names_modules_of_both_layouts(tmp_path):
    got = registry(tree(tmp_path) / "model_executor" / "models")
    assert got["OldForCausalLM"] == ("old", "OldForCausalLM")
    assert got["FamForCausalLM"] == ("vllm.models.fam", "FamForCausalLM")
    assert got["MixedForCausalLM"] == ("mixed_old", "MixedForCausalLM")  # named in full, read as the first layout


def test_a_family_package_is_read_through_its_platforms_branch(tmp_path):
    models = tree(tmp_path) / "model_executor" / "models"
    cuda, rocm = Source(models), Source(models, platform="rocm")
    assert cuda.resolve("vllm.models.fam", "FamForCausalLM")[0] == "vllm.models.fam.nvidia.model"
    assert rocm.resolve("vllm.models.fam", "FamForCausalLM")[0] == "vllm.models.fam.amd.model"
    assert cuda.supports_eagle3("vllm.models.fam", "FamForCausalLM")
    assert cuda.supports_eagle3("vllm.models.fam", "FamAliasForCausalLM")  # `import X as Y`: X is read
    assert not rocm.supports_eagle3("vllm.models.fam", "FamForCausalLM")
    assert rocm.plan("vllm.models.fam", "FamForCausalLM") == Plan("vllm.models.fam.common.layers", "FamModel", True)
    assert Source(models, platform="cpu").resolve("vllm.models.fam", "FamForCausalLM") is None
    assert cuda.supports_eagle3("vllm.models.lazy", "LazyForCausalLM")  # declared under TYPE_CHECKING only
    assert cuda.plan("vllm.models.mixed", "PkgMixedForCausalLM") == Plan("old", "OldModel", True)


def test_the_tables_hold_both_layouts_classes(tmp_path):
    native, plugin = read_tables(tree(tmp_path))
    assert native == {"FamForCausalLM", "FamAliasForCausalLM", "LazyForCausalLM"}
    assert plugin == {"OldForCausalLM", "MixedForCausalLM", "PkgMixedForCausalLM"}


def test_a_class_the_package_does_not_import_is_named_with_its_package(tmp_path):
    models = tree(tmp_path) / "model_executor" / "models"
    got = Source(models).plan("vllm.models.fam", "NoneForCausalLM")
    assert got == "NoneForCausalLM is not in vLLM's vllm.models.fam"
    assert Source(models).plan("old", "NoneForCausalLM") == "NoneForCausalLM is not in vLLM's old.py"
