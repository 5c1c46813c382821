"""Drafter directories: config.json + model.safetensors, written atomically, read without pickle.

The target's embedding and lm_head are never stored. The feature scale used in training is
folded into fc.weight, so the weights keep the reference (z-lab) layout.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..model import DFlashDrafter
from .formats import config_from_json, detect, to_speculators, to_zlab

CONFIG, WEIGHTS = "config.json", "model.safetensors"
DEFAULT_DRAFTER = Path(__file__).resolve().parent.parent / "assets" / "default-drafter"


def atomic_dir(final: str | os.PathLike, write) -> Path:
    """Call write(tmp_dir), then swap tmp_dir into place; a crash at any moment leaves either the
    old directory or the new one complete (`final.old` is taken back by `recover_dir`)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    old = final.with_name(final.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def recover_dir(final: str | os.PathLike) -> Path | None:
    """The last complete directory: `final`, or `final.old` if a swap was interrupted."""
    final = Path(final)
    old = final.with_name(final.name + ".old")
    if final.exists():
        return final
    if old.exists():
        old.rename(final)
        return final
    return None


def save_drafter(drafter: DFlashDrafter, directory: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors (weights cast to `dtype` if given; ids stay integers)."""
    sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
          for k, v in drafter.folded_state_dict().items() if not k.startswith("rotary_emb")}

    def write(tmp: Path) -> None:
        (tmp / CONFIG).write_text(json.dumps(to_zlab(drafter.config), indent=2) + "\n")
        save_file(sd, str(tmp / WEIGHTS), metadata={"format": "pt", "producer": "blockdraft"})

    return atomic_dir(directory, write)


def resolve_drafter(dir_or_name: str | os.PathLike) -> Path:
    if str(dir_or_name) == "default":
        path = DEFAULT_DRAFTER
        if not (path / CONFIG).exists():
            raise ValueError("this installation has no default drafter; train one with `blockdraft train`")
        return path
    path = Path(dir_or_name).expanduser()
    if not (path / CONFIG).exists() or not (path / WEIGHTS).exists():
        raise ValueError(f"{path} is not a drafter directory: it needs {CONFIG} and {WEIGHTS}")
    return path


def load_drafter(dir_or_name: str | os.PathLike = "default", *, device=None, dtype: torch.dtype = torch.float32,
                 num_target_layers: int | None = None) -> DFlashDrafter:
    """Read a drafter directory (JSON + safetensors only). Missing or unknown weights are an error.
    `num_target_layers` fills in what published speculators configs leave out."""
    path = resolve_drafter(dir_or_name)
    cfg = config_from_json(json.loads((path / CONFIG).read_text()), num_target_layers)
    drafter = DFlashDrafter(cfg)
    sd = load_file(str(path / WEIGHTS))
    expected = {k for k in drafter.state_dict() if not k.startswith("rotary_emb")}
    missing, unknown = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unknown:
        raise ValueError(f"{path / WEIGHTS} does not fit its config: missing {missing[:8]}, unknown {unknown[:8]}")
    if sd["fc.weight"].shape[1] != cfg.feature_size:
        raise ValueError(f"fc.weight takes {sd['fc.weight'].shape[1]} inputs but the config's "
                         f"{cfg.num_features} target layers x {cfg.target_hidden_size} give {cfg.feature_size}")
    drafter.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}, strict=False)
    return drafter.to(device=device, dtype=dtype).eval()


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str) -> Path:
    """Rewrite a drafter directory's config in another format; the weights are copied bit for bit."""
    path = resolve_drafter(src)
    raw = json.loads((path / CONFIG).read_text())
    cfg = config_from_json(raw)
    if cfg.draft_vocab_size and to in ("zlab", "speculators"):
        import warnings

        warnings.warn(f"this drafter scores a {cfg.draft_vocab_size}-token draft vocabulary; engines reading the "
                      f"{to} format score the full head: output stays lossless, acceptance may differ",
                      stacklevel=2)
    if to == "zlab":
        out = to_zlab(cfg)
    elif to == "speculators":
        out = to_speculators(cfg)
    else:
        raise ValueError(f"unknown format {to!r}; use zlab or speculators")
    if detect(raw) == "speculators" and to == "zlab":
        out["blockdraft"]["target_name"] = cfg.target_name or raw["speculators_config"]["verifier"]["name_or_path"]

    def write(tmp: Path) -> None:
        (tmp / CONFIG).write_text(json.dumps(out, indent=2) + "\n")
        shutil.copyfile(path / WEIGHTS, tmp / WEIGHTS)

    return atomic_dir(dst, write)
