"""What a rehearsal of ``ray up`` saw (:class:`UpReport`) and how it is said, and the parts it
reads the outcome with: the Cloud Storage emulator's checkpoints and the rehearsal's Ray
processes left on this machine. The rehearsal itself: :mod:`launcher.lab.ray_up`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from launcher.lab.compute_api import Call
from launcher.lab.up_copy import ON_WORKER


@dataclass
class UpReport:
    """What the up -> run -> down rehearsal saw."""

    stages: list[tuple[str, float]] = field(default_factory=list)
    commands: list[tuple[str, str]] = field(default_factory=list)  # (command, "ran" | "skipped: why" | ...)
    job_status: str = ""
    checkpoints: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # VMs, then disks
    ray_left: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    steps: list[tuple[str, float, int]] = field(default_factory=list)  # the head's setup: (command, s, exit)
    worker_steps: list[tuple[str, float, int]] = field(default_factory=list)  # the worker VM's, when one joins
    join: str = ""  # the worker type one VM of which joins the head ("" none: workers simulated)
    joined_s: float | None = None  # from the head's start to the worker's Ray node in `ray status`
    fresh: bool = False  # the head's venv was made and installed by its own setup commands
    injected: str = ""  # the failure asked for ("" none)
    failed_as_injected: bool = False  # `launcher cluster up` failed, as it had to

    def worker_inserts(self) -> int:
        """Worker VMs the autoscaler inserted: one when a worker joins and stays, more when it was replaced."""
        return sum(1 for c in self.calls if c.verb == "insert" and not c.refusal and "-worker-" in c.target)

    @property
    def ok(self) -> bool:
        clean = not self.left and not self.ray_left
        if self.injected:
            return self.failed_as_injected and clean
        joined = not self.join or (self.joined_s is not None and self.worker_inserts() == 1)
        return self.job_status == "SUCCEEDED" and bool(self.checkpoints) and clean and joined


def say_setup(report: UpReport, say: Callable[[str], None]) -> None:
    """Each setup command: what the rehearsal did with it and, where it ran, how long it took."""
    took = {command: (seconds, rc) for command, seconds, rc in report.steps}
    for command, what in report.commands:
        if what.startswith(ON_WORKER):  # said with the worker's own times when it has joined
            continue
        seconds, rc = took.get(command, (None, 0))
        when = "" if seconds is None else f"[{seconds:5.1f} s{f', exit {rc}' if rc else ''}] "
        say(f"   setup: {when}{what}: {command}")
    if report.steps:
        head = {c: what for c, what in report.commands if not what.startswith(ON_WORKER)}
        ran = [s for c, s, _ in report.steps if head.get(c) == "ran"]
        say(f"   the head's setup commands took {sum(s for _, s, _ in report.steps):.1f} s "
            f"({len(ran)} ran{', in a fresh venv' if report.fresh else ''})")


def _emulator_client(emulator_url: str):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="rehearsal", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": emulator_url})


def create_bucket(emulator_url: str, bucket: str) -> None:
    """A bucket in the Cloud Storage emulator at ``emulator_url`` for the rehearsal's run."""
    _emulator_client(emulator_url).create_bucket(bucket)


def checkpoints(emulator_url: str, bucket: str, prefix: str) -> list[str]:
    """The checkpoint objects under gs://BUCKET/PREFIX in the emulator."""
    client = _emulator_client(emulator_url)
    return sorted(b.name for b in client.list_blobs(bucket, prefix=prefix + "/") if "checkpoint" in b.name)


def ray_processes(ray_tmp: str) -> list[str]:
    """Processes whose command line names the rehearsal's Ray folder (raylet, GCS, workers, dashboard)."""
    folder = os.path.join(ray_tmp, "ray") + os.sep
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if folder in cmdline:
            found.append(f"{pid} {cmdline[:120]}")
    return found


def up_summary(report: UpReport) -> str:
    took = sum(s for _, s in report.stages)
    inserts = [c for c in report.calls if c.verb == "insert" and not c.refusal]
    deletes = [c for c in report.calls if c.verb == "delete" and not c.refusal]
    outcome = (f"injected {report.injected}: `launcher cluster up` "
               f"{'failed as it had to' if report.failed_as_injected else 'did not fail'}" if report.injected else
               f"run {report.job_status or 'not finished'}, {len(report.checkpoints)} checkpoint object(s) in the "
               "emulator")
    lines = [f"summary: {'OK' if report.ok else 'FAILED'} in {took:.0f} s; {len(report.calls)} API requests, "
             f"{len(inserts)} VM insert(s), {len(deletes)} delete(s); {outcome}",
             f"  left in the API: {', '.join(report.left) or 'nothing'}; Ray processes left: "
             f"{len(report.ray_left) or 'none'}"]
    if report.join and report.joined_s is not None:
        lines.append(f"  a {report.join} worker VM joined the head {report.joined_s:.0f} s after `ray up` began "
                     f"(its setup commands {sum(s for _, s, _ in report.worker_steps):.1f} s)")
        if report.worker_inserts() > 1:
            lines.append(f"  but the autoscaler inserted {report.worker_inserts()} worker VMs for it: the worker "
                         "was deleted and replaced (Ray's own GCP provider does that: cluster/gcp_provider.py)")
    elif report.join:
        lines.append(f"  no {report.join} worker VM joined the head")
    elif not report.injected:
        lines.append("  workers stayed simulated (min_workers 0 in the rehearsal's copy; the run fits on the head)")
    return "\n".join(lines)
