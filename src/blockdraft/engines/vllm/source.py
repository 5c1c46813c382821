"""vLLM's model source read as text, without importing vLLM: its model registry (which module and class
serve each architecture), whether a class declares `SupportsEagle3`, and what blockdraft's vLLM plugin
(`plugin.py`) would do for a class that does not (`Source.plan`, `can_capture`)."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

MODELS = "vllm.model_executor.models"  # vLLM's first layout: one module per family
PACKAGES = "vllm.models"  # vLLM 0.33's: a package per family, a folder per platform inside
PLATFORM = "cuda"  # the platform whose branches the reader follows unless told another (the engines' GPUs)


@dataclass(frozen=True)
class Plan:
    """What the plugin does for one wrapper class: build `inner` (defined in `inner_module`) with its
    forward rewritten (`rewrite`), or only mark the wrapper (the inner model records states already).
    `summed`: the stream between layers is `hidden + residual` (vLLM's fused-residual layers); else
    `hidden` alone (layers that take their input as the residual, such as Cohere's parallel blocks)."""

    inner_module: str
    inner: str
    rewrite: bool
    summed: bool = True


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def short_name(module: str) -> str:
    """A model module as the reader names it: relative to `MODELS` where it lies there (vLLM's first
    layout, "llama"), else fully qualified (vLLM 0.33's per-family packages, "vllm.models.deepseek_v4")."""
    return module[len(MODELS) + 1:] if module.startswith(MODELS + ".") else module


def full_name(module: str) -> str:
    """The importable name of a model module the reader names (`short_name`'s inverse)."""
    return module if module.startswith("vllm.") else f"{MODELS}.{module}"


def _is_model_module(full: str) -> bool:
    return full.startswith(MODELS + ".") or full.startswith(PACKAGES + ".")


def _imported_from(node: ast.ImportFrom, package: str) -> str | None:
    """The model module an import names (`short_name`), relative (any level) or absolute; None for a
    module outside vLLM's model code or an import of a module itself (`from . import x`)."""
    if not node.module:
        return None
    if node.level == 0:
        full = node.module
    else:
        parts = full_name(package).split(".") if package else MODELS.split(".")
        if node.level - 1 >= len(parts):
            return None
        full = ".".join(parts[:len(parts) - (node.level - 1)] + [node.module])
    return short_name(full) if _is_model_module(full) else None


def _truth(test: ast.expr, platform: str, checking: bool) -> bool | None:
    """What an `if` test at a model module's top level is on `platform`: `current_platform.is_X()`,
    `current_platform.device_type == "x"`, `TYPE_CHECKING` (`checking`), not/and/or of those; None when
    the reader cannot tell."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        got = _truth(test.operand, platform, checking)
        return None if got is None else not got
    if isinstance(test, ast.BoolOp):
        got = [_truth(v, platform, checking) for v in test.values]
        want = isinstance(test.op, ast.Or)
        return want if want in got else (None if None in got else not want)
    text = ast.unparse(test)
    if text.endswith("TYPE_CHECKING"):
        return checking
    if isinstance(test, ast.Call) and text.startswith("current_platform.is_") and text.endswith("()"):
        asked = text[len("current_platform.is_"):-2]
        return platform in ("cuda", "rocm") if asked == "cuda_alike" else asked == platform
    if (isinstance(test, ast.Compare) and ast.unparse(test.left) == "current_platform.device_type"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)):
        same = test.comparators[0].value == ("cuda" if platform == "rocm" else platform)
        return same if isinstance(test.ops[0], ast.Eq) else not same if isinstance(test.ops[0], ast.NotEq) else None
    return None


def _imports(tree: ast.Module, package: str, platform: str = PLATFORM) -> dict[str, tuple[str, str]]:
    """name -> (the model module it is imported from, its name there), for the statements a process on
    `platform` runs at the module's top level: `if` branches taken as `_truth` says (both where it cannot
    tell, the `if` branch winning), a `try` block's body. vLLM 0.33's family packages import a class in
    the branch of their platform, some only under TYPE_CHECKING (their `__getattr__` hands it out lazily):
    a name the run does not bind is read again with TYPE_CHECKING true. `package`: the package of the
    module read ("" for the models folder itself)."""

    def walk(stmts, out, checking):
        for node in stmts:
            if isinstance(node, ast.ImportFrom):
                mod = _imported_from(node, package)
                for a in node.names if mod else ():
                    out[a.asname or a.name] = (mod, a.name)
            elif isinstance(node, ast.If):
                took = _truth(node.test, platform, checking)
                if took is None:
                    walk(node.orelse, out, checking)
                walk(node.body if took in (True, None) else node.orelse, out, checking)
            elif isinstance(node, ast.Try):
                walk(node.body, out, checking)
        return out

    run = walk(tree.body, {}, False)
    return {**walk(tree.body, {}, True), **run}


def _model_call(init: ast.FunctionDef) -> str | None:
    """X in `self.model = X(...)` inside an __init__."""
    for node in ast.walk(init):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Call):
            t, f = node.targets[0], node.value.func
            if (isinstance(t, ast.Attribute) and t.attr == "model" and isinstance(t.value, ast.Name)
                    and t.value.id == "self" and isinstance(f, ast.Name)):
                return f.id
    return None


def find_loop(fn: ast.FunctionDef) -> tuple[int, ast.For, ast.Assign, str, str | None] | str:
    """(index in the body, the layer loop, the layer call's assignment, the hidden-state name, the
    residual name or None) of a decoder forward, or why it has not the shape this plugin rewrites."""
    if fn.decorator_list:
        return "its forward is decorated"
    if not (isinstance(fn.body[-1], ast.Return) and fn.body[-1].value is not None):
        return "its forward does not end by returning its output"
    for i, stmt in enumerate(fn.body):
        if isinstance(stmt, ast.For) and "self.layers" in ast.unparse(stmt.iter):
            calls = [s for s in stmt.body if isinstance(s, ast.Assign) and len(s.targets) == 1
                     and isinstance(s.value, ast.Call)]
            if len(calls) != 1:
                return "its layer loop does not make exactly one layer call"
            t = calls[0].targets[0]
            if isinstance(t, ast.Name):
                return i, stmt, calls[0], t.id, None
            if isinstance(t, ast.Tuple) and len(t.elts) == 2 and all(isinstance(e, ast.Name) for e in t.elts):
                h, r = t.elts[0].id, t.elts[1].id
                before = {n.id for s in fn.body[:i] for n in ast.walk(s) if isinstance(n, ast.Name)
                          and isinstance(n.ctx, ast.Store)}
                if r not in before:
                    return f"its residual {r!r} is not set before the layer loop"
                return i, stmt, calls[0], h, r
            return "its layer call does not return (hidden, residual) or hidden"
    return "its forward has no loop over self.layers"


def _restarts_residual(fn: ast.FunctionDef) -> bool:
    """A decoder layer's forward whose first statement is `residual = hidden_states`: it drops the
    residual it is given, so the stream it returns is `hidden_states` alone."""
    body = [b for b in fn.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
    first = body[0] if body else None
    return (isinstance(first, ast.Assign) and len(first.targets) == 1 and ast.unparse(first.targets[0]) == "residual"
            and ast.unparse(first.value) == "hidden_states")


def _records_states(fn: ast.FunctionDef) -> bool:
    return "_maybe_add_hidden_state" in ast.unparse(fn)


def _passes_through(fn: ast.FunctionDef | None) -> bool:
    """A wrapper forward that returns what `self.model(...)` returned, untouched."""
    if fn is None:
        return False
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return False
    ret = body[-1].value

    def is_model_call(v):
        return isinstance(v, ast.Call) and ast.unparse(v.func) == "self.model"

    if is_model_call(ret) and len(body) == 1:
        return True
    return (len(body) == 2 and isinstance(body[0], ast.Assign) and is_model_call(body[0].value)
            and isinstance(ret, ast.Name) and len(body[0].targets) == 1
            and ast.unparse(body[0].targets[0]) == ret.id)


class Source:
    """vLLM's model modules read as text (an installed tree, without importing vLLM)."""

    def __init__(self, models_dir: str | os.PathLike, platform: str = PLATFORM):
        self.dir, self.trees, self.platform = Path(models_dir), {}, platform

    def _path(self, module: str) -> tuple[Path, str] | None:
        """(file, its package) of a model module ("a.b": a/b.py or a/b/__init__.py under the models folder;
        "vllm.x.y": vllm/x/y.py or vllm/x/y/__init__.py of the tree the models folder is in)."""
        if module.startswith("vllm."):
            base = self.dir.parent.parent.joinpath(*module.split(".")[1:])
        else:
            base = self.dir.joinpath(*module.split("."))
        if base.with_suffix(".py").exists():
            return base.with_suffix(".py"), module.rpartition(".")[0]
        if (base / "__init__.py").exists():
            return base / "__init__.py", module
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self.trees:
            found = self._path(module)
            self.trees[module] = ast.parse(found[0].read_text()) if found else None
        return self.trees[module]

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """The module and class node a name refers to in `module` (defined there or imported)."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        found = _classes(tree).get(name)
        if found is not None:
            return module, found
        got = _imports(tree, self._path(module)[1], self.platform).get(name)
        return self.resolve(got[0], got[1], depth + 1) if got else None

    def method(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0):
        """(module, function node) of a method, looked up through the class's bases."""
        fn = _method(cls, name)
        if fn is not None or depth > 8:
            return (module, fn) if fn is not None else None
        for base in cls.bases:
            b = base.id if isinstance(base, ast.Name) else None
            got = self.resolve(module, b) if b else None
            if got is not None:
                found = self.method(got[0], got[1], name, depth + 1)
                if found is not None:
                    return found
        return None

    def supports_eagle3(self, module: str, cls_name: str, depth: int = 0) -> bool:
        """Whether vLLM's class implements SupportsEagle3 (through its bases), as its source says."""
        got = self.resolve(module, cls_name)
        if got is None or depth > 12:
            return False
        mod, cls = got
        for base in cls.bases:
            b = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
            if b == "SupportsEagle3" or (b and b != cls_name and self.supports_eagle3(mod, b, depth + 1)):
                return True
        return False

    def plan(self, module: str, cls_name: str) -> Plan | str:
        """What the plugin does for wrapper class `cls_name` of `module`, or why it cannot."""
        got = self.resolve(module, cls_name)
        if got is None:
            return f"{cls_name} is not in vLLM's {module if module.startswith('vllm.') else module + '.py'}"
        mod, cls = got
        init = self.method(mod, cls, "__init__")
        inner = _model_call(init[1]) if init else None
        if inner is None:
            return f"{cls_name} builds no `self.model = ...(...)` decoder model"
        if not _passes_through((self.method(mod, cls, "forward") or (None, None))[1]):
            return f"{cls_name}.forward does more than return its decoder model's output"
        where = self.resolve(init[0], inner)
        if where is None:
            return f"{cls_name}'s decoder model {inner} is not found in vLLM's source"
        fwd = self.method(where[0], where[1], "forward")
        if fwd is None:
            return f"{inner} has no forward"
        if _records_states(fwd[1]):
            return Plan(where[0], inner, rewrite=False)
        loop = find_loop(fwd[1])
        if isinstance(loop, str):
            return f"{inner}: {loop}"
        return Plan(where[0], inner, rewrite=True, summed=not self._layers_restart_residual(where[0], where[1]))

    def _layers_restart_residual(self, module: str, inner: ast.ClassDef) -> bool:
        """Whether the decoder layers the model builds (classes called in its __init__ whose forward
        takes a `residual`) drop the residual they are given."""
        init = self.method(module, inner, "__init__")
        if init is None:
            return False
        for node in ast.walk(init[1]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                got = self.resolve(init[0], node.func.id)
                fwd = self.method(got[0], got[1], "forward") if got else None
                if fwd and "residual" in [a.arg for a in fwd[1].args.args] and _restarts_residual(fwd[1]):
                    return True
        return False


def can_capture(models_dir: str | os.PathLike, module: str, cls_name: str) -> tuple[bool, str]:
    """(whether blockdraft's plugin gives this class the states, the reason when it cannot)."""
    got = Source(models_dir).plan(module, cls_name)
    return (True, "") if isinstance(got, Plan) else (False, got)


# the registry's tables of models that generate text (the Transformers backend's included: Olmo-2 runs there)
TABLES = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS", "_TRANSFORMERS_SUPPORTED_MODELS",
          "_TRANSFORMERS_BACKEND_MODELS")


def registry(models: Path) -> dict[str, tuple[str, str]]:
    """HF architecture -> (module, class) of the tables that generate text (`TABLES`), a later table
    naming an architecture again winning, as in vLLM's merged registry (`_VLLM_MODELS`). A module is
    named relative to the models folder, or in full where it lies elsewhere (`short_name`: vLLM 0.33's
    registry names its family packages so, "vllm.models.deepseek_v4")."""
    tree = ast.parse((models / "registry.py").read_text())
    out = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        name = getattr(target, "id", "")
        if name in TABLES and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) >= 2:
                    out[k.value] = (short_name(v.elts[0].value), v.elts[1].value)
    return out


def read_tables(vllm_dir: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(architectures whose vLLM class implements SupportsEagle3, those blockdraft's plugin gives the
    states to), from a vLLM source tree."""
    models = Path(vllm_dir) / "model_executor" / "models"
    src, native, plugin = Source(models), set(), set()
    for arch, (mod, cls) in registry(models).items():
        if src.supports_eagle3(mod, cls):
            native.add(arch)
        elif isinstance(src.plan(mod, cls), Plan):
            plugin.add(arch)
    return frozenset(native), frozenset(plugin)
