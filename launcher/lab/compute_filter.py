"""Compute Engine's list ``filter`` expressions, enough of them for the local Compute API.

Ray's GCP provider lists a cluster's VMs with a filter such as
``((labels.ray-node-kind = worker)) AND ((status = RUNNING) OR (status = STAGING))
AND (labels.ray-cluster-name = c) AND (NOT labels.tpu_cores:*)``,
``launcher cluster down`` with ``labels.ray-cluster-name = c``, and
``launcher cluster preemptions`` a zone's operations with
``operationType = "compute.instances.preempted"``. This reads AND, OR, NOT,
parentheses, ``FIELD = VALUE``, ``FIELD != VALUE`` and ``FIELD:*`` (the field
is present), where a field is a top-level field of the resource (``status``,
``name``, ``operationType``) or ``labels.KEY``. AND binds tighter than OR; an
empty filter matches everything.
"""

from __future__ import annotations

import re
from typing import Mapping

TOKEN = re.compile(r'\s*(\(|\)|!=|=|"[^"]*"|[^\s()=!"]+)')


def matches(expression: str, instance: Mapping) -> bool:
    """Whether ``instance`` (an instance or operation resource as JSON) passes ``expression``."""
    tokens = TOKEN.findall(expression or "")
    if not tokens:
        return True
    parser = _Parser(tokens, instance)
    result = parser.any_of()
    if parser.position != len(tokens):
        raise ValueError(f"cannot read the filter {expression!r} past {tokens[parser.position]!r}")
    return result


class _Parser:
    def __init__(self, tokens: list[str], instance: Mapping) -> None:
        self.tokens, self.position, self.instance = tokens, 0, instance

    def _peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ValueError("the filter ends too soon")
        self.position += 1
        return token

    def any_of(self) -> bool:
        result = self.all_of()
        while self._peek() == "OR":
            self._take()
            result = self.all_of() or result
        return result

    def all_of(self) -> bool:
        result = self.one()
        while self._peek() not in (None, ")", "OR"):
            if self._peek() == "AND":
                self._take()
            result = self.one() and result
        return result

    def one(self) -> bool:
        token = self._take()
        if token == "NOT":
            return not self.one()
        if token == "(":
            result = self.any_of()
            if self._take() != ")":
                raise ValueError("a '(' in the filter is not closed")
            return result
        if token.endswith(":*"):
            return self._field(token[:-2]) is not None
        op, value = self._take(), self._take().strip('"')
        if op not in ("=", "!="):
            raise ValueError(f"the filter compares with {op!r}; this API reads = and !=")
        return (str(self._field(token)) == value) == (op == "=")

    def _field(self, name: str):
        if name.startswith("labels."):
            return (self.instance.get("labels") or {}).get(name[len("labels."):])
        return self.instance.get(name)
