"""``launcher cluster ...``: Compute Engine cluster files, preflight, up/down, rehearsal, preemption history.

Ray stays the provisioner: ``cluster up`` runs the preflight and then Ray's own
``ray up``, and when that fails deletes the VMs it made (:mod:`cluster.cleanup`);
``cluster down`` runs ``ray down`` and then deletes the cluster's VMs it left
(stopped ones: Ray's provider stops rather than deletes with
``cache_stopped_nodes``, and preempted workers are stopped by Compute Engine)
and its disks no VM uses, and with ``--purge`` what Ray's bootstrap added to
the project.
``cluster rehearse`` runs Ray's GCP provider against a local Compute Engine API
(:mod:`launcher.lab.rehearsal`).
Everything else is a library call into :mod:`cluster`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from cluster.spec import ClusterSpec
from launcher import __version__, _deferred, flags, schema
from launcher.cli.options import EXIT_FAILED, EXIT_OK, Parser
from launcher.errors import LauncherError, UserError

PROJECT_ENVS = ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT")

def add_parsers(sub) -> None:
    """Add `launcher cluster ACTION` to the top-level subparsers."""
    cluster = sub.add_parser("cluster", help="Compute Engine: cluster file, preflight, up/down, preemptions")
    actions = cluster.add_subparsers(dest="cluster_command", metavar="ACTION", parser_class=Parser,
                                     required=True)
    cfg = actions.add_parser("config", help="write a Ray cluster file for GCP on stdout (> cluster.yaml)")
    cfg.add_argument("--spec", help="cluster spec YAML (keys as the flags, e.g. max_workers: 4); flags win")
    flags.add_flags(cfg, ClusterSpec)
    cfg.add_argument("-o", "--output", help="write to this file instead of stdout")

    pre = actions.add_parser("preflight", help="check a cluster file against the project before `ray up`")
    pre.add_argument("cluster_file")
    pre.add_argument("--bucket", help="gs://BUCKET[/PREFIX] the runs will use: exists, in the cluster's region")
    pre.add_argument("--json", action="store_true")

    up = actions.add_parser("up", help="preflight, then `ray up -y CLUSTER_FILE`")
    up.add_argument("cluster_file")
    up.add_argument("--bucket", help="also check this gs:// bucket (see preflight)")
    up.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    up.add_argument("--skip-preflight", action="store_true", help="go straight to `ray up`")
    up.add_argument("--keep-on-failure", action="store_true", help="when `ray up` fails, keep the VMs it made (to "
                    "look at them) and say what they bill; by default they are deleted")

    down = actions.add_parser("down", help="`ray down -y CLUSTER_FILE`, then delete the cluster's VMs it left "
                              "(stopped ones too)")
    down.add_argument("cluster_file")
    down.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    down.add_argument("--purge", action="store_true", help="also remove what Ray's bootstrap added to the project: "
                      "this machine's SSH key in its metadata and the service account ray-autoscaler-sa-v1 with its "
                      "roles (only when no Ray cluster VM is left in the project)")

    rh = actions.add_parser("rehearse", help="rehearse `ray up`/`ray down` of a cluster file: Ray's GCP provider "
                            "against a local Compute Engine API that checks each request (no cloud needed)")
    rh.add_argument("cluster_file")
    rh.add_argument("--quota", action="append", default=[], metavar="METRIC=N",
                    help="a quota of the local API, e.g. NVIDIA_T4_GPUS=4 or GPUS_ALL_REGIONS=0 (repeatable; "
                         "default: no limits)")
    rh.add_argument("--up", action="store_true",
                    help="the whole path on this machine: the real `ray up` over SSH to a loopback sshd (the head "
                         "VM), setup commands and ray start, a 1-epoch run checkpointing to the Cloud Storage "
                         "emulator, `ray status`, `ray down` (a few minutes; needs openssh-server and rsync)")
    rh.add_argument("--stockout", action="append", default=[], metavar="MACHINE_TYPE",
                    help="the zone has none of this machine type (`all`: of any): its inserts fail as Compute "
                         "Engine's do, with ZONE_RESOURCE_POOL_EXHAUSTED (repeatable)")
    rh.add_argument("--fail-head-setup", action="store_true",
                    help="with --up: the head's setup fails (an extra command exits 1), to see `launcher cluster up` "
                         "delete what it made")
    rh.add_argument("--worker", action="store_true",
                    help="with --up: one worker VM (a second loopback sshd) is launched by the head's autoscaler, "
                         "set up over SSH and joins the head's Ray, as a real worker does")
    rh.add_argument("--fresh-install", action="store_true",
                    help="with --up: the head VM starts without this project's venv, as a new VM does: its setup "
                         "commands install uv, Python 3.11 and the pinned packages (minutes, a few GB of downloads "
                         "from this machine's package sources), and each step's time is printed")

    guard = actions.add_parser("setup-guard", help="on a cluster's head (its file starts it): when N worker VMs "
                               "of a type in a row fail their setup, stop Ray launching more of that type")
    guard.add_argument("--max-failures", type=int, default=3, help="failed setups in a row (default 3)")
    guard.add_argument("--config", default="~/ray_bootstrap_config.yaml", help="the autoscaler's cluster file")
    guard.add_argument("--log", help="the autoscaler's log (default: monitor.log of the head's Ray session)")

    pe = actions.add_parser("preemptions", help="list the preemptions of a cluster's VMs, with times")
    pe.add_argument("--project", help="project id (default: GOOGLE_CLOUD_PROJECT)")
    pe.add_argument("--zone", required=True)
    pe.add_argument("--cluster", help="cluster name: only its VMs (ray-NAME-...); default all VMs of the zone")
    pe.add_argument("--json", action="store_true")


def cmd_cluster(args: argparse.Namespace) -> int:
    if args.cluster_command in ("preflight", "up", "down", "preemptions") and not getattr(args, "dry_run", False):
        _deferred.require("cluster", f"`launcher cluster {args.cluster_command}`")  # Compute Engine's clients
    return {"config": _config, "preflight": _preflight, "up": _up, "down": _down, "rehearse": _rehearse,
            "preemptions": _preemptions, "setup-guard": _setup_guard}[args.cluster_command](args)


def spec_from_args(args: argparse.Namespace):
    """Preset, then the --spec file, then flags; validated."""
    values = schema.load_mapping(args.spec, "--spec", "zone: ..., max_workers: ...") if args.spec else {}
    source = args.spec or "spec"
    if args.preset:  # the preset decides the base values, so it must be known before the rest
        values["preset"] = args.preset
    spec = ClusterSpec.from_mapping(values, source)
    overrides = flags.given_flags(args, ClusterSpec)
    if spec.project is None and overrides.get("project") is None:
        overrides["project"] = _env_project()
    # The source goes to the nodes to be installed, or for scripts/install-horovod.
    if (spec.install is None and overrides.get("install") is None) or spec.horovod or overrides.get("horovod"):
        overrides["source_dir"] = _deferred.checkout()
    return spec.merged(overrides).validated()


def _config(args: argparse.Namespace) -> int:
    from cluster.config import TENSORFLOW_ON_GPU, ray_cluster_config, setup_notes, to_yaml

    spec = spec_from_args(args)
    text = to_yaml(ray_cluster_config(spec, __version__), spec, __version__)
    if TENSORFLOW_ON_GPU in setup_notes(spec):
        print(f"note: {TENSORFLOW_ON_GPU}", file=sys.stderr)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.output}; next: launcher cluster preflight {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _preflight(args: argparse.Namespace) -> int:
    from cluster.preflight import FAIL, format_checks

    checks = run_preflight(args.cluster_file, args.bucket)
    if args.json:
        print(json.dumps([c.__dict__ for c in checks], indent=1))
    else:
        print(format_checks(checks))
    return EXIT_FAILED if any(c.status == FAIL for c in checks) else EXIT_OK


def run_preflight(cluster_file: str, bucket: str | None):
    from cluster.compute import Compute
    from cluster.preflight import run_checks

    config = schema.load_yaml(cluster_file, "cluster file")
    if not isinstance(config, dict):
        raise UserError(f"{cluster_file}: not a Ray cluster file (expected a mapping)")
    project = (config.get("provider") or {}).get("project_id") or ""
    return run_checks(config, Compute(project), bucket)


def _up(args: argparse.Namespace) -> int:
    from cluster.preflight import FAIL, format_checks

    command = [_ray(), "up", "-y", args.cluster_file]
    if args.dry_run:
        if not args.skip_preflight:
            print(f"would run: launcher cluster preflight {shlex.quote(args.cluster_file)}"
                  + (f" --bucket {shlex.quote(args.bucket)}" if args.bucket else ""))
        print("would run: " + shlex.join(command))
        print("and if it fails: " + ("keep the VMs it made and say what they bill" if args.keep_on_failure
                                     else "delete the VMs it made"))
        return EXIT_OK
    project, zone, name = _where(schema.load_yaml(args.cluster_file, "cluster file"))
    if not args.skip_preflight:
        checks = run_preflight(args.cluster_file, args.bucket)
        print(format_checks(checks), flush=True)
        if any(c.status == FAIL for c in checks):
            print("not starting the cluster: fix the failed checks (or pass --skip-preflight)", file=sys.stderr)
            return EXIT_FAILED
    before = _vm_names(project, zone, name)
    try:
        rc = _run(command)
    except KeyboardInterrupt:
        rc = 130
    if rc != 0 and before is not None:
        from cluster.cleanup import after_failed_up
        from cluster.compute import Compute

        after_failed_up(Compute(project), zone, name, before, args.keep_on_failure, print, args.cluster_file)
    elif rc != 0:
        print(f"`ray up` failed; check what it left: gcloud compute instances list --project {project} "
              f"--filter labels.ray-cluster-name={name}", file=sys.stderr)
    return rc


def _where(config) -> tuple[str, str, str]:
    provider = (config.get("provider") or {}) if isinstance(config, dict) else {}
    return (str(provider.get("project_id") or ""), str(provider.get("availability_zone") or ""),
            str(config.get("cluster_name") or "") if isinstance(config, dict) else "")


def _vm_names(project: str, zone: str, name: str) -> set[str] | None:
    """The cluster's VMs before `ray up`, so a failure deletes only what it made; None: cannot tell."""
    from cluster.compute import Compute

    if not (project and zone and name):
        return None
    try:
        return {vm.name for vm in Compute(project).instances(zone, name)}
    except LauncherError as exc:
        print(f"warning: cannot list cluster {name}'s VMs ({exc.what}): if `ray up` fails, what it made is not "
              "deleted", file=sys.stderr)
        return None


def _down(args: argparse.Namespace) -> int:
    config = schema.load_yaml(args.cluster_file, "cluster file")  # a clear error for a missing file, before Ray's
    command = [_ray(), "down", "-y", args.cluster_file]
    project, zone, name = _where(config)
    where = f"labelled ray-cluster-name={name} in {zone}"
    if args.dry_run:
        print("would run: " + shlex.join(command))
        if project and zone and name:
            print(f"would then delete the VMs {where} that it left (stopped ones included), and the cluster's "
                  "disks no VM uses" + ("; then Ray's SSH key and service account" if args.purge else ""))
        return EXIT_OK
    rc = _run(command)
    if project and zone and name:
        _delete_left(project, zone, name, where)
        if args.purge:
            from cluster.bootstrap import ProjectApis
            from cluster.cleanup import purge_bootstrap
            from cluster.compute import Compute

            region = str((config.get("provider") or {}).get("region") or zone.rsplit("-", 1)[0])
            user = str((config.get("auth") or {}).get("ssh_user") or "ubuntu")
            if not purge_bootstrap(Compute(project), ProjectApis(project), region, user, print):
                rc = rc or EXIT_FAILED
    return rc


def _delete_left(project: str, zone: str, name: str, where: str) -> None:
    """`ray down` lists running VMs only: delete the cluster's stopped ones too, then its detached disks."""
    from cluster.compute import Compute, delete_left_disks, delete_left_vms

    try:
        compute = Compute(project)
        left = delete_left_vms(compute, zone, name)
        disks = delete_left_disks(compute, zone, name)
    except LauncherError as exc:  # no credentials, no permission, no answer: say so, `ray down` has run
        print(f"warning: could not look for VMs {where} left after `ray down` ({exc.what}); check with: "
              f"gcloud compute instances list --project {project} --filter labels.ray-cluster-name={name}",
              file=sys.stderr)
        return
    if left:
        print(f"deleted {len(left)} VM(s) {where} that `ray down` left (their auto-delete disks with them):")
        for vm in left:
            print(f"  {vm.name} ({vm.status})")
    else:
        print(f"no VMs {where} left")
    if disks:
        print(f"deleted {len(disks)} disk(s) of cluster {name} that no VM used: "
              + ", ".join(f"{d.name} ({d.size_gb} GB {d.type})" for d in disks))


def _rehearse(args: argparse.Namespace) -> int:
    from launcher.lab.rehearsal import refusal_error, rehearse

    config = schema.load_yaml(args.cluster_file, "cluster file")
    stockout = tuple("*" if m == "all" else m for m in args.stockout)
    if args.up:
        return _rehearse_up(config, parse_quotas(args.quota), stockout, args.fail_head_setup, args.fresh_install,
                            args.worker)
    for flag in ("fail_head_setup", "fresh_install", "worker"):
        if getattr(args, flag):
            raise UserError(f"--{flag.replace('_', '-')} needs --up (the head's setup runs only there)", "add --up")
    try:
        report = rehearse(config, parse_quotas(args.quota), stockout=stockout)
    except UserError as exc:  # the file cannot be rehearsed (or would be refused before any request)
        raise UserError(f"{args.cluster_file}: {exc.what}", exc.fix) from None
    if report.refused:
        raise refusal_error(args.cluster_file, report)
    if report.left:
        raise LauncherError(f"the rehearsal left {', '.join(report.left)} in the local API", "a bug: please report it")
    return EXIT_OK


def _rehearse_up(config: dict, quotas: dict[str, float], stockout: tuple[str, ...], fail_setup: bool,
                 fresh: bool = False, join: bool = False) -> int:
    from launcher.lab.gcs_emulator import Emulator
    from launcher.lab.ray_up import rehearse_up
    from launcher.lab.up_report import create_bucket

    with tempfile.TemporaryDirectory(prefix="launcher-rehearsal-gcs-") as folder:
        emulator = Emulator(folder).start()
        try:
            create_bucket(emulator.url, "launcher-rehearsal")
            print(f"Cloud Storage emulator at {emulator.url}, bucket gs://launcher-rehearsal", flush=True)
            report = rehearse_up(config, emulator.url, "launcher-rehearsal", quotas,
                                 say=lambda line: print(line, flush=True), stockout=stockout,
                                 fail_head_setup=fail_setup, fresh=fresh, join=join)
        finally:
            emulator.stop()
    if not report.ok:
        raise LauncherError("the rehearsal's run or teardown did not end clean (see the summary above)")
    return EXIT_OK


def parse_quotas(values: list[str]) -> dict[str, float]:
    """``["NVIDIA_T4_GPUS=4", ...]`` -> ``{"NVIDIA_T4_GPUS": 4.0}``."""
    quotas = {}
    for value in values:
        metric, _, limit = value.partition("=")
        try:
            quotas[metric.strip().upper()] = float(limit)
        except ValueError:
            raise UserError(f"--quota {value}: not METRIC=N", "write e.g. --quota NVIDIA_T4_GPUS=4") from None
        if not metric.strip() or quotas[metric.strip().upper()] < 0:
            raise UserError(f"--quota {value}: not METRIC=N", "write e.g. --quota NVIDIA_T4_GPUS=4") from None
    return quotas


def _setup_guard(args: argparse.Namespace) -> int:
    from cluster.setup_guard import watch

    watch(args.max_failures, args.config, args.log, say=lambda line: print(line, flush=True))
    return EXIT_OK


def _preemptions(args: argparse.Namespace) -> int:
    from cluster.compute import Compute

    project = args.project or _env_project()
    if not project:
        raise UserError("no Google Cloud project given", "pass --project PROJECT_ID (or set GOOGLE_CLOUD_PROJECT)")
    prefix = f"ray-{args.cluster}-" if args.cluster else ""
    found = Compute(project).preemptions(args.zone, prefix)
    if args.json:
        print(json.dumps([p.__dict__ for p in found], indent=1))
        return EXIT_OK
    who = f"cluster {args.cluster}" if args.cluster else "all VMs"
    if not found:
        print(f"no preemptions of {who} in {args.zone} (Compute Engine keeps operations for a limited time)")
        return EXIT_OK
    print(f"{len(found)} preemption(s) of {who} in {args.zone}:")
    print(f"  {'time':<31} instance")
    for p in found:
        print(f"  {p.time:<31} {p.instance}")
    return EXIT_OK


def _ray() -> str:
    """The `ray` command of this Python environment (so `ray up` uses the pinned Ray)."""
    here = os.path.join(os.path.dirname(sys.executable), "ray")
    return here if os.path.exists(here) else "ray"


def _run(command: list[str]) -> int:
    print("running: " + shlex.join(command), flush=True)
    try:
        return subprocess.call(command)
    except FileNotFoundError:
        raise UserError(f"{command[0]} not found", "install Ray's CLI: pip install 'ray[default]==2.60.0'") from None


def _env_project() -> str | None:
    return next((os.environ[e] for e in PROJECT_ENVS if os.environ.get(e)), None)


COMMANDS = {"cluster": cmd_cluster}
