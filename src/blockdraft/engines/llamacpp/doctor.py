"""llama.cpp's check in `blockdraft doctor --llama-cpp`: llama-server with the drafter's GGUF against
target-only llama-server and blockdraft's own drafter (the same drafts, the same output)."""

from __future__ import annotations

from ...checks import FAIL, PASS, Check


def check_llamacpp(target, drafter, target_gguf: str | None) -> Check:
    """llama-server with this drafter's GGUF against target-only llama-server and blockdraft's drafter."""
    import tempfile

    from ...data.eval_prompts import load_prompt_set
    from ..exports import export_gguf
    from ...data.chat import encode_prompt
    from .server import compare

    prompts = [encode_prompt(target.tokenizer, m)[0].tolist() for m in load_prompt_set("mtbench", 3)]
    src = target_gguf or target_gguf_of(drafter)
    with tempfile.TemporaryDirectory(prefix="blockdraft-doctor-") as tmp:
        path, _ = export_gguf(drafter, f"{tmp}/draft.gguf", target_gguf=src, allow_mismatch=True)
        got = compare(target, drafter, prompts, target_gguf=src, drafter_gguf=path, max_new_tokens=96, log_dir=tmp)
    # DFlash: each slot's draft; DSpark and DFlash2: each step of the kind's walk, from llama.cpp's own
    # previous draft (the whole walk from the anchor agrees less: a near tie flipped early changes the
    # rest of its block; measured 0.93-0.95 against 0.98-0.99 per step, reference/test_llamacpp.py)
    ok = got["identical"] and got["step_agreement"] >= 0.95
    msg = (f"llama.cpp ({got['spec_type']}) drafts blockdraft's tokens in {got['step_agreement']:.1%} of the "
           f"{'walk steps' if drafter.kind.chained else 'slots'} of its {got['draft_calls']} drafts and "
           f"accepts {got['llamacpp_tau']:.2f} tokens per step; outputs {'identical' if got['identical'] else 'DIFFER'}")
    return Check("llama.cpp", PASS if ok else FAIL, msg,
                 "" if ok else "llama.cpp computes another function from the GGUF: check `blockdraft convert "
                               "--to gguf`'s refusals and the target GGUF (--target-gguf)")


def target_gguf_of(drafter) -> str:
    from ...target.files import target_gguf

    found = target_gguf(drafter.config.target_name)
    if found is None:
        raise ValueError("the llama.cpp check needs the target's GGUF file: pass --target-gguf FILE")
    return str(found)
