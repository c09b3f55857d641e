"""Script and package runs, worker side: the user's program as a subprocess of each Ray worker.

:func:`script_worker` is Ray Train's training function for ``--script`` and
``--package`` runs (see :mod:`launcher.driver.script`). On each rank it:

1. agrees with the other ranks on this worker group's id, and learns every
   rank's address (through the driver's mailbox actor), for CLUSTER_SPEC;
2. starts ``python FILE ARGS`` or ``python -m MODULE ARGS`` in the program's
   folder (the copy Ray shipped to this node) with the backend's variables
   (torchrun's, Horovod's, TF_CONFIG) and Vertex AI's (``AIP_*_DIR``,
   ``CLUSTER_SPEC``, the hypertune metrics file), plus ``--job-dir``;
3. ships the program's output, line by line, and rank 0's hypertune metrics
   to the driver's mailbox;
4. on a preemption notice (Ray Train marks every worker when a node of the
   group is drained), writes the deadline to the notice file and sends the
   program SIGTERM; once it has exited (having saved, if it handles SIGTERM),
   the worker waits for Ray Train to restart the group on the replacement
   node, which is charged to the preemption budget, not ``--max-failures``;
5. ends with the program's exit status: a non-zero one fails this rank, which
   Ray Train restarts while ``--max-failures`` allows.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from launcher import _ray, frameworks
from launcher.settings import ATTEMPT, PREEMPTION_DEADLINE_S, PREEMPTION_FILE, RUN_NAME
from launcher.worker import deps, vertex
from launcher.worker.usage import Sampler

FLUSH_S = 0.1           # how often a worker ships buffered output lines and checks for a notice
MAX_BATCH = 500         # and at most this many lines per message
ROSTER_TIMEOUT_S = 120  # every rank joins the roster within this, or the group fails
HOLD_GRACE_S = 30       # after the drain deadline, a node still here is not going: fail the group


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the worker thread that started it ends
    (Ray killing a worker must not leave an orphaned training program holding the ring)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ScriptFailed(RuntimeError):
    def __init__(self, rank: int, status: int) -> None:
        super().__init__(f"rank {rank}: the program exited with status {status}")
        self.rank, self.status = rank, status


class NotPreempted(RuntimeError):
    """A notice came, the program stopped, and the node was still here well after the deadline."""


def program_folder(program: dict[str, Any]) -> str:
    """This node's copy of the program's folder: the working_dir Ray shipped (on PYTHONPATH),
    else the driver's folder (a run on the driver's machine that ships nothing)."""
    if program.get("shipped"):
        entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        entries.sort(key=lambda p: "working_dir" not in p)  # Ray's working_dir_files/... first
        for entry in entries:
            if _holds(entry, program):
                return entry
    return program["folder"]


def _holds(folder: str, program: dict[str, Any]) -> bool:
    if program.get("archives"):  # built packages: the folder holds the archives, installed from there
        return all(os.path.isfile(os.path.join(folder, name)) for name in program["archives"])
    if program["kind"] == "script":
        return os.path.isfile(os.path.join(folder, program["target"]))
    base = os.path.join(folder, *program["target"].split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__main__.py"))


def command(program: dict[str, Any], folder: str, args: list[str], python: str | None = None) -> list[str]:
    python = python or sys.executable
    if program["kind"] == "command":  # a containerSpec's command, run as given in its image
        return [*program["command"], *args]
    if program["kind"] == "module":
        return [python, "-m", program["target"], *args]
    return [python, os.path.join(folder, program["target"]), *args]


def _own_address() -> str:
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def roster_addresses(sink, attempt: str, rank: int, world: int, framework: str,
                     env: dict[str, str]) -> list[str]:
    """Every rank's host:port, in rank order: TF_CONFIG's for TensorFlow (the ports its
    servers use), else each rank's own address, gathered through the driver's mailbox."""
    import ray

    if "TF_CONFIG" in frameworks.get(framework).program_env_names and env.get("TF_CONFIG"):
        addresses = vertex.tf_addresses(env["TF_CONFIG"])
        if len(addresses) == world:
            return addresses
    ray.get(sink.join.remote(attempt, rank, _own_address()))
    deadline = time.monotonic() + ROSTER_TIMEOUT_S
    while True:
        members = ray.get(sink.members.remote(attempt))
        if len(members) >= world:
            return [members[r] for r in range(world)]
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(members)} of {world} ranks joined within {ROSTER_TIMEOUT_S}s")
        time.sleep(0.05)


def program_env(config: dict[str, Any], rank: int, world: int, attempt: str, addresses: list[str],
                notice_path: str, metrics_path: str) -> dict[str, str]:
    """Vertex AI's variables for this rank (see :mod:`launcher.worker.vertex`) and the launcher's."""
    env = {"CLUSTER_SPEC": json.dumps(vertex.cluster_spec(addresses, rank, {"run": config["run_name"]})),
           vertex.METRIC_FILE_ENV: metrics_path,
           PREEMPTION_DEADLINE_S: str(int(config.get("notice_s", 30))), PREEMPTION_FILE: notice_path,
           RUN_NAME: config["run_name"], ATTEMPT: attempt,
           "PYTHONUNBUFFERED": "1"}
    env.update(vertex.output_dirs(config["run_uri"]))
    if config.get("trial_id"):
        env[vertex.TRIAL_ENV] = str(config["trial_id"])
    if config["framework"] == "tensorflow":
        env["TF_CONFIG"] = json.dumps(vertex.tf_config(addresses, rank, config.get("trial_id")))
    return env


def _preemption_info():
    """This worker's own view of a notice (no barrier: the program does not call Ray)."""
    return _ray.train_context().preemption_context.preemption_info


def script_worker(config: dict[str, Any]) -> None:
    """Ray Train's training function for a program: run it, stream its output, pass on a notice."""
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    os.environ.update(config.get("env", {}))
    attempt = broadcast_from_rank_zero(uuid.uuid4().hex if rank == 0 else None)
    scratch = tempfile.mkdtemp(prefix=f"launcher-{attempt[:8]}-r{rank}-")
    try:
        status, deadline_s = _run_program(config, rank, world, attempt, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # the metrics and notice files: read and shipped
    if deadline_s is not None:
        _hold(rank, deadline_s)
    if status != 0:
        raise ScriptFailed(rank, status)


def _run_program(config: dict[str, Any], rank: int, world: int, attempt: str,
                 scratch: str) -> tuple[int, float | None]:
    """Run this rank's copy of the program to its end, relaying what it says and passing on a
    preemption notice; (its exit status, the drain deadline if a notice came)."""
    notice_path = vertex.notice_file(scratch, attempt, rank)
    metrics_path = os.path.join(scratch, "hypertune", "output.metrics")
    proc, address = _start(config, rank, world, attempt, notice_path, metrics_path)
    relay = _Relay(config["sink"], rank, attempt, metrics_path if rank == 0 else None)
    relay.send({"started": time.time(), "address": address})
    relay.follow(proc)
    deadline_s = None
    while proc.poll() is None:
        time.sleep(FLUSH_S)
        relay.ship()
        if deadline_s is None:
            info = _preemption_info()
            if info is not None:
                deadline_s = _pass_on_notice(proc, info, notice_path)
                relay.send({"notice": deadline_s, "time": time.time()})
    relay.finish({"exit": proc.returncode, "time": time.time(), "preempted": deadline_s is not None})
    return proc.returncode, deadline_s


def _start(config: dict[str, Any], rank: int, world: int, attempt: str, notice_path: str,
           metrics_path: str) -> tuple[subprocess.Popen, str]:
    """Start this rank's copy of the program with the backend's and Vertex AI's variables, once
    every rank's address is known; (the process, this rank's address)."""
    from launcher import backends

    backend = backends.get(config["backend"])
    env = {**os.environ, **backend.script_env(config["framework"])}
    # The thread count the script would get from its own launcher, unless the user set one (Ray
    # sets OMP_NUM_THREADS to the worker's CPUs: 0.9x of horovodrun's speed for TensorFlow here).
    threads = config.get("omp_threads") or backend.script_threads(config["framework"])
    if threads:
        env["OMP_NUM_THREADS"] = threads
    else:
        env.pop("OMP_NUM_THREADS", None)
    addresses = roster_addresses(config["sink"], attempt, rank, world, config["framework"], env)
    env.update(program_env(config, rank, world, attempt, addresses, notice_path, metrics_path))
    program = config["program"]
    folder = program_folder(program)
    python = None
    if program.get("requirements"):  # installed by the driver already, unless this node is new
        python, _ = deps.ensure(program["requirements"], program["env_key"], folder, pip_environ=program.get("pip_env"))
    args = list(config["args"]) + (["--job-dir", config["job_dir"]] if config.get("job_dir") else [])
    proc = subprocess.Popen(command(program, folder, args, python), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, cwd=_cwd(program, folder, config["cwd"]),
                            preexec_fn=_die_with_parent)
    return proc, addresses[rank]


class _Relay:
    """What a rank sends the driver's mailbox (``sink``) while its program runs, each message
    tagged with the rank and the group's attempt: the program's output in batches, the CPU and
    memory of this worker and its children (the program among them: sampled from when the relay
    is made), rank 0's hypertune metrics (``metrics_path``), and the rank's own events."""

    def __init__(self, sink, rank: int, attempt: str, metrics_path: str | None) -> None:
        self.sink, self.tag, self.metrics_path = sink, {"rank": rank, "attempt": attempt}, metrics_path
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.pending: list = []
        self.last_metric = 0.0
        self.usage = Sampler().start()
        self.reader: threading.Thread | None = None

    def send(self, message: dict[str, Any]) -> None:
        self.pending.append(self.sink.put.remote({**self.tag, **message}))

    def follow(self, proc: subprocess.Popen) -> None:
        """Read the program's output in a thread of its own, keeping the lines until shipped."""
        def read() -> None:
            for raw in proc.stdout:
                with self.lock:
                    self.lines.append(raw.decode("utf-8", errors="replace").rstrip("\n"))

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()

    def ship(self) -> None:
        import ray

        if len(self.pending) > 1000:  # a long run: forget the messages already delivered
            self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)[1]
        with self.lock:
            batch, self.lines[:] = self.lines[:MAX_BATCH], self.lines[MAX_BATCH:]
        if batch:
            self.send({"lines": batch})
        samples = self.usage.take()
        if samples:
            self.send({"usage": samples})
        if self.metrics_path:
            entries = vertex.read_metrics(self.metrics_path, self.last_metric)
            if entries:
                self.last_metric = entries[-1]["timestamp"]
                self.send({"metrics": entries})

    def finish(self, message: dict[str, Any]) -> None:
        """Ship what is left once the program has exited, then ``message``, and wait until the
        mailbox holds all of it."""
        import ray

        self.reader.join()
        while self.lines:
            self.ship()
        self.ship()
        self.usage.stop()
        self.send(message)
        ray.get(self.pending)


def _cwd(program: dict[str, Any], folder: str, driver_cwd: str) -> str | None:
    """Where the program starts: its shipped folder; a container's command in the image's own
    working directory (None: the worker's); else the driver's folder where this node has it."""
    if program["kind"] == "command":
        return None
    if program.get("shipped"):
        return folder
    return driver_cwd if os.path.isdir(driver_cwd) else folder


def _pass_on_notice(proc, info, notice_path: str) -> float:
    """Write the notice file, then SIGTERM the program; returns the drain deadline (UNIX s)."""
    deadline = info.deadline_ms / 1000 if info.deadline_ms else time.time() + 30
    left = max(0.0, deadline - time.time())
    tmp = notice_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"deadline_unix_s": deadline, "seconds_left": round(left, 1)}, f)
    os.replace(tmp, notice_path)  # a program polling the file never reads half of it
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    return deadline


def _hold(rank: int, deadline: float) -> None:
    """The program stopped for a preemption: what it saved is where the restarted group
    starts, so wait for Ray Train to restart the group (it stops this worker at the
    deadline, or sooner when the node goes)."""
    print(f"rank {rank}: preemption notice: the program has stopped; waiting for Ray Train to restart "
          "the group on the replacement node", flush=True)
    while time.time() < deadline + HOLD_GRACE_S:
        time.sleep(0.5)
    raise NotPreempted(f"rank {rank}: a preemption notice came, but the node was still up {HOLD_GRACE_S}s "
                       "after its deadline")
