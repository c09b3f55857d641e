"""A spec's command-line flags, derived from its declaration (:mod:`launcher.schema`).

:func:`add_flags` adds one flag per declared field, with the field's help, every default
None so that :func:`given_flags` tells a flag given from one left out (a YAML's value
stands); :func:`from_flags` builds a spec from flags alone (a command with no YAML),
each value checked against its field's bounds; :func:`to_argv` is the other way, the
flags that rebuild a spec elsewhere (``launcher submit`` runs ``launcher run`` with them
on the cluster).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from launcher.errors import UserError
from launcher.schema import WANT, Field, broken_bound, checked, field_named, fields

def parse_bool(text: str) -> bool:
    """``--switch true|false|yes|no|1|0`` (a bare ``--switch`` means true)."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


_PARSERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (), switches: bool = False) -> None:
    """One flag per declared field of ``cls`` (except ``skip``); every default is None, so
    :func:`given_flags` can tell a flag given from one left out (the YAML's value stands).
    ``switches``: a bool flag takes no value (``--emulator``), for commands without a YAML to override."""
    for f in fields(cls):
        if f.flag is None or f.name in skip:
            continue
        if not f.flag.startswith("-"):  # positional
            parser.add_argument(f.name, metavar=f.flag, help=f.help)
        elif f.kind == "bool":
            how = {"action": "store_const"} if switches else {"nargs": "?", "type": parse_bool, "metavar": "true|false"}
            parser.add_argument(f.flag, dest=f.name, const=True, default=None, help=f.help, **how)
        else:
            bare = {"nargs": "?", "const": f.const} if f.const is not None else {}
            metavar = f.metavar or (None if f.choices else f.flag[2:].upper().replace("-", "_"))
            parser.add_argument(f.flag, dest=f.name, type=_PARSERS.get(f.kind, str), default=None, help=f.help,
                                metavar=metavar, choices=f.choices or None,
                                action="append" if f.repeat else "store", **bare)


def given_flags(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields whose flags were given (parsed by :func:`add_flags`), by field name."""
    return {f.name: getattr(args, f.name) for f in fields(cls)
            if f.flag is not None and getattr(args, f.name, None) is not None}


def from_flags(cls: type, args: argparse.Namespace) -> Any:
    """An instance of ``cls`` from the flags :func:`add_flags` added (a command with no YAML): a flag
    left out keeps its field's default; a given one is checked against the field's bounds, then
    the instance's ``check()``. UserError: one line naming the flag."""
    return checked(cls(**{name: _flag_value(field_named(cls, name), raw)
                           for name, raw in given_flags(args, cls).items()}))


def _flag_value(f: Field, raw: Any) -> Any:
    """A given flag's value as its field holds it (a list flag's text split at commas, each item
    converted); UserError for a value out of the field's bounds or a list of no items."""
    if f.kind not in ("tuple", "list"):
        if broken_bound(f, raw):
            raise UserError(f"{f.flag} must be {broken_bound(f, raw)}, got {raw}")
        return raw
    items = [t.strip() for t in (raw if f.repeat else raw.split(",")) if t.strip()]
    if len(items) < max(f.min_items or 0, 1):
        raise UserError(f"{f.flag} {raw!r} gives no value", f"for example {f.flag} {'1,2' if f.item else 'a,b'}")
    try:
        items = [_PARSERS[f.item or "str"](t) for t in items]
    except ValueError:
        raise UserError(f"{f.flag} {raw!r} is not a comma-separated list of {WANT[f.item].split()[-1]}s",
                        f"for example {f.flag} 1,2") from None
    broken = [b for b in (broken_bound(f, v) for v in items) if b]
    if broken:
        raise UserError(f"{f.flag} {raw!r}: every value must be {broken[0]}")
    return tuple(items)


def to_argv(spec: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """Flags that rebuild ``spec``'s flag fields (those not None, except ``skip``)."""
    argv: list[str] = []
    for f in fields(type(spec)):
        value = getattr(spec, f.name)
        if f.flag is None or f.name in skip or value is None:
            continue
        if f.kind == "bool":
            argv += [f.flag, "true" if value else "false"]
        elif f.kind == "tuple":
            argv += [f.flag, ",".join(value)]
        else:
            argv += [f.flag, repr(value) if isinstance(value, float) else str(value)]
    return argv
