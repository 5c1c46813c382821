"""The target cache (issue 34): a GGUF target is converted once per machine however many processes
(torchrun's ranks, two commands) need it at once; an entry is used only when its completion marker
is there, anything else is rebuilt; whichever rank converts writes the weights; a killed
converter's temporary is removed by the next one. The converter is made cheap (a tiny model, a
small tokenizer) in the subprocesses; the real conversion is what `smollm2_dir` does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blockdraft.target import cache as target_cache
from blockdraft.rundir.locks import host
from blockdraft.rundir.ownership import MARKER, read_marker
from conftest import dead_pid

ROOT = Path(__file__).resolve().parents[2]

CONVERT = """
import os, sys, time
import torch
sys.path.insert(0, sys.argv[3])
from conftest import tiny_causal_lm
from blockdraft.target import cache as target_cache
from blockdraft.target.files import resolve_target

def cheap_load(path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    with open(sys.argv[2], "a") as f:
        f.write(f"{os.getpid()}\\n")
    if os.environ.get("DIE"):
        os.kill(os.getpid(), 9)
    time.sleep(1.5)  # the slow de-quantisation, while the others arrive
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))
    return tiny_causal_lm("llama"), tok

target_cache.load_gguf = cheap_load
if os.environ.get("WORLD_SIZE"):
    torch.distributed.init_process_group("gloo")
    if torch.distributed.get_rank() == 0:
        time.sleep(0.5)  # rank 1 converts: the case that left a cache of tokenizer files only
path, _ = resolve_target(sys.argv[1])
from transformers import AutoModelForCausalLM
got, want = AutoModelForCausalLM.from_pretrained(path).state_dict(), tiny_causal_lm("llama").state_dict()
assert all(torch.equal(got[k], want[k]) for k in want), "the cache holds other weights"
print(path, flush=True)
"""


def env_for(cache: Path, **extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "BLOCKDRAFT_CACHE": str(cache),
            **extra}


def fake_gguf(tmp_path: Path) -> Path:
    p = tmp_path / "model.gguf"
    p.write_bytes(b"GGUF not read: the converter is replaced")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["two commands", "two torchrun ranks"])
def test_concurrent_first_use_converts_once_and_every_process_gets_a_whole_entry(tmp_path, how):
    cache, log, gguf = tmp_path / "cache", tmp_path / "conversions.log", fake_gguf(tmp_path)
    group = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT, str(gguf), str(log), str(ROOT / "tests")],
                              env=env_for(cache, **({**group, "RANK": str(r)} if "torchrun" in how else {})),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1 and len(log.read_text().splitlines()) == 1  # one conversion, one entry
    entry = Path(paths.pop())
    assert sorted(p.name for p in cache.iterdir()) == [entry.name]  # no temporary, no lock left
    assert read_marker(entry)["command"] == target_cache.OWNER and (entry / "model.safetensors").exists()


def test_an_incomplete_entry_and_a_killed_converters_temporary_are_replaced(tmp_path):
    cache, log, gguf = tmp_path / "cache", tmp_path / "conversions.log", fake_gguf(tmp_path)
    argv = [sys.executable, "-c", CONVERT, str(gguf), str(log), str(ROOT / "tests")]
    killed = subprocess.Popen(argv, env=env_for(cache, DIE="1"))
    assert killed.wait() == -signal.SIGKILL
    tmp = [p.name for p in cache.iterdir() if p.name.endswith(f".blockdraft-tmp-{host()}-{killed.pid}")]
    entry_name = tmp[0][1:].split(".blockdraft-tmp-")[0]
    assert sorted(p.name for p in cache.iterdir()) == sorted(tmp + [f".{entry_name}.blockdraft-lock"])
    entry = cache / entry_name
    entry.mkdir()
    (entry / "tokenizer.json").write_text("{}")  # what rank 1 left under torchrun: no weights, no marker,
    (entry / "config.json").write_text("{}")  # or a converter killed before the weights
    legacy = cache / f"{entry_name}.tmp{dead_pid()}"  # an earlier release's leftover, an hour old
    legacy.mkdir()
    os.utime(legacy, (time.time() - 7200, time.time() - 7200))
    young = cache / f"{entry_name}.tmp{dead_pid()}"  # too young to be sure no converter is at work
    young.mkdir()
    assert subprocess.run(argv, env=env_for(cache), capture_output=True).returncode == 0
    assert sorted(p.name for p in cache.iterdir()) == sorted([entry_name, young.name])
    assert read_marker(entry)["command"] == target_cache.OWNER and (entry / "model.safetensors").exists()
    assert json.loads((entry / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_a_complete_entry_is_used_as_it_is(tmp_path, monkeypatch):
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / MARKER).write_text(json.dumps({"command": target_cache.OWNER}))
    monkeypatch.setattr(target_cache, "load_gguf", lambda p: pytest.fail("converted again"))
    assert target_cache.convert_once(fake_gguf(tmp_path), entry) == entry


def test_an_empty_cache_variable_is_the_default_cache_never_the_current_directory(tmp_path, monkeypatch):
    from blockdraft.target.files import cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for empty in ("", "  "):
        monkeypatch.setenv("BLOCKDRAFT_CACHE", empty)
        assert cache_dir() == tmp_path / "home" / ".cache" / "blockdraft"
    monkeypatch.setenv("BLOCKDRAFT_CACHE", "~/elsewhere")
    assert cache_dir() == tmp_path / "home" / "elsewhere"


def test_a_cache_variable_naming_a_file_is_not_a_directory_in_one_line(tmp_path, monkeypatch):
    from blockdraft.target.files import resolve_target

    afile = tmp_path / "cache"
    afile.write_text("a file")
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(afile))
    monkeypatch.setattr(target_cache, "load_gguf", lambda p: pytest.fail("converted"))
    for where in (afile, afile / "deeper"):
        monkeypatch.setenv("BLOCKDRAFT_CACHE", str(where))
        said = fr"the cache {where} \(BLOCKDRAFT_CACHE\) is not a directory \({afile} is a file\)"
        with pytest.raises(ValueError, match=said):
            resolve_target(str(fake_gguf(tmp_path)))
    from blockdraft.engines.vllm.launch import plugin_path  # the engines' folder there too

    with pytest.raises(ValueError, match=fr"the cache {afile / 'engine'} \(BLOCKDRAFT_CACHE\) is not a directory"):
        plugin_path(afile / "engine")
    assert afile.read_text() == "a file"


def test_a_cache_on_a_small_disk_is_refused_before_converting(tmp_path, monkeypatch, smollm2_dir):
    import shutil as real_shutil

    from blockdraft.rundir import atomic
    from blockdraft.target.files import target_gguf

    gguf = target_gguf("smollm2")
    need = target_cache.converted_bytes(gguf)
    written = sum(f.stat().st_size for f in Path(smollm2_dir).iterdir())  # the real conversion's entry
    assert written <= need <= written + 32 * 2**20
    usage = real_shutil.disk_usage(tmp_path)
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: usage._replace(free=2 * 2**20))  # a 2 MB disk
    monkeypatch.setattr(target_cache, "load_gguf", lambda p: pytest.fail("converted before the check"))
    monkeypatch.setattr(target_cache, "converted_bytes", lambda p: need)  # read once above (3 s)
    with pytest.raises(ValueError, match=r"not enough disk space for the target converted from "
                                         r"SmolLM2-135M-Instruct.Q4_1.gguf \(BLOCKDRAFT_CACHE\) .*2.0 MiB free"):
        target_cache.convert_once(gguf, tmp_path / "entry")
    assert not (tmp_path / "entry").exists()


def test_a_disk_that_fills_while_converting_is_one_line_naming_the_cache(tmp_path, monkeypatch):
    import errno

    def full(gguf, tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(target_cache, "_write_entry", full)
    with pytest.raises(ValueError, match=f"the target cache {tmp_path} ran out of disk space while converting "
                                         "model.gguf; free some space or set BLOCKDRAFT_CACHE"):
        target_cache.convert_once(fake_gguf(tmp_path), tmp_path / "entry")
