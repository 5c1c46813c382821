"""Prompts for the default dataset, built from real text that installs offline.

Sources: the Python standard library's own sources (function docstrings and code, module
docstrings) and the system's section-1 manual pages (command summaries). No evaluation
set (MT-Bench, GSM8K, HumanEval) is read. A small share of arithmetic word problems is
made from templates, with object names taken from the same texts, so that step-by-step
numeric reasoning is not absent from training; they are marked `kind: "arith"`.
"""

from __future__ import annotations

import ast
import gzip
import random
import re
import sysconfig
from pathlib import Path

CODE_TASKS = [
    "Write a Python function `{name}{sig}` that {doc}",
    "Implement `{name}{sig}` in Python. It should {doc}",
]
EXPLAIN_TASKS = [
    "Explain what this Python function does:\n\n```python\n{src}\n```",
    "Review this Python code and describe how it works step by step:\n\n```python\n{src}\n```",
]
PROSE_TASKS = [
    "Summarize the following text in a few sentences:\n\n{text}",
    "Explain the following documentation to a beginner:\n\n{text}",
    "What are the key points of this passage?\n\n{text}",
]
MAN_TASKS = [
    "How do I use the `{cmd}` command ({what})? Give an example.",
    "What does the Unix command `{cmd}` do? Explain with examples.",
]


def stdlib_functions(limit_files: int = 400, seed: int = 0) -> list[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[:limit_files] + sorted(root.glob("*/*.py"))[:limit_files]
    out = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        mod_doc = ast.get_docstring(tree)
        if mod_doc and len(mod_doc) > 200:
            out.append({"kind": "prose", "text": mod_doc[:1200]})
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                src = ast.get_source_segment(text, node) or ""
                if doc and 40 < len(doc) < 600 and 3 < src.count("\n") < 30:
                    out.append({"kind": "func", "name": node.name, "sig": _signature(node), "doc": doc, "src": src})
    random.Random(seed).shuffle(out)
    return out


def _signature(node: ast.FunctionDef) -> str:
    args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
    return "(" + ", ".join(args) + ")"


def man_summaries(limit: int = 2000) -> list[dict]:
    out = []
    for path in sorted(Path("/usr/share/man/man1").glob("*.1.gz"))[:limit]:
        try:
            raw = gzip.open(path, "rt", errors="ignore").read(20000)
        except OSError:
            continue
        m = re.search(r"\.SH\s+\"?NAME\"?\s*\n(.+?)\n", raw)
        if not m:
            continue
        line = re.sub(r"\\f[BIRP]|\\", "", m.group(1))
        if " - " in line:
            cmd, what = line.split(" - ", 1)
            cmd = cmd.split(",")[0].strip()
            if cmd and what and len(what) < 120:
                out.append({"kind": "man", "cmd": cmd, "what": what.strip().rstrip(".")})
    return out


STOP = {"with", "from", "that", "into", "this", "other", "using", "about", "between", "display", "create",
        "print", "convert", "manage", "show", "generate", "check", "list", "based", "used", "tool", "utility",
        "command", "program", "tools", "version", "simple", "standard", "format", "information", "given", "line"}


def common_nouns(mans: list[dict], k: int = 60) -> list[str]:
    """Frequent plain words of the manual pages' one-line summaries (file, archive, package, ...)."""
    from collections import Counter

    words = Counter(w.rstrip("s") for m in mans for w in re.findall(r"\b[a-z]{4,9}\b", m["what"].lower()))
    return [w for w, _ in words.most_common(k + len(STOP)) if w not in STOP and len(w) > 3][:k]


def arith_problems(nouns: list[str], n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    forms = [
        "A library has {a} {x}s. It gets {b} more each week for {c} weeks. How many {x}s does it have then? "
        "Explain step by step.",
        "Each box holds {a} {x}s. How many boxes are needed for {p} {x}s? Show your reasoning.",
        "A team processes {a} {x}s per hour for {c} hours and then {b} {x}s per hour for {d} hours. "
        "How many {x}s in total? Work it out step by step.",
        "There are {p} {x}s. {q} percent of them are removed. How many remain? Explain.",
    ]
    out = []
    for _ in range(n):
        f = rng.choice(forms)
        x = rng.choice(nouns)
        out.append({"kind": "arith", "text": f.format(a=rng.randint(2, 60), b=rng.randint(2, 40), c=rng.randint(2, 9),
                                                      d=rng.randint(2, 9), p=rng.randint(50, 900),
                                                      q=rng.choice([10, 20, 25, 40, 50]), x=x)})
    return out


def build_prompts(n: int = 800, seed: int = 0) -> list[dict]:
    """A shuffled mix of `n` prompt records {"id", "kind", "messages"} (user turn only)."""
    rng = random.Random(seed)
    funcs = stdlib_functions(seed=seed)
    mans = man_summaries()
    rng.shuffle(mans)
    nouns = common_nouns(mans) or ["record"]
    quota = {"func": int(0.4 * n), "explain": int(0.15 * n), "prose": int(0.1 * n), "man": int(0.2 * n)}
    quota["arith"] = n - sum(quota.values())
    items: list[tuple[str, str]] = []
    fn = [f for f in funcs if f["kind"] == "func"]
    for f in fn[:quota["func"]]:
        doc = f["doc"].split("\n\n")[0].replace("\n", " ").strip()
        doc = doc[0].lower() + doc[1:] if doc else doc
        items.append(("func", rng.choice(CODE_TASKS).format(name=f["name"], sig=f["sig"], doc=doc)))
    for f in fn[quota["func"]:quota["func"] + quota["explain"]]:
        items.append(("explain", rng.choice(EXPLAIN_TASKS).format(src=f["src"])))
    for f in [f for f in funcs if f["kind"] == "prose"][:quota["prose"]]:
        items.append(("prose", rng.choice(PROSE_TASKS).format(text=f["text"])))
    for m in mans[:quota["man"]]:
        items.append(("man", rng.choice(MAN_TASKS).format(cmd=m["cmd"], what=m["what"])))
    for a in arith_problems(nouns, quota["arith"], seed):
        items.append(("arith", a["text"]))
    rng.shuffle(items)
    return [{"id": i, "kind": k, "messages": [{"role": "user", "content": t}]} for i, (k, t) in enumerate(items)]
