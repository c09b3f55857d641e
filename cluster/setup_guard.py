"""Stop Ray relaunching, without end, worker VMs whose setup fails: a watcher on the head.

Ray 2.60's v2 autoscaler (what `ray up` runs since Ray 2.50) sets up each new
worker with the file's setup commands, three tries on the same VM
(``ThreadedRayInstaller``); then it marks the instance ``RAY_INSTALL_FAILED``,
terminates the VM and, while ``min_workers`` or a waiting run still asks for
a node of that type, launches another: a new billed VM each time, with no end.
No setting of Ray bounds it (``RAY_AUTOSCALER_RECONCILE_MAX_NUM_RETRY_REQUEST_TO_ALLOCATE``
counts retries of an allocation, not failed setups; the install tries are a
constructor default).

So the cluster file starts ``launcher cluster setup-guard`` next to Ray on the
head. It follows the autoscaler's log (``monitor.log`` of the head's Ray
session), where Ray's instance manager logs every instance's status changes
(``Update instance RAY_INSTALLING->RAY_INSTALL_FAILED (id=..., type=...,
cloud_instance_id=..., ...)``), and when ``limit`` VMs of one node type in a
row have failed their setup (one that comes up in between starts the count
again) it caps that node type in ``~/ray_bootstrap_config.yaml``, which the
autoscaler reads again every round: ``max_workers`` becomes the number of that
type's workers that are up, ``min_workers`` at most that. Ray launches no more
of them; those up keep running. It says so in one line, in its log
(``~/launcher-setup-guard.log``). The next `ray up` writes the file anew, and
the cap with it.

The guard ends when the head's Ray restarts (``session_latest`` names another
session), as the next `ray up`'s ``ray start`` does, which starts a new guard.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import yaml

BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"
LOG = "~/launcher-setup-guard.log"
# Ray's InstanceUtil.get_log_str_for_update, for a new instance and for a change of status.
INSTANCE_RE = re.compile(r"(?:New instance (?P<new>[A-Z_]+)|Update instance [A-Z_]+->(?P<status>[A-Z_]+)) "
                         r"\(id=(?P<id>[^,]+), type=(?P<type>[^,]+), cloud_instance_id=(?P<vm>[^,]*), "
                         r"ray_id=[^)]*\): ?(?P<details>.*)")
FAILED, RUNNING = "RAY_INSTALL_FAILED", "RAY_RUNNING"


def session_log(ray_tmp: str | None = None) -> str:
    """The autoscaler's log of the head's current Ray session (``RAY_TMPDIR`` as Ray reads it)."""
    root = ray_tmp or os.environ.get("RAY_TMPDIR") or "/tmp"
    return os.path.join(os.path.realpath(os.path.join(root, "ray", "session_latest")), "logs", "monitor.log")


@dataclass
class SetupGuard:
    """Reads the autoscaler's log lines (:meth:`feed`) and caps a node type whose setups keep failing."""

    config_path: str
    limit: int
    say: Callable[[str], None] = print
    instances: dict[str, tuple[str, str]] = field(default_factory=dict)  # Ray's instance id -> (type, status)
    failed: dict[str, list[str]] = field(default_factory=dict)  # node type -> its VMs that failed, in a row
    capped: set[str] = field(default_factory=set)

    def feed(self, line: str) -> None:
        m = INSTANCE_RE.search(line)
        if m is None:
            return
        kind, status = m["type"], m["new"] or m["status"]
        self.instances[m["id"]] = (kind, status)
        if status == RUNNING:
            self.failed.pop(kind, None)
        elif status == FAILED:
            self.failed.setdefault(kind, []).append(m["vm"] or m["id"])
            if self.limit > 0 and len(self.failed[kind]) >= self.limit and kind not in self.capped:
                self.cap(kind, m["details"].strip())

    def up(self, kind: str) -> int:
        return sum(1 for k, status in self.instances.values() if k == kind and status == RUNNING)

    def cap(self, kind: str, last_error: str) -> None:
        """Let Ray launch no more VMs of ``kind``: its max_workers becomes the number up now."""
        self.capped.add(kind)
        path = os.path.expanduser(self.config_path)
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)  # Ray writes it as JSON, which YAML reads
        node = (config.get("available_node_types") or {}).get(kind)
        vms = self.failed[kind]
        if node is None:
            self.say(f"launcher setup-guard: {len(vms)} {kind} VMs failed their setup, and {path} has no node "
                     "type of that name to cap")
            return
        up = self.up(kind)
        was = node.get("max_workers", config.get("max_workers"))
        node["max_workers"], node["min_workers"] = up, min(int(node.get("min_workers") or 0), up)
        with open(path + ".guard", "w", encoding="utf-8") as f:
            json.dump(config, f)
        os.replace(path + ".guard", path)  # the autoscaler never reads half a file
        self.say(f"launcher setup-guard: the setup of {len(vms)} {kind} VMs in a row failed ({', '.join(vms)}; "
                 f"the last: {last_error[:300]}); Ray would go on replacing each with a new billed VM, so the head "
                 f"launches no more of them (max_workers {was} -> {up} in {self.config_path}). Fix the setup "
                 "commands, then `launcher cluster up` again (or `launcher cluster down`).")


def follow(path: str, keep_going: Callable[[], bool], poll_s: float = 2.0) -> Iterator[str]:
    """The lines of a log as they are written (from its start; a rotated or truncated log is read anew)."""
    f, inode, rest = None, None, ""
    while keep_going():
        if f is None:
            try:
                f = open(path, encoding="utf-8", errors="replace")
            except FileNotFoundError:  # Ray has not written it yet
                time.sleep(poll_s)
                continue
            inode, rest = os.fstat(f.fileno()).st_ino, ""
        chunk = f.read()
        if chunk:
            *lines, rest = (rest + chunk).split("\n")
            yield from lines
            continue
        try:
            now = os.stat(path)
            moved = now.st_ino != inode or now.st_size < f.tell()
        except FileNotFoundError:
            moved = True
        if moved:
            f.close()
            f = None
        else:
            time.sleep(poll_s)
    if f is not None:
        f.close()


def watch(limit: int, config_path: str = BOOTSTRAP_CONFIG, log: str | None = None, poll_s: float = 2.0,
          say: Callable[[str], None] = print) -> SetupGuard:
    """Follow the current Ray session's autoscaler log until that session is no longer the latest."""
    log = log or session_log()
    session = os.path.dirname(os.path.dirname(log))
    guard = SetupGuard(config_path, limit, say)
    say(f"launcher setup-guard: following {log}; a node type is capped after {limit} failed setups in a row")

    def same_session() -> bool:
        return os.path.realpath(os.path.join(os.path.dirname(session), "session_latest")) == session

    for line in follow(log, same_session, poll_s):
        guard.feed(line)
    return guard
