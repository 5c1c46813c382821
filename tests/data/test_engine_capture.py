"""Features from vLLM, on the readers' side, without vLLM: the ids blockdraft asks the engine for, the
documents it sends, the engine's arguments, and the target's outputs put together from files laid out
as vLLM's hidden-states connector writes them (`hidden_states` [T, k, Ht] in ascending aux-id order,
`token_ids` [T]). The stand-in here runs transformers' own model on each document alone; the vLLM engine
itself is judged in the reference suite (reference/test_vllm_extract.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from blockdraft.data.features import DiskFeatures, extract
from blockdraft.engines.vllm.capture import StateReader, capture_ids, check_can_capture, segment_name, segments
from blockdraft.engines.vllm.feed import engine_kwargs
from blockdraft.target import final_norm_of
from conftest import tiny_rows, tiny_target
from engine_stub import document_states


def test_the_engine_is_asked_for_the_inputs_of_the_next_layers_and_the_last_output():
    # vLLM's aux id k is the input of layer k: blockdraft's layer L (its output) is id L + 1
    assert capture_ids([1, 9, 17, 25, 33], 36) == [2, 10, 18, 26, 34, 36]
    assert capture_ids([3, 0], 6) == [1, 4, 6]
    assert capture_ids([5], 6) == [6]  # the last layer's output is asked for once


def test_documents_are_the_spans_where_positions_restart():
    rows = tiny_rows(3, L=40)
    rows["position_ids"][1, 30:] = torch.arange(10)  # a third span in row 1 (say, the padding)
    got = segments(rows, [0, 1, 2])
    want = []  # brute force: a span ends before each later position 0
    for r in range(3):
        starts = [j for j in range(40) if rows["position_ids"][r, j] == 0]
        want += [(r, s, e) for s, e in zip(starts, starts[1:] + [40])]
    assert got == want and (1, 30, 40) in got
    rows["position_ids"][2, 0] = 3
    with pytest.raises(ValueError, match="positions must start at 0"):
        segments(rows, [2])


def test_the_engine_runs_with_no_prefix_cache_and_blockdrafts_ids():
    kw = engine_kwargs({"target": "/m", "dtype": "float32", "tmp_dir": "/t", "aux_ids": [2, 9, 30],
                        "max_model_len": 520, "kv_bytes": 2**28})
    assert kw["enable_prefix_caching"] is False  # a cached prefix would be skipped and its states never written
    assert kw["skip_tokenizer_init"] is True  # token ids in: a target directory needs no tokenizer
    spec = kw["speculative_config"]
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 9, 30]
    conn = kw["kv_transfer_config"]  # blockdraft's connector on a CPU and on CUDA alike
    assert conn["kv_connector_module_path"] == "blockdraft.engines.vllm.connector"
    assert conn["kv_connector"] == "BlockdraftHiddenStatesConnector"
    # a CPU engine asks for its KV space in bytes; a GPU one for a share of each GPU
    assert kw["kv_cache_memory_bytes"] == 2**28 and "gpu_memory_utilization" not in kw
    gpu = engine_kwargs({"target": "/m", "dtype": "bfloat16", "tmp_dir": "/t", "aux_ids": [2], "max_model_len": 9,
                         "memory": 0.8, "quantization": "fp8"})
    assert gpu["gpu_memory_utilization"] == 0.8 and "kv_cache_memory_bytes" not in gpu and gpu["quantization"] == "fp8"


def engine_files(target, rows, directory, ids):
    """What vLLM writes per document: the state entering each asked layer k (transformers'
    hidden_states[k] for k < n) and, for k = n, the last layer's output before the final norm."""
    directory.mkdir(parents=True, exist_ok=True)
    n = target.num_layers
    for r, s, e in segments(rows, range(rows["input_ids"].shape[0])):
        tok = rows["input_ids"][r, s:e]
        states = document_states(target.model, target._layers[n - 1], n, tok.tolist(), ids)  # [T, k, Ht]
        save_file({"hidden_states": states, "token_ids": tok.clone()},
                  str(directory / f"{segment_name((r, s, e))}.safetensors"))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: a (1 + w) final norm and soft-capping
def test_a_cache_from_engine_files_equals_the_transformers_cache(tmp_path, arch):
    t = tiny_target(arch, num_features=3)
    rows = tiny_rows(5)
    extract(t, rows, tmp_path / "hf", shard_rows=2, progress=False)
    ids = capture_ids(t.layer_ids, t.num_layers)
    d = tmp_path / "engine-states"
    engine_files(t, rows, d, ids)
    reader = StateReader(t, rows, final_norm_of(t.model), 4)
    extract(t, rows, tmp_path / "eng", shard_rows=2, progress=False, identity={"engine": "vllm"},
            outputs=lambda idx: reader.assemble(idx, lambda seg: files_of(d, seg)),
            info={"engine_dtype": "float32", "quantization": None})
    a, b = DiskFeatures(tmp_path / "hf"), DiskFeatures(tmp_path / "eng")
    x, y = a(torch.arange(5)), b(torch.arange(5))
    torch.testing.assert_close(y.features, x.features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.final_hidden, x.final_hidden, rtol=1e-5, atol=1e-5)
    assert torch.equal(y.top, x.top)
    with torch.no_grad():  # and the labels are the model's own logits
        for s, e in ((0, 20), (20, 40)):  # each document run alone
            torch.testing.assert_close(t.head(y.final_hidden[:1, s:e]), t.model(rows["input_ids"][:1, s:e]).logits,
                                       rtol=1e-4, atol=1e-4)
    assert b.manifest["engine"] == "vllm" and b.manifest["engine_dtype"] == "float32"
    assert "engine_dtype" not in a.manifest


def files_of(d, seg):
    """A segment's states, read from its file as the spool's reader reads them."""
    from blockdraft.engines.vllm.states import read_states

    path = d / f"{segment_name(seg)}.safetensors"
    return read_states(str(path)), path


def test_engine_files_for_other_tokens_are_refused(tmp_path):
    t = tiny_target("llama", num_features=2)
    rows = tiny_rows(2)
    d = tmp_path / "engine-states"
    engine_files(t, rows, d, capture_ids(t.layer_ids, t.num_layers))
    other = dict(rows, input_ids=rows["input_ids"].roll(1, dims=1))
    with pytest.raises(ValueError, match="holds other tokens"):
        StateReader(t, other, final_norm_of(t.model), 4).assemble(torch.tensor([0]), lambda seg: files_of(d, seg))


def test_a_target_vllm_cannot_capture_gets_one_line_naming_the_other_paths():
    from types import SimpleNamespace

    def target(arch):
        return SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(architectures=[arch])))

    with pytest.raises(ValueError) as e:
        check_can_capture(target("BloomForCausalLM"))  # no `self.model` decoder for the plugin to rewrite
    msg = str(e.value)
    assert "\n" not in msg and "BloomForCausalLM" in msg and "--engine transformers" in msg and "--target-fsdp" in msg
    check_can_capture(target("LlamaForCausalLM"))  # vLLM's own class
    check_can_capture(target("Glm4MoeForCausalLM"))  # through blockdraft's vLLM plugin
