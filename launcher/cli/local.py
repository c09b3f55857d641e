"""``launcher up`` / ``launcher down``: a warm local Ray head that ``launcher run`` reuses."""

from __future__ import annotations

import argparse
import sys

from launcher.cli.options import EXIT_OK
from launcher.errors import UserError


def add_parsers(sub) -> None:
    up = sub.add_parser("up", help="start a warm local Ray head that `launcher run` uses until `launcher down`")
    up.add_argument("--num-cpus", type=int, default=None,
                    help="logical CPUs of the head (default: 4 per core, as many as a run without the head may "
                    "give its own Ray, so the head takes every such run)")
    up.add_argument("--port", type=int, default=6390, help="the head's GCS port on 127.0.0.1 (default 6390)")
    up.add_argument("--pool-minutes", type=float, default=None,
                    help="after each run, keep worker processes with its framework imported for this long, "
                    "ready for the next run of the same framework (default 10; 0: none). Each holds memory "
                    "(about 0.4 GB for torch) while it waits")
    sub.add_parser("down", help="stop the warm local Ray head started by `launcher up`")


def cmd_up(args: argparse.Namespace) -> int:
    from launcher.driver import localhead

    if args.num_cpus is not None and args.num_cpus < 1:
        raise UserError(f"--num-cpus must be >= 1, got {args.num_cpus}")
    if args.pool_minutes is not None and not 0 <= args.pool_minutes <= 24 * 60:
        raise UserError(f"--pool-minutes must be between 0 and 1440, got {args.pool_minutes:g}",
                        "0 keeps no processes between runs")
    pool_s = None if args.pool_minutes is None else round(args.pool_minutes * 60)
    state = localhead.up(args.num_cpus, args.port, pool_s=pool_s,
                         note=lambda message: print(message, file=sys.stderr, flush=True))
    verb = "already running" if state.get("already_running") else "started"
    print(f"warm local Ray {verb} at {state['address']} with {state['num_cpus']} CPUs; "
          "`launcher run` uses it until `launcher down`")
    return EXIT_OK


def cmd_down(args: argparse.Namespace) -> int:
    from launcher.driver import localhead

    stopped = localhead.down(note=lambda message: print(message, file=sys.stderr, flush=True))
    print("stopped the warm local Ray" if stopped else "no warm local Ray was running")
    return EXIT_OK


COMMANDS = {"up": cmd_up, "down": cmd_down}
