"""Declaring a spec once: each field's type, default and help, with flags and YAML keys derived.

A spec (:class:`launcher.spec.JobSpec`, :class:`cluster.spec.ClusterSpec`) is
a frozen dataclass whose fields are declared with :func:`option`. From that
one declaration come:

* the YAML keys a spec file may hold, each checked against the field's real
  type (``int``, ``float | None``, ``tuple[str, ...]``, a ``Literal`` of
  choices, another spec or a tuple of them...), an unknown key answered with
  the closest valid one (:func:`from_mapping`, :func:`build` for nested
  specs such as a tuning file's ``hyperparameters`` block);
* the command-line flags, with the field's help (:mod:`launcher.flags`).

Every problem is a :class:`~launcher.errors.UserError` naming the key (with
its place in a nested spec, e.g. ``params[0] (lr).minValue``), the bad value
and an example of a good one. A spec class may define ``check(self)``, raising
``ValueError(message)`` for a rule across fields; :func:`build` reports it
as one line too. This is the project's one mechanism for checking specs.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import operator
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from launcher.errors import UserError

_KINDS = {int: "int", float: "float", str: "str", bool: "bool"}
_EXAMPLES = {"int": "2", "float": "0.5", "str": "text", "bool": "true", "dict": "{key: value}",
             "tuple": "[a, b]"}
_BOUNDS = (("ge", operator.lt, "at least"), ("gt", operator.le, "more than"), ("le", operator.gt, "at most"))
# what a value of each kind must be, as a message says it (the flags' messages too)
WANT = {"int": "an integer", "float": "a number", "str": "a non-empty string", "bool": "true or false",
        "dict": "a mapping of name: value", "tuple": "a list of strings"}


def option(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None, cli: bool = True,
           default_factory: Callable[[], Any] | Any = dataclasses.MISSING, metavar: str | None = None,
           ge: float | None = None, gt: float | None = None, le: float | None = None,
           min_items: int | None = None, const: Any = None, repeat: bool = False) -> Any:
    """A spec field: its default, its help, and whether (and as what) it is a command-line flag.

    Args:
        flag: the flag's name when it is not ``--`` + the field name with dashes; without dashes
            (``URI``), the command's positional argument of that name.
        cli: False for fields set only by YAML or by the program (no flag).
        const: a string flag's value when it is given without one (``--mlflow`` alone).
        ge, gt, le: bounds of a number (each number of a list flag): at least, more than, at most.
        min_items: the fewest items a list may hold.
        repeat: a list flag given once per item (``--param A --param B``), not comma-separated.
    """
    metadata = {"help": help, "flag": flag, "cli": cli, "metavar": metavar, "ge": ge, "gt": gt, "le": le,
                "min_items": min_items, "const": const, "repeat": repeat}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Field:
    """One declared field, its annotation resolved to a kind."""

    name: str
    kind: str          # int | float | str | bool | dict | tuple | choice | spec | list
    optional: bool     # None is a valid value
    help: str
    flag: str | None   # None: not on the command line
    metavar: str | None
    choices: tuple[Any, ...] = ()   # a choice's valid values
    item: Any = None                # a list's item: a kind ("float", "str") or a spec class; a spec's class
    ge: float | None = None         # bounds of a number: at least, more than, at most
    gt: float | None = None
    le: float | None = None
    min_items: int | None = None
    required: bool = False          # no default: a mapping must give it
    const: Any = None               # a string flag's value when given bare
    repeat: bool = False            # a list flag given once per item


@functools.lru_cache(maxsize=None)
def fields(cls: type) -> tuple[Field, ...]:
    """The declared fields of a spec class, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, optional, extra = _kind(hints[f.name])
        meta = f.metadata or {}
        flag = None  # a list of numbers is a flag (comma-separated); a nested spec or a list of them is not
        if meta.get("cli", True) and kind != "spec" and (kind != "list" or extra in ("int", "float")):
            flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append(Field(f.name, kind, optional, meta.get("help", ""), flag, meta.get("metavar"),
                         choices=extra if kind == "choice" else (), item=None if kind == "choice" else extra,
                         required=required, **{k: meta.get(k) for k in ("ge", "gt", "le", "min_items", "const")},
                         repeat=bool(meta.get("repeat"))))
    return tuple(out)


def _kind(annotation: Any) -> tuple[str, bool, Any]:
    """(kind, optional, extra): ('int', True, None) for ``int | None``; ('tuple', False, None)
    for ``tuple[str, ...]``; ('list', False, 'float') for ``tuple[float, ...]``; ('list', False,
    Param) for ``tuple[Param, ...]``; ('choice', False, ('A', 'B')) for ``Literal['A', 'B']``;
    ('spec', False, Hyper) for a nested spec class."""
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            raise TypeError(f"unsupported annotation {annotation!r}")
        annotation = args[0]
    origin = typing.get_origin(annotation) or annotation
    if origin is typing.Literal:
        return "choice", optional, typing.get_args(annotation)
    if origin is tuple:
        item = (typing.get_args(annotation) or (str,))[0]
        if item is str:
            return "tuple", optional, None
        if item in (int, float):
            return "list", optional, _KINDS[item]
        if item is dict:
            return "list", optional, "dict"
        if dataclasses.is_dataclass(item):
            return "list", optional, item
        raise TypeError(f"unsupported annotation {annotation!r}")
    if origin is dict:
        return "dict", optional, None
    if origin in _KINDS:
        return _KINDS[origin], optional, None
    if dataclasses.is_dataclass(origin):
        return "spec", optional, origin
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


def check_keys(cls: type, values: Mapping[str, Any], source: str, where: str = "") -> None:
    """UserError for the first key that is not a field of ``cls``, with the closest one (``where``:
    the mapping's place in a nested spec)."""
    known = [f.name for f in fields(cls)]
    for key in values:
        if key not in known:
            raise UserError(f"{source}: unknown key {key!r}" + (f" in {where}" if where else ""),
                            closest(str(key), known))


def closest(key: str, known: list[str]) -> str:
    """The hint for an unknown key: the closest known one, else the list of them."""
    # "num_workers" is how Ray's ScalingConfig spells it: match without the prefix first.
    close = (difflib.get_close_matches(key.removeprefix("num_"), known, n=1)
             or difflib.get_close_matches(key, known, n=1))
    return f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(known)}"


def coerce(field: Field, value: Any, source: str, where: str = "") -> Any:
    """``value`` checked against the field's type (an int is a valid float; strings are stripped).

    ``where`` is the field's place in a nested spec (``params[0] (lr)``), for messages.
    """
    key = f"{where}.{field.name}" if where else field.name
    if value is None:
        if field.optional:
            return None
        raise UserError(f"{source}: {key} may not be empty", f"give {field.name} a value or leave the key out")
    if field.kind == "choice":
        if value not in field.choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in field.choices], n=1)
            raise UserError(f"{source}: {key} = {value!r}: must be one of {', '.join(map(str, field.choices))}",
                            f"did you mean {close[0]}?" if close else f"for example {field.name}: "
                            f"{field.choices[0]}")
        return value
    if field.kind == "spec":
        return build(field.item, value, source, key)
    if field.kind == "list":
        return _list(field, value, source, key)
    ok, result = _convert(field.kind, value)
    if not ok:
        raise UserError(f"{source}: {key} must be {WANT[field.kind]}, got {value!r}",
                        f"for example {field.name}: {_EXAMPLES[field.kind]}")
    broken = broken_bound(field, result)
    if broken:
        raise UserError(f"{source}: {key} = {value!r}: must be {broken}", f"give {field.name} a value of {broken}")
    return result


def broken_bound(field: Field, value: Any) -> str | None:
    """The bound of ``field`` that the number ``value`` breaks ("at least 1"); None: it keeps them all."""
    bounds = ((getattr(field, key), breaks, words) for key, breaks, words in _BOUNDS)
    return next((f"{words} {b:g}" for b, breaks, words in bounds if b is not None and breaks(value, b)), None)


def _list(field: Field, value: Any, source: str, key: str) -> tuple[Any, ...]:
    """A list of numbers or of nested specs, each item checked; an item of specs is named by its
    class's ``LABEL`` key where it has one (``params[1] (lr)``)."""
    if not isinstance(value, (list, tuple)):
        raise UserError(f"{source}: {key} must be a list, got {value!r}", f"write {field.name}: [...]")
    if field.min_items and len(value) < field.min_items:
        raise UserError(f"{source}: {key} must list at least {field.min_items} item"
                        f"{'s' if field.min_items > 1 else ''}", f"add an item to {field.name}")
    out = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if isinstance(field.item, str):
            ok, result = _convert(field.item, item)
            if not ok:
                raise UserError(f"{source}: {where} must be {WANT[field.item]}, got {item!r}",
                                f"for example {field.name}: [{_EXAMPLES[field.item]}]")
            out.append(result)
            continue
        label = getattr(field.item, "LABEL", None)
        if label and isinstance(item, dict) and isinstance(item.get(label), str):
            where += f" ({item[label]})"
        out.append(build(field.item, item, source, where))
    return tuple(out)


def build(cls: type, raw: Any, source: str, where: str = "") -> Any:
    """An instance of the spec class ``cls`` from a YAML mapping, nested specs included.

    Every key is checked (unknown: the closest known one; missing; wrong type or choice),
    then the instance's own ``check()``, whose ``ValueError`` becomes one line.

    Raises:
        UserError: the first problem, naming its place (``where``) in the file ``source``.
    """
    if not isinstance(raw, dict):
        raise UserError(f"{source}: {where or 'the file'} must be a mapping of keys, got {raw!r}",
                        f"valid keys: {', '.join(f.name for f in fields(cls))}")
    check_keys(cls, raw, source, where)
    known = {f.name: f for f in fields(cls)}
    for f in known.values():
        if f.required and f.name not in raw:
            raise UserError(f"{source}: {where + '.' if where else ''}{f.name} is missing",
                            getattr(cls, "HINT", f"add {f.name}: ..."))
    values = {key: coerce(known[key], value, source, where) for key, value in raw.items()}
    return checked(cls(**values), f"{source}: ", "fix the value")


def checked(instance: Any, prefix: str = "", hint: str | None = None) -> Any:
    """``instance`` after its own ``check()`` (a rule across fields), whose ValueError becomes one line."""
    check = getattr(instance, "check", None)
    if callable(check):
        try:
            check()
        except ValueError as exc:
            raise UserError(f"{prefix}{exc}", getattr(type(instance), "HINT", hint)) from None
    return instance


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


def to_mapping(spec: Any) -> dict[str, Any]:
    """A spec built by :func:`build` as plain YAML/JSON values (lists, nested mappings), keys
    whose value is None left out: what :func:`build` reads back into an equal spec."""
    out: dict[str, Any] = {}
    for f in fields(type(spec)):
        value = getattr(spec, f.name)
        if value is None:
            continue
        if f.kind == "spec":
            value = to_mapping(value)
        elif f.kind in ("list", "tuple"):
            value = [to_mapping(v) if dataclasses.is_dataclass(v) else v for v in value]
        out[f.name] = value
    return out


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