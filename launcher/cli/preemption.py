"""``launcher preemption ...`` and ``launcher bench preemption``: the command-line side of
:mod:`launcher.preemption.watcher` and :mod:`launcher.lab.chaos`.

* ``preemption watch`` runs on each Spot/preemptible node (the cluster file
  starts it): it waits for GCE's notice and drains the node's Ray node.
* ``preemption demo`` tries the whole path on this machine: a local
  autoscaling multi-node cluster, a simulated notice (or a node lost without one), and
  the run's summary showing what it cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time

from launcher import flags
from launcher.cli.options import (EXIT_FAILED, EXIT_OK, Parser, add_program_flags, add_run_flags, program_from_args,
                                  program_spec, spec_from_args, wants_job_dir)
from launcher.cli.run import format_summary
from launcher.errors import UserError


def add_parsers(sub) -> None:
    pre = sub.add_parser("preemption", help="GCE preemption: the node watcher, and a local demo")
    pre_sub = pre.add_subparsers(dest="preemption_command", metavar="ACTION", parser_class=Parser,
                                 required=True)
    w = pre_sub.add_parser("watch", help="wait for GCE's preemption notice and drain this node's Ray node")
    w.add_argument("--address", default=None, help="Ray cluster (GCS) address (default: RAY_ADDRESS, or the "
                   "Ray node running on this machine)")
    w.add_argument("--node-id", default=None, help="hex id of the Ray node to drain (default: the alive node "
                   "whose IP is this machine's)")
    w.add_argument("--deadline-margin-s", type=float, default=5.0,
                   help="drain deadline this many seconds before GCE's hard power-off (default 5)")
    w.add_argument("--notice-s", type=float, default=30.0, help="seconds from notice to power-off (GCE: 30)")
    w.add_argument("--metadata-host", default=None,
                   help="metadata server host[:port] (default: GCE_METADATA_HOST or metadata.google.internal)")

    d = pre_sub.add_parser("demo", help="train on a local multi-node cluster and preempt a node mid-run: any "
                           "code launcher run takes (a workload, your training function, --script, --package)")
    add_run_flags(d, skip=("address",))
    add_program_flags(d)
    d.add_argument("--without-notice", action="store_true", help="lose the node without a notice instead")
    d.add_argument("--notice-s", type=float, default=6.0,
                   help="simulated notice length in seconds (GCE: 30; shorter keeps the demo quick)")
    d.add_argument("--boot-s", type=float, default=0.0,
                   help="the replacement node comes up this long after the autoscaler asks (GCE: minutes; "
                   "default 0)")
    d.add_argument("--preempt-after-s", type=float, default=None,
                   help="preempt this long after the launch (default: once the run's first step checkpoint is "
                   "stored; a --script or --package keeps its checkpoints to itself: 30 s)")
    d.add_argument("--json", action="store_true", help="print the run's summary as JSON")


DEMO_DEFAULTS = {"epochs": 16, "checkpoint_every_steps": 10}  # a run long enough to preempt, checkpoints often
PROGRAM_PREEMPT_AFTER_S = 30.0


def _log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} launcher preemption watch: {text}", file=sys.stderr, flush=True)


def cmd_preemption(args: argparse.Namespace) -> int:
    if args.preemption_command == "demo":
        return _demo(args)
    from launcher.preemption import drain

    stop = threading.Event()
    # SIGTERM (node shutdown, systemd stop) ends the watch quietly.
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
        outcome = drain.watch(address, node_id=args.node_id, host=args.metadata_host,
                                   notice_s=args.notice_s, margin_s=args.deadline_margin_s, log=_log, stop=stop)
    finally:
        signal.signal(signal.SIGTERM, previous)
    _log(f"done ({outcome})")
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from launcher.lab.autoscaling import AutoscalingLab
    from launcher.lab.chaos import run_in_background

    if args.notice_s < 3:
        raise UserError(f"--notice-s must be >= 3, got {args.notice_s:g}",
                        "the workers need a moment to see the notice and checkpoint")
    if args.boot_s < 0:
        raise UserError(f"--boot-s must be 0 or more, got {args.boot_s:g}")
    if args.preempt_after_s is not None and args.preempt_after_s < 0:
        raise UserError(f"--preempt-after-s must be 0 or more, got {args.preempt_after_s:g}")

    def note(text: str) -> None:  # one write per line: the lab's threads note too, and print() writes twice
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    spec, program = demo_spec(args)  # checked before the lab starts; its address is filled in once it is up
    nodes = max(2, spec.workers)
    note(f"starting a local Ray cluster: a head and {nodes} worker nodes from Ray's autoscaler, each with a fake "
         "GCE metadata server and the preemption watcher")
    with AutoscalingLab(nodes=nodes, notice_s=args.notice_s, margin_s=min(2.0, args.notice_s / 3),
                        boot_s=args.boot_s, note=note) as lab:
        spec = dataclasses.replace(spec, address=lab.address)
        run = run_in_background(spec, note, program=program, program_args=args.program_args,
                                job_dir=wants_job_dir(args, program))
        try:
            if args.preempt_after_s is not None or program is not None:
                run.wait_for_training(args.preempt_after_s if args.preempt_after_s is not None
                                      else PROGRAM_PREEMPT_AFTER_S)
            else:
                run.wait_for_checkpoint(lambda m: m.global_step >= (spec.checkpoint_every_steps or 1))
        except RuntimeError:
            if run.running:
                raise
            summary = run.wait()
            print(format_summary(summary), file=sys.stderr)
            raise UserError(f"run {spec.name} ended before the preemption ({summary.status}): nothing was "
                            "preempted", "train longer (--epochs, or the program's own arguments) or lower "
                            "--preempt-after-s") from None
        if args.without_notice:
            note("demo: removing a worker node without notice")
            lab.kill(0)
        else:
            note("demo: GCE announces the preemption of a worker node (instance/preempted = TRUE)")
            lab.preempt(0)
        summary = run.wait()
    print(json.dumps(summary.to_json(), sort_keys=True, default=str) if args.json else format_summary(summary))
    if program is not None:
        return run.exit_code if run.exit_code is not None else EXIT_FAILED
    return EXIT_OK if summary.succeeded else EXIT_FAILED


def demo_spec(args: argparse.Namespace):
    """The demo's run as ``launcher run`` would build it from the same flags (the demo's own defaults
    where a flag is not given), and the program it runs (None: a workload or training function)."""
    program = program_from_args(args)
    spec = program_spec(args, program) if program is not None else spec_from_args(args)
    given = flags.given_flags(args, type(spec))
    defaults = {k: v for k, v in DEMO_DEFAULTS.items() if k not in given and program is None}
    if "name" not in given and program is None:
        defaults["name"] = time.strftime("preemption_demo_%Y%m%d_%H%M%S")
    if "max_failures" not in given:
        defaults["max_failures"] = 1 if args.without_notice else 0  # a lost node is a failure; a notice is not
    return (spec.merged(defaults).validated() if defaults else spec), program


COMMANDS = {"preemption": cmd_preemption}
