"""``launcher runs``: the runs under a storage root, or one run with its checkpoints, from their run logs;
``--compare`` puts runs side by side and ``--plot`` draws a metric over the steps."""

from __future__ import annotations

import argparse
import json
import os

from launcher.cli.options import EXIT_OK
from launcher.errors import UserError
from launcher.storage import Storage
from launcher.storage.runs import format_run, format_table, list_runs
from launcher.storage.uri import DEFAULT_STORAGE, normalize_storage


def add_parsers(sub) -> None:
    runs = sub.add_parser("runs", help="list the runs under a storage root, show one run, or compare runs")
    runs.add_argument("name", nargs="?", metavar="NAME",
                      help="show this run only, with the checkpoints it keeps")
    runs.add_argument("--storage", default=DEFAULT_STORAGE, help="storage root: a folder or gs://BUCKET/PREFIX "
                      f"(default {DEFAULT_STORAGE})")
    runs.add_argument("--compare", nargs="+", metavar="RUN",
                      help="these runs side by side: the parameters that differ and the final metrics, "
                           "and a plot of --plot METRIC (default: the loss) over the steps")
    runs.add_argument("--plot", metavar="METRIC",
                      help="draw METRIC over the steps (NAME or --compare) to a PNG; 'time': where each "
                           "epoch's time went; 'usage': each worker's CPU and memory (launcher.cli.runviews)")
    runs.add_argument("--out", metavar="PNG", help="where the plot goes (default: NAME-METRIC.png here)")
    runs.add_argument("--json", action="store_true")


def cmd_runs(args: argparse.Namespace) -> int:
    from launcher.cli.runviews import compare, plot_run, run_named

    storage = Storage.resolve(normalize_storage(args.storage))
    if storage.is_local and not os.path.isdir(storage.root):
        raise UserError(f"--storage {args.storage}: no such folder ({storage.root})",
                        "give the folder your runs went to (`launcher run --storage`), ./runs by default")
    if args.compare:
        return compare(storage, [*([args.name] if args.name else []), *args.compare], args)
    if args.name:
        run = run_named(storage, args.name)
        if args.plot:
            print(f"wrote {plot_run(storage, args.name, args.plot, args.out)}")
            return EXIT_OK
        print(json.dumps(run.to_json(), indent=1) if args.json else format_run(run))
        return EXIT_OK
    if args.plot:
        raise UserError(f"--plot {args.plot} needs a run: name it (`launcher runs NAME --plot {args.plot}`) "
                        "or give --compare RUN ...", "`launcher runs` lists the runs")
    runs = list_runs(storage)
    print(json.dumps([r.to_json() for r in runs], indent=1) if args.json else format_table(runs))
    return EXIT_OK


COMMANDS = {"runs": cmd_runs}
