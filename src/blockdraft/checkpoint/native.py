"""Drafter directories: config.json + model.safetensors, written atomically, read without pickle,
and exported to the ecosystem's formats (`formats/`).

A native directory is the z-lab layout as engines load it, unchanged (vLLM included): for a
draft vocabulary it holds `d2t` offsets and the target head's rows for the draft ids as
`lm_head.weight` (the target's own, never trained; `save_drafter(head_rows=...)`), bit for bit
what `convert --to zlab` writes. The target's embedding and full head are never stored. Reading
turns `d2t` (or an older directory's `draft_vocab`) into the drafter's ids and drops the rows.
The feature scale used in training is folded into fc.weight, so the weights keep the reference
(z-lab) layout.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from ..rundir.atomic import atomic_dir
from ..finite import require_finite
from ..rundir.ownership import swapping
from ..model import DFlashDrafter
from ..target.files import head_rows
from . import formats
from .formats import Export

CONFIG, WEIGHTS = "config.json", "model.safetensors"
SWAP_WAIT = 30.0  # seconds a read waits for a save swapping a new version of the directory in
OWNED = (CONFIG, WEIGHTS)
DEFAULT_DRAFTER = Path(__file__).resolve().parent.parent / "assets" / "default-drafter"


def state_tensors(drafter: DFlashDrafter, dtype: torch.dtype | None) -> dict:
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
            for k, v in drafter.folded_state_dict().items() if not k.startswith("rotary_emb")}


def _write(directory, config: dict, sd: dict, owner: str, extra: dict | None = None) -> Path:
    require_finite(sd, f"the drafter to write in {directory}", "nothing was written; retrain it or resume from an "
                   "earlier checkpoint with a lower --lr")  # a NaN drafter drafts nothing
    extra = extra or {}

    def write(tmp: Path) -> None:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(sd, str(tmp / WEIGHTS), metadata={"format": "pt", "producer": "blockdraft"})
        for name, text in extra.items():
            (tmp / name).write_text(text)

    need = sum(v.numel() * v.element_size() for v in sd.values()) + 2**20
    return atomic_dir(directory, write, owned=(*OWNED, *extra), need_bytes=need, owner=owner)


def save_drafter(drafter: DFlashDrafter, directory: str | os.PathLike, *, head_rows: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None, owner: str = "save_drafter", extra: dict | None = None) -> Path:
    """Write config.json + model.safetensors in the z-lab layout engines load (weights cast to `dtype`
    if given; ids stay integers). A draft vocabulary needs `head_rows`, the target head's rows for
    `drafter.draft_vocab` ([Vd, H], `TargetModel.head_rows`): written as `lm_head.weight` (in the
    weights' dtype) beside the `d2t` offsets. Only a directory `owner` wrote (its marker) is
    replaced; any other is refused. `extra`: more files written with them (name -> text), in the same
    swap."""
    cfg = drafter.config
    if cfg.draft_vocab_size and head_rows is None:
        head_rows = _loaded_rows(drafter)
    if cfg.draft_vocab_size and head_rows is None:
        raise ValueError(f"the drafter has a {cfg.draft_vocab_size}-token draft vocabulary: saving it needs the "
                         "target's head rows for it, head_rows=target.head_rows(drafter.draft_vocab)")
    if head_rows is not None and not cfg.draft_vocab_size:
        raise ValueError("head_rows is for a drafter with a draft vocabulary; this one scores the target's full head")
    if head_rows is not None and tuple(head_rows.shape) != (cfg.draft_vocab_size, cfg.hidden_size):
        raise ValueError(f"head_rows is {list(head_rows.shape)}; the drafter needs the target head's rows for its "
                         f"draft vocabulary, [{cfg.draft_vocab_size}, {cfg.hidden_size}]")
    fmt, ex = formats.get(formats.NATIVE), Export(head_rows=None if head_rows is None else head_rows.detach().cpu())
    sd = fmt.write_weights({k: v.cpu() for k, v in state_tensors(drafter, dtype).items()}, cfg, ex)
    return _write(directory, fmt.write_config(cfg, ex), sd, owner, extra)


def _loaded_rows(drafter: DFlashDrafter) -> torch.Tensor | None:
    """The target head's rows a loaded directory held for the drafter's draft vocabulary (the same
    ids still), so a loaded drafter saves back without its target (`load_drafter`)."""
    got = getattr(drafter, "loaded_head_rows", None)
    if got is None or not torch.equal(got[0].cpu(), drafter.draft_vocab.cpu().to(got[0].dtype)):
        return None
    return got[1]


def resolve_drafter(dir_or_name: str | os.PathLike) -> Path:
    if str(dir_or_name) == "default":
        path = DEFAULT_DRAFTER
        if not (path / CONFIG).exists():
            raise ValueError("this installation has no default drafter; train one with `blockdraft train`")
        return path
    path = Path(dir_or_name).expanduser()
    deadline = time.monotonic() + SWAP_WAIT
    while not (path / CONFIG).exists() or not (path / WEIGHTS).exists():
        if not swapping(path) or time.monotonic() > deadline:
            raise ValueError(f"{path} is not a drafter directory: it needs {CONFIG} and {WEIGHTS}")
        time.sleep(0.02)  # a save is between moving the old version aside and the new one in
    return path


def _read_pair(path: Path) -> tuple[bytes, bytes]:
    """config.json and model.safetensors of one version of `path`: both opened through one handle
    on the directory, so a save swapping a new version in meanwhile gives the old pair or the new
    one, never a config of one and the weights of the other."""
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = []
        for name in (CONFIG, WEIGHTS):
            with os.fdopen(os.open(name, os.O_RDONLY, dir_fd=dfd), "rb") as f:
                got.append(f.read())
        return got[0], got[1]
    finally:
        os.close(dfd)


def read_snapshot(path: Path) -> tuple[bytes, bytes]:
    """`_read_pair`, waiting (up to SWAP_WAIT) while a save swaps the directory: the version it read
    may be removed before its files open, which is then read again."""
    deadline = time.monotonic() + SWAP_WAIT
    while True:
        try:
            return _read_pair(path)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise ValueError(f"{path} is not a drafter directory: it needs {CONFIG} and {WEIGHTS}") from None
            path = resolve_drafter(path)  # waits for the swap, or says what is missing
            time.sleep(0.02)


def read_config(path: Path, num_target_layers: int | None = None, text: bytes | None = None):
    """The config of the drafter directory `path` (`text`: its config.json, already read)."""
    try:
        raw = json.loads((path / CONFIG).read_bytes() if text is None else text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / CONFIG} is not valid JSON ({e}); re-export or re-train the drafter") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path / CONFIG} must be a JSON object (a drafter config), not a {type(raw).__name__}")
    try:
        return raw, formats.config_from_json(raw, num_target_layers)
    except ValueError as e:
        raise ValueError(f"{path / CONFIG}: {e}") from None
    except (TypeError, KeyError, AttributeError, IndexError) as e:  # a field of the wrong shape, deep inside
        raise ValueError(f"{path / CONFIG} is not a drafter config blockdraft can read "
                         f"({type(e).__name__}: {e})") from None


def read_weights(path: Path, blob: bytes | None = None) -> dict:
    """The tensors of the drafter directory `path` (`blob`: its model.safetensors, already read)."""
    try:
        return load_bytes((path / WEIGHTS).read_bytes() if blob is None else blob)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path / WEIGHTS} is damaged or truncated ({e}); copy it again or re-train") from None


def load_drafter(dir_or_name: str | os.PathLike = "default", *, device=None, dtype: torch.dtype = torch.float32,
                 num_target_layers: int | None = None) -> DFlashDrafter:
    """Read a drafter directory of any registered format (JSON + safetensors only). Missing or unknown
    weights are an error. `num_target_layers` fills in what published speculators configs leave out."""
    path = resolve_drafter(dir_or_name)
    text, blob = read_snapshot(path)  # one version, whole, even while a save swaps another in
    _, cfg = read_config(path, num_target_layers, text)
    drafter = DFlashDrafter(cfg, initialize=False)  # every weight is loaded below (missing ones refused)
    raw = read_weights(path, blob)
    # every command and kind loads through here: a drafter with a NaN or Inf drafts nothing, silently
    require_finite(raw, str(path / WEIGHTS), "copy it again, or re-train it")
    sd = formats.native_weights(raw, cfg)
    expected = {k for k in drafter.state_dict() if not k.startswith("rotary_emb")}
    missing, unknown = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unknown:
        raise ValueError(f"{path / WEIGHTS} does not fit its config: missing {missing[:8]}, unknown {unknown[:8]}")
    if sd["fc.weight"].shape[1] != cfg.feature_size:
        raise ValueError(f"fc.weight takes {sd['fc.weight'].shape[1]} inputs but the config's "
                         f"{cfg.num_features} target layers x {cfg.target_hidden_size} give {cfg.feature_size}")
    try:
        drafter.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}, strict=False)
    except RuntimeError as e:  # a tensor of the wrong shape
        raise ValueError(f"{path / WEIGHTS} does not fit its config: {str(e).splitlines()[-1].strip()}") from None
    rows = raw.get("lm_head.weight")
    if cfg.draft_vocab_size and rows is not None and tuple(rows.shape) == (cfg.draft_vocab_size, cfg.hidden_size):
        drafter.loaded_head_rows = (sd["draft_vocab"].clone(), rows)  # what save_drafter writes back
    return drafter.to(device=device, dtype=dtype).eval()


def default_verifier(target_name: str | None) -> str | None:
    """The local directory of the target a drafter was trained for, when it can be found offline."""
    from ..target.files import EMBEDDED, resolve_target

    if not target_name:
        return None
    if target_name in EMBEDDED or Path(target_name).is_dir():
        return str(resolve_target(target_name)[0])
    return None


def write_export(drafter: DFlashDrafter, dst: str | os.PathLike, to: str, *, verifier: str | None = None) -> Path:
    """Write `drafter` in format `to`, as it is. What its consumers would compute from the files is
    theirs to say: `engines.exports.export_drafter` asks them first and refuses for them."""
    fmt = formats.get(to)
    cfg = drafter.config
    verifier = verifier or default_verifier(cfg.target_name)
    sd = state_tensors(drafter, None)
    rows = head_rows(verifier, sd["draft_vocab"]).to(sd["fc.weight"].dtype) if cfg.draft_vocab_size and verifier \
        else None
    ex = Export(verifier=verifier, head_rows=rows)
    out = fmt.write_config(cfg, ex)
    return _write(dst, out, fmt.write_weights(sd, cfg, ex), "convert")


def write_gguf(drafter: DFlashDrafter, dst: str | os.PathLike, *, target_gguf: str | os.PathLike | None = None,
               overwrite: bool = False) -> Path:
    """Write `drafter` as llama.cpp's DFlash GGUF file, as it is; `target_gguf` is the target file
    llama-server loads (default: the embedded target's own GGUF). An existing `dst` is refused unless
    `overwrite` and a `blockdraft convert` wrote it. `engines.exports.export_gguf` asks llama.cpp's
    quirks first and refuses for it."""
    from ..target.files import target_gguf as find_target_gguf
    from .formats import gguf

    cfg = drafter.config
    target_gguf = target_gguf or find_target_gguf(cfg.target_name)
    if target_gguf is None:
        raise ValueError(f"the GGUF export copies the tokenizer from the target's GGUF (the file llama-server "
                         f"loads); pass --target-gguf FILE (the drafter was trained for {cfg.target_name!r})")
    return gguf.write(state_tensors(drafter, None), cfg, dst, target_gguf, overwrite=overwrite)


def convert_source(src: str | os.PathLike, dst: str | os.PathLike,
                   num_target_layers: int | None = None) -> DFlashDrafter:
    """The drafter `convert` rewrites, loaded in its stored dtype (the trained tensors are copied bit
    for bit, never re-rounded), with the verifier a speculators config names; `dst` must be elsewhere.
    `engines.exports.convert` writes it."""
    path = resolve_drafter(src)
    if Path(dst).resolve() == path.resolve():
        raise ValueError("the destination is the source directory; choose a new directory")
    dtype = read_weights(path)["fc.weight"].dtype
    drafter = load_drafter(path, num_target_layers=num_target_layers, dtype=dtype)
    raw, _ = read_config(path, num_target_layers)
    if drafter.config.target_name is None and formats.detect(raw) == "speculators":
        drafter.config.target_name = raw["speculators_config"]["verifier"]["name_or_path"]
    return drafter
