"""Target outputs stored for reuse: an in-memory memo and on-disk shards (`blockdraft extract`).

Legend: R packed rows of L tokens, F*Ht feature width, Ht target hidden size.

Per row, what training needs from the target: the context features [L, F*Ht] (clause 1)
and the final normed hidden state [L, Ht], from which the target's own head gives its
logits (clause 3: one norm, never two). A disk cache carries a manifest (target name,
layer ids, tokenizer hash, dtype, row length); a cache made for another target,
tokenizer or layer ids is refused. Shards are written atomically; a restart skips the
finished ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

MANIFEST = "manifest.json"
ROW_KEYS = ("input_ids", "loss_mask", "position_ids", "document_ids")


@torch.no_grad()
def target_outputs(target, rows: dict, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [n, L, F*Ht], final_hidden [n, L, Ht]) of the given rows, on the CPU."""
    out = target(rows["input_ids"][idx].to(target.device), position_ids=rows["position_ids"][idx].to(target.device),
                  return_final_hidden=True)
    return out.features.cpu(), out.final_hidden.cpu()


class FeatureMemo:
    """Computes a row's target outputs on first use and keeps them (small datasets, many epochs):
    features, final normed state, and the target's full-vocabulary argmax at every position, so
    that later steps with a draft vocabulary run the head on the draft rows only."""

    def __init__(self, target, rows: dict):
        self.target, self.rows = target, rows
        self.store: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        missing = [i for i in idx.tolist() if i not in self.store]
        if missing:
            f, h = target_outputs(self.target, self.rows, torch.tensor(missing))
            for j, i in enumerate(missing):
                self.store[i] = (f[j], h[j], self._argmax(h[j]))
        got = [self.store[i] for i in idx.tolist()]
        return tuple(torch.stack([g[k] for g in got]) for k in range(3))

    @torch.no_grad()
    def _argmax(self, final: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        dev, dt = self.target.device, self.target.dtype
        return torch.cat([self.target.head(final[i:i + chunk].to(dev, dt)).argmax(-1).cpu()
                          for i in range(0, final.shape[0], chunk)])


def memo_bytes(target, rows: dict) -> int:
    R, L = rows["input_ids"].shape
    return R * L * (len(target.layer_ids) + 1) * target.hidden_size * 4


def cache_identity(target, max_length: int, dtype: torch.dtype) -> dict:
    return {"target": target.name, "layer_ids": list(target.layer_ids), "tokenizer_hash": target.tokenizer_hash,
            "hidden_size": target.hidden_size, "dtype": str(dtype).replace("torch.", ""), "max_length": max_length}


def extract(target, rows: dict, out: str | os.PathLike, *, shard_rows: int = 16, dtype: torch.dtype = torch.float32,
            rank: int = 0, world: int = 1, progress: bool = True) -> Path:
    """Write shard files shard-{k}.safetensors for the shards k with k % world == rank."""
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    R, L = rows["input_ids"].shape
    ident = cache_identity(target, L, dtype)
    mpath = out / MANIFEST
    if mpath.exists():
        old = json.loads(mpath.read_text())
        if {k: old.get(k) for k in ident} != ident:
            raise ValueError(f"{out} holds a cache made with other settings; use a new directory")
    n_shards = (R + shard_rows - 1) // shard_rows
    manifest = dict(ident, rows=R, shard_rows=shard_rows, shards=[f"shard-{k:05d}.safetensors" for k in range(n_shards)])
    if rank == 0:
        _write_json(mpath, manifest)
    mine = [k for k in range(n_shards) if k % world == rank]
    for k in tqdm(mine, desc="extract", disable=not progress):
        path = out / manifest["shards"][k]
        if path.exists():
            continue  # finished before a restart
        idx = torch.arange(k * shard_rows, min(R, (k + 1) * shard_rows))
        f, h = target_outputs(target, rows, idx)
        tensors = {key: rows[key][idx].contiguous() for key in ROW_KEYS}
        tensors.update(features=f.to(dtype).contiguous(), final_hidden=h.to(dtype).contiguous())
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    return out


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


class DiskFeatures:
    """A finished cache directory: rows (for the trainer) and their stored target outputs."""

    def __init__(self, directory: str | os.PathLike, *, expect: dict | None = None):
        self.dir = Path(directory)
        mpath = self.dir / MANIFEST
        if not mpath.exists():
            raise ValueError(f"{self.dir} is not a feature cache (no {MANIFEST}); make one with `blockdraft extract`")
        self.manifest = json.loads(mpath.read_text())
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
        parts, sizes = {k: [] for k in ROW_KEYS}, []
        for k in range(len(self._paths)):
            fh = self._open(k)
            for key in ROW_KEYS:
                parts[key].append(fh.get_tensor(key))
            sizes.append(parts["input_ids"][-1].shape[0])
        self.rows = {k: torch.cat(v) for k, v in parts.items()}
        self._starts = [0]
        for n in sizes:
            self._starts.append(self._starts[-1] + n)

    def _open(self, k: int):
        if k not in self._handles:
            from safetensors import safe_open

            self._handles[k] = safe_open(self._paths[k], "pt", device="cpu")
        return self._handles[k]

    def __call__(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import bisect

        feats, finals = [], []
        for i in idx.tolist():
            if not 0 <= i < self._starts[-1]:
                raise IndexError(f"row {i} is outside this cache's {self._starts[-1]} rows")
            k = bisect.bisect_right(self._starts, i) - 1
            j, fh = i - self._starts[k], self._open(k)
            feats.append(fh.get_slice("features")[j:j + 1])
            finals.append(fh.get_slice("final_hidden")[j:j + 1])
        return torch.cat(feats).float(), torch.cat(finals).float()
