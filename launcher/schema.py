"""Declaring a spec once: each field's type, default and help, with flags and YAML keys derived.

A spec (:class:`launcher.spec.JobSpec`, :class:`cluster.spec.ClusterSpec`) is
a frozen dataclass whose fields are declared with :func:`option`. From that
one declaration come:

* the YAML keys a spec file may hold, each checked against the field's real
  type (``int``, ``float | None``, ``tuple[str, ...]``...), an unknown key
  answered with the closest valid one (:func:`from_mapping`);
* the command-line flags (:func:`add_flags`, :func:`given_flags`), with the
  field's help, and :func:`to_argv`, the flags that rebuild a spec elsewhere
  (``launcher submit`` runs ``launcher run`` with them on the cluster).

Every problem is a :class:`~launcher.errors.UserError` naming the key, the
bad value and an example of a good one.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from launcher.errors import UserError

_KINDS = {int: "int", float: "float", str: "str", bool: "bool"}
_EXAMPLES = {"int": "2", "float": "0.5", "str": "text", "bool": "true", "dict": "{key: value}",
             "tuple": "[a, b]"}
_WANT = {"int": "an integer", "float": "a number", "str": "a non-empty string", "bool": "true or false",
         "dict": "a mapping of name: value", "tuple": "a list of strings"}


def option(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None, cli: bool = True,
           default_factory: Callable[[], Any] | Any = dataclasses.MISSING, metavar: str | None = None) -> Any:
    """A spec field: its default, its help, and whether (and as what) it is a command-line flag.

    Args:
        flag: the flag's name when it is not ``--`` + the field name with dashes.
        cli: False for fields set only by YAML or by the program (no flag).
    """
    metadata = {"help": help, "flag": flag, "cli": cli, "metavar": metavar}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Field:
    """One declared field, its annotation resolved to a kind."""

    name: str
    kind: str          # int | float | str | bool | dict | tuple
    optional: bool     # None is a valid value
    help: str
    flag: str | None   # None: not on the command line
    metavar: str | None

    @property
    def dest(self) -> str:
        return self.name


@functools.lru_cache(maxsize=None)
def fields(cls: type) -> tuple[Field, ...]:
    """The declared fields of a spec class, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, optional = _kind(hints[f.name])
        meta = f.metadata or {}
        flag = None
        if meta.get("cli", True):
            flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        out.append(Field(f.name, kind, optional, meta.get("help", ""), flag, meta.get("metavar")))
    return tuple(out)


def _kind(annotation: Any) -> tuple[str, bool]:
    """('int', True) for ``int | None``; ('tuple', False) for ``tuple[str, ...]``..."""
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            raise TypeError(f"unsupported annotation {annotation!r}")
        annotation = args[0]
    origin = typing.get_origin(annotation) or annotation
    if origin in (dict, tuple):
        return origin.__name__, optional
    if origin in _KINDS:
        return _KINDS[origin], optional
    raise TypeError(f"unsupported annotation {annotation!r}")


def field_named(cls: type, name: str) -> Field:
    return next(f for f in fields(cls) if f.name == name)


def flag_of(cls: type, name: str) -> str:
    """The flag of a field (``--name-with-dashes`` when it has none), for messages."""
    return next((f.flag for f in fields(cls) if f.name == name and f.flag), "--" + name.replace("_", "-"))


# -- YAML and mappings ------------------------------------------------------------------

def from_mapping(cls: type, values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Check a mapping's keys and values against ``cls``'s fields; returns them coerced.

    Raises:
        UserError: an unknown key (with the closest known one) or a value of the wrong type.
    """
    check_keys(cls, values, source)
    known = {f.name: f for f in fields(cls)}
    return {key: coerce(known[key], value, source) for key, value in values.items()}


def check_keys(cls: type, values: Mapping[str, Any], source: str) -> None:
    """UserError for the first key that is not a field of ``cls``, with the closest one."""
    known = [f.name for f in fields(cls)]
    for key in values:
        if key not in known:
            raise UserError(f"{source}: unknown key {key!r}", _closest(str(key), known))


def _closest(key: str, known: list[str]) -> str:
    # "num_workers" is how Ray's ScalingConfig spells it: match without the prefix first.
    close = (difflib.get_close_matches(key.removeprefix("num_"), known, n=1)
             or difflib.get_close_matches(key, known, n=1))
    return f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(known)}"


def coerce(field: Field, value: Any, source: str) -> Any:
    """``value`` checked against the field's type (an int is a valid float; strings are stripped)."""
    key = field.name
    if value is None:
        if field.optional:
            return None
        raise UserError(f"{source}: {key} may not be empty", f"give {key} a value or leave the key out")
    ok, result = _convert(field.kind, value)
    if not ok:
        raise UserError(f"{source}: {key} must be {_WANT[field.kind]}, got {value!r}",
                        f"for example {key}: {_EXAMPLES[field.kind]}")
    return result


def _convert(kind: str, value: Any) -> tuple[bool, Any]:
    if kind == "bool":
        return isinstance(value, bool), value
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool), value
    if kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if kind == "str":
        ok = isinstance(value, str) and bool(value.strip())
        return ok, value.strip() if ok else value
    if kind == "dict":
        return isinstance(value, dict), dict(value) if isinstance(value, dict) else value
    items = value.split(",") if isinstance(value, str) else value  # tuple of strings
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        return False, value
    return True, tuple(i.strip() for i in items if i.strip())


# -- the command line -------------------------------------------------------------------

def parse_bool(text: str) -> bool:
    """``--switch true|false|yes|no|1|0`` (a bare ``--switch`` means true)."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


_PARSERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str, "tuple": str}


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per declared field of ``cls`` (except ``skip``); every default is None, so
    :func:`given_flags` can tell a flag given from one left out (the YAML's value stands)."""
    for f in fields(cls):
        if f.flag is None or f.name in skip:
            continue
        if f.kind == "bool":
            parser.add_argument(f.flag, dest=f.dest, nargs="?", const=True, default=None, type=parse_bool,
                                metavar="true|false", help=f.help)
        else:
            parser.add_argument(f.flag, dest=f.dest, type=_PARSERS[f.kind], default=None, help=f.help,
                                metavar=f.metavar or f.flag[2:].upper().replace("-", "_"))


def given_flags(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields whose flags were given (parsed by :func:`add_flags`), by field name."""
    return {f.name: getattr(args, f.dest) for f in fields(cls)
            if f.flag is not None and getattr(args, f.dest, None) is not None}


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


# -- YAML files -------------------------------------------------------------------------

def load_yaml(path: str, flag: str, hint: str = "pass the path of a YAML file") -> Any:
    """A YAML file's content (an empty file is {}); UserError for a missing, unreadable
    or malformed file, naming the line and column of a syntax error."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=_unique_keys_loader())
    except FileNotFoundError:
        raise UserError(f"{flag} {path} does not exist", hint) from None
    except IsADirectoryError:
        raise UserError(f"{flag} {path} is a folder, not a file", hint) from None
    except OSError as exc:
        raise UserError(f"cannot read {flag} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"{flag} {path} is not a text file", hint) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise UserError(f"{path}: {problem}{where}", "fix the YAML syntax") from None
    return {} if raw is None else raw


def _unique_keys_loader():
    """yaml.SafeLoader that refuses a key given twice in one mapping (YAML keeps the last one
    silently, which hides a typo'd copy-paste)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeys


def load_mapping(path: str, flag: str, example: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping of spec keys (``example`` shows two)."""
    raw = load_yaml(path, flag)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of spec keys ({example}), got a {type(raw).__name__}")
    return raw
