"""The target cache: a GGUF target (the embedded SmolLM2, or a user's .gguf) converted once per
machine into a safetensors directory under `~/.cache/blockdraft` ($BLOCKDRAFT_CACHE).

Once per machine: the conversion runs under the entry's lock (`locks`; the others wait, they are
not refused), so concurrent first uses (torchrun's ranks, two commands) wait for one converter. An
entry is complete only when its completion marker (the ownership marker of `target-cache`,
written last) is there; anything else under its name is rebuilt. Whichever process converts
writes every file itself: transformers' `save_pretrained` writes the weights on rank 0 of a
process group only, whatever `is_main_process` says (5.17 and 5.25), so it is not used for them.
A killed converter's temporary is removed by the next one.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from pathlib import Path

import torch

from ..rundir.atomic import check_free_space, nearest_existing
from ..rundir.locks import locked, pid_alive
from ..rundir.ownership import owned_by, remove_leftovers, temp_path, write_marker
from .classes import failed

OWNER = "target-cache"
_LEGACY_TMP = re.compile(r"^(?P<base>.+)\.tmp(?P<pid>\d+)$")  # what releases before 0.10 left: NAME.tmpPID


def complete(out: str | os.PathLike) -> bool:
    """Whether a cache entry was written to the end (its completion marker is there)."""
    return owned_by(out, OWNER)


def load_gguf(gguf_path: Path):
    """(model, tokenizer) of a GGUF file, de-quantised to fp32 (slow: every tensor); a TargetLoadError
    with transformers' cause where it cannot read the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except Exception as e:  # an architecture transformers' GGUF reader lacks, a damaged file: the target does not load
        raise failed(gguf_path, e) from e
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain one from its config and weights.
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    return plain, tok


def save_plain(model, tok, directory: Path) -> None:
    """config.json, generation_config.json, model.safetensors and the tokenizer's files, written by
    this process whatever its rank. A tied copy (the head of tied embeddings) is stored once, as
    transformers stores it; loading ties it back."""
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen.add(key)
            tensors[name] = t.detach().contiguous()
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(directory)


def _remove_legacy(out: Path, min_age_s: float = 3600.0) -> None:
    """The `NAME.tmpPID` folders earlier releases left (up to 538 MB each): removed once their
    process is gone and they are an hour old (their name does not say the host)."""
    for p in out.parent.iterdir() if out.parent.is_dir() else ():
        m = _LEGACY_TMP.match(p.name)
        if m and m["base"] == out.name and p.is_dir() and not p.is_symlink() and not pid_alive(int(m["pid"])) \
                and time.time() - p.stat().st_mtime > min_age_s:
            shutil.rmtree(p, ignore_errors=True)


def _write_entry(gguf_path: Path, tmp: Path) -> None:
    tmp.mkdir(parents=True)
    try:
        model, tok = load_gguf(gguf_path)
        save_plain(model, tok, tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        write_marker(tmp, OWNER)  # last: the entry is complete only with it
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def converted_bytes(gguf_path: Path) -> int | None:
    """About what the converted entry takes: every weight in fp32 and 16 MiB for the tokenizer's
    files (SmolLM2: 513 MiB and 3.4 MiB); None when the file's header cannot be read (its load says
    why). Reads the header only (about 3 s for SmolLM2, against the conversion's minutes)."""
    try:
        from gguf import GGUFReader

        return 4 * sum(int(t.n_elements) for t in GGUFReader(gguf_path).tensors) + 16 * 2**20
    except Exception:  # noqa: BLE001 -- not a GGUF this reader knows: the conversion itself reports it
        return None


def check_cache_dir(where: Path) -> None:
    """The cache directory is one, or can be made (a file on its path: one line, not "File exists")."""
    p = nearest_existing(where)
    if not p.is_dir():
        raise ValueError(f"the cache {where} (BLOCKDRAFT_CACHE) is not a directory ({p} is a file); set it to a "
                         "directory")


def convert_once(gguf_path: Path, out: Path) -> Path:
    """The cache entry `out` for `gguf_path`, converted here unless another process already did
    (or is doing it: then this one waits for it). Room for it is checked before the conversion, and
    a disk that fills anyway is one line naming the cache."""
    out = Path(out)
    if complete(out):
        return out
    check_cache_dir(out.parent)
    with locked(out, "target cache", wait=True, lead=True):  # every rank: no rank waits on a collective here
        if complete(out):
            return out
        remove_leftovers(out)
        _remove_legacy(out)
        need = converted_bytes(Path(gguf_path))
        if need is not None:
            check_free_space(out.parent, need, f"the target converted from {Path(gguf_path).name} (BLOCKDRAFT_CACHE)")
        tmp = temp_path(out)
        try:
            _write_entry(Path(gguf_path), tmp)
        except Exception as e:  # safetensors' own error names no file and no fix
            if getattr(e, "errno", None) != errno.ENOSPC and "No space left" not in str(e):
                raise
            raise ValueError(f"the target cache {out.parent} ran out of disk space while converting "
                             f"{Path(gguf_path).name}; free some space or set BLOCKDRAFT_CACHE to another "
                             "directory") from None
        if out.is_symlink():
            out.unlink()
        elif out.exists():  # an incomplete entry (a converter that died, an older release's): rebuilt
            stale = temp_path(out, "old")
            out.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(out)
    return out
