"""The ``launcher bench`` registry: a benchmark is a frozen dataclass of its settings, each
field declared once with :func:`launcher.schema.option` (type, default, help, bounds; a rule
across fields in its ``check()``), and a function registered under a name for it::

    @benchmark("stall", Stall, help="training time one step checkpoint costs")
    def stall(s: Stall, args) -> int: ...

:mod:`launcher.cli.bench` derives the flags and builds the settings. The declarations are in
``bench_training.py`` and ``bench_systems.py``; each function imports its ``benchmarks/`` module.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from launcher.errors import UserError

OUT = "./bench-results"
OUT_HELP = "folder for JSON, CSV and PNG results"


@dataclass(frozen=True)
class Benchmark:
    """One ``launcher bench NAME``."""

    name: str
    settings: type   # a frozen dataclass declared with launcher.schema.option
    help: str        # the one line ``launcher bench --help`` shows
    run: Callable[[Any, argparse.Namespace], int]  # (settings, parsed arguments) -> exit code
    # Flags beyond the settings, e.g. the run flags a benchmark hands on to `launcher run`'s spec.
    more_flags: Callable[[argparse.ArgumentParser], None] | None = None


BENCHMARKS: dict[str, Benchmark] = {}


def benchmark(name: str, settings: type, *, help: str,
              more_flags: Callable[[argparse.ArgumentParser], None] | None = None):
    """Register the decorated ``run(settings, args) -> exit code`` as ``launcher bench NAME``."""
    def register(run: Callable[[Any, argparse.Namespace], int]):
        if name in BENCHMARKS:
            raise ValueError(f"benchmark {name!r} is registered twice")
        BENCHMARKS[name] = Benchmark(name, settings, help, run, more_flags)
        return run
    return register


def names(flag: str, given: Iterable[str], valid: Iterable[str]) -> list[str]:
    """``given`` (each once, in order), each a name in ``valid``: a registry of the implementation's."""
    valid, given = list(valid), list(dict.fromkeys(given))
    bad = [n for n in given if n not in valid]
    if bad:
        raise UserError(f"{flag}: unknown {', '.join(bad)}", f"valid: {', '.join(valid)}")
    return given


def shared(cls: type, settings: Any, **changes: Any) -> Any:
    """A benchmark's own ``Settings`` (its Python API) from the declared ``settings``: the fields
    both have, then ``changes``."""
    return cls(**{**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)
                     if hasattr(settings, f.name)}, **changes})


def note(text: str) -> None:
    """Progress, on stderr (the table goes to stdout)."""
    print(text, file=sys.stderr, flush=True)


def wrote(paths: list[str]) -> None:
    for path in paths:
        print(f"wrote {path}")


def load_line(when: str, values: Iterable[float]) -> str:
    return f"# load average (1, 5, 15 min) {when}: " + " ".join(f"{v:.2f}" for v in values)
