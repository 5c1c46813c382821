"""Every family people train drafters for, through the commands a user runs, with default flags:
`doctor --target`, a short `train`, `doctor --drafter` (greedy identity included) and both exports.

Each target is a tiny random model of the family (blockdraft.target.tiny: the family's quirk switched on,
norm gains random) saved with save_pretrained beside SmolLM2's tokenizer, so the CLI loads it as
it loads a user's directory. Only run-size flags are passed (steps, lengths, one thread) and
--verifier for the exports (the target is not under the working directory). The speculative
output of the trained drafter is also compared with transformers' own generate.
"""

from __future__ import annotations

import json

import pytest
import torch

from blockdraft.cli import main
from blockdraft.target.tiny import ALL_ARCHS, RECURRENT_ARCHS, tiny_causal_lm

pytestmark = pytest.mark.slow  # ~8 s a family, 22 families

RUN = ["--steps", "2", "--max-length", "128", "--batch-tokens", "256", "--max-anchors", "16", "--eval-every", "2",
       "--eval-fraction", "0.1", "--no-progress", "--threads", "1"]
# what train must say about its initialisation where the usual one cannot apply
INIT_SAYS = {"cohere": "final norm is not an RMSNorm blockdraft can copy: the drafter's output norm starts small",
             "nemotron_h": "the drafter layers start from random", "deepseek_v3": "attention, MLP start(s) from random"}


@pytest.fixture(scope="module")
def tokenizer():
    from blockdraft.target.files import random_target_tokenizer

    try:
        return random_target_tokenizer()
    except ValueError as e:
        pytest.skip(f"SmolLM2's tokenizer is not here: {e}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from blockdraft.data import load_conversations
    from blockdraft.data.pipeline import default_data_file

    convs, _ = load_conversations(default_data_file())
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs[:16]))
    return str(path)


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_doctor_train_doctor_convert_with_default_flags(arch, tokenizer, data, tmp_path, capsys):
    target = tmp_path / arch
    model = tiny_causal_lm(arch, vocab=len(tokenizer), layers=8, hidden=32, max_positions=1024)
    with torch.no_grad():  # clear winners: greedy decoding without near-ties
        model.get_output_embeddings().weight.mul_(8)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)

    rc, out = run(capsys, "doctor", "--target", str(target), "--threads", "1")
    assert rc == 0 and "FAIL" not in out, out
    assert "PASS  labels" in out and "PASS  greedy identity" in out, out

    run_dir = tmp_path / "run"
    rc, out = run(capsys, "train", "--target", str(target), "--data", data, "--out", str(run_dir), *RUN)
    assert rc == 0, out
    init = [line for line in out.splitlines() if line.startswith("init:")]
    assert init, out
    if arch in INIT_SAYS:
        assert any(INIT_SAYS[arch] in line for line in init), init
    drafter = run_dir / "drafter"

    rc, out = run(capsys, "doctor", "--target", str(target), "--drafter", str(drafter), "--threads", "1")
    assert rc == 0 and "FAIL" not in out, out
    for check in ("labels", "greedy identity", "serving = training", "target match"):
        assert f"PASS  {check}" in out, out
    if arch in RECURRENT_ARCHS:
        assert "recurrent layers" in out

    # the trained drafter's speculative output against transformers' own greedy decoding
    from transformers import AutoModelForCausalLM

    from blockdraft.checkpoint import load_drafter
    from blockdraft.generate import speculative_generate
    from blockdraft.target import TargetModel

    d = load_drafter(str(drafter))
    t = TargetModel.from_pretrained(str(target), layer_ids=d.config.target_layer_ids, device="cpu")
    ids = torch.tensor([tokenizer("Name three prime numbers and explain why.")["input_ids"]])
    ref = AutoModelForCausalLM.from_pretrained(target).eval().generate(ids, max_new_tokens=20, do_sample=False,
                                                                       eos_token_id=None, pad_token_id=0)
    res = speculative_generate(t, d, ids, max_new_tokens=20)
    assert res.tokens == ref[0, ids.shape[1]:].tolist()

    ids_native = list(d.config.target_layer_ids)
    for fmt in ("zlab", "speculators"):
        dst = tmp_path / fmt
        rc, out = run(capsys, "convert", "--to", fmt, "--verifier", str(target), str(drafter), str(dst))
        assert rc == 0, out
        cfg = json.loads((dst / "config.json").read_text())
        assert (dst / "model.safetensors").exists()
        if fmt == "zlab":
            assert cfg["dflash_config"]["target_layer_ids"] == ids_native
        else:  # each id names the input of the next layer (one more)
            assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in ids_native]
            assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(target)
