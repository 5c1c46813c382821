"""vllm-project/speculators (0.9.0) loads `blockdraft convert --to speculators` output as written and
computes the same drafter; on one packed batch with the same anchors its training step and ours
agree (loss up to the stated normalisation factor, per-slot accuracy, fc gradient). The same for
the drafter kinds: its DSparkDraftModel and DFlash2DraftModel load our DSpark and DFlash2 exports
strictly, give our Markov-corrected and confidence logits (DSpark) and unary logits and candidate
scores (DFlash2), and their own loss code gives our loss and gradients.

Run in the speculators/dflash environment: `reference/run.sh` (PYTHONPATH=src).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from common import ANCHOR_CASES, CASES, KIND_CASES, TINY_V, B, W, save_target, smollm2_target, smollm2_variants, \
    threads, tiny_drafter, tiny_target

from blockdraft.engines.exports import export_drafter
from blockdraft.model import BlockLayout
from blockdraft.model.blocks import block_input_ids
from blockdraft.train import Batch, compute_loss
from blockdraft.train.loss import slot_weights

# this environment has the package: missing is a failure, never a skip (reference/README.md)
core = importlib.import_module("speculators.models.dflash.core")
losses = importlib.import_module("speculators.losses")
threads()


def load_speculators(path):
    """speculators' own loader; its default attention is flex, which has no CPU path: sdpa here."""
    cfg = core.DFlashSpeculatorConfig.from_pretrained(str(path))
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    return core.DFlashDraftModel.from_pretrained(str(path), config=cfg).float().eval()


def packed_rows(target, T=64, docs=(0, 24, 44), prompt=6, seed=3):
    """One packed row of three documents whose first `prompt` tokens are not learned (so no block
    reaches into the next document's learned tokens: speculators trains those slots, we do not)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_V - 1, (1, T), generator=g)
    doc = torch.zeros(1, T, dtype=torch.long)
    for s in docs[1:]:
        doc[:, s:] += 1
    loss = torch.ones(1, T, dtype=torch.long)
    for s in docs:
        loss[:, s:s + prompt] = 0
    return ids, doc, loss


def target_inputs(target, ids, doc):
    """The target's features [1, T, F*H] and last decoder layer output before the final norm
    [1, T, H] (what speculators takes: it applies the verifier's norm and head itself)."""
    from blockdraft.train.step import positions_from_documents

    pos = positions_from_documents(doc)
    seen = {}
    hook = target._layers[-1].register_forward_hook(lambda m, i, o: seen.update(last=o[0] if isinstance(o, tuple)
                                                                                  else o))
    try:
        out = target(ids, position_ids=pos, return_logits=False)
    finally:
        hook.remove()
    return out.features, seen["last"], pos


def their_forward(model, target, ids, doc, loss, n_anchors, seed=0):
    feats, last, pos = target_inputs(target, ids, doc)
    torch.manual_seed(seed)  # speculators draws its anchors from the global generator
    hidden, logits, targets, mask, idx = model._backbone_forward(feats, ids, loss, last, doc, pos,
                                                                 max_anchors=n_anchors)
    b = model.block_size
    return logits[0].view(-1, b, logits.shape[-1]), targets[0], mask[0], idx.view(-1, b)[:, 0], feats, pos


def our_logits(target, ours, ids, doc, pos, feats, anchors):
    flat_doc, flat_pos = doc.reshape(-1), pos.reshape(-1)
    layout = BlockLayout(flat_doc, flat_pos, anchors, ours.block_size)
    emb = target.embed(block_input_ids(ids.reshape(-1), anchors, ours.block_size, ours.mask_token_id))
    with torch.no_grad():
        hidden = ours(feats.reshape(flat_doc.shape[0], -1), emb, layout, backend="dense")
    return target.head(hidden, ours.vocab_rows)  # [N, B, Vd]


def export(tmp_path, target, ours, **kw):
    verifier = save_target(target, tmp_path / "verifier")
    path, _ = export_drafter(ours, tmp_path / "spec", "speculators", verifier=verifier, **kw)
    return path


@pytest.mark.parametrize("case", sorted(ANCHOR_CASES) + ["full-2layers", "draft-vocab"])
def test_speculators_drafter_equals_ours(tmp_path, case):
    """speculators windows from the anchor, like blockdraft's anchor rule: equal everywhere."""
    target = tiny_target()
    ours = tiny_drafter(target, {**CASES, **ANCHOR_CASES}[case])
    theirs = load_speculators(export(tmp_path, target, ours, allow_mismatch=True))
    assert not torch.isnan(theirs.lm_head.weight).any()  # the head came from the file / the verifier
    ids, doc, loss = packed_rows(target)
    logits, _, _, anchors, feats, pos = their_forward(theirs, target, ids, doc, loss, n_anchors=20)
    mine = our_logits(target, ours, ids, doc, pos, feats, anchors)
    assert int(anchors.max()) > W  # anchors on both sides of W - B + 1
    torch.testing.assert_close(logits, mine, rtol=1e-4, atol=1e-4)


def test_speculators_trains_a_query_window_drafter_as_another_function(tmp_path):
    """The engines' query window is not speculators' rule: its drafts equal ours only while every
    query's window still reaches the document start, as docs/consumers.md's table says."""
    target = tiny_target()
    ours = tiny_drafter(target, CASES["sliding-causal"])
    theirs = load_speculators(export(tmp_path, target, ours))
    ids, doc, loss = packed_rows(target)
    logits, _, _, anchors, feats, pos = their_forward(theirs, target, ids, doc, loss, n_anchors=30)
    mine = our_logits(target, ours, ids, doc, pos, feats, anchors)
    for j, a in enumerate(anchors.tolist()):
        diff = (logits[j] - mine[j]).abs().max().item()
        if int(pos[0, a]) <= W - B:
            assert diff < 1e-4, (a, diff)
        else:
            assert diff > 1e-4, (a, diff)


def per_slot_accuracy(metrics) -> list[float]:
    return [float(metrics[f"position_{k}_acc_sum"] / metrics[f"position_{k}_acc_total"]) for k in range(1, B)]


@pytest.mark.parametrize("case", ["full-2layers", "anchor-causal"])
def test_one_training_step_matches_speculators(tmp_path, case):
    """Same packed batch, same anchors, same gamma, KL loss. speculators divides the weighted loss
    by the number of supervised slots S, blockdraft by the sum of their weights: ours x sum(w)/S
    is theirs. Per-slot accuracy and the fc gradient (same factor) agree too."""
    target = tiny_target()
    ours = tiny_drafter(target, {**CASES, **ANCHOR_CASES}[case]).train()
    theirs = load_speculators(export(tmp_path, target, ours, allow_mismatch=True)).train()
    ids, doc, loss = packed_rows(target)
    feats, last, pos = target_inputs(target, ids, doc)
    gamma = 2.0
    torch.manual_seed(0)
    _, their_loss, metrics = theirs(feats, ids, loss, last, doc, pos, gamma=gamma, max_anchors=24,
                                    loss_config=losses.resolve_loss_config("kl_div", "eager"))
    their_loss.backward()
    torch.manual_seed(0)
    _, _, _, anchors, _, _ = their_forward(theirs, target, ids, doc, loss, n_anchors=24)  # the same draw
    batch = Batch(ids, loss, pos, doc)
    my_loss, m = compute_loss(target, ours, batch, anchors=anchors, gamma=gamma, loss="kl", backend="dense")
    my_loss.backward()
    sup = torch.tensor(m["slot_counts"], dtype=torch.float)
    w = slot_weights(B, gamma)
    factor = float((w * sup).sum() / sup.sum())  # sum of the supervised slots' weights / S
    torch.testing.assert_close(their_loss.detach(), my_loss.detach() * factor, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(per_slot_accuracy(metrics)), torch.tensor(m["slot_accuracy"][1:]))
    assert float(metrics["loss_sum"].detach()) == pytest.approx(float(their_loss.detach()), rel=1e-6)
    torch.testing.assert_close(theirs.fc.weight.grad, ours.fc.weight.grad * factor, rtol=1e-3, atol=1e-7)
    assert ours.fc.weight.grad.abs().max() > 0


def test_dpace_weights_equal_speculators():
    """--gamma-schedule dpace computes speculators' own D-PACE weights (`dpace_loss_decay`) from the
    same per-slot cross-entropy, holes in the loss mask and the untrained anchor slot included."""
    from speculators.losses.utils import dpace_loss_decay

    from blockdraft.train.loss import dpace_weights

    g = torch.Generator().manual_seed(4)
    N, b = 9, 6
    sup = torch.rand(N, b, generator=g) < 0.8
    sup[:, 0] = False
    ce = torch.rand(N, b, generator=g) * 4 * sup  # speculators masks the loss before weighing it
    for alpha in (0.5, 0.1):
        theirs = dpace_loss_decay(torch.arange(N * b) % b, loss_mask=sup.reshape(1, -1).long(), block_size=b,
                                  dpace_alpha=alpha, elementwise_loss=ce.reshape(1, -1))
        torch.testing.assert_close(dpace_weights((-ce).exp(), sup, alpha), theirs.reshape(N, b))


def test_one_dpace_training_step_matches_speculators(tmp_path):
    """speculators' default recipe (D-PACE, cross-entropy) against `--gamma-schedule dpace --loss
    hard` on one packed batch with the same anchors: the losses differ by the stated normalisation
    (theirs / S, ours / the sum of the weights), and so do the fc gradients."""
    from speculators.losses.utils import dpace_loss_decay

    from blockdraft.train.loss import DPace

    target = tiny_target()
    ours = tiny_drafter(target, CASES["full-2layers"]).train()
    theirs = load_speculators(export(tmp_path, target, ours, allow_mismatch=True)).train()
    ids, doc, loss = packed_rows(target)
    feats, last, pos = target_inputs(target, ids, doc)
    torch.manual_seed(0)
    _, their_loss, _ = theirs(feats, ids, loss, last, doc, pos, max_anchors=24, per_position_loss_weight="dpace",
                              dpace_alpha=0.5, loss_config=losses.resolve_loss_config("ce", "eager"))
    their_loss.backward()
    torch.manual_seed(0)
    logits, targets, mask, anchors, _, _ = their_forward(theirs, target, ids, doc, loss, n_anchors=24)
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.argmax(-1).reshape(-1),
                                               reduction="none") * mask.reshape(-1)
        w = dpace_loss_decay(None, loss_mask=mask.reshape(1, -1), block_size=B, dpace_alpha=0.5,
                             elementwise_loss=ce.reshape(1, -1))
    factor = float(w.sum() / mask.sum())
    my_loss, _ = compute_loss(target, ours, Batch(ids, loss, pos, doc), anchors=anchors, gamma=DPace(0.5),
                              loss="hard", backend="dense")
    my_loss.backward()
    torch.testing.assert_close(their_loss.detach(), my_loss.detach() * factor, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(theirs.fc.weight.grad, ours.fc.weight.grad * factor, rtol=1e-3, atol=1e-7)
    assert ours.fc.weight.grad.abs().max() > 0


def test_smollm2_drafter_loads_as_written_and_matches(tmp_path):
    """The shipped SmolLM2 drafter's weights (sliding, draft vocabulary) under speculators' own
    window rule (the anchor rule) through its converter, on real text: speculators' logits equal
    ours; the verifier path is the local target."""
    target = smollm2_target([1, 8, 14, 21, 27])
    ours = smollm2_variants()["anchor-causal"]
    from blockdraft.checkpoint.native import default_verifier

    path, found = export_drafter(ours, tmp_path / "spec", "speculators", allow_mismatch=True)
    assert any(f.consumer == "vLLM" and f.refuse for f in found)  # the anchor rule is refused for serving
    theirs = load_speculators(path)
    assert theirs.config.speculators_config.verifier.name_or_path == default_verifier("smollm2")
    text = "The quick brown fox jumps over the lazy dog. " * 6
    ids = target.tokenizer(text, return_tensors="pt")["input_ids"][:, :64]
    doc, loss = torch.zeros_like(ids), torch.ones_like(ids)
    logits, _, _, anchors, feats, pos = their_forward(theirs, target, ids, doc, loss, n_anchors=12)
    mine = our_logits(target, ours, ids, doc, pos, feats, anchors)
    torch.testing.assert_close(logits, mine, rtol=1e-4, atol=2e-4)


# --------------------------------------------------------------------------- the drafter kinds

dspark_core = importlib.import_module("speculators.models.dspark.core")
dflash2_core = pytest.importorskip("speculators.models.dflash2.core")
KIND_MODELS = {"dspark": dspark_core.DSparkDraftModel, "dflash2": dflash2_core.DFlash2DraftModel}


def load_kind_strictly(path, kind):
    """speculators' own loader for the kind (sdpa, as above), refusing any missing, unexpected or
    mismatched weight, and checking that every tensor of the file is the model's."""
    from safetensors.torch import load_file

    model_cls = KIND_MODELS[kind]
    cfg = model_cls.config_class.from_pretrained(str(path))
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    # output_loading_info makes from_pretrained return a pair, so speculators' own from_pretrained skips
    # the two steps after loading: done here as it does them (speculators/model.py)
    model, info = model_cls.from_pretrained(str(path), config=cfg, output_loading_info=True)
    model.load_vocab_mappings(None, None)
    model.load_verifier_weights()
    assert type(model) is model_cls and model.config.speculators_model_type == kind
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    sd, theirs = load_file(str(path / "model.safetensors")), model.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in sd.items())
    return model.float().eval()


class Captured:
    """Records the arguments speculators' forward hands its loss code (`compute_metrics` of the
    kind's core module): the Markov-corrected and confidence logits, the unary logits and the
    candidate scores, as its own forward computed them."""

    def __init__(self, module):
        self.module, self.original, self.args, self.kwargs = module, module.compute_metrics, None, None

    def __enter__(self):
        def record(*args, **kwargs):
            self.args, self.kwargs = args, kwargs
            return self.original(*args, **kwargs)

        self.module.compute_metrics = record
        return self

    def __exit__(self, *exc):
        self.module.compute_metrics = self.original


def our_hidden(target, ours, ids, doc, pos, feats, anchors):
    flat_doc, flat_pos = doc.reshape(-1), pos.reshape(-1)
    layout = BlockLayout(flat_doc, flat_pos, anchors, ours.block_size)
    emb = target.embed(block_input_ids(ids.reshape(-1), anchors, ours.block_size, ours.mask_token_id))
    return ours(feats.reshape(flat_doc.shape[0], -1), emb, layout, backend="dense")  # [N, B, H]


def previous_tokens(ids, anchors):
    """blockdraft's teacher-forced previous token of every slot k >= 1: the data's token at a + k - 1
    (speculators' `[b0, b0, b1, ...]` shift, sample_from_anchor false) [N, B - 1]."""
    from blockdraft.model.blocks import label_positions

    return ids.reshape(-1)[label_positions(anchors, B)[:, 1:]]


def kind_step(tmp_path, kind):
    """Their forward (with its loss code recorded) and ours on one packed batch, same anchors."""
    target = tiny_target()
    ours = tiny_drafter(target, KIND_CASES[kind]).train()
    theirs = load_kind_strictly(export(tmp_path, target, ours), kind).train()
    ids, doc, loss = packed_rows(target)
    feats, last, pos = target_inputs(target, ids, doc)
    gamma = 4.0
    torch.manual_seed(0)
    with Captured(dspark_core if kind == "dspark" else dflash2_core) as seen:
        # their trainer's call (get_trainer_kwargs) with --loss-fn kl_div, the eager (CPU) implementation
        _, their_loss, metrics = theirs(feats, ids, loss, last, doc, pos, gamma=gamma, max_anchors=24,
                                        loss_config=losses.resolve_loss_config("kl_div", "eager"),
                                        tv_loss_fn=losses.resolve_loss_config("tv", "eager")["tv"][0])
    their_loss.backward()
    torch.manual_seed(0)
    _, _, mask, anchors, _, _ = their_forward(theirs, target, ids, doc, loss, n_anchors=24)  # the same draw
    my_loss, m = compute_loss(target, ours, Batch(ids, loss, pos, doc), anchors=anchors, gamma=gamma, loss="kl",
                              backend="dense")
    my_loss.backward()
    sup = torch.tensor(m["slot_counts"], dtype=torch.float)
    assert torch.equal(sup, mask.view(-1, B).sum(0).float())  # the same supervised slots
    factor = float((slot_weights(B, gamma) * sup).sum() / sup.sum())  # sum of the supervised slots' weights / S
    return target, ours, theirs, seen, (ids, doc, pos, feats, anchors), (their_loss, my_loss, factor), (metrics, m)


def test_speculators_dspark_equals_ours_and_trains_the_same(tmp_path):
    """DSparkDraftModel loads our DSpark export as written; its forward's Markov-corrected logits and
    confidence logits are ours; its loss (KL, gamma 4, fixed-exp-decay, + the confidence BCE against
    1 - TV) is ours x sum(w)/S, and so are the gradients of fc and of the Markov head's W2."""
    target, ours, theirs, seen, (ids, doc, pos, feats, anchors), (their_loss, my_loss, factor), (metrics, m) = \
        kind_step(tmp_path, "dspark")
    N = anchors.numel()
    logits, conf = seen.args[0].view(N, B, -1), seen.args[2].view(N, B)
    with torch.no_grad():
        h = our_hidden(target, ours, ids, doc, pos, feats, anchors)[:, 1:]  # slots 1.. (slot 0 predicts nothing)
        prev = previous_tokens(ids, anchors)
        terms = ours.kind.slot_terms(ours, lambda x: target.head(x), None)
        mine = terms.logits(h.reshape(-1, h.shape[-1]), prev.reshape(-1)).view(N, B - 1, -1)
        my_conf = ours.confidence_head(h, ours.markov_head.markov_w1(prev))
        bias = ours.markov_head(prev)[0]
    assert bias.abs().max() > 0.1 and (my_conf - ours.confidence_head.proj.bias).abs().max() > 0.1  # they matter
    torch.testing.assert_close(logits[:, 1:], mine, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conf[:, 1:], my_conf, rtol=1e-4, atol=1e-4)
    assert "confidence_loss_sum" in metrics and float(metrics["confidence_loss_sum"]) > 0
    torch.testing.assert_close(their_loss.detach(), my_loss.detach() * factor, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(per_slot_accuracy(metrics)), torch.tensor(m["slot_accuracy"][1:]))
    torch.testing.assert_close(theirs.fc.weight.grad, ours.fc.weight.grad * factor, rtol=1e-3, atol=1e-7)
    w2 = "markov_head.markov_w2.weight"
    torch.testing.assert_close(theirs.get_parameter(w2).grad, ours.get_parameter(w2).grad * factor, rtol=1e-3,
                               atol=1e-7)
    for name in ("markov_head.markov_w1.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"):
        torch.testing.assert_close(theirs.get_parameter(name).grad, ours.get_parameter(name).grad * factor,
                                   rtol=1e-3, atol=1e-7)
    assert ours.get_parameter(w2).grad.abs().max() > 0


def test_speculators_dflash2_equals_ours_and_trains_the_same(tmp_path):
    """DFlash2DraftModel loads our DFlash2 export as written; its forward's unary logits and the
    selector's candidate scores are ours (the same candidates: the unary top K, the target put in
    the K-th place when missing); its loss (KL + the K-way selector CE, gamma 4) is ours x sum(w)/S,
    and so are the gradients of fc and of the selector's hidden projection."""
    target, ours, theirs, seen, (ids, doc, pos, feats, anchors), (their_loss, my_loss, factor), (metrics, m) = \
        kind_step(tmp_path, "dflash2")
    N, K = anchors.numel(), ours.config.selector_top_k
    kw = seen.kwargs
    unary, scores = kw["unary_logits"].view(N, B, -1), kw["candidate_logits"].view(N, B, K)
    cand, label = kw["training_candidate_ids"].view(N, B, K)[:, 1:], kw["target_positions"].view(N, B)[:, 1:]
    with torch.no_grad():
        h = our_hidden(target, ours, ids, doc, pos, feats, anchors)[:, 1:]
        mine = target.head(h)  # [N, B - 1, V]
        prev = previous_tokens(ids, anchors)
        my_scores = mine.gather(-1, cand) + ours.candidate_selector.edges(
            h.reshape(-1, h.shape[-1]), prev.reshape(-1), cand.reshape(-1, K)).view(N, B - 1, K)
        edges = my_scores - mine.gather(-1, cand)
        top = mine.topk(K, dim=-1).indices
        want = kw["targets"].view(N, B, -1)[:, 1:].argmax(-1)
        hit = (top == want[..., None]).any(-1)
    assert edges.abs().max() > 0.1  # the selector matters
    torch.testing.assert_close(unary[:, 1:], mine, rtol=1e-4, atol=1e-4)
    assert torch.equal(cand[hit], top[hit]) and torch.equal(cand[~hit][:, :-1], top[~hit][:, :-1])
    assert torch.equal(cand[~hit][:, -1], want[~hit]) and bool((label[~hit] == K - 1).all())
    assert bool(hit.any()) and bool((~hit).any())  # both cases occur
    torch.testing.assert_close(scores[:, 1:], my_scores, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(their_loss.detach(), my_loss.detach() * factor, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(theirs.fc.weight.grad, ours.fc.weight.grad * factor, rtol=1e-3, atol=1e-7)
    g = "candidate_selector.hidden_projection.weight"
    torch.testing.assert_close(theirs.get_parameter(g).grad, ours.get_parameter(g).grad * factor, rtol=1e-3,
                               atol=1e-7)
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight"):
        torch.testing.assert_close(theirs.get_parameter(name).grad, ours.get_parameter(name).grad * factor,
                                   rtol=1e-3, atol=1e-7)
    assert ours.get_parameter(g).grad.abs().max() > 0
