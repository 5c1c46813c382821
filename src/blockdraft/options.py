"""Typed run options: dataclass fields are the only definition of a setting's default and help.

A field's metadata holds its help text (and optionally `choices`, `flag`, `hidden`). The CLI's
flags are generated from the fields (`add_options`), read back into the dataclass
(`from_args`), and a saved configuration replays with explicit flags on top (`explicit_flags`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def opt(default: Any, help: str, **meta: Any):
    """A dataclass field with its help text (meta: choices, flag, hidden=True for library-only)."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help, **meta})
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def _inner(tp) -> tuple[type, bool]:
    """(base type, optional) of an annotation such as `int | None`."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _shown(default) -> str:
    return "none" if default is None else ",".join(map(str, default)) if isinstance(default, list) else str(default)


def states_default(help_text: str | None) -> bool:
    """Whether a help text already says what its default is (then no second default is shown)."""
    return "(default:" in (help_text or "")


def add_options(parser: argparse.ArgumentParser, cls, *, only: tuple[str, ...] | None = None) -> None:
    """One flag per field of `cls` (`--max-rows` for `max_rows`), help text with the default shown."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if meta.get("hidden") or (only is not None and f.name not in only):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        base, _ = _inner(hints[f.name])
        help_text = meta["help"].replace("%", "%%")
        if not meta.get("required") and not states_default(meta["help"]):  # argparse fills %(default)s in
            help_text += " (default: %(default)s)" if not isinstance(default, list) else f" (default: {_shown(default)})"
        if meta.get("required"):
            parser.add_argument(flag, dest=f.name, type=base, required=True, help=help_text)
            continue
        if base is bool:
            parser.add_argument(flag, dest=f.name, default=default, help=help_text,
                                action=argparse.BooleanOptionalAction if default else "store_true")
            continue
        kind = _int_list if typing.get_origin(base) is list else base
        parser.add_argument(flag, dest=f.name, type=kind, default=default, choices=meta.get("choices"),
                            metavar=meta.get("metavar"), help=help_text)


def from_args(cls, args: argparse.Namespace):
    """The dataclass from parsed flags (fields without a flag keep their defaults)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def explicit_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations the user set on the command line (to lay over a replayed configuration)."""
    quiet = argparse.Namespace()
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    try:
        parser.parse_known_args(argv, namespace=quiet)
    finally:
        pass
    return set(vars(quiet))


def replace_from(cfg, values: dict):
    """`cfg` with the fields named in `values` replaced (unknown names are an error)."""
    names = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown {type(cfg).__name__} fields {unknown}")
    return dataclasses.replace(cfg, **values)
