"""Resumable training state: drafter, optimiser and progress (step, tokens, time).

The data order and each micro-batch's anchors derive from (seed, step), and the learning
rate from the step, so nothing else needs saving.

Everything is written as safetensors + JSON (no pickle) into one directory, swapped in
atomically, so a kill at any moment leaves the last complete checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .atomic import atomic_dir, recover_dir
from ..finite import require_finite

STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.safetensors"


def save_state(directory: str | Path, *, drafter, optimizer, progress: dict, drafter_state: dict | None = None,
               optimizer_state: dict | None = None, need_bytes: int = 0, owner: str = "train",
               settings: dict | None = None, keep_old=None) -> Path:
    """`drafter_state`/`optimizer_state`: full states gathered from a sharded run (else taken from
    the objects). `need_bytes`: free space checked before anything is written. `owner`: the
    command whose marker the directory carries (only such a directory is replaced). `settings`: the
    run's recorded settings (train_config.json's), kept with the state so a resume can still compare
    against them when that file is lost. `keep_old`: where the checkpoint replaced goes (`atomic_dir`;
    None: removed)."""
    sd = drafter.state_dict() if drafter_state is None else drafter_state
    tensors: dict[str, torch.Tensor] = {f"drafter.{k}": _host_copy(v) for k, v in sd.items()}
    tensors["drafter_feature_scale"] = _host_copy(drafter.feature_scale)
    require_finite(tensors, f"the checkpoint's drafter in {directory}")  # host copies: no device read
    opt = optimizer.state_dict() if optimizer_state is None else optimizer_state
    for idx, st in opt["state"].items():
        for name, val in st.items():
            t = val if torch.is_tensor(val) else torch.tensor(val)
            tensors[f"opt.{idx}.{name}"] = _host_copy(t)
    tensors["rng.torch"] = torch.get_rng_state()
    meta = {"progress": progress, "param_groups": opt["param_groups"],
            "drafter_config": drafter.config.to_dict(), **({"settings": settings} if settings else {})}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / STATE_TENSORS))
        (tmp / STATE_JSON).write_text(json.dumps(meta, indent=1))

    return atomic_dir(directory, write, owned=(STATE_JSON, STATE_TENSORS), need_bytes=need_bytes,
                      owner=owner, keep_old=keep_old)


def checkpoint_bytes(params: int) -> int:
    """About what one checkpoint of a drafter of `params` parameters takes: it and AdamW's two
    moments, in fp32."""
    return 3 * params * 4 + 2**20


def run_bytes(params: int, keep: int = 1, best: bool = False) -> int:
    """The disk a run needs: the `keep` checkpoints it keeps and one more (a swap holds the old one
    until the new one is whole), the final drafter and, with `best`, the best one."""
    return (keep + 1) * checkpoint_bytes(params) + (1 + best) * (checkpoint_bytes(params) // 3)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a state tensor, made by the copy to the host itself (a clone on the GPU first
    would hold a second copy of the drafter and its optimizer there while the file is written)."""
    return t.detach().to("cpu", copy=True).contiguous()


def read_meta(directory: str | Path) -> dict:
    """The checkpoint's trainer_state.json, checked to hold what a resume reads: one line naming the
    file otherwise (a file cut short, emptied or edited)."""
    path = Path(directory) / STATE_JSON
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"the checkpoint's {path} is damaged or unreadable ({e}); start a new --out, or restore "
                         "it") from None
    progress = meta.get("progress") if isinstance(meta, dict) else None
    problems = [name for name, ok in (
        ("progress", isinstance(progress, dict) and isinstance(progress.get("step"), int)),
        ("param_groups", isinstance(meta, dict) and isinstance(meta.get("param_groups"), list)),
        ("drafter_config", isinstance(meta, dict) and isinstance(meta.get("drafter_config"), dict))) if not ok]
    if problems:
        raise ValueError(f"the checkpoint's {path} is damaged: it lacks {', '.join(problems)}; start a new --out, "
                         "or restore it")
    return meta


def find_checkpoint(directory: str | Path) -> Path | None:
    """The last complete checkpoint directory (one a killed swap moved aside taken back), or None."""
    path = recover_dir(directory, "train")
    return path if path is not None and (path / STATE_JSON).exists() else None


def load_state(directory: str | Path, *, drafter, optimizer) -> dict:
    """Restore into existing objects; returns the saved progress dict."""
    path = find_checkpoint(directory)
    if path is None:
        raise ValueError(f"no checkpoint to resume from in {directory}")
    meta = read_meta(path)
    try:
        tensors = load_file(str(path / STATE_TENSORS))
    except (OSError, ValueError, SafetensorError) as e:
        raise ValueError(f"the checkpoint in {path} is damaged ({e}); start a new --out, or restore it") from None
    require_finite({k: v for k, v in tensors.items() if k.startswith("drafter")}, str(path / STATE_TENSORS),
                   "start a new --out, or restore it")
    # written before the window rule was a field (and with the dead `extra`): the anchor rule
    saved_cfg = {"sliding_window_rule": "anchor", **{k: v for k, v in meta["drafter_config"].items() if k != "extra"}}
    now = drafter.config.to_dict()
    if saved_cfg != now:
        diff = sorted(k for k in set(saved_cfg) | set(now) if saved_cfg.get(k) != now.get(k))
        raise ValueError(f"the checkpoint in {path} was trained with other drafter settings ({diff}); "
                         "resume with the same flags or start a new --out")
    try:
        _restore(tensors, meta, drafter, optimizer)
    except (KeyError, RuntimeError, ValueError, IndexError) as e:
        raise ValueError(f"the checkpoint in {path} does not fit this run's drafter and optimizer "
                         f"({' '.join(str(e).split())[:200]}); start a new --out, or restore it") from None
    return meta["progress"]


def _restore(tensors: dict, meta: dict, drafter, optimizer) -> None:
    drafter.load_state_dict({k[len("drafter."):]: v for k, v in tensors.items() if k.startswith("drafter.")})
    drafter.feature_scale.copy_(tensors["drafter_feature_scale"])
    state: dict[int, dict] = {}
    for key, val in tensors.items():
        if key.startswith("opt."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = val
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
