"""What a drafter kind refuses is said before any work (issue 58, item 7.1): `train --kind domino` with a
draft vocabulary used to train the whole run and then fail at the drafter's write, leaving checkpoints
and no drafter. LiLiCorr and Domino score the full vocabulary (vLLM's LiLiCorr and SpecForge's Domino
have no other), so a draft vocabulary for them is refused before the target loads and nothing is
written, and `--draft-vocab auto` (8,192 ids on a CPU) is the full vocabulary for them.
"""

from __future__ import annotations

import pytest

from blockdraft.cli import main
from blockdraft.config import KINDS

from .test_preflight_checks import forbid_loading

# the kinds whose readers score the full vocabulary: vLLM 0.32's LiLiCorr (models/lilicorr.py refuses a
# draft vocabulary) and SpecForge 0.2.0's DominoDraftModel (embed_proj has one row per target token)
FULL_VOCABULARY = {"lilicorr", "domino"}
STARTS = {"a new drafter": ["--draft-vocab", "64"],
          "the shipped drafter (8,192 ids)": ["--init-drafter", "default"]}


@pytest.mark.parametrize("start", sorted(STARTS))
@pytest.mark.parametrize("kind", sorted(FULL_VOCABULARY))
def test_a_draft_vocabulary_for_a_full_vocabulary_kind_is_refused_before_any_work(tmp_path, monkeypatch, capsys,
                                                                                 kind, start):
    forbid_loading(monkeypatch)  # the target and the data are read before any step: neither may be
    out = tmp_path / "run"
    assert main(["train", "--kind", kind, *STARTS[start], "--out", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "full vocabulary" in err[0] and f"--kind {kind}" in err[0], err
    assert not out.exists()  # nothing written: no checkpoint, no drafter, no settings


@pytest.mark.parametrize("kind", KINDS)
def test_auto_is_the_full_vocabulary_for_the_kinds_that_need_it(kind):
    """The drafter `train --kind K` plans on a CPU (the embedded 49,152-token target): 8,192 ids, or the
    full vocabulary for the kinds whose readers score it; the plan passes the kind's own checks."""
    from blockdraft.cli import build_parser, train_config
    from blockdraft.train.preflight import planned_drafter, target_config

    argv = ["--kind", kind, "--device", "cpu"]
    cfg = train_config(build_parser().parse_args(["train", *argv]), argv)
    planned = planned_drafter(cfg, target_config(cfg.target.target))
    assert planned.kind == kind
    assert planned.draft_vocab_size == (None if kind in FULL_VOCABULARY else 8192)


@pytest.mark.parametrize("kind", sorted(set(KINDS) - FULL_VOCABULARY - {"dflash"}))
def test_the_other_kinds_keep_a_draft_vocabulary(kind):
    """Only the full-vocabulary kinds refuse: a DSpark or DFlash2 drafter from the shipped 8,192-id
    drafter passes the same checks."""
    from blockdraft.cli import build_parser, train_config
    from blockdraft.train.preflight import check_before_loading

    argv = ["--kind", kind, "--init-drafter", "default"]
    check_before_loading(train_config(build_parser().parse_args(["train", *argv]), argv))
