"""Package exports imported on first use (PEP 562), so importing a package stays cheap.

A package's ``__init__`` lists what it exports and from which module::

    __all__, __getattr__ = lazy_exports(__name__, {"run": "launcher.driver.launch"})

``from launcher.driver import run`` then imports ``launcher.driver.launch``
only when ``run`` is first asked for (it imports Ray).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, table: dict[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """(``__all__``, ``__getattr__``) for a package exporting ``name -> module`` lazily."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return sorted(table), __getattr__
