"""``launcher bench NAME``: a subcommand per registered benchmark (:mod:`launcher.cli.bench_registry`),
its flags derived from its declaration (plus ``--out``); it is called with its settings, a bad
value refused first in one line (exit 2)."""

from __future__ import annotations

import argparse
from typing import Any

from launcher import flags
from launcher.cli import bench_training, bench_systems  # noqa: F401, I001 (registers them, in this order)
from launcher.cli.bench_registry import BENCHMARKS, OUT, OUT_HELP
from launcher.cli.options import Parser


def add_parsers(sub) -> None:
    """Add ``bench`` and a subcommand for each registered benchmark."""
    bench = sub.add_parser("bench", help=f"benchmarks ({', '.join(BENCHMARKS)})")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", parser_class=Parser, required=True)
    for b in BENCHMARKS.values():
        parser = bench_sub.add_parser(b.name, help=b.help)
        flags.add_flags(parser, b.settings, switches=True)
        if b.more_flags:
            b.more_flags(parser)
        parser.add_argument("--out", default=OUT, help=OUT_HELP)


def settings(args: argparse.Namespace) -> Any:
    """The settings of the benchmark ``args`` names, from its flags (UserError: a bad value)."""
    return flags.from_flags(BENCHMARKS[args.bench_command].settings, args)


def cmd_bench(args: argparse.Namespace) -> int:
    return BENCHMARKS[args.bench_command].run(settings(args), args)


COMMANDS = {"bench": cmd_bench}
