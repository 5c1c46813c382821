"""DESIGN.md stays a design (the contract, the layers, how to extend), and each consumer's release is
written once in the package: in its constant in blockdraft/releases.py, which every message takes it from."""

from __future__ import annotations

import re
from pathlib import Path

import blockdraft
from blockdraft import releases

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(blockdraft.__file__).parent
DESIGN_MAX_LINES = 300
# constant -> whether messages also name its major.minor (vLLM's: "vLLM 0.32", releases.VLLM_SERIES); the
# other short forms ("0.5", "0.2") are everyday numbers, so only the full strings are looked for there
CONSTANTS = {"VLLM_RELEASE": True, "SGLANG_RELEASE": False, "LLAMACPP_RELEASE": False, "SPECULATORS_RELEASE": False,
             "SPECFORGE_RELEASE": False, "MODELOPT_RELEASE": False}


def test_design_is_short():
    lines = (REPO / "DESIGN.md").read_text().splitlines()
    assert len(lines) <= DESIGN_MAX_LINES, (
        f"DESIGN.md has {len(lines)} lines (at most {DESIGN_MAX_LINES}): put a consumer's facts in "
        "docs/consumers.md or beside its module, not in the design")


def spellings(name: str) -> list[str]:
    """The ways the constant's release may be written: in full, and its major.minor where messages use it."""
    release = getattr(releases, name)
    return [release] + ([releases.series(release)] if CONSTANTS[name] else [])


def test_each_release_is_written_once():
    """Brute force: every line of every .py under src/ that names a release, outside its constant's line."""
    defined, stray = {}, []
    for name in CONSTANTS:
        pattern = re.compile("|".join(rf"(?<![\d.]){re.escape(s)}(?!\d)" for s in spellings(name)))
        for path in sorted(PACKAGE.rglob("*.py")):
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if not pattern.search(line):
                    continue
                if path.name == "releases.py" and line.startswith(f"{name} = "):
                    defined[name] = line
                else:
                    stray.append(f"{path.relative_to(PACKAGE)}:{no}: {line.strip()}")
    assert set(defined) == set(CONSTANTS), f"constants without their definition line: {set(CONSTANTS) - set(defined)}"
    assert not stray, "a release written outside blockdraft/releases.py (use its constant):\n" + "\n".join(stray)


def test_vllm_constant_is_the_run_release():
    from blockdraft.engines.vllm import releases as vllm_releases

    assert vllm_releases.run_release() == releases.VLLM_RELEASE
