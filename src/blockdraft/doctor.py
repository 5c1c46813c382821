"""`blockdraft doctor`: the DFlash contract checked on the user's own target, data and checkpoint.

Every check returns PASS, WARN or FAIL with a one-line explanation and what to do. Each
compares this code path against an independent reference on the user's own setup: the
target's own logits, the dense mask, the target's own greedy decoding.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


@dataclass
class Check:
    name: str
    status: str
    message: str
    fix: str = ""


def _guard(name: str, fn, *args) -> Check:
    try:
        return fn(*args)
    except Exception as e:  # a crash in a check is reported as its failure, never hidden
        return Check(name, FAIL, f"{type(e).__name__}: {e}", "see the traceback with --debug")


def check_layer_ids(target, drafter) -> Check:
    c = drafter.config
    bad = [i for i in c.target_layer_ids if not 0 <= i <= target.num_layers - 2]
    if bad:
        return Check("layer ids", FAIL, f"ids {bad} are outside [0, {target.num_layers - 2}]", "retrain with valid ids")
    if drafter.fc.in_features != len(c.target_layer_ids) * target.hidden_size:
        return Check("layer ids", FAIL, f"fc takes {drafter.fc.in_features} inputs, but {len(c.target_layer_ids)} "
                     f"layers x {target.hidden_size} = {len(c.target_layer_ids) * target.hidden_size}",
                     "the checkpoint's ids do not match its fc; re-export it")
    if list(target.layer_ids) != list(c.target_layer_ids):
        return Check("layer ids", FAIL, f"target hooks {target.layer_ids} != checkpoint ids {c.target_layer_ids}",
                     "load the target with layer_ids from the checkpoint")
    return Check("layer ids", PASS, f"{c.target_layer_ids} in range, fc width {drafter.fc.in_features} = "
                 f"{len(c.target_layer_ids)} x {target.hidden_size}, written in config.json")


def check_labels(target, drafter, sample_ids: torch.Tensor) -> Check:
    from .train import Batch, prepare

    ids = sample_ids[:, : max(drafter.block_size + 2, min(sample_ids.shape[1], 256))]
    batch = Batch(ids, torch.ones_like(ids))
    p = prepare(target, drafter, batch, max_anchors=32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = target.model(ids.to(target.device)).logits[0]  # the model's own output
    want = []
    for j, a in enumerate(p.anchors.tolist()):
        for k in range(drafter.block_size):
            if p.supervised[j, k]:
                want.append(ref[a + k - 1])
    err = (p.target_logits - torch.stack(want)).abs().max().item()
    scale = ref.abs().max().item()
    if err > 1e-3 * max(1.0, scale):
        return Check("labels", FAIL, f"training labels differ from the target's own logits by {err:.3g}",
                     "labels must be the target's final-norm + head output at position a+k-1 (clause 3)")
    return Check("labels", PASS, f"labels equal model(input_ids).logits at a+k-1 (max diff {err:.2g})")


def check_mask(drafter) -> Check:
    from .model.masks import anchor_block_mask, chunked_mask_as_dense

    g = torch.Generator().manual_seed(0)
    T = 96
    doc = torch.zeros(T, dtype=torch.long)
    for cut in (20, 51, 70):
        doc[cut:] += 1
    anchors = torch.sort(torch.randperm(T, generator=g)[:12]).values
    for i in range(drafter.config.num_hidden_layers):
        w, causal = drafter.config.layer_window(i), drafter.config.layer_causal_in_block(i)
        ref = anchor_block_mask(doc, anchors, drafter.block_size, w, causal)
        fast = chunked_mask_as_dense(doc, anchors, drafter.block_size, max_blocks=3, sliding_window=w,
                                     causal_in_block=causal)
        if not torch.equal(ref, fast):
            n = int((ref != fast).sum())
            return Check("mask", FAIL, f"layer {i}: the fast mask differs from the dense reference in {n} places",
                         "the chunked attention path leaks or drops keys; report a bug")
    return Check("mask", PASS, "fast mask equals the dense reference on a 4-document layout, every layer")


def check_mask_token(target, drafter) -> Check:
    m = drafter.config.mask_token_id
    try:
        target.check_mask_token(m)
    except ValueError as e:
        return Check("mask token", FAIL, str(e), "retrain with a reserved/unused token as MASK")
    row = target.model.get_input_embeddings().weight[m]
    if not torch.isfinite(row).all():
        return Check("mask token", FAIL, f"embedding row of MASK ({m}) is not finite", "pick another MASK token")
    return Check("mask token", PASS, f"MASK = {m} ({target.tokenizer.convert_ids_to_tokens(m) if target.tokenizer else m})"
                 ", inside the vocabulary, not pad/eos/bos/unk, finite embedding")


def check_pairing(target, drafter) -> Check:
    from .generate import check_pair

    try:
        check_pair(target, drafter)
    except ValueError as e:
        return Check("target match", FAIL, str(e), "use the drafter trained for this target")
    return Check("target match", PASS, "hidden size, vocabulary, layers and tokenizer agree")


def check_sliding(drafter) -> Check:
    c = drafter.config
    sliding = [i for i, t in enumerate(c.layer_types) if t == "sliding_attention"]
    if not sliding:
        return Check("sliding layers", PASS, "no sliding-window layers: no train/serve mismatch possible")
    if not c.sliding_causal_in_block:
        return Check("sliding layers", WARN, f"layers {sliding} slide and are bidirectional in the block; vLLM runs "
                     "sliding-window draft layers causally", "serve with an engine that honours the flag, or retrain "
                     "with sliding_causal_in_block=True")
    return Check("sliding layers", PASS, f"layers {sliding} slide, causal in the block as engines serve them")


def check_data(target, path: str | None) -> Check:
    from .data import load_conversations, render

    if path is None:
        return Check("data", WARN, "no --data given: loss masks not checked", "pass --data FILE")
    tok = target.tokenizer
    if not getattr(tok, "chat_template", None):
        return Check("data", WARN, "the tokenizer has no chat template: a plain fallback is used", "set a template")
    convs, _ = load_conversations(path, skip_bad_lines=True)
    for c in convs[:20]:
        r = render(tok, c)
        ids = [i for i, m in zip(r["input_ids"], r["loss_mask"]) if m]
        learned = tok.decode(ids)
        for msg in c:
            if msg["role"] != "assistant" and len(msg["content"]) > 12 and msg["content"] in learned \
                    and not any(msg["content"] in a["content"] for a in c if a["role"] == "assistant"):
                return Check("data", FAIL, f"a {msg['role']} turn is inside the loss mask",
                             "loss_mask must be 1 on assistant tokens only")
        for msg in c:
            if msg["role"] == "assistant" and msg["content"].strip() and msg["content"].strip() not in learned:
                return Check("data", FAIL, "an assistant turn is missing from the loss mask",
                             "check the chat template's assistant markers")
    return Check("data", PASS, f"loss masks cover exactly the assistant turns on {min(20, len(convs))} conversations")


def check_greedy(target, drafter, sample_ids: torch.Tensor) -> Check:
    from .generate import speculative_generate
    from .generate.baseline import target_greedy

    ids = sample_ids[:, :64]
    ref = target_greedy(target, ids, max_new_tokens=24).tokens
    got = speculative_generate(target, drafter, ids, max_new_tokens=24)
    if got.tokens != ref:
        first = next(i for i, (a, b) in enumerate(zip(got.tokens, ref)) if a != b)
        return Check("greedy identity", FAIL, f"speculative output departs from the target's at token {first}",
                     "the verify/accept/crop loop is broken; report a bug")
    return Check("greedy identity", PASS, f"24 tokens identical to the target's own greedy decode (tau {got.tau:.2f})")


def sample_input(target, data: str | None) -> torch.Tensor:
    from .bench.prompts import encode

    text = "Explain how a hash table works, then write a short Python example."
    if data:
        from .data import load_conversations, render

        convs, _ = load_conversations(data, skip_bad_lines=True)
        if convs:
            return torch.tensor([render(target.tokenizer, convs[0])["input_ids"]])
    return encode(target.tokenizer, [{"role": "user", "content": text}])


def run_doctor(target, drafter, data: str | None = None, sample_ids: torch.Tensor | None = None) -> list[Check]:
    ids = sample_input(target, data) if sample_ids is None else sample_ids
    return [
        _guard("layer ids", check_layer_ids, target, drafter),
        _guard("labels", check_labels, target, drafter, ids),
        _guard("mask", check_mask, drafter),
        _guard("mask token", check_mask_token, target, drafter),
        _guard("target match", check_pairing, target, drafter),
        _guard("sliding layers", check_sliding, drafter),
        _guard("data", check_data, target, data),
        _guard("greedy identity", check_greedy, target, drafter, ids),
    ]


def report(checks: list[Check], as_json: bool = False) -> str:
    if as_json:
        return json.dumps([asdict(c) for c in checks], indent=1)
    lines = []
    for c in checks:
        lines.append(f"{c.status:4}  {c.name:16} {c.message}" + (f"\n      fix: {c.fix}" if c.status != PASS and c.fix
                                                                    else ""))
    return "\n".join(lines)



def doctor_main(target_name: str, drafter_path: str, data: str | None, device: str | None) -> list[Check]:
    """Load what can be loaded; a checkpoint or target that does not load is itself a FAIL."""
    from .checkpoint import load_drafter
    from .target import TargetModel, target_num_layers

    try:
        drafter = load_drafter(drafter_path, device=device, num_target_layers=target_num_layers(target_name))
    except ValueError as e:
        return [Check("checkpoint", FAIL, str(e), "re-export the checkpoint (config.json + model.safetensors)")]
    try:
        target = TargetModel.from_pretrained(target_name, layer_ids=drafter.config.target_layer_ids, device=device)
    except ValueError as e:
        return [Check("layer ids", FAIL, str(e), "the checkpoint's target_layer_ids do not fit this target")]
    return run_doctor(target, drafter, data)
