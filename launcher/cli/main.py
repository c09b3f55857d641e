"""The ``launcher`` command line: parse, dispatch to a command group, map errors to exit codes.

``main(argv)`` returns the exit code, so tests and notebooks can call it.
Bad input prints one line on stderr (what, why, how to fix) and exits 2; a
service that does not answer, or a run that fails, exits 1; an interrupted
run exits 130. --verbose adds tracebacks.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Sequence

from launcher import __version__, _deferred
from launcher.cli import bench, checkpoint, cluster, data, doctor, jobs, local, predict, preemption, run, runs, tune
from launcher.cli.options import EXIT_CANCELLED, EXIT_USAGE, Parser
from launcher.driver import startup
from launcher.errors import LauncherError

# In the order `launcher --help` lists them.
GROUPS = (run, tune, predict, runs, checkpoint, local, bench, preemption, data, cluster, jobs, doctor)
COMMANDS = {name: handler for group in GROUPS for name, handler in group.COMMANDS.items()}
# Commands that use the warm local head (`launcher up`) when given no --address.
WARM_HEAD_USERS = ("run", "tune", "predict", "serve")


def build_parser() -> Parser:
    p = Parser(prog="launcher", description="Distributed deep-learning training on Ray, "
               "from a laptop to a Compute Engine cluster.")
    p.add_argument("--version", action="version", version=f"launcher {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="show Ray's logs and full tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for group in GROUPS:
        group.add_parsers(sub)
    return p


def _exit_now(code: int) -> None:
    """End a finished ``launcher run`` process without the interpreter's clean-up.

    Everything is written and Ray is shut down by now; tearing down the modules
    Ray, pyarrow and friends loaded takes another ~0.6 s on a 2-core machine.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    argv_given = argv
    if argv is None:  # a real command line: time the process from its start
        startup.begin_cli()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    verbose = "-v" in argv or "--verbose" in argv
    args = None
    try:
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return EXIT_USAGE
        if args.command in WARM_HEAD_USERS:
            from launcher.driver import localhead

            localhead.warm_head_for(getattr(args, "address", None))  # before anything imports Ray
        code = COMMANDS[args.command](args)
        if argv_given is None and args.command == "run":
            _exit_now(code)
        return code
    except (LauncherError, ModuleNotFoundError) as exc:  # UserError: exit 2; Unreachable: exit 1
        if verbose:
            traceback.print_exc()
        if isinstance(exc, ModuleNotFoundError):  # a library of an extra that is not installed: name it
            extra = _deferred.extra_of(exc.name or "")
            if extra is None or args is None:
                raise
            exc = _deferred.extra_error(exc.name, extra, _command(args))
        # One line, whatever a library put into the message.
        print("error: " + " ".join(line.strip() for line in str(exc).splitlines() if line.strip()), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # a command may say what the interruption left behind
        print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
        return EXIT_CANCELLED


def _command(args) -> str:
    """``launcher cluster rehearse``: the command and its action, as typed."""
    action = getattr(args, f"{args.command}_command", None)
    return f"`launcher {args.command}{' ' + action if isinstance(action, str) else ''}`"
