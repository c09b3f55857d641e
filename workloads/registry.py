"""A small name -> object registry whose errors list the valid names.

Used for everything a user names on the command line (workloads here,
backends and frameworks in the launcher), so a typo always answers with the
choices and the closest match.
"""

from __future__ import annotations

import difflib
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class UnknownName(KeyError):
    """A name that is not registered; str() is a complete, user-facing sentence."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownName(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(str(name), self._items, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"unknown {self.kind} {name!r}{hint}; valid: {', '.join(self.names())}"

    def names(self) -> list[str]:
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(self._items.values())
