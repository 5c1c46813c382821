"""blockdraft's vLLM plugin: the layer states `extract_hidden_states` needs, for target classes vLLM wrote
without them (Glm4Moe first: GLM-4.5/4.6/4.7; Gemma-2/3, Mixtral, Cohere, GLM-4, Falcon-H1).

vLLM's `extract_hidden_states` method asks the target class for the states entering chosen layers
(`SupportsEagle3`: `set_aux_hidden_state_layers`, and a forward that returns them beside its output);
a class without that interface is refused. Every such class in vLLM is a causal-LM wrapper around a
decoder model whose forward runs the layers in one loop over `islice(self.layers, ...)`. For those,
this plugin makes the class vLLM itself would have written, from vLLM's own source:

* the decoder model's forward, with its loop rewritten to record each layer's input stream
  (`hidden + residual`, or `hidden` where a layer keeps no separate residual) through vLLM's own
  `EagleModelMixin._maybe_add_hidden_state`, and to return `(output, states)` when layers were asked
  for: the same statements vLLM's own Eagle-3 targets carry (qwen3_moe.py, llama.py), and nothing else
  of the forward changed (embedding scales, norms, pipeline stages stay vLLM's code);
* the wrapper class, marked `SupportsEagle3`, building that decoder model instead of vLLM's.

A decoder model that already records them (GLM-4 reuses Llama's) only has its wrapper marked. A
class whose source does not have that shape is refused by name when an engine asks for it (`register`
raises, `can_capture` says why); it is never skipped for vLLM to refuse later.

The plugin acts only in engines blockdraft starts for capture: they carry `ENV` (the architectures
to give states to) in their environment, and vLLM loads the plugin in each of its processes through
its `vllm.general_plugins` entry point (`launch.plugin_path`). Without `ENV` it does nothing, so an
installed blockdraft never changes what a user's own vLLM serves. The rewritten forward is written to
a file (`BLOCKDRAFT_VLLM_AUX_DIR`, default the system's temporary folder) so that tracebacks, Python's
`inspect` and vLLM's compile cache see real source.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

from .source import (MODELS, PACKAGES, TABLES, Plan, Source, can_capture, find_loop, full_name,  # noqa: F401
                     registry, short_name)  # (re-exported: the reader's names, as before it moved)

ENV = "BLOCKDRAFT_VLLM_PLUGIN"
AUX_DIR_ENV = "BLOCKDRAFT_VLLM_AUX_DIR"
PREFIX = "Aux__"
AUX, INDEX = "_blockdraft_aux", "_blockdraft_i"

# --------------------------------------------------------------------------- in vLLM's processes


def rewrite_forward(source: str, summed: bool = True) -> str:
    """A decoder forward's source with the layer states recorded (see the module's docstring);
    `summed`: the stream is hidden + residual (else hidden alone, `Plan.summed`)."""
    tree = ast.parse(textwrap.dedent(source))
    fn = tree.body[0]
    got = find_loop(fn)
    if isinstance(got, str):
        raise ValueError(got)
    i, loop, call, h, r = got
    res = r if (r and summed) else "None"
    loop.iter = ast.Call(func=ast.Name("enumerate", ast.Load()), args=[loop.iter],
                         keywords=[ast.keyword("start", ast.parse("self.start_layer", mode="eval").body)])
    loop.target = ast.Tuple([ast.Name(INDEX, ast.Store()), loop.target], ast.Store())
    loop.body.insert(loop.body.index(call) + 1,
                     ast.parse(f"self._maybe_add_hidden_state({AUX}, {INDEX} + 1, {h}, {res})").body[0])
    fn.body.insert(i, ast.parse(f"{AUX} = self._maybe_add_hidden_state([], self.start_layer, {h}, {res})").body[0])
    out = fn.body[-1].value
    fn.body[-1] = ast.Return(ast.IfExp(test=ast.Name(AUX, ast.Load()),
                                       body=ast.Tuple([out, ast.Name(AUX, ast.Load())], ast.Load()), orelse=out))
    return ast.unparse(ast.fix_missing_locations(tree))


def _written(source: str, name: str) -> Path:
    """The rewritten source as a file (the same bytes are written once)."""
    root = Path(os.environ.get(AUX_DIR_ENV) or Path(tempfile.gettempdir()) / f"blockdraft-vllm-aux-{os.getuid()}")
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}-{hashlib.sha256(source.encode()).hexdigest()[:12]}.py"
    if not path.exists():
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(source)
        os.replace(tmp, path)
    return path


def _models_dir() -> Path:
    return Path(sys.modules["vllm"].__file__).parent / "model_executor" / "models"


def _platform() -> str:
    """This process's platform as the family packages test it (ROCm's device type is "cuda" too)."""
    from vllm.platforms import current_platform

    return "rocm" if current_platform.is_rocm() else str(current_platform.device_type)


def build(module: str, cls_name: str):
    """The wrapper class with layer states for vLLM's `cls_name` of `module` (in a vLLM process)."""
    import importlib
    import inspect

    from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3

    outer = getattr(importlib.import_module(full_name(module)), cls_name)
    # planned where this process's class is defined (a family package imports its platform's)
    plan = Source(_models_dir()).plan(short_name(outer.__module__), outer.__name__)
    if isinstance(plan, str):
        raise ValueError(f"blockdraft's vLLM plugin cannot give {cls_name} its layer states: {plan}")
    inner = getattr(importlib.import_module(full_name(plan.inner_module)), plan.inner)
    attrs = {"__module__": __name__, "__qualname__": f"{cls_name}WithStates", "supports_eagle3": True}
    if plan.rewrite:
        fwd = inner.forward
        src = rewrite_forward(inspect.getsource(fwd), summed=plan.summed)
        ns = dict(fwd.__globals__)
        exec(compile(src, str(_written(src, f"{plan.inner_module}.{plan.inner}")), "exec"), ns)
        forward = ns["forward"]
        with_states = type(f"{plan.inner}WithStates", (inner, EagleModelMixin),
                           {"forward": forward, "__module__": __name__})
        forward.__qualname__ = f"{with_states.__name__}.forward"
        init_globals = outer.__init__.__globals__

        def __init__(self, *, vllm_config, prefix: str = ""):  # the signature vLLM looks for
            saved = init_globals[plan.inner]
            init_globals[plan.inner] = with_states  # the wrapper builds the decoder model by this name
            try:
                outer.__init__(self, vllm_config=vllm_config, prefix=prefix)
            finally:
                init_globals[plan.inner] = saved

        attrs["__init__"] = __init__
    return type(f"{cls_name}WithStates", (outer, SupportsEagle3), attrs)


def __getattr__(name: str):
    """`PREFIX module__Class`: the class `register` points vLLM's registry at, built on first use."""
    if not name.startswith(PREFIX) or "__" not in name[len(PREFIX):]:
        raise AttributeError(name)
    module, cls_name = name[len(PREFIX):].split("__", 1)
    built = globals()[name] = build(module, cls_name)
    return built


def register() -> None:
    """vLLM's plugin hook (every vLLM process): in a capture engine blockdraft started, point each
    architecture `ENV` names (`{"architectures": [...]}`) at the class this module builds for it
    (lazily, by name)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    from vllm import ModelRegistry

    source = Source(_models_dir(), _platform())
    for arch in json.loads(spec).get("architectures", []):
        entry = ModelRegistry.models.get(arch)
        module, cls = getattr(entry, "module_name", None), getattr(entry, "class_name", None)
        if module is None or not module.startswith((MODELS + ".", PACKAGES + ".")) or cls is None:
            continue  # already ours (plugins load more than once), or not one of vLLM's own modules
        short = short_name(module)
        if source.supports_eagle3(short, cls):
            continue  # vLLM's own class captures
        plan = source.plan(short, cls)
        if not isinstance(plan, Plan):  # refused by name: vLLM would otherwise refuse it at start, saying less
            raise ValueError(f"blockdraft's vLLM plugin cannot give {arch} ({short}.{cls} of vLLM "
                             f"{getattr(sys.modules['vllm'], '__version__', '?')}) its layer states: {plan}")
        ModelRegistry.register_model(arch, f"{__name__}:{PREFIX}{short}__{cls}")
