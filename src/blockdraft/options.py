"""Typed run options: dataclass fields are the only definition of a setting's default and help.

A field's metadata holds its help text (and optionally `choices`, `flag`, `hidden`). The CLI's
flags are generated from the fields (`add_options`), read back into the dataclass
(`from_args`), and a saved configuration replays with explicit flags on top (`explicit_flags`).

A field's type and metadata (`min`/`max` inclusive, `above`/`below` exclusive, `check`: a
function of the value that raises ValueError, e.g. a path that must exist) are its constraint:
the same one checks a flag when it is parsed (`Checked`, argparse's type) and a value read
from a saved configuration (`check_fields`). Numbers are finite and, unless a field says
otherwise, never negative; strings are never empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import operator
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


BOUNDS = {"min": (">=", operator.ge), "max": ("<=", operator.le), "above": (">", operator.gt),
          "below": ("<", operator.lt)}  # inclusive, inclusive, exclusive, exclusive
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "an object",
               list: "a list of integers"}


class Checked:
    """An argparse type that is also the constraint of a setting: its kind (int, float, str, or a
    comma-separated list of ints), its bounds and an optional `check` of the parsed value against
    this machine (a path, a device), which `check_parsed` runs after parsing (a parser alone, as the
    memory plan reads a README command, looks at no files). `validate` applies the same constraint
    to a value read from a file."""

    def __init__(self, kind, *, check=None, **bounds):
        unknown = set(bounds) - set(BOUNDS)
        if unknown:
            raise TypeError(f"unknown bounds {sorted(unknown)}")
        if kind in (int, float, list) and not {"min", "above"} & set(bounds):
            bounds["min"] = 0  # numbers are never negative unless a setting says so
        self.kind, self.check, self.bounds = kind, check, bounds
        self.__name__ = _KIND_NAMES.get(kind, getattr(kind, "__name__", str(kind)))

    def __call__(self, text: str):
        try:
            return self.validate(self.parse(text), environment=False)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    def parse(self, text: str):
        try:
            if self.kind is list:
                return [int(x) for x in text.split(",") if x.strip()]
            return self.kind(text)
        except ValueError:
            raise ValueError(f"expected {self.__name__}, got {text!r}") from None

    def validate(self, value, *, environment: bool = True):
        """`value` if it meets the constraint, else ValueError saying what it must be; `environment`:
        also the `check` (paths that must exist, a device that must be there)."""
        if self.kind is list:
            if not value:
                raise ValueError("expected at least one integer")
            for v in value:
                self._bounded(v)
        elif self.kind is str:
            if not value.strip():
                raise ValueError("must not be empty")
        else:
            self._bounded(value)
        if environment and self.check is not None:
            got = self.check(value)
            value = value if got is None else got
        return value

    def _bounded(self, v) -> None:
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"must be a finite number, got {v}")
        for name, bound in self.bounds.items():
            op, holds = BOUNDS[name]
            if not holds(v, bound):
                raise ValueError(f"must be {op} {bound}, got {v}")


def check_parsed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every parsed flag's `check` (paths that must exist, a device that must be there), before any
    work; a failure is the parser's own one-line error."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if isinstance(action.type, Checked) and action.type.check is not None and value is not None:
            try:
                setattr(args, action.dest, action.type.validate(value))
            except ValueError as e:
                parser.error(f"argument {'/'.join(action.option_strings) or action.dest}: {e}")


def existing(kind: str | None = None, *, names: tuple[str, ...] = (), prefixes: tuple[str, ...] = ()):
    """A `check`: one of `names` or a value with one of `prefixes` (checked where it is read), else a
    path that exists (`kind` "file" or "dir": one of that kind)."""
    from pathlib import Path

    def check(value: str) -> None:
        if value in names or value.startswith(prefixes or ("\0",)):
            return
        p = Path(value).expanduser()
        if not (p.is_file() if kind == "file" else p.is_dir() if kind == "dir" else p.exists()):
            what = {"file": "file", "dir": "directory"}.get(kind, "file or directory")
            also = f" (nor {' or '.join(map(repr, names))})" if names else ""
            raise ValueError(f"no such {what}: {value}{also}")

    return check


def field_constraint(f: dataclasses.Field, hint) -> Checked | None:
    """The constraint of a dataclass field (None for a bool: a switch has no value to check)."""
    base, _ = _inner(hint)
    kind = list if typing.get_args(base) == (int,) and typing.get_origin(base) is list else base
    if kind not in (int, float, str, list):
        return None  # a switch, a dict: its type is all there is to check
    meta = f.metadata
    return Checked(kind, check=meta.get("check"), **{k: meta[k] for k in BOUNDS if k in meta})


def is_kind(value, hint) -> bool:
    """Whether a value read from JSON has the field's type (ints pass for floats; bools are not ints)."""
    base, optional = _inner(hint)
    if value is None:
        return optional
    origin = typing.get_origin(base)
    if origin is list:
        (item,) = typing.get_args(base) or (object,)
        return isinstance(value, list) and all(is_kind(v, item) for v in value)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or base) if base is not typing.Any else True


def _kind_name(hint) -> str:
    base, optional = _inner(hint)
    origin = typing.get_origin(base)
    if origin is list:
        (item,) = typing.get_args(base) or (object,)
        name = f"a list of {_KIND_NAMES.get(item, 'values').split(' ', 1)[-1]}s"
    else:
        name = _KIND_NAMES.get(origin or base, getattr(base, "__name__", str(base)))
    return name + (" or null" if optional else "")


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def check_fields(obj, *, where: str = "", environment: bool = True) -> None:
    """Every field of a dataclass instance against its type and constraint (a configuration read
    from a file), or a ValueError naming the field, what it must be and what it is."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not is_kind(value, hints[f.name]):
            raise ValueError(f"{where}{f.name} must be {_kind_name(hints[f.name])}, got {value!r}")
        rule = field_constraint(f, hints[f.name])
        if value is None or rule is None:
            continue
        try:
            rule.validate(value, environment=environment)
        except ValueError as e:
            raise ValueError(f"{where}{f.name} {e}") from None


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
        kind = field_constraint(f, hints[f.name])
        if meta.get("required"):
            parser.add_argument(flag, dest=f.name, type=kind, required=True, help=help_text + " (required)")
            continue
        if base is bool:
            parser.add_argument(flag, dest=f.name, default=default, help=help_text,
                                action=argparse.BooleanOptionalAction if default else "store_true")
            continue
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
