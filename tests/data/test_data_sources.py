"""load_conversations: schemas, file formats, and every kind of bad input."""

from __future__ import annotations

import json
import sys

import pytest

from blockdraft.data import LoadStats, load_conversations

OPENAI = {"messages": [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
]}
SHAREGPT = {"conversations": [
    {"from": "system", "value": "Be terse."},
    {"from": "human", "value": "What is 2+2?"},
    {"from": "gpt", "value": "4."},
]}
EXPECTED = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
]
NO_ASSISTANT = {"messages": [{"role": "user", "content": "anyone?"}]}


def test_both_schemas_normalise_to_the_same_messages(write_jsonl):
    convs, stats = load_conversations(write_jsonl([OPENAI, SHAREGPT]))
    assert convs == [EXPECTED, EXPECTED]
    assert stats == LoadStats(read=2, kept=2, bad_lines=0, no_assistant=0)


@pytest.mark.parametrize("name,role", [
    ("system", "system"), ("human", "user"), ("user", "user"), ("gpt", "assistant"),
    ("assistant", "assistant"), ("chatgpt", "assistant"), ("bard", "assistant"),
    ("bing", "assistant"), ("Human", "user"), ("GPT", "assistant"),
])
def test_sharegpt_role_names(write_jsonl, name, role):
    rec = {"conversations": [{"from": name, "value": "x"}, {"from": "gpt", "value": "y"}]}
    convs, _ = load_conversations(write_jsonl([rec]))
    assert convs[0][0] == {"role": role, "content": "x"}


def test_multi_turn_order_and_content_parts(write_jsonl):
    rec = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
        {"role": "assistant", "content": None},
    ]}
    convs, _ = load_conversations(write_jsonl([rec]))
    assert convs == [[{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"},
                      {"role": "user", "content": "d"}, {"role": "assistant", "content": ""}]]


IMAGE_TURN = {"messages": [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                 {"type": "text", "text": "What is in this picture?"}]},
    {"role": "assistant", "content": "A cat."},
]}


def test_an_image_part_is_refused_in_one_line_or_skipped_and_counted(write_jsonl):
    """Drafters are trained for the target's text decoder, on text: a record with an image part is bad
    input (named by file and line), which --skip-bad-lines skips and counts."""
    path = write_jsonl([OPENAI, IMAGE_TURN])
    with pytest.raises(ValueError) as e:
        load_conversations(path)
    msg = str(e.value)
    assert "\n" not in msg and f"{path.name}:2: message 0 holds a 'image_url' part" in msg, msg
    assert "trains on text alone" in msg and "--skip-bad-lines" in msg, msg
    convs, stats = load_conversations(path, skip_bad_lines=True)
    assert convs == [EXPECTED] and stats == LoadStats(read=2, kept=1, bad_lines=1, no_assistant=0)


def test_blank_lines_are_ignored_and_not_counted(write_jsonl):
    convs, stats = load_conversations(write_jsonl(["", OPENAI, "   ", SHAREGPT, ""]))
    assert len(convs) == 2 and stats.read == 2


def test_json_array_file(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([OPENAI, SHAREGPT, NO_ASSISTANT], indent=2))
    convs, stats = load_conversations(path)
    assert convs == [EXPECTED, EXPECTED]
    assert stats == LoadStats(read=3, kept=2, bad_lines=0, no_assistant=1)


def test_json_lines_under_a_json_name(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(OPENAI) + "\n" + json.dumps(SHAREGPT) + "\n")
    assert load_conversations(str(path))[0] == [EXPECTED, EXPECTED]


def test_malformed_json_array_names_file_and_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text("[\n" + json.dumps(OPENAI) + ",\n{broken\n]")
    with pytest.raises(ValueError, match=rf"{path.name}:3: malformed JSON"):
        load_conversations(path)


def test_dataset_object_duck_typed():
    class FakeDataset:  # like datasets.Dataset: iterating yields dicts
        def __iter__(self):
            yield OPENAI
            yield SHAREGPT
            yield NO_ASSISTANT

    convs, stats = load_conversations(FakeDataset())
    assert convs == [EXPECTED, EXPECTED]
    assert stats == LoadStats(read=3, kept=2, bad_lines=0, no_assistant=1)
    assert load_conversations([OPENAI])[0] == [EXPECTED]


def test_malformed_line_names_file_and_line(write_jsonl):
    path = write_jsonl([OPENAI, OPENAI, '{"messages": [', OPENAI])
    with pytest.raises(ValueError) as e:
        load_conversations(path)
    msg = str(e.value)
    assert f"{path}:3:" in msg and "malformed JSON" in msg and "skip_bad_lines=True" in msg


def test_skip_bad_lines_counts_them(write_jsonl):
    path = write_jsonl([OPENAI, "not json", SHAREGPT, "{", NO_ASSISTANT, '{"foo": 1}', "[1, 2]"])
    convs, stats = load_conversations(path, skip_bad_lines=True)
    assert convs == [EXPECTED, EXPECTED]
    assert stats == LoadStats(read=7, kept=2, bad_lines=4, no_assistant=1)


def test_invalid_utf8_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(OPENAI).encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match=rf"{path.name}:2: not valid UTF-8"):
        load_conversations(path)
    assert load_conversations(path, skip_bad_lines=True)[1].bad_lines == 1


def test_no_assistant_is_skipped_and_counted(write_jsonl):
    only_system = {"conversations": [{"from": "system", "value": "s"}]}
    empty = {"messages": []}
    convs, stats = load_conversations(write_jsonl([NO_ASSISTANT, OPENAI, only_system, empty]))
    assert convs == [EXPECTED]
    assert stats == LoadStats(read=4, kept=1, bad_lines=0, no_assistant=3)


def test_unknown_role_names_file_line_and_role(write_jsonl):
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "narrator", "content": "n"},
                        {"role": "assistant", "content": "a"}]}
    path = write_jsonl([OPENAI, bad])
    with pytest.raises(ValueError) as e:
        load_conversations(path)
    assert f"{path}:2:" in str(e.value) and "'narrator'" in str(e.value)
    convs, stats = load_conversations(path, skip_bad_lines=True)
    assert convs == [EXPECTED]
    assert stats == LoadStats(read=2, kept=1, bad_lines=1, no_assistant=0)


@pytest.mark.parametrize("record,needle", [
    ({"text": "hello"}, "no 'messages' (OpenAI) or 'conversations' (ShareGPT) key"),
    ({"messages": "hi"}, "must be a list"),
    ({"messages": [{"content": "x"}]}, "no 'role'"),
    ({"messages": [{"role": "user", "content": 3}]}, "content of type int"),
    ({"messages": ["hi"]}, "message 0 is a str"),
])
def test_malformed_records(write_jsonl, record, needle):
    path = write_jsonl([record])
    with pytest.raises(ValueError, match=rf"{path.name}:1: .*") as e:
        load_conversations(path)
    assert needle in str(e.value)


def test_record_index_for_datasets():
    with pytest.raises(ValueError, match=r"record 1: .*unknown role 'narrator'"):
        load_conversations([OPENAI, {"messages": [{"role": "narrator", "content": "x"}]}])


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match="empty|no records"):
        load_conversations(path)


def test_empty_json_list_and_dataset(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("[]")
    with pytest.raises(ValueError, match="no records"):
        load_conversations(path)
    with pytest.raises(ValueError, match="no records"):
        load_conversations([])


def test_bad_paths_and_objects(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_conversations(tmp_path / "missing.jsonl")
    other = tmp_path / "data.csv"
    other.write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown file type"):
        load_conversations(other)
    with pytest.raises(ValueError, match="iterable of records"):
        load_conversations(42)
    with pytest.raises(ValueError, match="iterable of records"):
        load_conversations(OPENAI)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1 not really")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match="pip install pyarrow"):
        load_conversations(path)


def test_parquet_with_pyarrow(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([OPENAI, OPENAI, NO_ASSISTANT]), path)
    convs, stats = load_conversations(path)
    assert convs == [EXPECTED, EXPECTED]
    assert stats == LoadStats(read=3, kept=2, bad_lines=0, no_assistant=1)
    share = tmp_path / "share.parquet"
    pq.write_table(pa.Table.from_pylist([SHAREGPT, {"conversations": [{"from": "alien", "value": "x"}]}]), share)
    with pytest.raises(ValueError, match=r"share.parquet: row 1: .*'alien'"):
        load_conversations(share)


def _records():
    return [{"messages": [{"role": "user", "content": f"q{k}"}, {"role": "assistant", "content": f"a{k}",
                                                                "reasoning_content": f"r{k}"}]} for k in range(3)]


def test_a_datasets_directory_and_a_local_hf_name_are_read_offline(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    datasets.Dataset.from_list(_records()).save_to_disk(str(tmp_path / "saved"))
    convs, stats = load_conversations(str(tmp_path / "saved"))
    assert stats.kept == 3 and convs[2][1] == {"role": "assistant", "content": "a2", "reasoning_content": "r2"}
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_records()[:2])}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_conversations(str(tmp_path / "dict"))[0]) == 2
    datasets.DatasetDict({"test": datasets.Dataset.from_list(_records())}).save_to_disk(str(tmp_path / "nodict"))
    with pytest.raises(ValueError, match="without a 'train' split"):
        load_conversations(str(tmp_path / "nodict"))
    (tmp_path / "repo").mkdir()  # a dataset by name that datasets resolves without the network
    (tmp_path / "repo" / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    convs, _ = load_conversations(f"hf:{tmp_path / 'repo'}")
    assert [c[0]["content"] for c in convs] == ["q0", "q1", "q2"]


def test_a_dataset_missing_from_the_local_cache_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    with pytest.raises(ValueError, match=r"hf:nobody/nothing: not in the local datasets cache") as e:
        load_conversations("hf:nobody/nothing")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not one datasets' save_to_disk wrote"):
        (tmp_path / "plain").mkdir()
        load_conversations(str(tmp_path / "plain"))


def test_the_datasets_path_switches_the_hub_offline_even_when_it_was_imported_first(tmp_path, monkeypatch):
    """huggingface_hub reads HF_HUB_OFFLINE once, at import (transformers imports it before any data
    is read): the switch must reach the module itself, or a missing dataset would be looked up online."""
    pytest.importorskip("datasets")
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    with pytest.raises(ValueError, match="not in the local datasets cache"):
        load_conversations("hf:nobody/nothing")
    assert hub.HF_HUB_OFFLINE is True
