"""Draining this machine's Ray node for preemption, and the watch that ties it to GCE's notice.

:func:`watch` (``launcher preemption watch``, started on every Spot or
preemptible node by the cluster file) checks for the metadata server, finds
this machine's Ray node, then runs a :class:`~launcher.preemption.watcher.Watcher`
whose action drains that node through the GCS with reason PREEMPTION and a
deadline. Ray is imported only here, and only when draining is set up.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import threading
import time
from typing import Callable

from launcher import _ray
from launcher.errors import UserError
from launcher.preemption.watcher import (DEADLINE_MARGIN_S, NOTICE_S, NotOnGCE, Watcher, metadata_host,
                                         poll_preempted)

DRAIN_REASON = "DRAIN_NODE_REASON_PREEMPTION"


def short_node_id(node_id: str) -> str:
    """A node id short enough to read and long enough to tell nodes apart: its first 12 hex
    digits, or, for an id that starts with a run of f's (Ray's fake multi-node provider, which
    the preemption lab uses, numbers its nodes at the end of such an id), the few f's and the
    number after them: ``ffff...00002``."""
    rest = node_id.lstrip("f")
    if len(node_id) - len(rest) >= 8 and rest:
        return f"ffff...{rest}"
    return f"{node_id[:12]}..."


def gcs_client(address: str):
    return _ray.GcsClient(address=_ray.canonicalize_bootstrap_address(address))


def own_node_id(client, ips: set[str] | None = None) -> str:
    """The hex id of the alive Ray node whose IP is one of this machine's.

    Raises:
        UserError: no node, or several (several Ray nodes on one machine: pass --node-id).
    """
    ips = ips or local_ips()
    matches = [nid.hex() for nid, info in client.get_all_node_info().items()
               if info.state == 0 and info.node_manager_address in ips]  # 0: ALIVE
    if len(matches) == 1:
        return matches[0]
    what = "no alive Ray node has" if not matches else f"{len(matches)} alive Ray nodes have"
    raise UserError(f"{what} this machine's IP ({', '.join(sorted(ips))})",
                    "start the watcher on a Ray node, or pass --node-id (see `ray list nodes`)")


def local_ips() -> set[str]:
    """This machine's addresses as Ray would name them (best effort, no network traffic)."""
    ips = {"127.0.0.1"}
    try:
        ips.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET))
    except OSError:
        pass
    try:
        ips.add(_ray.node_ip_address())
    except Exception:  # noqa: BLE001 - only a hint
        pass
    return {ip for ip in ips if _is_ip(ip)}


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def drain_node(client, node_id: str, deadline_s: float, message: str) -> tuple[bool, str]:
    """Ask the GCS to drain ``node_id`` for preemption, gone by ``deadline_s`` (UNIX seconds)."""
    accepted, why = client.drain_node(node_id, _ray.DrainNodeReason.Value(DRAIN_REASON),
                                      message, int(deadline_s * 1000))
    return bool(accepted), str(why or "")


def node_drainer(address: str, node_id: str | None, log: Callable[[str], None]) -> Callable[[float], str]:
    """The ``on_notice`` action: drain this machine's Ray node (found once, up front)."""
    client = gcs_client(address)
    node = node_id or own_node_id(client)
    log(f"Ray node {short_node_id(node)} (of the Ray cluster at {address}) will be drained on a notice")

    def act(deadline_s: float) -> str:
        accepted, why = drain_node(client, node, deadline_s, "GCE preemption notice (instance/preempted=TRUE)")
        left = deadline_s - time.time()
        if accepted:
            return f"drained Ray node {short_node_id(node)} with reason PREEMPTION, deadline in {left:.1f}s"
        return f"drain of Ray node {short_node_id(node)} was rejected: {why}"

    return act


def watch(address: str, *, node_id: str | None = None, host: str | None = None,
          notice_s: float = NOTICE_S, margin_s: float = DEADLINE_MARGIN_S,
          log: Callable[[str], None] = print, stop: threading.Event | None = None) -> str:
    """Watch for GCE's notice and drain this node's Ray node; see :class:`Watcher`."""
    host = host or metadata_host()
    if margin_s < 0 or margin_s >= notice_s:
        raise UserError(f"--deadline-margin-s must be >= 0 and below the {notice_s:g}s notice, got {margin_s:g}",
                        "for example --deadline-margin-s 5")
    # Check for GCE before touching Ray: off GCE the watcher has nothing to do.
    try:
        poll_preempted(host, None, timeout_s=10)
    except NotOnGCE as exc:
        log(f"not on Compute Engine: {exc}; nothing to watch, exiting")
        return "not-on-gce"
    except (OSError, http.client.HTTPException):
        pass  # transient; the watcher's loop retries with backoff
    act = node_drainer(address, node_id, log)
    return Watcher(host, act, log, notice_s, margin_s, stop).run()
