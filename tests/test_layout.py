"""The package's import structure, read from its source (every import, those inside functions too):
no module imports itself back through others, and imports go downward only, through the layers
DESIGN.md section 3 draws. A new upward import fails here with the edge that breaks the rule."""

from __future__ import annotations

import ast
from pathlib import Path

import blockdraft

ROOT = Path(blockdraft.__file__).parent
# DESIGN.md section 3, lowest first; a unit may import units of its own layer or below.
LAYERS = (
    # no blockdraft algorithm
    ("__init__", "options", "process_group", "finite", "preempt", "checks", "releases"),
    ("rundir",),  # a command's output directory: ownership, locks, swaps, the trainer's state, retention
    ("config",),  # the drafter's side of the contract
    ("model", "target", "checkpoint", "pairing"),  # the two models and their files
    ("data", "generate", "bench"),  # the data, decoding, the benchmark runner
    ("engines",),  # everything that runs or serves a model: who serves what, and what runs the target
    ("train", "plan", "extract"),
    ("doctor",),  # the checks (a command's library)
    ("cli", "__main__"),
)
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """module -> the blockdraft modules it imports (a name imported from a package counts as its
    submodule where one exists, else as the package)."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}

    def known(name: str) -> str:
        while name not in paths:
            name = name.rsplit(".", 1)[0]
        return name

    out: dict[str, set[str]] = {}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        found = out.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                if source.split(".")[0] == "blockdraft":
                    found.update(known(f"{source}.{a.name}") for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(known(a.name) for a in node.names if a.name.split(".")[0] == "blockdraft")
        found.discard(mod)
    return out


def unit(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles, one per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_imports_inside_functions_and_relative_ones():
    graph = imports()
    assert "blockdraft.engines" in graph["blockdraft.doctor"]  # `from . import engines` inside a function
    # `from ...checkpoint...`, three levels up
    assert "blockdraft.checkpoint.formats.gguf" in graph["blockdraft.engines.llamacpp.consumer"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back():
    assert cycles(imports()) == []


def test_no_package_imports_a_package_that_imports_it_back():
    """Within a layer too: two packages that import each other are one concern split in two."""
    graph, edges = imports(), set()
    for m, ts in graph.items():
        edges.update((unit(m), unit(t)) for t in ts if unit(t) != unit(m))
    assert sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b) == []


def test_imports_go_downward_only():
    graph = imports()
    units = {unit(m) for m in graph}
    assert units <= set(RANK), f"place these in LAYERS (and DESIGN.md section 3): {sorted(units - set(RANK))}"
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if RANK[unit(t)] > RANK[unit(m)])
    assert upward == [], upward


def test_no_private_name_is_imported_from_another_module():
    """A name with a leading underscore is its module's own: another module asks for a public one."""
    found = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("blockdraft")):
                found += [f"{module_name(path)}: {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == [], found


def sentences(markdown: str) -> list[str]:
    """A page's sentences, code left out: every heading and list item is its own, paragraphs are split
    where a sentence ends (., ! or ? before a capital, a backtick or a parenthesis)."""
    import re

    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    blocks, out = re.split(r"\n\s*\n|\n(?=\s*[-#*] )|\n(?=\s*\d+\. )", text), []
    for block in blocks:
        flat = " ".join(block.split())
        out += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", flat) if s.strip()]
    return out


def test_the_readme_is_short_enough_to_read_in_one_sitting():
    """At most 200 lines; no sentence over 60 words; the long material lives in docs/."""
    readme = (ROOT.parents[1] / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    longest = max(sentences(readme), key=lambda s: len(s.split()))
    assert len(longest.split()) <= 60, longest
    assert sentences("A b c. D e.\n\n- one item. Two.\n- three") == ["A b c.", "D e.", "- one item.", "Two.", "- three"]


def test_every_docs_page_is_written_as_the_readme_is():
    """docs/: no sentence over 60 words (a table's rows are data, not sentences)."""
    pages = sorted((ROOT.parents[1] / "docs").glob("*.md"))
    assert pages
    long = [(p.name, " ".join(s.split()[:12])) for p in pages for s in sentences(p.read_text())
            if len(s.split()) > 60 and not s.startswith("|")]
    assert long == [], long


# the engines that run or serve a model; "dflash" and "speculators" also name a kind and a format, so a
# comparison with them is not an engine's branch
ENGINE_NAMES = {"transformers", "vllm", "llama.cpp", "llamacpp", "sglang"}


def engine_name_branches(tree: ast.AST) -> list[int]:
    """Lines that compare a value with an engine's name (`x == "vllm"`, `x in ("vllm", ...)`)."""
    def names(node) -> set:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value.lower()}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(names(e) for e in node.elts))
        return set()

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(names(x) & ENGINE_NAMES for x in (node.left, *node.comparators))]


def test_no_code_outside_engines_branches_on_an_engines_name():
    """Commands ask `engines` for what they need (a runner, a consumer's records); only engines/ knows
    which engine does what."""
    found = [f"{module_name(p)}:{line}" for p in ROOT.rglob("*.py") if "engines" not in p.relative_to(ROOT).parts
             for line in engine_name_branches(ast.parse(p.read_text()))]
    assert found == [], found
    assert engine_name_branches(ast.parse('if a == "vllm" or b in ("x", "llama.cpp"): pass')) == [1, 1]


# what a command may take from rundir/ directly: the object, and the rules any writer applies
# (markers, locks, swaps) or an option's parser needs (--report-to's trackers)
RUNDIR_DOORS = {"blockdraft.rundir", "blockdraft.rundir.directory", "blockdraft.rundir.ownership",
                "blockdraft.rundir.locks", "blockdraft.rundir.atomic", "blockdraft.rundir.trackers"}


def test_a_runs_files_are_reached_through_rundir_only():
    """The state files, the checkpoints kept, the best drafter, the metrics, the settings and the plots
    are `RunDir`'s: no module outside rundir/ imports the modules that hold them."""
    behind = sorted(f"{m} -> {t}" for m, ts in imports().items() if unit(m) != "rundir"
                    for t in ts if unit(t) == "rundir" and t not in RUNDIR_DOORS)
    assert behind == [], behind
    # the reader sees such an import (it would fail the test above if a command made one)
    assert "blockdraft.rundir.state" in imports()["blockdraft.rundir.directory"]


# checkpoint.native's writers that do not ask the consumers: only engines.exports calls them
UNASKED_WRITERS = {"write_export", "write_gguf", "convert_source"}


def unasked_writes(tree: ast.AST) -> list[int]:
    """Lines importing one of UNASKED_WRITERS from checkpoint.native."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("checkpoint.native"):
            if {a.name for a in node.names} & UNASKED_WRITERS:
                found.append(node.lineno)
    return found


def test_every_export_asks_the_consumers_first():
    """A consumer's quirks live with the consumer (engines/), and a format's writer knows no engine: an
    export reaches the writer only through engines.exports, which refuses what a server would serve
    as another function."""
    found = [f"{module_name(p)}:{line}" for p in ROOT.rglob("*.py") if module_name(p) != "blockdraft.engines.exports"
             for line in unasked_writes(ast.parse(p.read_text()))]
    assert found == [], found
    assert unasked_writes(ast.parse("from ..checkpoint.native import load_drafter, write_gguf")) == [1]
    formats_dir = ROOT / "checkpoint" / "formats"
    assert not [p.name for p in formats_dir.glob("*.py") if "Difference" in p.read_text()]  # no record made there


def test_nothing_outside_engines_imports_an_engines_own_package():
    """Commands and the library reach vLLM (and any engine's package) through `engines`' interface: a
    runner (`engines.runner(name)`, with its own options and flags), the consumers' registry. Only
    engines/ imports engines.vllm or engines.llamacpp."""
    own = ("blockdraft.engines.vllm", "blockdraft.engines.llamacpp")
    found = sorted(f"{m} -> {t}" for m, ts in imports().items() if unit(m) != "engines"
                   for t in ts if t.startswith(own))
    assert found == [], found
    assert any(t.startswith(own) for t in imports()["blockdraft.engines.consumers"])  # the reader sees them
