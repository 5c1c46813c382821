"""`blockdraft doctor`: the DFlash contract checked on the user's own target, data and checkpoint.

Every check returns PASS, WARN, FAIL or SKIP with a one-line explanation and what to do. Each
compares this code path against an independent reference on the user's own setup: the
target's own logits, the dense mask, the target's own greedy decoding, the training path
against the serving path. Without a checkpoint (`--target` alone, before training) the checks
that need none run on a probe drafter of `blockdraft train`'s default layout; the others are
named as skipped.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import asdict

import torch

from .checks import FAIL, PASS, SKIP, WARN, Check  # noqa: F401 (doctor's names)


def _guard(name: str, fn, *args, debug: bool = False) -> Check:
    try:
        return fn(*args)
    except Exception as e:  # a crash in a check is reported as its failure, never hidden
        if debug:
            traceback.print_exc()
        return Check(name, FAIL, f"{type(e).__name__}: {e}", "rerun with --debug for the traceback")


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
    err = (p.target_logits.per_slot() - torch.stack(want)).abs().max().item()
    scale = ref.abs().max().item()
    if err > 1e-3 * max(1.0, scale):
        return Check("labels", FAIL, f"training labels differ from the target's own logits by {err:.3g}",
                     "labels must be the target's final-norm + head output at position a+k-1 (clause 3)")
    # a feature cache stores the final normed state and scores it with target.head (the drafter's
    # logits too): that must be the model's own logits, its logit scale or soft-cap included
    with torch.no_grad():
        final = target(ids.to(target.device), return_final_hidden=True).final_hidden[0]
        head_err = (target.head(final) - ref).abs().max().item()
    if head_err > 1e-3 * max(1.0, scale):
        return Check("labels", FAIL, f"the target's head on its final normed state differs from its logits by "
                     f"{head_err:.3g}: this family scales or caps its logits in a way blockdraft does not apply",
                     "report the family (blockdraft.target.family.logit_transform)")
    return Check("labels", PASS, f"labels equal model(input_ids).logits at a+k-1 (max diff {err:.2g}), and so does "
                 f"the head on the cached final state ({head_err:.2g})")


def check_weights(drafter):
    """Every weight of the drafter is finite."""
    from .finite import nonfinite

    sd = drafter.state_dict()
    bad = nonfinite(sd)
    if bad:
        return Check("finite weights", FAIL, f"{len(bad)} tensors hold non-finite values: {', '.join(bad[:3])}"
                     + (" ..." if len(bad) > 3 else ""), "the checkpoint is damaged or its training diverged: "
                     "retrain (or resume from an earlier checkpoint with a lower --lr)")
    return Check("finite weights", PASS, f"all {sum(t.numel() for t in sd.values()):,} values of {len(sd)} tensors "
                 "are finite")


@torch.no_grad()
def check_logits(target, drafter, sample_ids: torch.Tensor):
    """The drafter's logits on the check batch (and the target features they come from) are finite."""
    from .finite import count
    from .train import Batch, prepare

    ids = sample_ids[:, : max(drafter.block_size + 2, min(sample_ids.shape[1], 256))]
    p = prepare(target, drafter, Batch(ids, torch.ones_like(ids)), max_anchors=32,
                generator=torch.Generator().manual_seed(0))
    dt = drafter.fc.weight.dtype
    found = {"target features": count(p.features)}
    if not found["target features"]:
        hidden = drafter(p.features.to(dt), p.block_embeds.to(dt), p.layout)  # [N, B, Hd]
        found["drafter logits"] = count(target.head(hidden.to(target.dtype), drafter.vocab_rows))
    bad = [f"{k} ({v})" for k, v in found.items() if v]
    if bad:
        return Check("finite logits", FAIL, f"non-finite values on the check batch: {', '.join(bad)}",
                     "non-finite weights (see 'finite weights') or a target that overflows in its dtype")
    return Check("finite logits", PASS, f"the drafter's logits on {p.anchors.numel()} check blocks are finite")


def check_mask(drafter) -> Check:
    from .model.masks import anchor_block_mask, chunked_mask_as_dense

    g = torch.Generator().manual_seed(0)
    T = 96
    doc = torch.zeros(T, dtype=torch.long)
    for cut in (20, 51, 70):
        doc[cut:] += 1
    anchors = torch.sort(torch.randperm(T, generator=g)[:12]).values
    c = drafter.config
    for i in range(c.num_hidden_layers):
        w, causal = c.layer_window(i), c.layer_causal_in_block(i)
        ref = anchor_block_mask(doc, anchors, drafter.block_size, w, causal, c.sliding_window_rule)
        fast = chunked_mask_as_dense(doc, anchors, drafter.block_size, max_blocks=3, sliding_window=w,
                                     causal_in_block=causal, window_rule=c.sliding_window_rule)
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
    name = target.tokenizer.convert_ids_to_tokens(m) if target.tokenizer else m
    return Check("mask token", PASS, f"MASK = {m} ({name}), inside the vocabulary, not pad/eos/bos/unk, finite embedding")


def check_pairing(target, drafter) -> Check:
    from .pairing import pair_problems

    problems = pair_problems(target, drafter)
    if problems:
        return Check("target match", FAIL, "trained for another target: " + "; ".join(problems),
                     "use the drafter trained for this target")
    return Check("target match", PASS, "hidden size, vocabulary, layers and tokenizer agree")


def check_family(target) -> Check:
    from .target.family import describe

    fam = describe(target.model)
    note = "" if fam.mlp_activation == "silu" else f"; its {fam.mlp_activation} MLP is not copied into the drafter"
    if fam.norm_rule in ("not an RMSNorm", "none"):  # train falls back by itself, and says so
        note += "; its final norm is not an RMSNorm to copy: the drafter's output norm starts small (0.1)"
    return Check("target family", PASS, fam.summary() + note)


def check_engines(drafter) -> Check:
    """What each consumer of each export computes (checkpoint.formats): a serving engine that would
    compute another function is a WARN naming it; everything else is listed."""
    from .engines import differences
    from .engines.exports import retrain_hint

    found = differences(drafter.config)
    refused = [f"{name} -> {d}" for name, d in found if d.refuse]
    if refused:
        return Check("serving engines", WARN, "; ".join(refused),
                     f"{retrain_hint([d for _, d in found if d.refuse])}, or serve it with another")
    notes = "; ".join(f"{name} -> {d}" for name, d in found)
    return Check("serving engines", PASS, "every export's engines compute this drafter's function"
                 + (f" (notes: {notes})" if notes else ""))


def lilicorr_problems(drafter) -> list[str]:
    """LiLiCorr's terms as vLLM builds and checks them: K a power of two <= 16, the full vocabulary,
    the correlator's block-shaped tensors for this block size, and both convolution fields or neither."""
    c, cor = drafter.config, drafter.lilicorr
    K, B, out = c.lilicorr_candidate_topk, c.block_size, []
    if not (0 < K <= 16 and K & (K - 1) == 0):
        out.append(f"lilicorr_candidate_topk {K} is not a power of two <= 16 (vLLM refuses it)")
    if c.draft_vocab_size:
        out.append("a draft vocabulary: vLLM's LiLiCorr needs the full target vocabulary")
    shapes = {"slot_embedding": (cor.slot_embedding.shape[2], B - 1),
              "rank_embedding": (cor.rank_embedding.shape[3], K),
              "relative_slot_bias": (cor.relative_slot_bias.shape[1], 2 * B - 1)}
    out += [f"{n} is sized for {got}, the config says {want}" for n, (got, want) in shapes.items() if got != want]
    if bool(c.conv_kernel_size) != bool(c.conv_group_size):
        out.append("conv_kernel_size and conv_group_size must both be set or both 0 (vLLM refuses one alone)")
    return out


def domino_problems(drafter) -> list[str]:
    """Domino's tensors against its fields, as SpecForge builds them (a bias-free GRU over the target's
    embedding rows; Linear(Hd + G, E) -> SiLU -> Linear(E, Vd), no biases), and its prefix inside the block."""
    c, gru, proj = drafter.config, drafter.prefix_gru, drafter.embed_proj
    G, E, Vd = c.gru_hidden_dim, c.emb_dim, c.draft_vocab_size or c.vocab_size
    want = {"prefix_gru.weight_ih_l0": (3 * G, c.hidden_size), "prefix_gru.weight_hh_l0": (3 * G, G),
            "embed_proj.0.weight": (E, c.hidden_size + G), "embed_proj.2.weight": (Vd, E)}
    got = {"prefix_gru.weight_ih_l0": gru.weight_ih_l0.shape, "prefix_gru.weight_hh_l0": gru.weight_hh_l0.shape,
           "embed_proj.0.weight": proj[0].weight.shape, "embed_proj.2.weight": proj[2].weight.shape}
    out = [f"{n} is {tuple(got[n])}, its fields say {w}" for n, w in want.items() if tuple(got[n]) != w]
    if gru.bias or proj[0].bias is not None or proj[2].bias is not None:
        out.append("Domino's GRU and projections carry biases SpecForge's checkpoint has no place for")
    if not 0 <= c.pure_draft_prefix_len < c.block_size - 1:
        out.append(f"pure_draft_prefix_len {c.pure_draft_prefix_len} leaves no slot corrected")
    return out


def check_kind(drafter) -> Check:
    """The contract terms a drafter kind adds, on this checkpoint: the anchor convention, the kind's
    tensors against its config, DFlash2's in-block causality (measured) and llama.cpp's limits; and
    which engines serve the kind."""
    c, kind = drafter.config, drafter.config.kind
    problems = []
    if c.sample_from_anchor:
        problems.append("sample_from_anchor is true: blockdraft trains slot 0 as the anchor")
    if kind == "dspark" and c.markov_rank:
        w2 = drafter.markov_head.markov_w2.weight
        if w2.shape[0] != (c.draft_vocab_size or c.vocab_size):
            problems.append(f"markov_w2 has {w2.shape[0]} rows for a {c.draft_vocab_size or c.vocab_size}-token head")
    if kind == "domino":
        problems += domino_problems(drafter)
    if kind == "dflash2":
        K = c.selector_top_k
        if c.hidden_size < K * (K + 1):
            problems.append(f"llama.cpp needs hidden >= K (K + 1) = {K * (K + 1)} for its selector, hidden is "
                            f"{c.hidden_size}")
        with torch.no_grad():  # later block rows must not reach earlier ones through the convolutions
            g = torch.Generator().manual_seed(0)
            conv = drafter.layers[0].attention_conv
            x = torch.randn(2, c.block_size, c.hidden_size, generator=g).to(conv.base_kernel)
            y = conv.prepare(x)[0]
            x[:, c.block_size // 2:] += 1
            if not torch.equal(conv.prepare(x)[0][:, :c.block_size // 2], y[:, :c.block_size // 2]):
                problems.append("the convolutions let a later block row reach an earlier one")
    if kind == "lilicorr":
        problems += lilicorr_problems(drafter)
    if problems:
        return Check("drafter kind", FAIL, f"{kind}: " + "; ".join(problems), "retrain with blockdraft train --kind")
    from . import engines

    note = "; ".join(filter(None, (e.installed_kind_refusal(kind) for e in engines.CONSUMERS.values())))
    msg = f"{kind}: the kind's terms hold on this checkpoint; served by {engines.servers(kind)}"
    return Check("drafter kind", WARN if note else PASS, msg + (f"; {note}" if note else ""),
                 "serve it with llama.cpp, or vLLM's V2 runner on a GPU" if note else "")


def capture_check(target, engine) -> Check:
    """Whether `engine` (blockdraft.engines) can hand a DFlash drafter this target's hidden states."""
    from .engines.base import architectures

    archs = architectures(target)
    ok, source = engine.captures(archs)
    has, lacks = engine.capture_rule
    if ok:
        return Check(engine.capture_check, PASS, f"{engine.name} can run {archs[0]} as a DFlash target ({has}, by "
                                                 f"{source})")
    return Check(engine.capture_check, WARN, f"{engine.name} cannot capture {archs[0]}'s hidden states ({lacks}, by "
                                             f"{source}): {engine.capture_refused}", engine.capture_fix)


def check_data(target, path: str | None) -> Check:
    from .data import load_conversations, render

    if path is None:
        return Check("data", WARN, "no --data given: loss masks not checked", "pass --data FILE")
    from .data.chat import assistant_spans, has_chat_template, render_text

    tok = target.tokenizer
    if not has_chat_template(tok):
        return Check("data", WARN, "the tokenizer has no chat template: a plain fallback is used", "set a template")
    try:  # read as train reads it (a malformed record refused, not skipped), so doctor passes what train takes
        convs, _ = load_conversations(path)
    except ValueError as e:
        return Check("data", FAIL, f"train refuses it: {e}", "fix or remove the record, or train with --skip-bad-lines")
    hidden = 0
    for c in convs[:20]:
        try:  # a template that drops what a turn holds, or a turn it cannot locate: train refuses it alike
            r = render(tok, c)
            left_out: list = []
            assistant_spans(tok, c, render_text(tok, c), left_out)
        except ValueError as e:
            return Check("data", FAIL, f"train refuses it: {e}", "pass --chat-template FILE with the target's own "
                                                                 "template, or fix the record")
        dropped = [why for _, why in left_out if "leaves out" in why]
        if dropped:
            where = getattr(c, "where", None) or "a record"
            return Check("data", FAIL, f"{where}: {dropped[0]}, so that turn carries no loss",
                         "pass --chat-template FILE with the target's own template, one that renders it")
        ids = [i for i, m in zip(r["input_ids"], r["loss_mask"]) if m]
        learned = tok.decode(ids)
        for msg in c:
            if msg["role"] != "assistant" and len(msg["content"]) > 12 and msg["content"] in learned \
                    and not any(msg["content"] in a["content"] for a in c if a["role"] == "assistant"):
                return Check("data", FAIL, f"a {msg['role']} turn is inside the loss mask",
                             "loss_mask must be 1 on assistant tokens only")
        passed = {i for i, _ in left_out}  # hidden in the history: no loss, by design
        hidden += len(passed)
        for i, msg in enumerate(c):
            if msg["role"] == "assistant" and i not in passed and msg["content"].strip() \
                    and msg["content"].strip() not in learned:
                return Check("data", FAIL, "an assistant turn is missing from the loss mask",
                             "check the chat template's assistant markers")
    note = f" ({hidden} earlier turns the template's history shows otherwise carry no loss: --show lists them)" \
        if hidden else ""
    return Check("data", PASS, f"loss masks cover exactly the assistant turns on {min(20, len(convs))} conversations"
                               + note)


def check_greedy(target, drafter, sample_ids: torch.Tensor) -> Check:
    from .generate import speculative_generate
    from .generate.baseline import target_greedy

    from .target.model import CropRefused

    ids = sample_ids[:, :64]
    ref = target_greedy(target, ids, max_new_tokens=24).tokens
    try:
        got = speculative_generate(target, drafter, ids, max_new_tokens=24)
    except CropRefused as e:  # a cache that cannot take drafts back: nothing blockdraft can verify exactly
        return Check("greedy identity", SKIP, str(e))
    if got.tokens != ref:
        first = next(i for i, (a, b) in enumerate(zip(got.tokens, ref)) if a != b)
        return Check("greedy identity", FAIL, f"speculative output departs from the target's at token {first}",
                     "the verify/accept/crop loop is broken; report a bug")
    return Check("greedy identity", PASS, f"24 tokens identical to the target's own greedy decode (tau {got.tau:.2f})")


def serving_vs_training(target, drafter, ids: torch.Tensor, max_new_tokens: int = 48):
    """The drafts of `speculative_generate` (the serving path: cached drafting) and those of the
    training path (packed layout, training attention, teacher-forced on the generated text, anchors
    where the steps were), per step and slot, plus both paths' accepted lengths. The last step is
    left out (generation shrinks it to the room left)."""
    from .generate import speculative_generate
    from .train import Batch, prepare
    from .train.loss import accepted_lengths

    res = speculative_generate(target, drafter, ids, max_new_tokens=max_new_tokens)
    P, B = ids.shape[1], drafter.block_size
    before = [1]
    for a in res.accepted[:-1]:
        before.append(before[-1] + a)
    steps = len(before) - 1
    anchors = torch.tensor([P + c - 1 for c in before[:-1]], dtype=torch.long)
    seq = torch.cat([ids[0].cpu(), torch.tensor(res.tokens, dtype=torch.long)])[None]
    loss_mask = (torch.arange(seq.shape[1]) >= P).long()[None]
    with torch.no_grad():
        p = prepare(target, drafter, Batch(seq, loss_mask), anchors=anchors.to(target.device))
        dt = drafter.fc.weight.dtype
        hidden = drafter(p.features.to(dt), p.block_embeds.to(dt), p.layout)  # [N, B, Hd]
        rows = drafter.vocab_rows

        def head(h):
            return target.head(h.to(target.dtype), rows)

        # each block's drafts from the training path's rows, read as the kind reads them when it serves
        # (DSpark's and DFlash2's walks start from the anchor's token)
        trained = torch.stack([drafter.kind.draft(drafter, head, hidden[j, 1:], int(seq[0, a]), rows, None, None,
                                                  embed=target.embed, anchor=_anchor_row(drafter, p, a)).tokens.cpu()
                               for j, a in enumerate(anchors.tolist())])  # [N, B-1]
        want = torch.full_like(trained, -1)  # the text's next tokens; -1 past its end
        for j, a in enumerate(anchors.tolist()):
            nxt = seq[0, a + 1:a + B]
            want[j, :nxt.shape[0]] = nxt
        served_len = torch.tensor(res.accepted[:steps])
        trained_len = accepted_lengths(torch.cat([torch.zeros(steps, 1, dtype=torch.bool), trained == want], 1))
    served = [d for d in res.drafts[:steps]]
    return served, trained.tolist(), served_len.tolist(), trained_len.tolist()


def _anchor_row(drafter, p, a: int) -> torch.Tensor | None:
    """The context row at a - 1, which a kind's walk may read (LiLiCorr's anchor; one document: every
    anchor after the first token has one), computed only for a kind that reads it."""
    if not drafter.kind.whole_block or a == 0:
        return None
    return drafter.context(p.features[a - 1:a].to(drafter.fc.weight.dtype))[0]


def check_serving(target, drafter, sample_ids: torch.Tensor) -> Check:
    from .target.model import CropRefused

    try:
        served, trained, served_len, trained_len = serving_vs_training(target, drafter, sample_ids[:, :64])
    except CropRefused as e:  # blockdraft's generation cannot run this target (check_greedy says why)
        return Check("serving = training", SKIP, str(e))
    if not served:
        return Check("serving = training", WARN, "the answer ended after one step: nothing to compare",
                     "pass --data with a longer first conversation")
    slots = sum(len(s) for s in served)
    differ = sum(a != b for s, t in zip(served, trained) for a, b in zip(s, t))
    tau_s, tau_t = sum(served_len) / len(served_len), sum(trained_len) / len(trained_len)
    if differ > slots // 50:  # a rare flip of a near-tie between two forwards is not a bug
        return Check("serving = training", FAIL, f"{differ} of {slots} drafted tokens differ between generation and "
                     f"the training path on the same text (tau {tau_s:.2f} vs {tau_t:.2f})",
                     "training and generation compute different drafters (mask, window or causal flag); report a bug")
    return Check("serving = training", PASS, f"generation drafts what the training path drafts on the same text "
                 f"({slots - differ}/{slots} tokens; tau {tau_s:.2f} served, {tau_t:.2f} teacher-forced)")


def sample_input(target, data: str | None) -> torch.Tensor:
    from .data.chat import encode_prompt

    text = "Explain how a hash table works, then write a short Python example."
    if data:
        from .data import load_conversations, render

        convs, _ = load_conversations(data, skip_bad_lines=True)
        if convs:
            return torch.tensor([render(target.tokenizer, convs[0])["input_ids"]])
    return encode_prompt(target.tokenizer, [{"role": "user", "content": text}])


NEEDS_CHECKPOINT = ("checkpoint", "target match", "finite weights", "serving engines", "drafter kind",
                    "serving = training", "vLLM acceptance", "llama.cpp")


def probe_drafter(target):
    """A drafter of `blockdraft train`'s default layout for this target (random weights): what the
    contract checks need when no checkpoint exists yet."""
    from .model import DFlashDrafter, DrafterConfig
    from .train.build import DrafterOptions

    return DFlashDrafter(DrafterConfig.for_target(target, **DrafterOptions().layout())).to(target.device).eval()


def check_engine_features(target) -> Check:
    """Whether vLLM's engines capture this target's features for training (the engine's own check)."""
    from . import engines

    return engines.doctor_checks()["engine_features"](target)


def check_acceptance(target, drafter, ids) -> Check:
    """`--vllm`: vLLM serving the drafter accepts what blockdraft accepts (the engine's own check)."""
    from . import engines

    return engines.doctor_checks()["acceptance"](target, drafter, ids)


def check_llamacpp(target, drafter, target_gguf: str | None) -> Check:
    """`--llama-cpp`: llama-server with the drafter's GGUF against blockdraft's (the engine's own check)."""
    from . import engines

    return engines.doctor_checks()["llama_cpp"](target, drafter, target_gguf)


def run_doctor(target, drafter, data: str | None = None, sample_ids: torch.Tensor | None = None, *,
               vllm: bool = False, llama_cpp: bool = False, target_gguf: str | None = None,
               debug: bool = False) -> list[Check]:
    """All checks; with `drafter` None, those that need no checkpoint (on a probe drafter)."""
    from . import engines

    ids = sample_input(target, data) if sample_ids is None else sample_ids
    probe = drafter is None
    d = probe_drafter(target) if probe else drafter
    checks = [
        _guard("layer ids", check_layer_ids, target, d, debug=debug),
        _guard("labels", check_labels, target, d, ids, debug=debug),
        _guard("finite logits", check_logits, target, d, ids, debug=debug),
        _guard("mask", check_mask, d, debug=debug),
        _guard("mask token", check_mask_token, target, d, debug=debug),
        _guard("target family", check_family, target, debug=debug),
        *(_guard(e.capture_check, capture_check, target, e, debug=debug) for e in engines.capturing()),
        _guard("engine features (vLLM)", check_engine_features, target, debug=debug),
        _guard("data", check_data, target, data, debug=debug),
        _guard("greedy identity", check_greedy, target, d, ids, debug=debug),
    ]
    if probe:
        for c in checks:
            if c.name in ("layer ids", "finite logits", "mask", "mask token", "greedy identity"):
                c.message += " (probe drafter: blockdraft train's default layout)"
        return checks + [Check(n, SKIP, "needs a trained drafter (--drafter DIR)") for n in NEEDS_CHECKPOINT]
    checks[5:5] = [_guard("target match", check_pairing, target, d, debug=debug),
                   _guard("finite weights", check_weights, d, debug=debug),
                   _guard("serving engines", check_engines, d, debug=debug),
                   _guard("drafter kind", check_kind, d, debug=debug)]
    checks.append(_guard("serving = training", check_serving, target, d, ids, debug=debug))
    if vllm:
        checks.append(_guard("vLLM acceptance", check_acceptance, target, d, ids, debug=debug))
    if llama_cpp:
        checks.append(_guard("llama.cpp", check_llamacpp, target, d, target_gguf, debug=debug))
    return checks


def report(checks: list[Check], as_json: bool = False) -> str:
    if as_json:
        return json.dumps([asdict(c) for c in checks], indent=1)
    lines = []
    for c in checks:
        fix = f"\n      fix: {c.fix}" if c.status in (WARN, FAIL) and c.fix else ""
        lines.append(f"{c.status:4}  {c.name:18} {c.message}{fix}")
    return "\n".join(lines)


def target_check(e: ValueError, debug: bool = False) -> Check:
    """The FAIL of a target that did not load (target.classes.TargetLoadError: its cause) or loaded as
    something blockdraft cannot run (the reason): named `target`, the step that failed."""
    from .target.classes import TargetLoadError

    if debug:
        traceback.print_exception(e)
    if isinstance(e, TargetLoadError):
        import transformers

        return Check("target", FAIL, str(e), f"check that transformers {transformers.__version__} has this model's "
                     "class and that the directory holds its config.json and weights; --debug for the traceback")
    return Check("target", FAIL, str(e), "a target is a transformers causal LM (or a wrapper of one) with its "
                 "tokenizer; --debug for the traceback")


def doctor_main(target_name: str, drafter_path: str | None, data: str | None, device: str | None, *,
                vllm: bool = False, llama_cpp: bool = False, target_gguf: str | None = None,
                debug: bool = False) -> list[Check]:
    """Load what can be loaded; a checkpoint or target that does not load is itself a FAIL, named for
    the step that failed (the target's, before the checkpoint's, which is read against it)."""
    from .checkpoint import load_drafter
    from .target import TargetModel, target_num_layers

    drafter = None
    if drafter_path is not None:
        try:
            num_layers = target_num_layers(target_name)
        except ValueError as e:
            return [target_check(e, debug)]
        try:
            drafter = load_drafter(drafter_path, device=device, num_target_layers=num_layers)
        except ValueError as e:
            return [Check("checkpoint", FAIL, str(e), "re-export the checkpoint (config.json + model.safetensors)")]
    try:
        ids = None if drafter is None else drafter.config.target_layer_ids
        target = TargetModel.from_pretrained(target_name, layer_ids=ids, device=device)
    except ValueError as e:  # the checkpoint's ids were checked against the target's layer count above
        return [target_check(e, debug)]
    if target_gguf is None:
        from .target.files import target_gguf as find

        found = find(target_name)
        target_gguf = None if found is None else str(found)
    return run_doctor(target, drafter, data, vllm=vllm, llama_cpp=llama_cpp, target_gguf=target_gguf, debug=debug)
