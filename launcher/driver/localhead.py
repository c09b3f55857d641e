"""A warm local Ray head: ``launcher up`` starts one, ``launcher down`` stops it.

Starting Ray is a fixed cost of every local run (several seconds on a small
machine, plus its shutdown). With a head kept running, ``launcher run``
without --address finds it through a small state file and connects instead.
The head has no dashboard and takes only clients with Ray's token (``RAY_AUTH_MODE=token``).
It is not loopback-only: on Linux Ray replaces the loopback node address it is given with this
machine's own and its GCS and raylet listen on every interface (seen with ``ss -ltn``, Ray 2.60);
the token is what keeps others out.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable

from launcher.errors import UserError
from launcher.storage.runs import pid_alive
from launcher.worker import pool

from launcher.settings import LOCAL_RAY, STATE_DIR as STATE_ENV
# A launch without a warm head starts a local Ray with as many logical CPUs as its workers ask
# for, up to this many per core (session.check_local_fit): a laptop runs more workers than it has
# cores. The warm head is given that many by default, so it takes every run a cold start takes.
LOCAL_OVERSUBSCRIPTION = 4
# On SIGTERM, `ray start --block` first drains its node, for up to this many seconds (default 30),
# so that a cluster can move work elsewhere. A warm head has nowhere to move it, and Ray Train's
# detached coordinator keeps the node busy: `launcher down` waited the whole 30 s. Off for the head.
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
# Ray's token authentication: on for the head we start (its token is Ray's
# default, ~/.ray/auth_token); a driver connecting to an explicit address must
# say so, as Ray never turns it on by itself for one.
AUTH_ENV = "RAY_AUTH_MODE"
# The dashboard agent's reporter gathers every process's CPU and memory for a dashboard every
# 5 s; a local Ray (a launch's own, or this head) has no dashboard, so once a minute is enough
# (the agent went from 0.7 to 0.4 % of a core during a run: benchmarks/ray_tax).
REPORTER_ENV, REPORTER_MS = "REPORTER_UPDATE_INTERVAL_MS", "60000"
# By default the raylet starts an idle worker process per CPU when the first driver connects.
# Ray Train's actors carry their own runtime environment and never use them (the head's pool
# starts its own, launcher.worker.pool): on the warm head six of them took 3.4 % of a core for as
# long as it stayed up (the idle head: 6.1 % of a core with them, 2.9 % without, over 30 s).
# Off for a local Ray the launcher starts; a value the user set wins.
PRESTART_ENV = "RAY_prestart_worker_first_driver"
# On every process of a local Ray the launcher starts (the raylet passes its environment on): a run
# begun inside one, as a tuning trial is, leaves out what only a cluster needs (session.Connection.local).
MARK_ENV = {LOCAL_RAY: "1"}
# How long the head keeps a run's pool of ready worker processes (launcher.worker.pool) by default.
POOL_S = 600
# The raylet starts at most this many worker processes at once (Ray's default: the cores, up to
# the CPUs), and drops the rest of a request for idle ones: the head allows a whole pool.
STARTUP_ENV = "RAY_worker_maximum_startup_concurrency"


def state_file() -> str:
    root = os.environ.get(STATE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "launcher")
    return os.path.join(root, "local-head.json")


def _ray_cli() -> str:
    return shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray") or "ray"


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def _has_token() -> bool:
    """Whether Ray's authentication token is at hand where Ray looks for it."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return bool(os.environ.get("RAY_AUTH_TOKEN", "").strip()) or os.path.isfile(path)


def running_head() -> dict | None:
    """The warm head's state ({"address", "num_cpus"}) if one is up, else None."""
    try:
        with open(state_file(), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    return state if _reachable(state.get("address", "")) else None


def warm_head_for(address: str | None) -> dict | None:
    """The warm head a launch without an address (nor RAY_ADDRESS) uses, if one is up; its
    auth mode is set for Ray then. Call it before Ray is first imported: Ray reads the auth
    mode once, at import, and a launch that imported Ray first (any module that does, at
    the top) could not authenticate to the head."""
    if address or os.environ.get("RAY_ADDRESS"):
        return None
    head = running_head()
    if head:
        os.environ.setdefault(AUTH_ENV, head.get("auth_mode", "token"))
    return head


def up(num_cpus: int | None = None, port: int = 6390, timeout_s: float = 60.0,
       note: Callable[[str], None] | None = None, pool_s: int | None = None) -> dict:
    """Start a local head (idempotent) and record its address.

    The head runs under ``ray start --block`` in its own session: stopping that
    one process (``down``) stops this head's processes and no other Ray. ``pool_s``: how long
    each run's pool of ready worker processes is kept (:data:`POOL_S`; 0: no pool).
    """
    state = running_head()
    if state:
        return {**state, "already_running": True}
    cpus = num_cpus or default_cpus()
    note = note or (lambda message: None)
    note(f"starting a local Ray head at 127.0.0.1:{port} with {cpus} logical CPUs"
         + ("" if num_cpus else f" ({LOCAL_OVERSUBSCRIPTION} per core: the most a run without it may ask for)"))
    os.makedirs(os.path.dirname(state_file()), exist_ok=True)
    log_path = os.path.join(os.path.dirname(state_file()), "local-head.log")
    cmd = [_ray_cli(), "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
           f"--num-cpus={cpus}", "--include-dashboard=false", "--disable-usage-stats"]
    env = {**os.environ, **MARK_ENV, AUTH_ENV: os.environ.get(AUTH_ENV, "token"), DRAIN_ENV: os.environ.get(DRAIN_ENV, "0"),
           REPORTER_ENV: os.environ.get(REPORTER_ENV, REPORTER_MS), PRESTART_ENV: os.environ.get(PRESTART_ENV, "0"),
           STARTUP_ENV: os.environ.get(STARTUP_ENV, str(max(cpus, os.cpu_count() or 1) + pool.RAY_TRAIN_ACTORS))}
    if env[AUTH_ENV] == "token" and not _has_token():
        # A first local ray.init() makes one; `ray start` only refuses to start without it.
        note("making Ray's authentication token (~/.ray/auth_token), as a first local Ray would")
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run([_ray_cli(), "get-auth-token", "--generate"], env=env, timeout=60,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    address = f"127.0.0.1:{port}"
    deadline = time.time() + timeout_s
    while not _reachable(address):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            with open(log_path) as f:
                tail = [line for line in f.read().splitlines() if line.strip()][-1:] or ["no output"]
            raise UserError(f"`ray start --head` failed: {tail[0]}",
                            f"is another Ray using port {port}? see {log_path}")
        time.sleep(0.2)
    state = {"address": address, "num_cpus": cpus, "pid": proc.pid, "auth_mode": env[AUTH_ENV],
             "drain": env[DRAIN_ENV], "pool_s": POOL_S if pool_s is None else pool_s}
    with open(state_file(), "w", encoding="utf-8") as f:
        json.dump(state, f)
    note("warming it up with a 1-epoch run of the default workload (about 10 s on 2 cores)"
         + ("; it leaves processes ready for the next run" if state["pool_s"] else ""))
    _warm_up(env, min(2, cpus), 180.0)
    raylet = raylet_of(proc.pid)
    if state["pool_s"] and raylet:
        note("waiting for those processes to finish importing (seconds on 2 cores)")
        pool.wait_ready(raylet, min(2, cpus) + pool.RAY_TRAIN_ACTORS, 90.0)
    return state


def raylet_of(head_pid: int, proc: str = "/proc") -> int | None:
    """The pid of the raylet that ``ray start`` (``head_pid``) started, found through /proc
    (None elsewhere, or if it is not found)."""
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(os.path.join(proc, pid, "cmdline"), "rb") as f:
                if b"/raylet/raylet" not in f.read().split(b"\0")[0]:
                    continue
            with open(os.path.join(proc, pid, "stat"), encoding="ascii", errors="replace") as f:
                parent = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == head_pid:
            return int(pid)
    return None


def default_cpus(cores: int | None = None) -> int:
    """The head's logical CPUs unless ``--num-cpus`` says otherwise: as many as a launch without
    it may give its own local Ray, so every run that starts cold also fits on the head (Ray
    places workers by logical CPUs; on either Ray, the workers share the machine's cores)."""
    return LOCAL_OVERSUBSCRIPTION * (cores or os.cpu_count() or 1)


def fit_hint(cpus_asked: float) -> str | None:
    """The fix to name when a run does not fit on the Ray this process is connected to, if that
    is the warm head (None otherwise): a head started with fewer CPUs than the run asks for."""
    ray = sys.modules.get("ray")  # never import Ray for this: a process that has not cannot be connected
    head = running_head()
    if ray is None or head is None or not ray.is_initialized():
        return None
    try:  # Ray names the head's GCS by this machine's IP, not the loopback address it was given
        if ray.get_runtime_context().gcs_address.rpartition(":")[2] != head["address"].rpartition(":")[2]:
            return None
    except Exception:  # noqa: BLE001 - only the hint's wording is at stake
        return None
    need = max(math.ceil(cpus_asked), 1)
    return (f"the warm local Ray (`launcher up`) has {head.get('num_cpus')} CPUs: `launcher down` (a run then "
            f"starts its own Ray, sized to it), or `launcher down` then `launcher up --num-cpus {need}`; "
            "or lower --workers")


# A first run on the new head: `launcher run` of the default workload for one epoch, from
# this process's environment, as the user's next run will be. It settles the head (the first
# run on a new head took 16-23 s and later ones 12-14 s before there was a warm-up: 2-core
# machine, 1-epoch digits-mlp) and, like every run on the head, leaves its pool of processes
# ready (launcher.worker.pool): the user's first torch run starts in them.
def _warm_up(env: dict, workers: int, timeout_s: float) -> None:
    """Run the warm-up; a failure is not fatal (the head works, only slower at first)."""
    with tempfile.TemporaryDirectory(prefix="launcher-warm-up-") as folder, \
            contextlib.suppress(subprocess.SubprocessError, OSError):
        subprocess.run([sys.executable, "-m", "launcher", "run", "--storage", folder, "--name", "warm_up",
                        "--epochs", "1", "--workers", str(workers), "--json"],
                       env=env, timeout=timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def down(timeout_s: float = 40.0, note: Callable[[str], None] | None = None) -> bool:
    """Stop the head recorded by ``up``; returns whether one was running. ``note`` hears what
    it waits for."""
    state = running_head()
    with contextlib.suppress(FileNotFoundError):
        os.remove(state_file())
    if state is None:
        return False
    note = note or (lambda message: None)
    note(f"stopping the warm local Ray at {state['address']} (pid {state['pid']})"
         + ("" if state.get("drain") == "0" else "; Ray drains its node first, up to 30 s"))
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(state["pid"]), signal.SIGTERM)
    deadline = time.time() + timeout_s
    while (_reachable(state["address"]) or _alive(int(state["pid"]))) and time.time() < deadline:
        time.sleep(0.2)
    _forget_default_address(state["address"])
    return True


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (the head's `ray start`, which stops the head's processes
    before it exits). Where this process started the head (``launcher bench overhead`` calls
    ``up`` and ``down``), it is a child that stays a zombie until reaped: reaped here."""
    try:
        exited, _ = os.waitpid(pid, os.WNOHANG)
        return exited == 0
    except ChildProcessError:  # not ours: another process started the head
        pass
    return pid_alive(pid)


def _forget_default_address(address: str) -> None:
    """Remove Ray's note of the 'current' local cluster if it names the head just stopped;
    a stale note makes a later plain ``ray.init()`` try to join a dead cluster."""
    note = os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")
    with contextlib.suppress(OSError):
        with open(note, encoding="utf-8") as f:
            current = f.read().strip()
        if current.rpartition(":")[2] == address.rpartition(":")[2]:
            os.remove(note)
