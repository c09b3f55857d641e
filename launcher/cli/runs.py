"""``launcher runs``: the runs under a storage root, or one run with its checkpoints, from their run logs."""

from __future__ import annotations

import argparse
import json
import os

from launcher.cli.options import EXIT_OK
from launcher.errors import UserError
from launcher.storage import Storage
from launcher.storage.uri import DEFAULT_STORAGE, normalize_storage


def add_parsers(sub) -> None:
    runs = sub.add_parser("runs", help="list the runs under a storage root, or show one run")
    runs.add_argument("name", nargs="?", metavar="NAME",
                      help="show this run only, with the checkpoints it keeps")
    runs.add_argument("--storage", default=DEFAULT_STORAGE, help="storage root: a folder or gs://BUCKET/PREFIX "
                      f"(default {DEFAULT_STORAGE})")
    runs.add_argument("--json", action="store_true")


def cmd_runs(args: argparse.Namespace) -> int:
    from launcher.storage.runs import describe_run, format_run, format_table, list_runs

    storage = Storage.resolve(normalize_storage(args.storage))
    if storage.is_local and not os.path.isdir(storage.root):
        raise UserError(f"--storage {args.storage}: no such folder ({storage.root})",
                        "give the folder your runs went to (`launcher run --storage`), ./runs by default")
    if args.name:
        run = describe_run(storage, args.name)
        if run is None:
            raise UserError(f"no run {args.name} under {storage.uri}",
                            "`launcher runs` lists the runs there; --storage names another root")
        print(json.dumps(run.to_json(), indent=1) if args.json else format_run(run))
        return EXIT_OK
    runs = list_runs(storage)
    print(json.dumps([r.to_json() for r in runs], indent=1) if args.json else format_table(runs))
    return EXIT_OK


COMMANDS = {"runs": cmd_runs}
