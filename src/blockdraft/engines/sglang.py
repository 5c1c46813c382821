"""SGLang as a consumer of blockdraft's drafters (one `Consumer` of blockdraft.engines): it reads the
z-lab layout and serves DFlash drafters only (`SGLANG_READ`), for the HF architectures below.

SGLang's DFlash worker asks the target model for its drafter's context once, before CUDA graphs
are captured: the model runner calls `model.set_dflash_layers_to_capture(layer_ids)` when the
model has that attribute (`hasattr`, so a method inherited from a base class counts) and refuses
to start otherwise (DSpark drafters may use `set_dspark_layers_to_capture` instead). The model is
the class the registry maps the checkpoint's `architectures[0]` onto: every module directly under
`sglang/srt/models/` names its classes in `EntryClass` (a class or a list), and a class's
`__name__` is the HF architecture it serves.

`sglang_capture()` reads that from an installed SGLang's own source (no import of SGLang): the
registry's classes, and whether each defines the method or inherits it through its bases, across
the modules they are imported from. Without SGLang it falls back on `SGLANG_CAPTURE`, read that
way from sglang SGLANG_READ (SGLANG_PROVENANCE; `python -m blockdraft.engines.sglang PATH/TO/sglang` prints it again).

What SGLang's DFlash draft model (srt/models/dflash.py, srt/speculative/dflash_utils.py) takes
from a drafter's config: `layer_types` with "sliding_attention" layers and `sliding_window` (the HF
convention, current token included); in-block attention bidirectional by default for full layers and
causal by default for sliding ones, `is_causal` in the config deciding for all; no head of its own: it
borrows the target's `lm_head` over the full vocabulary, and weights it does not know (a d2t map, head
rows) are skipped when loading, so a drafter with a reduced draft vocabulary is not served as trained.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from ..config import WINDOW_ANCHOR, DrafterConfig
from ..releases import SGLANG_RELEASE
from .base import ANCHOR_RULE_SERVED, Difference, Consumer, ignores_draft_vocab, installed_tree, installed_version

CAPTURE_METHOD = "set_dflash_layers_to_capture"
SGLANG_READ = SGLANG_RELEASE
SGLANG_PROVENANCE = (f"sglang {SGLANG_READ}: its release wheel (cp311 manylinux_2_34, files dated 2026-10-30, "
                     "sha256 00b3cd5b265a...); the wheel records no git commit, and the repository's snapshot "
                     "was too large to bring here")
# 70 of the 290 registered architectures. Not listed though SGLang can capture them: MiniCPM-V 4.6 / 4.7
# (MiniCPMV4_6ForConditionalGeneration, ...), whose class forwards attributes through `__getattr__` to a
# per-version instance that has the method; a static reader cannot follow that, and misses it (a warning,
# never a false pass). Listed though no target: the registry's own draft/MTP classes that inherit it.
SGLANG_CAPTURE = frozenset((
    "BeamForCausalLM", "Cosmos3ForConditionalGeneration", "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM",
    "DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMNextN", "Gemma4AssistantForCausalLM", "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration", "Gemma4UnifiedAssistantForCausalLM",
    "Gemma4UnifiedForConditionalGeneration", "Glm4MoeLiteForCausalLM", "Glm4MoeLiteForCausalLMNextN",
    "Glm5NextForConditionalGeneration", "Glm5NextForConditionalGenerationNextN", "GlmMoeDsaForCausalLM",
    "GlmMoeDsaForCausalLMNextN", "GptOssForCausalLM", "IQuestCoderForCausalLM",
    "InklingForConditionalGeneration", "InternLM3ForCausalLM", "InternS1ProForConditionalGeneration",
    "InternS2MobiusForConditionalGeneration", "InternS2PreviewForConditionalGeneration",
    "KimiK25ForConditionalGeneration", "KimiK3ForConditionalGeneration", "KimiK3LinearForCausalLM",
    "LagunaForCausalLM", "Lfm2BidirectionalModel", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM",
    "Lfm2VlForConditionalGeneration", "Llama4ForCausalLM", "LlamaForCausalLM", "LlamaForCausalLMEagle",
    "LlamaForCausalLMEagle3", "MellumForCausalLM", "MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM", "MiMoV2MTP",
    "MiniMaxM3SparseForConditionalGeneration", "Ministral3ForCausalLM", "MistralForCausalLM",
    "MistralForCausalLMEagle", "MistralLarge3ForCausalLM", "MistralLarge3ForCausalLMEagle",
    "MuseGlimmerForCausalLM", "MuseGlimmerForConditionalGeneration", "MuseSparkForConditionalGeneration",
    "NanbeigeForCausalLM", "NemotronHForCausalLM", "NemotronHForCausalLMMTP", "NemotronHPuzzleForCausalLM",
    "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Nano_VL_V2", "NemotronH_Omni_Reasoning_V3",
    "Phi3ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3MoeForCausalLMMTP",
    "Qwen3NextForCausalLM", "Qwen3NextForCausalLMMTP", "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen4ExpForConditionalGeneration",
    "TeleFLMForCausalLM"
))


def _package_dir(sglang_python_dir: Path) -> Path:
    """The `sglang` package folder: given itself, or a folder holding it (a checkout's python/)."""
    d = Path(sglang_python_dir)
    return d / "sglang" if (d / "sglang" / "srt").is_dir() and not (d / "srt").is_dir() else d


class Modules:
    """SGLang's modules read as syntax trees: the names each binds at module level (classes,
    aliases, imports), and whether a class has CAPTURE_METHOD, itself or through its bases."""

    def __init__(self, package: Path, method: str = CAPTURE_METHOD):
        self.package, self.method = package, method
        self.names: dict[str, dict | None] = {}
        self.trees: dict[str, ast.Module] = {}
        self.memo: dict[tuple[str, str], bool] = {}

    def _path(self, dotted: str) -> Path | None:
        parts = dotted.split(".")
        if parts[0] != "sglang":
            return None
        base = self.package.joinpath(*parts[1:])
        for path in (base.with_suffix(".py") if len(parts) > 1 else None, base / "__init__.py"):
            if path is not None and path.is_file():
                return path
        return None

    def is_module(self, dotted: str) -> bool:
        return self._path(dotted) is not None

    def bindings(self, dotted: str) -> dict | None:
        """name -> ("class", ClassDef) | ("alias", expr) | ("from", module, name) | ("module", dotted)."""
        if dotted not in self.names:
            path = self._path(dotted)
            self.names[dotted] = None if path is None else self._bind(dotted, path, self.tree(dotted))
        return self.names[dotted]

    def tree(self, dotted: str) -> ast.Module:
        if dotted not in self.trees:
            self.trees[dotted] = ast.parse(self._path(dotted).read_text())
        return self.trees[dotted]

    @staticmethod
    def _statements(body):
        """Module-level statements, into if/try/with blocks (definitions made conditionally)."""
        for node in body:
            yield node
            for field in ("body", "orelse", "finalbody"):
                if isinstance(node, (ast.If, ast.Try, ast.With)) and getattr(node, field, None):
                    yield from Modules._statements(getattr(node, field))
            for handler in getattr(node, "handlers", ()) if isinstance(node, ast.Try) else ():
                yield from Modules._statements(handler.body)

    def _bind(self, dotted: str, path: Path, tree: ast.Module) -> dict:
        package = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
        out: dict = {}
        for node in self._statements(tree.body):
            if isinstance(node, ast.ClassDef):
                out[node.name] = ("class", node)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and isinstance(node.value, (ast.Name, ast.Attribute)):
                out[node.targets[0].id] = ("alias", node.value)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    up = package.split(".")
                    up = up[:len(up) - (node.level - 1)] if node.level > 1 else up
                    source = ".".join(up + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:
                    if a.name != "*":
                        out[a.asname or a.name] = ("from", source, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        out[a.asname] = ("module", a.name)
                    else:
                        out[a.name.split(".")[0]] = ("module", a.name.split(".")[0])
        return out

    def resolve(self, module: str, expr, depth: int = 0):
        """What `expr` names in `module`: ("class", module, ClassDef), ("module", dotted) or None."""
        if depth > 24:
            return None
        if isinstance(expr, ast.Subscript):  # Generic[T] and the like
            return self.resolve(module, expr.value, depth + 1)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve(module, expr.value, depth + 1)
            return self.member(owner[1], expr.attr, depth + 1) if owner and owner[0] == "module" else None
        if isinstance(expr, ast.Name):
            return self.member(module, expr.id, depth + 1, own=True)
        return None

    def member(self, module: str, name: str, depth: int = 0, own: bool = False):
        """`name` as bound in `module` (or, for `from pkg import sub`, the submodule pkg.sub)."""
        b = (self.bindings(module) or {}).get(name)
        if b is None:
            return ("module", f"{module}.{name}") if not own and self.is_module(f"{module}.{name}") else None
        kind = b[0]
        if kind == "class":
            return ("class", module, b[1])
        if kind == "alias":
            return self.resolve(module, b[1], depth + 1)
        if kind == "module":
            return ("module", b[1]) if self.is_module(b[1]) else None
        _, source, original = b
        if self.bindings(source) is None:
            return None
        return self.member(source, original, depth + 1) if depth <= 24 else None

    def has_method(self, module: str, cls: ast.ClassDef, depth: int = 0) -> bool:
        key = (module, f"{cls.name}@{cls.lineno}")
        if key in self.memo or depth > 24:
            return self.memo.get(key, False)
        self.memo[key] = False  # a base cycle reads as "not found"
        for node in self._statements(cls.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == self.method or \
                    isinstance(node, ast.Assign) and any(getattr(t, "id", "") == self.method for t in node.targets):
                self.memo[key] = True
                return True
        for base in cls.bases:
            found = self.resolve(module, base)
            if found and found[0] == "class" and self.has_method(found[1], found[2], depth + 1):
                self.memo[key] = True
                return True
        return False


def registry(mods: Modules) -> dict[str, tuple[str, ast.ClassDef]]:
    """HF architecture -> (module, class) from each model module's `EntryClass`, as SGLang's
    registry builds it (modules directly under srt/models, the class's own name as the key)."""
    models = mods.package / "srt" / "models"
    if not models.is_dir():
        raise ValueError(f"{mods.package} holds no srt/models folder: not an SGLang source tree")
    out: dict[str, tuple[str, ast.ClassDef]] = {}
    for path in sorted(models.glob("*.py")):
        if path.name == "__init__.py":
            continue
        dotted = f"sglang.srt.models.{path.stem}"
        entry = None
        for node in mods.tree(dotted).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EntryClass" for t in node.targets):
                entry = node.value
            elif isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "EntryClass":
                entry = node.value
        for elt in entry.elts if isinstance(entry, (ast.List, ast.Tuple)) else [entry] if entry is not None else []:
            found = mods.resolve(dotted, elt)
            if found and found[0] == "class":
                out.setdefault(found[2].name, (found[1], found[2]))
    return out


def read_sglang_capture(sglang_python_dir: Path, method: str = CAPTURE_METHOD) -> frozenset[str]:
    """The HF architectures whose SGLang class has `method` (its own or inherited), read from an
    SGLang source tree: the `sglang` package folder or a folder holding it."""
    mods = Modules(_package_dir(sglang_python_dir), method)
    return frozenset(arch for arch, (module, cls) in registry(mods).items()
                     if mods.has_method(module, cls))


def sglang_capture() -> tuple[frozenset[str], str]:
    """(architectures, where the list comes from): the installed SGLang's, else the table above."""
    root = installed_tree("sglang", "srt/models/registry.py")
    if root is not None:
        try:
            return read_sglang_capture(root), f"the installed SGLang {installed_version('sglang')}"
        except (OSError, SyntaxError, ValueError, RecursionError):  # a tree this reader does not follow
            pass
    return SGLANG_CAPTURE, f"sglang {SGLANG_READ} (read when blockdraft was written; SGLang is not installed here)"


def quirks(fmt: str, cfg: DrafterConfig) -> list[Difference]:
    """What SGLang does with the z-lab layout that the drafter's function does not say."""
    if fmt != "zlab":
        return []
    out = []
    if cfg.has_sliding and cfg.sliding_window_rule == WINDOW_ANCHOR:
        out.append(Difference("SGLang", True, ANCHOR_RULE_SERVED))
    if cfg.draft_vocab_size:
        out.append(Difference("SGLang", False, ignores_draft_vocab(cfg)))
    if cfg.kind != "dflash":
        out.append(Difference("SGLang", False, f"serves DFlash drafters only ({SGLANG_READ}): this {cfg.kind} "
                                               "drafter's added modules would not run there"))
    return out


CONSUMER = Consumer(
    name="SGLang", release=f"SGLang {SGLANG_READ}", formats=("zlab",), kinds={"dflash": ""},
    refused_kinds={"dspark": "DFlash drafters only", "dflash2": "DFlash drafters only",
                   "lilicorr": "DFlash drafters only (its LiLiCorr PR #37462 is not in this release)",
                   "domino": "its Domino (PR #36899) not read here"},
    capture=sglang_capture, capture_rule=(CAPTURE_METHOD, f"its class lacks {CAPTURE_METHOD}"),
    capture_check="target capture (SGLang)", capture_refused="SGLang's DFlash worker refuses it",
    capture_fix="serve with another engine (vLLM, llama.cpp, blockdraft) or an SGLang that adds it",
    quirks=quirks,
)


if __name__ == "__main__":
    print("\n".join(sorted(read_sglang_capture(Path(sys.argv[1])))))
