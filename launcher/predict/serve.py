"""``launcher serve``: a run's model behind HTTP, on Ray Serve, in AI Platform's format
(what it answers: :mod:`launcher.predict.endpoint`).

Concurrent requests share forward passes (Ray Serve's ``@serve.batch``, up to
``max_batch`` requests per pass). Waiting requests queue inside the replica, in
the batch queue, up to ``max_queued`` per replica: there each forward pass takes
the next ``max_batch`` at once; past that a request gets a 503 with ``Retry-After``
at once.

Two ways in. **Direct ingress** (Ray Serve's ``RAY_SERVE_THROUGHPUT_OPTIMIZED``): the
one replica listens on the server's port itself, so no proxy actor copies each request
and its answer between processes. It serves where ``launcher serve`` starts its own
local Ray for one replica; Ray reads the settings when it starts, so they are set for
that start. **Ray Serve's proxy** everywhere else: on a cluster (``--address``), with
several replicas behind one port, and on a Ray this command did not start (the warm
head of ``launcher up``). (Requests the proxy holds back for a replica at capacity are
retried with back-off, seconds each: measured, 8 to 21 requests/s where the replica's
own queue gave 230. The proxy queues as many again as the replica.) The "serving"
line says which one runs.

On this machine ``launcher serve`` serves on 127.0.0.1 until Ctrl-C, SIGTERM or
``launcher serve --stop``; ``--public`` listens on every interface (no authentication
unless ``--token-file``: anyone who reaches the port can use it). Every server has its
own entry under the state folder (:mod:`launcher.predict.servers`). With ``--address``
the application is deployed on that cluster, stays there after the command returns,
and ``--stop --address ...`` deletes it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from launcher.driver import localhead, session
from launcher.errors import UserError
from launcher.predict.formats.base import Batch
from launcher.predict.endpoint import MAX_INSTANCES, PROBE_HEADER, Endpoint, Routes
from launcher.predict.model import ModelRef
from launcher.predict.servers import (APP, _check_port, _entry_path, _remove, _write_entry,
                                      servers_dir)
from launcher.storage import Storage

DIRECT, PROXY = "direct ingress", "Ray Serve's proxy"
# Direct ingress and its companions (a replica's user code on its own event loop, gRPC
# between deployments, its GC frozen after start-up), read once by each Ray process.
THROUGHPUT = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
DIRECT_ENABLED = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


@dataclass(frozen=True)
class ServeOptions:
    """How a server takes its load (``launcher serve`` flags)."""

    port: int = 8000
    public: bool = False
    replicas: int = 1
    max_batch: int = 64          # requests merged into one forward pass, at most
    batch_wait_ms: float = 5.0   # how long a batch waits to fill
    max_queued: int = 1000       # requests a replica holds (and a proxy as many again); past them, 503
    max_instances: int = MAX_INSTANCES

    @property
    def max_ongoing(self) -> int:
        """Requests a replica holds at once: its queue, and at least a batch in the forward
        pass and the next one filling up."""
        return max(self.max_queued, 2 * self.max_batch)

    def check(self) -> None:
        for flag, value in (("--replicas", self.replicas), ("--max-batch", self.max_batch),
                            ("--max-queued", self.max_queued)):
            if value < 1:
                raise UserError(f"{flag} {value}: must be 1 or more")
        if not 0 <= self.batch_wait_ms <= 10_000:
            raise UserError(f"--batch-wait-ms {self.batch_wait_ms:g}: must be 0..10000",
                            "a few milliseconds lets concurrent requests share a forward pass")
        if not 1 <= self.port <= 65535:
            raise UserError(f"--port {self.port} is not a port number", "use 1..65535, e.g. 8000")


def deployment(options: ServeOptions):
    """The Ray Serve deployment of :class:`Endpoint`, sized for its batching."""
    from ray import serve

    class ModelEndpoint(Endpoint):
        @serve.batch(max_batch_size=options.max_batch, batch_wait_timeout_s=options.batch_wait_ms / 1000)
        async def _batch(self, batches: list[Batch]) -> list[Batch]:
            return await self._batch_impl(batches)

    return serve.deployment(ModelEndpoint, name="model", num_replicas=options.replicas,
                            max_ongoing_requests=options.max_ongoing, max_queued_requests=options.max_queued,
                            backpressure_config={"status_code": 503, "retry_after_s": 1},
                            ray_actor_options={"num_cpus": 0.5}, graceful_shutdown_timeout_s=2,
                            # the endpoint writes its own access log; Ray Serve's line per request
                            # was 3-4 % of a busy replica's samples (py-spy, 1 instance a request)
                            logging_config={"enable_access_log": False})


def ingress(options: ServeOptions, *, joined: bool, warm_head: bool, ray_running: bool,
            env: dict[str, str], port_closing: bool = False) -> tuple[str, str]:
    """(DIRECT or PROXY, why) for a server: direct ingress needs a local Ray this command starts
    (Ray reads it at start), one replica (each direct-ingress replica has its own port), and a
    port no stopped server's connections still hold (``port_closing``: the replica binds
    without SO_REUSEADDR, so it could not listen there until TIME_WAIT ends, up to 60 s)."""
    if joined:
        return PROXY, "a cluster's nodes each have their own proxy"
    if options.replicas > 1:
        return PROXY, f"{options.replicas} replicas share port {options.port}"
    if warm_head:
        return PROXY, "the warm head's Ray started without direct ingress"
    if ray_running:
        return PROXY, "Ray was already started in this process"
    if port_closing:
        return PROXY, (f"port {options.port} still holds the closing connections of the server that had it "
                       "(TIME_WAIT, up to 60 s), where the replica itself cannot listen yet")
    for name in (THROUGHPUT, DIRECT_ENABLED):
        if env.get(name, "1") != "1":
            return PROXY, f"{name}={env[name]} is set"
    return DIRECT, "one replica on this machine's own Ray"


def direct_environ(port: int) -> dict[str, str]:
    """What Ray reads at start for direct ingress with the replica on ``port`` (Ray Serve
    gives ports from [MIN, MAX); it still starts its proxy, on another port, unused).
    No draining period: no load balancer in front needs it, and a stop is a stop."""
    return {THROUGHPUT: "1", DIRECT_ENABLED: "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
            "RAY_SERVE_DIRECT_INGRESS_PORT_RETRY_COUNT": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def serve(ref: ModelRef, options: ServeOptions = ServeOptions(), *, routes: Routes | None = None,
          address: str | None = None, verbose: bool = False, ready=None, note=None) -> int:
    """Serve ``ref``: on this machine until stopped (then returns 0), or deployed on the
    cluster at ``address`` (returns 0 at once). ``ready(url, access_log, path)`` (``path``: the
    way in, :func:`ingress`'s, said in words) is called as soon as
    the server answers (here: its first answer to /healthz; on a cluster: once Ray Serve reports
    the application running). Exit-code rule: a stop (Ctrl-C, SIGTERM, ``--stop``) once
    ``ready`` was called is how a server ends: it is stopped, ``note`` says so (default: a line
    on stderr) and this returns 0; a stop before that raises KeyboardInterrupt (130)."""
    options.check()
    note = note or (lambda text: print(text, file=sys.stderr, flush=True))
    host = "0.0.0.0" if options.public else "127.0.0.1"
    joined = bool(address or os.environ.get("RAY_ADDRESS"))
    if not joined:
        _claim_port(host, options.port, note)
    ray = sys.modules.get("ray")
    path, why = ingress(options, joined=joined, warm_head=not joined and localhead.running_head() is not None,
                        ray_running=ray is not None and ray.is_initialized(), env=dict(os.environ),
                        port_closing=not joined and _closing(host, options.port))
    proxy_port = _free_port(host) if path == DIRECT else options.port
    access_log = None if joined else _access_log(ref, options.port)
    url = f"http://{'127.0.0.1' if not options.public else host}:{options.port}"
    serving = False
    try:
        with session.environ(direct_environ(options.port) if path == DIRECT else {}, override=True), \
                session.connect(address, workers=options.replicas, cpus_per_worker=0.5, verbose=verbose):
            from ray import serve as ray_serve

            if not verbose:
                logging.getLogger("ray.serve").setLevel(logging.WARNING)
            ray_serve.start(http_options={"host": host, "port": proxy_port})
            app = deployment(options).bind(ref, routes or Routes(), options.max_instances, access_log)
            _deployed(lambda: ray_serve.run(app, name=APP, route_prefix="/"), None if joined else options.port)
            serving = True
            try:
                if not joined:
                    _write_entry({"pid": os.getpid(), "port": options.port, "url": url, "model": ref.uri,
                                  "run": ref.run, "access_log": access_log, "since": time.time()})
                if ready is not None:
                    ready(url, access_log, f"{path}: {why}")
                if joined:  # the application stays on the cluster
                    return 0
                while True:
                    signal.pause()  # Ctrl-C (and SIGTERM, turned into it) ends it
            except KeyboardInterrupt:
                note(f"stopping the model server at {url}")
                raise
            finally:
                if not joined:
                    _remove(_entry_path(options.port))
            # The local Ray goes down as the session closes, and the server with it: no need to
            # wait for Serve's graceful shutdown, which takes tens of seconds on a busy machine.
    except KeyboardInterrupt:
        if not serving:
            raise
        note(f"stopped the model server at {url}")
    return 0


def _claim_port(host: str, port: int, note, timeout_s: float = 75.0) -> None:
    """Refuse a port another server listens on, at once; wait (``timeout_s`` at most) for one
    that only the closed connections of a server that had it still hold. A direct-ingress
    replica listens without SO_REUSEADDR (Ray 2.60 binds it so), and then its connections in
    TIME_WAIT (60 s on Linux) keep every new listener off the port."""
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        try:
            _check_port(host, port)
            return
        except UserError:
            if _listening(port) or time.monotonic() > deadline:
                raise
            if not said:
                note(f"port {port}: the connections of the server that had it are still closing (TIME_WAIT, "
                     "up to 60 s); waiting for it")
                said = True
            time.sleep(0.5)


def _closing(host: str, port: int) -> bool:
    """Whether only TIME_WAIT connections hold ``port``: a listener without SO_REUSEADDR (as a
    direct-ingress replica binds) cannot have it, one with it (the proxy's) can."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return False
        except OSError:
            return True


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _deployed(deploy, port: int | None, poll_s: float = 0.2) -> None:
    """Deploy (``deploy``: Ray Serve's ``run``) and return as soon as the server answers.

    Ray Serve's ``run`` returns once its controller reports the application RUNNING, which
    came about 6 s after the server first answered /healthz on 2 cores: a server that answers
    is up, so for a server on this machine (on ``port``) that first answer is the sign. ``run``
    goes on in a thread meanwhile; its error, if it fails first, is raised here."""
    done: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            deploy()
            done["error"] = None
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            done["error"] = exc

    thread = threading.Thread(target=run, name="serve-deploy", daemon=True)
    thread.start()
    while True:
        thread.join(poll_s)
        if "error" in done:
            if done["error"] is not None:
                raise done["error"]
            return
        if port is not None and _answers(port):
            return


def _answers(port: int) -> bool:
    """Whether the server on this machine's ``port`` answers /healthz with 200 (straight to
    loopback: no proxy from the environment in between)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/healthz", headers={PROBE_HEADER: "1"})
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _access_log(ref: ModelRef, port: int) -> str:
    """``<run>/serve/access-PORT.log`` for a run on this machine's disk, else the state folder's."""
    store = Storage.resolve(ref.storage_uri)
    parts = list(ref.parts)
    if store.is_local and parts and parts[-1] == "model":
        folder = os.path.join(store.path(*parts[:-1]), "serve")
    else:
        folder = os.path.join(servers_dir(), "logs")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"access-{port}.log"), "a", encoding="utf-8"):
            pass
    except OSError:  # a run folder we cannot write to
        folder = os.path.join(servers_dir(), "logs")
        os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"access-{port}.log")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
