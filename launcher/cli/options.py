"""What the commands share: exit codes, the parser class, and the run flags.

The run flags (``launcher run``, ``launcher submit``, and later ``tune``) are
generated from :class:`~launcher.spec.JobSpec`'s declaration, so a new spec
field is a new flag and YAML key at once. :func:`spec_from_args` turns the
parsed flags (over an optional ``--config`` YAML) into a validated spec.
"""

from __future__ import annotations

import argparse

from launcher import schema
from launcher.errors import UserError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CANCELLED = 0, 1, 2, 130


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}", f"see `{self.prog} --help`")


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """-v after the command too (``launcher run -v``), not only before it."""
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show Ray's logs and full tracebacks")


def add_run_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """``--config``, one flag per JobSpec field (except ``skip``) and ``--param KEY=VALUE``."""
    from launcher.spec import JobSpec  # imports the workload registry: only for the commands that run

    parser.add_argument("--config", help="job spec YAML; flags override its values")
    schema.add_flags(parser, JobSpec, skip=skip)
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="workload parameter, e.g. --param image_size=64 (repeatable)")


def spec_from_args(args: argparse.Namespace):
    """The YAML file (if any) first, then the flags that were given; a validated JobSpec."""
    from launcher.spec import JobSpec, load_spec_file

    spec = load_spec_file(args.config) if args.config else JobSpec()
    overrides = schema.given_flags(args, JobSpec)
    if args.param:
        overrides["params"] = parse_params(args.param, spec.params)
    return spec.merged(overrides).validated()


def parse_params(items: list[str], base: dict | None = None) -> dict:
    """``--param KEY=VALUE`` items over ``base`` (values stay strings: the workload converts them)."""
    params = dict(base or {})
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--param {item!r} is not KEY=VALUE", "for example --param image_size=64")
        params[key.strip()] = value.strip()
    return params
