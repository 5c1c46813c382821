"""The commands a newcomer runs, on the real embedded target (slow) and the bundled data."""

from __future__ import annotations


import pytest

from blockdraft.data.eval_prompts import load_prompt_set
from blockdraft.cli import main
from blockdraft.data.pipeline import default_data_file


def test_bundled_data_is_present_and_never_an_evaluation_prompt():
    """The bundled conversations: one target answer to each prompt of the committed prompt set
    (>= 10,000), and no evaluation prompt among them."""
    from blockdraft.data import load_conversations
    from blockdraft.data.prompt_set import read_prompts

    convs, _ = load_conversations(default_data_file())
    users = [c[0]["content"] for c in convs]
    assert len(convs) >= 10_000 and all(c[-1]["role"] == "assistant" and c[-1]["content"].strip() for c in convs)
    assert sorted(users) == sorted(msgs[0]["content"] for _, msgs in read_prompts())
    for name in ("mtbench", "gsm8k", "humaneval"):
        for msgs in load_prompt_set(name):
            text = msgs[0]["content"]
            probe = text[:60] if name != "humaneval" else text.split("```python\n")[1][:60]
            assert not any(probe in u for u in users), (name, probe)


def test_committed_prompt_set_is_large_unique_and_never_an_evaluation_prompt():
    """The prompt set `regenerate` answers by default: >= 10,000 distinct user turns, most written
    by the target itself, and no evaluation prompt inside any of them (checked by substring, a rule
    independent of the 8-gram filter that built the set)."""
    from blockdraft.data.prompt_set import read_prompts

    prompts = read_prompts()
    users = [msgs[0]["content"] for _, msgs in prompts]
    assert len(prompts) >= 10_000 and len(set(users)) == len(users) == len({i for i, _ in prompts})
    assert sum(i.startswith("magpie-") for i, _ in prompts) > len(prompts) / 2
    joined = "\n\x00".join(users)
    for name in ("mtbench", "gsm8k", "humaneval"):
        for msgs in load_prompt_set(name):
            text = msgs[0]["content"]
            probe = text[:60] if name != "humaneval" else text.split("```python\n")[1][:60]
            assert probe not in joined, (name, probe)


def test_generate_and_bench_default_to_the_fastest_setting_measured_for_the_shipped_drafter():
    """With no --draft-threshold / --lookup, the speed settings are those of the best mean speedup
    among the committed bench results of the shipped drafter (all with outputs identical); a flag wins.
    --verify-chunk passes through (0, one forward per block, unless given)."""
    import json
    from pathlib import Path

    from blockdraft.checkpoint import load_drafter
    from blockdraft.cli import build_parser, speed_settings

    runs = []
    for f in sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("bench-default-n10*.json")):
        sets = json.loads(f.read_text())
        assert all(s["identical"] for s in sets), f
        runs.append((sum(s["speedup"] for s in sets) / len(sets),
                     {"draft_threshold": sets[0]["draft_threshold"], "lookup": sets[0]["lookup"]}))
    best = max(runs, key=lambda r: r[0])[1]
    drafter = load_drafter("default")
    parser = build_parser()
    assert speed_settings(parser.parse_args(["generate", "hi"]), drafter) == {**best, "verify_chunk": 0}
    assert speed_settings(parser.parse_args(["generate", "hi", "--lookup", "0", "--draft-threshold", "0",
                                             "--verify-chunk", "4"]),
                          drafter) == {"draft_threshold": 0.0, "lookup": 0, "verify_chunk": 4}
    assert speed_settings(parser.parse_args(["bench", "--n", "1", "--verify-chunk", "2"]),
                          drafter) == {**best, "verify_chunk": 2}


def test_unknown_command_and_bad_data_are_clear_errors(tmp_path, capsys):
    assert main([]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [\n')
    assert main(["train", "--data", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


@pytest.mark.slow
def test_train_generate_doctor_on_the_embedded_target(tmp_path, smollm2_dir, capsys):
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--steps", "3", "--max-rows", "3", "--max-length", "256",
            "--batch-tokens", "512", "--eval-every", "3", "--eval-fraction", "0.02", "--no-progress", "--threads", "1"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "held-out accepted length" in printed
    assert (out / "drafter" / "model.safetensors").exists() and (out / "loss.png").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    # resume from the finished checkpoint: nothing left to do, same drafter
    assert main(args + ["--resume"]) == 0
    assert main(["generate", "--drafter", str(out / "drafter"), "--chat", "Name a prime number.",
                 "--max-new-tokens", "8", "--threads", "1"]) == 0
    assert main(["doctor", "--drafter", str(out / "drafter"), "--threads", "1"]) == 0
    assert "FAIL" not in capsys.readouterr().out


def test_every_option_of_every_command_shows_its_default_or_says_it_is_required():
    """--help tells every option's default (a required one says so), for every subcommand."""
    import argparse

    from blockdraft.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, sub in subs.choices.items():
        fmt = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            shown = fmt._expand_help(action) if action.help else ""
            if "default" not in shown and not (action.required and "required" in shown):
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing


def test_no_function_in_the_package_is_longer_than_60_lines():
    """DESIGN.md's rule of thumb 2, held: a long function is split where it does two things."""
    import ast
    from pathlib import Path

    import blockdraft

    long = []
    for f in sorted(Path(blockdraft.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{f.name}:{node.name} {node.end_lineno - node.lineno + 1}")
    assert not long, long


def test_every_option_of_every_command_shows_its_default_in_help():
    import argparse

    from blockdraft.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = []
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            f = parser._get_formatter()
            f.add_argument(action)
            text = " ".join(f.format_help().split()).lower()
            if "default" not in text and "required" not in text:
                silent.append(f"{name} {action.option_strings[-1]}")
    assert silent == [], silent


def _commands_with(dest: str) -> dict:
    import argparse

    from blockdraft.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: p for name, p in sub.choices.items() if any(a.dest == dest for a in p._actions)}


@pytest.mark.parametrize("extra", [["--top-p", "0.5"], ["--seed", "3"], ["--top-p", "0.5", "--seed", "0"]])
def test_every_command_refuses_sampling_flags_that_greedy_decoding_would_ignore(tmp_path, capsys, extra):
    from blockdraft.cli import build_parser, unused_sampling

    needs = {"generate": ["hi"], "regenerate": ["--out", str(tmp_path / "a.jsonl")]}
    assert set(_commands_with("temperature")) == set(needs)  # a new command taking --temperature joins the sweep
    for cmd, args in needs.items():
        with pytest.raises(SystemExit) as got:  # refused before any work: no target is loaded
            main([cmd, *args, *extra])
        err = capsys.readouterr().err
        assert got.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"blockdraft {cmd}: error: ") and "--temperature 0 decodes greedily" in err, err
        assert all(flag in err for flag in extra[::2]) and ("--seed" in err) == ("--seed" in extra), err
        for ok in ([], [*extra, "--temperature", "0.7"]):  # greedy as given, and every flag when sampling
            assert unused_sampling(build_parser().parse_args([cmd, *args, *ok])) is None
    assert not (tmp_path / "a.jsonl").exists()



def test_every_flag_accepts_the_default_its_help_shows():
    """A default is a value the flag itself takes (`doctor --show 0` was refused though 0 is its default)."""
    import argparse

    from blockdraft.cli import build_parser
    from blockdraft.options import Checked

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    refused = []
    for name, parser in sub.choices.items():
        for a in parser._actions:
            if isinstance(a.type, Checked) and a.default is not None and a.option_strings:
                text = ",".join(map(str, a.default)) if isinstance(a.default, list) else str(a.default)
                try:
                    a.type(text)  # what typing the default on the command line does
                except argparse.ArgumentTypeError as e:
                    refused.append(f"{name} {a.option_strings[0]} {text}: {e}")
    assert refused == []


def test_the_command_list_names_every_format_convert_writes():
    """`blockdraft --help` lists the commands without building their flags, so convert's line names the
    formats in words: each one `convert --to` takes."""
    from blockdraft.checkpoint.formats import EXPORTS
    from blockdraft.cli.parsers import COMMANDS

    assert all(name in COMMANDS["convert"][0] for name in EXPORTS)
