"""One definition of every default: `blockdraft train` with no flags is the library's RunConfig()."""

from __future__ import annotations

import dataclasses
import json

import pytest

from blockdraft.cli import build_parser, train_config
from blockdraft.train.run import RunConfig


def parse(*argv):
    args = build_parser().parse_args(["train", *argv])
    return train_config(args, list(argv))


def test_train_with_no_flags_is_the_default_run_config_field_by_field():
    got, want = parse(), RunConfig()
    for part in RunConfig.PARTS:
        a, b = getattr(got, part), getattr(want, part)
        for f in dataclasses.fields(b):
            assert getattr(a, f.name) == getattr(b, f.name), (part, f.name)
    assert got == want


def test_every_field_with_a_flag_reaches_the_config():
    got = parse("--max-rows", "0", "--lr", "1e-3", "--layer-ids", "1,2", "--no-init-from-target", "--window-rule",
                "anchor", "--no-progress", "--steps", "7")
    assert got.data.max_rows == 0 and got.train.lr == 1e-3 and got.target.layer_ids == [1, 2]
    assert got.drafter.init_from_target is False and got.drafter.window_rule == "anchor"
    assert got.train.progress is False and got.train.steps == 7


def test_a_saved_config_replays_with_the_flags_given_on_top(tmp_path):
    first = parse("--steps", "5", "--max-rows", "9", "--block-size", "8", "--out", str(tmp_path / "a"))
    path = tmp_path / "train_config.json"
    path.write_text(json.dumps(first.to_dict()))
    again = parse("--config", str(path), "--out", str(tmp_path / "b"))
    assert again.train.steps == 5 and again.data.max_rows == 9 and again.drafter.block_size == 8
    assert again.train.out == str(tmp_path / "b")  # the flag given beside --config wins
    assert RunConfig.from_dict(first.to_dict()) == first
    with pytest.raises(ValueError, match="unknown train settings"):
        RunConfig.from_dict({"train": {"learning_rate": 1}})


def test_the_help_shows_every_default():
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "(default: 128)" in text and "(default: query)" in text and "(default: 0.0006)" in text


def test_every_flag_shows_at_most_one_default():
    """A help text that names its default (e.g. --device's 'cuda if available') gets no second one."""
    import re

    from blockdraft.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    for name, p in sub.choices.items():
        doubled = re.findall(r"\(default: [^)]*\)\s*\(default: [^)]*\)", " ".join(p.format_help().split()))
        assert not doubled, (name, doubled)
