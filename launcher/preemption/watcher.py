"""Watching for GCE's preemption notice: the metadata server, long-polled.

GCE tells a Spot or preemptible VM about its end through the metadata
server: ``instance/preempted`` turns from FALSE to TRUE about 30 seconds
before the hard power-off. Ray Train reacts to a node being *drained* with
reason PREEMPTION (its own PreemptionWatcher polls the drain state), but
nothing in Ray watches GCE. :class:`Watcher` closes that gap: it long-polls
the metadata server (``wait_for_change`` with ``last_etag``) and, on TRUE,
calls its action once: :mod:`launcher.preemption.drain` drains the node's Ray
node with a deadline a few seconds inside the notice, so Ray Train restarts
the worker group before the node vanishes.

Nothing here imports Ray.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import quote


METADATA_ENV = "GCE_METADATA_HOST"
DEFAULT_METADATA_HOST = "metadata.google.internal"
PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
NOTICE_S = 30.0           # GCE: ACPI soft-off, then hard-off 30 s later (Spot / preemptible)
DEADLINE_MARGIN_S = 5.0   # drain deadline this much before the hard-off
LONG_POLL_TIMEOUT_S = 300  # the metadata server answers a long poll by then at the latest
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


class NotOnGCE(Exception):
    """The metadata server does not exist here (no name, or not Google's server)."""


@dataclass(frozen=True)
class Answer:
    value: str   # "TRUE" or "FALSE"
    etag: str


def metadata_host() -> str:
    return os.environ.get(METADATA_ENV) or DEFAULT_METADATA_HOST


def poll_preempted(host: str, last_etag: str | None, timeout_s: float = LONG_POLL_TIMEOUT_S) -> Answer:
    """One poll of ``instance/preempted``. Without ``last_etag`` it answers at once;
    with it, it long-polls until the value's ETag differs (or the server's timeout).

    Raises:
        NotOnGCE: the host name does not resolve, or the reply lacks the
            ``Metadata-Flavor: Google`` header (some other server answered).
        OSError, http.client.HTTPException: transient trouble; retry.
    """
    path = PREEMPTED_PATH
    if last_etag:
        # The server's own timeout ends the long poll before our socket's does.
        path += (f"?wait_for_change=true&last_etag={quote(last_etag)}"
                 f"&timeout_sec={max(1, int(timeout_s) - 5)}")
    name, _, port = host.rpartition(":") if host.count(":") == 1 else (host, "", "")
    conn = http.client.HTTPConnection(name or host, int(port) if port else 80, timeout=timeout_s)
    try:
        try:
            conn.request("GET", path, headers={"Metadata-Flavor": "Google"})
        except socket.gaierror as exc:
            raise NotOnGCE(f"{host} does not resolve ({exc.strerror})") from None
        reply = conn.getresponse()
        body = reply.read().decode("utf-8", "replace").strip()
        if reply.getheader("Metadata-Flavor") != "Google":
            raise NotOnGCE(f"{host} answered without the Metadata-Flavor: Google header")
        if reply.status != 200:
            raise http.client.HTTPException(f"metadata server answered {reply.status}: {body[:200]}")
        return Answer(body.upper(), reply.getheader("ETag") or "")
    finally:
        conn.close()


def drain_deadline_s(noticed_at: float, notice_s: float = NOTICE_S, margin_s: float = DEADLINE_MARGIN_S) -> float:
    """When Ray should have given up the node: inside the notice, never before now."""
    return max(noticed_at, noticed_at + notice_s - margin_s)


# -- the watcher -----------------------------------------------------------------------

@dataclass
class Watcher:
    """Long-polls the metadata server; on TRUE calls ``on_notice(deadline_s)`` once and stops.

    ``log`` receives one line per thing seen or done. :meth:`run` returns the
    outcome: "drained" (notice acted on), "not-on-gce" or "stopped".
    """

    host: str
    on_notice: Callable[[float], str]
    log: Callable[[str], None]
    notice_s: float = NOTICE_S
    margin_s: float = DEADLINE_MARGIN_S
    stop: threading.Event | None = None
    poll_timeout_s: float = LONG_POLL_TIMEOUT_S

    def run(self) -> str:
        stop = self.stop or threading.Event()
        etag, failures = None, 0
        self.log(f"watching http://{self.host}{PREEMPTED_PATH} for a preemption notice")
        while not stop.is_set():
            try:
                answer = poll_preempted(self.host, etag, self.poll_timeout_s)
            except NotOnGCE as exc:
                self.log(f"not on Compute Engine: {exc}; nothing to watch, exiting")
                return "not-on-gce"
            except (OSError, http.client.HTTPException) as exc:
                wait = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
                self.log(f"metadata server unreachable ({type(exc).__name__}: {exc}); retrying in {wait:g}s")
                stop.wait(wait)
                continue
            failures = 0
            if answer.etag == etag and answer.value != "TRUE":
                continue  # the long poll timed out without a change
            etag = answer.etag
            self.log(f"instance/preempted = {answer.value} (etag {answer.etag or '-'})")
            if answer.value == "TRUE":
                noticed = time.time()
                deadline = drain_deadline_s(noticed, self.notice_s, self.margin_s)
                self.log(self.on_notice(deadline))
                return "drained"
        return "stopped"
