"""Target outputs stored for reuse: an in-memory memo and on-disk shards (`blockdraft extract`).

Legend: R packed rows of L tokens, F*Ht feature width, Ht target hidden size.

Per row, what training needs from the target (one `StoredOutputs` record, from the memo and
the disk cache alike): the context features [L, F*Ht] (clause 1), the final normed hidden
state [L, Ht], from which the target's own head gives its logits (clause 3: one norm, never
two), and the target's full-vocabulary argmax [L], so that a drafter with a draft vocabulary
runs the head on its draft rows only. A disk cache carries a manifest (target name, layer
ids, tokenizer hash, dtype, row length, shard layout, a hash of the rows); a cache made for
another target, tokenizer, layer ids or data is refused. Shards are written atomically; a
restart skips the finished ones and removes the temporaries a killed run left. Only a directory
that is new, empty or carries extract's marker is written (ownership).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..rundir.atomic import check_free_space
from ..finite import require_finite
from ..rundir.ownership import MARKER as OWNER_MARKER
from ..rundir.ownership import check_owned, is_temp, open_private, read_marker, remove_leftovers_in, temp_path, write_marker
from ..process_group import grouped

MANIFEST = "manifest.json"
ENGINE_STATES = "engine-states"  # an engine's captured states, waiting to become shards (extract --engine vllm)
ROW_KEYS = ("input_ids", "loss_mask", "position_ids", "document_ids")
OWNER = "extract"  # the command whose marker a cache directory carries (ownership)
INFO = ("engine_dtype", "quantization")  # how an engine cache was made: recorded, not part of its identity


@dataclass
class StoredOutputs:
    """The target's outputs for some rows, as training reads them instead of running the target."""

    features: torch.Tensor  # [n, L, F*Ht]
    final_hidden: torch.Tensor  # [n, L, Ht] after the target's own final norm
    top: torch.Tensor | None = None  # [n, L] the target's full-vocabulary argmax (None: run the full head)


@torch.no_grad()
def target_outputs(target, rows: dict, idx: torch.Tensor, rows_per_forward: int | None = None) -> StoredOutputs:
    """Features, final normed state and full-vocabulary argmax of the given rows, on the CPU; the
    target runs `rows_per_forward` rows at a time (default: all at once)."""
    step = rows_per_forward or max(1, idx.numel())
    parts = []
    for i in range(0, idx.numel(), step):
        sub = idx[i:i + step]
        dev = target.device
        out = target(rows["input_ids"][sub].to(dev), position_ids=rows["position_ids"][sub].to(dev),
                     return_final_hidden=True)
        parts.append(StoredOutputs(out.features.cpu(), out.final_hidden.cpu(), full_argmax(target, out.final_hidden).cpu()))
        del out
    if len(parts) == 1:
        return parts[0]
    return StoredOutputs(*(torch.cat([getattr(p, f) for p in parts]) for f in ("features", "final_hidden", "top")))


@torch.no_grad()
def full_argmax(target, final: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """[..., L, Ht] final states -> [..., L] the target's argmax, the head run a chunk of rows at a time."""
    flat = final.reshape(-1, final.shape[-1])
    dev, dt = target.device, target.dtype
    top = torch.cat([target.head(flat[i:i + chunk].to(dev, dt)).argmax(-1) for i in range(0, flat.shape[0], chunk)])
    return top.reshape(final.shape[:-1])


class FeatureMemo:
    """Computes a row's target outputs on first use and keeps them (small datasets, many epochs)."""

    def __init__(self, target, rows: dict):
        self.target, self.rows = target, rows
        self.store: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def compute(self, idx: torch.Tensor) -> StoredOutputs:
        """The outputs of `idx`, from the store where kept, else computed and not kept."""
        if all(i in self.store for i in idx.tolist()):
            return self(idx)
        return target_outputs(self.target, self.rows, idx)

    def __call__(self, idx: torch.Tensor) -> StoredOutputs:
        missing = [i for i in idx.tolist() if i not in self.store]
        if missing:
            got = target_outputs(self.target, self.rows, torch.tensor(missing))
            for j, i in enumerate(missing):
                self.store[i] = (got.features[j], got.final_hidden[j], got.top[j])
        rows = [self.store[i] for i in idx.tolist()]
        return StoredOutputs(*(torch.stack([r[k] for r in rows]) for k in range(3)))


def memo_bytes(target, rows: dict) -> int:
    R, L = rows["input_ids"].shape
    return R * L * (len(target.layer_ids) + 1) * target.hidden_size * 4


def cache_identity(target, max_length: int, dtype: torch.dtype) -> dict:
    return {"target": target.name, "layer_ids": list(target.layer_ids), "tokenizer_hash": target.tokenizer_hash,
            "hidden_size": target.hidden_size, "dtype": str(dtype).replace("torch.", ""), "max_length": max_length}


def rows_hash(rows: dict) -> str:
    """A hash of the packed rows (ids, masks, positions, documents): other data, another cache."""
    h = hashlib.sha256()
    for key in ROW_KEYS:
        t = rows[key].to(torch.int64).contiguous()
        h.update(key.encode() + str(tuple(t.shape)).encode() + t.numpy().tobytes())
    return h.hexdigest()[:16]


def row_bytes(target, L: int, dtype: torch.dtype) -> int:
    """Bytes one packed row of L tokens takes in a cache: F features, the final state, the argmax."""
    return L * ((len(target.layer_ids) + 1) * target.hidden_size * torch.finfo(dtype).bits // 8 + 8)


def shard_bytes(rows: dict, n: int, width: int, hidden: int, dtype: torch.dtype) -> int:
    """The size of a shard file of `n` rows as `extract` writes it (safetensors: an 8-byte length, the
    JSON header padded to 8 bytes, the tensors): the rows' own tensors, features [n, L, width] and
    final states [n, L, hidden] in `dtype`, the argmax [n, L] int64."""
    L = rows["input_ids"].shape[1]
    item = torch.empty(0, dtype=dtype).element_size()
    parts = {k: (rows[k].element_size(), [n, L]) for k in ROW_KEYS}
    parts.update(features=(item, [n, L, width]), final_hidden=(item, [n, L, hidden]), top=(8, [n, L]))
    header, offset = {}, 0
    for name, (size, shape) in sorted(parts.items()):
        end = offset + size * shape[0] * shape[1] * (shape[2] if len(shape) > 2 else 1)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, end]}
        offset = end
    return 8 + (len(json.dumps(header, separators=(",", ":"))) + 7) // 8 * 8 + offset


def auto_shard_rows(target, L: int, dtype: torch.dtype, budget: int = 2**30) -> int:
    """Rows per shard file: about `budget` bytes of outputs (held in host RAM while the shard is
    made), 1 to 64 rows."""
    return max(1, min(64, budget // row_bytes(target, L, dtype)))


def extract(target, rows: dict, out: str | os.PathLike, *, shard_rows: int = 16, dtype: torch.dtype | None = None,
            rank: int = 0, world: int = 1, progress: bool = True, batch_tokens: int = 16384,
            outputs=None, identity: dict | None = None, info: dict | None = None) -> Path:
    """Write shard files shard-{k}.safetensors for the shards k with k % world == rank.

    The target runs `batch_tokens` tokens (whole rows) at a time; `dtype` (default: the target's
    own, bf16 on CUDA) is what the shards store. `outputs` (rows -> StoredOutputs) gives a shard's
    outputs instead (an engine's states, read through its spool: `engines.vllm.capture.RowsAhead`);
    `identity` adds manifest entries a cache to complete must match, `info` entries that only say how
    it was made (the engine's dtype and quantization; kept from the manifest when not given)."""
    from tqdm.auto import tqdm

    out = Path(out)
    if rank == 0:  # a new or empty directory, or a cache extract wrote (its marker); never another
        check_owned(out, OWNER)
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0 and read_marker(out) is None:
        write_marker(out, OWNER)
    if world > 1 and grouped():  # the other ranks write shards only once rank 0 has checked and owns `out`
        torch.distributed.barrier()
    remove_leftovers_in(out)  # shards and manifests a killed extract (this host) left half-written
    R, L = rows["input_ids"].shape
    dtype = dtype or target.dtype
    rows_per_forward = max(1, batch_tokens // L)
    ident = {**cache_identity(target, L, dtype), "rows": R, "shard_rows": shard_rows, "rows_hash": rows_hash(rows),
             "engine": "transformers", **(identity or {})}
    mpath = out / MANIFEST
    _check_same_cache(out, mpath, ident)
    n_shards = (R + shard_rows - 1) // shard_rows
    kept = {k: v for k, v in json.loads(mpath.read_text()).items() if k in INFO} if mpath.exists() else {}
    manifest = dict(ident, **{**kept, **(info or {})}, shards=[f"shard-{k:05d}.safetensors" for k in range(n_shards)])
    todo = [min(R, (k + 1) * shard_rows) - k * shard_rows for k in range(n_shards)
            if not (out / manifest["shards"][k]).exists()]  # every rank's: the ranks share the disk
    check_free_space(out, sum(shard_bytes(rows, n, len(target.layer_ids) * target.hidden_size, target.hidden_size,
                                          dtype) for n in todo), "the feature cache")
    if rank == 0:
        _write_json(mpath, manifest)
    mine = [k for k in range(n_shards) if k % world == rank]
    for k in tqdm(mine, desc="extract", disable=not progress):
        path = out / manifest["shards"][k]
        if path.exists():
            continue  # finished before a restart
        idx = torch.arange(k * shard_rows, min(R, (k + 1) * shard_rows))
        got = target_outputs(target, rows, idx, rows_per_forward) if outputs is None else outputs(idx)
        tensors = {key: rows[key][idx].contiguous() for key in ROW_KEYS}
        tensors.update(features=got.features.to(dtype).contiguous(), final_hidden=got.final_hidden.to(dtype).contiguous(),
                       top=got.top.contiguous())
        del got
        require_finite({n: tensors[n] for n in ("features", "final_hidden")},
                       f"the target's outputs for shard {k} (rows {int(idx[0])}-{int(idx[-1])})",
                       "nothing of the shard was written; extract in float32 (--dtype float32 --target-dtype float32)")
        tmp = temp_path(path)
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    return out


def _check_same_cache(out: Path, mpath: Path, ident: dict) -> None:
    """A cache to complete was made with these settings (`ident`); a directory without one holds nothing else."""
    if mpath.exists():
        old = json.loads(mpath.read_text())
        before = {"engine": "transformers", "target_dtype": ident.get("target_dtype")}  # older caches lack these
        changed = [k for k in ident if old.get(k, before.get(k)) != ident[k]]
        if changed:
            raise ValueError(f"{out} holds a cache made with other settings ({', '.join(changed)} differ"
                             f"{': other data' if 'rows_hash' in changed else ''}); use a new directory")
    elif holds_other_files(out):
        raise ValueError(f"{out} is not empty and holds no feature cache; use a new directory")


def holds_other_files(out: Path) -> bool:
    """Whether a directory with no manifest holds files that are no part of a cache being made
    (other ranks' shards, or an engine's captured states, may be there)."""
    return Path(out).exists() and not (Path(out) / MANIFEST).exists() and any(
        not (p.name.startswith(("shard-", MANIFEST, ENGINE_STATES, OWNER_MARKER)) or is_temp(p.name))
        for p in Path(out).iterdir())


def damaged(path: str, e: Exception) -> ValueError:
    return ValueError(f"feature cache shard {path} is damaged ({type(e).__name__}: {str(e)[:120]}); delete it and "
                      "rerun `blockdraft extract` with the same arguments: it rewrites only the missing shards")


def _write_json(path: Path, obj: dict) -> None:
    # a peer rank that looks at the directory meanwhile must see a cache being made, not "other
    # files" (holds_other_files knows the temporaries' names)
    tmp = temp_path(path)
    with open_private(tmp, "x") as f:
        f.write(json.dumps(obj, indent=1))
    os.replace(tmp, path)


class DiskFeatures:
    """A finished cache directory: rows (for the trainer) and their stored target outputs, in the
    stored precision (the drafter and the head cast them where they are used)."""

    prefetch = True  # reads are disk-bound: the trainer reads a micro-batch ahead (data.prefetch)

    def __init__(self, directory: str | os.PathLike, *, expect: dict | None = None, rows: bool = True):
        """`rows` False: only the manifest and every shard's header are checked (before anything loads)."""
        self.dir = Path(directory)
        mpath = self.dir / MANIFEST
        if not mpath.exists():
            raise ValueError(f"{self.dir} is not a feature cache (no {MANIFEST}); make one with `blockdraft extract`")
        try:
            self.manifest = json.loads(mpath.read_text())
            if not all(isinstance(s, str) for s in self.manifest["shards"]):
                raise TypeError("shards must be file names")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{mpath} is damaged ({type(e).__name__}: {e}); rerun `blockdraft extract` into a new "
                             "directory") from None
        if expect is not None:
            bad = {k: (self.manifest.get(k), v) for k, v in expect.items()
                   if k != "dtype" and self.manifest.get(k) != v}
            if bad:
                raise ValueError(f"feature cache {self.dir} was made for another setup: "
                                 + "; ".join(f"{k}: cache {a!r} vs now {b!r}" for k, (a, b) in bad.items()))
        missing = [s for s in self.manifest["shards"] if not (self.dir / s).exists()]
        if missing:
            raise ValueError(f"feature cache {self.dir} is incomplete ({len(missing)} shards missing); "
                             "rerun `blockdraft extract` with the same arguments to finish it")
        # rows (token ids, masks, positions) are small and kept; features and final states stay on
        # disk and are read row by row through safetensors' memory map (an 8B target's features
        # are ~170 MB per 4k-token row in bf16: a real cache does not fit in RAM)
        self._paths = [str(self.dir / s) for s in self.manifest["shards"]]
        self._handles: dict[int, object] = {}
        for k in range(len(self._paths)):
            try:
                self._check_shard(k, self._open(k))
            except ValueError:
                raise
            except Exception as e:
                raise damaged(self._paths[k], e) from None
        if rows:
            self._read_rows()

    def _read_rows(self) -> None:
        parts, sizes = {k: [] for k in ROW_KEYS}, []
        for k in range(len(self._paths)):
            fh = self._open(k)
            try:
                for key in ROW_KEYS:
                    parts[key].append(fh.get_tensor(key))
            except Exception as e:
                raise damaged(self._paths[k], e) from None
            sizes.append(parts["input_ids"][-1].shape[0])
        self.rows = {k: torch.cat(v) for k, v in parts.items()}
        self._starts = [0]
        for n in sizes:
            self._starts.append(self._starts[-1] + n)

    def _check_shard(self, k: int, fh) -> None:
        """Shard k holds what the manifest says, from its header alone: its rows of max_length tokens,
        features of the manifest's layers and width (a shard copied from another cache is refused
        here, not as a torch.cat error after the target loaded)."""
        m = self.manifest
        L, H, R, per = m.get("max_length"), m.get("hidden_size"), m.get("rows"), m.get("shard_rows")
        n = min(R, (k + 1) * per) - k * per if isinstance(R, int) and isinstance(per, int) else None
        want = {key: [n, L] for key in ROW_KEYS}
        want.update(features=[n, L, len(m.get("layer_ids") or []) * (H or 0) or None], final_hidden=[n, L, H])
        for key, shape in want.items():
            got = list(fh.get_slice(key).get_shape())
            if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
                raise ValueError(f"feature cache shard {self._paths[k]} holds {key} of shape {got}, but the cache's "
                                 f"{MANIFEST} says {[w if w is not None else '*' for w in shape]} (max_length {L}): "
                                 "a shard of another extract; delete it and rerun `blockdraft extract` with the same "
                                 "arguments (it rewrites only the missing shards)")

    def _open(self, k: int):
        if k not in self._handles:
            from safetensors import SafetensorError, safe_open

            try:
                self._handles[k] = safe_open(self._paths[k], "pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise damaged(self._paths[k], e) from None
        return self._handles[k]

    def __call__(self, idx: torch.Tensor) -> StoredOutputs:
        import bisect

        feats, finals, tops = [], [], []
        for i in idx.tolist():
            if not 0 <= i < self._starts[-1]:
                raise IndexError(f"row {i} is outside this cache's {self._starts[-1]} rows")
            k = bisect.bisect_right(self._starts, i) - 1
            j, fh = i - self._starts[k], self._open(k)
            try:
                feats.append(fh.get_slice("features")[j:j + 1])
                finals.append(fh.get_slice("final_hidden")[j:j + 1])
                if "top" in fh.keys():  # caches written before the argmax was stored have none
                    tops.append(fh.get_slice("top")[j:j + 1])
            except Exception as e:  # safetensors raises several kinds on a cut file
                raise damaged(self._paths[k], e) from None
            require_finite({"features": feats[-1], "final_hidden": finals[-1]},
                           f"feature cache shard {self._paths[k]}, row {j}", "delete the shard and rerun `blockdraft "
                           "extract` with the same arguments (in float32 if the target overflowed)")
        top = torch.cat(tops) if len(tops) == len(feats) else None
        return StoredOutputs(torch.cat(feats), torch.cat(finals), top)


class CacheView:
    """Some rows of a DiskFeatures, renumbered 0..n-1 (a training or held-out part of a cache)."""

    prefetch = True

    def __init__(self, cache: DiskFeatures, idx: torch.Tensor):
        self.cache, self.idx = cache, idx

    def __call__(self, i: torch.Tensor) -> StoredOutputs:
        return self.cache(self.idx[i])


def throughput(tokens: int, seconds: float, what: str, start_s: float | None = None) -> None:
    """The line `benchmarks/extract_engines.py` reads: tokens of packed rows written per second."""
    start = "" if start_s is None else f"; engine start {start_s:.0f} s not counted"
    print(f"extract: {tokens:,} tokens ({what}) in {seconds:.1f} s: {tokens / max(seconds, 1e-9):,.0f} tokens/s{start}")
