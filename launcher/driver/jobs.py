"""Submitting runs to a running Ray cluster as Ray jobs, and watching them.

``launcher submit`` validates the job spec here, then hands Ray's job server
(the dashboard's HTTP API, ``http://HEAD:8265``) a shell entrypoint that runs
``python -m launcher run`` with every field of the validated spec spelled out
as a flag. The job's runtime environment carries this launcher's own code
(the ``launcher`` and ``workloads`` packages, as py_modules) so the cluster
runs the submitter's version, plus the environment the run needs to reach
its storage. Inside the job, Ray sets RAY_ADDRESS, so the run joins the
cluster instead of starting a Ray of its own.

Everything goes through ``ray.job_submission.JobSubmissionClient``; errors
from it become one line: :class:`UserError` for bad input, :class:`Unreachable`
for a job server that does not answer.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from launcher import __version__, flags, schema
from launcher.errors import Unreachable, UserError
from launcher.settings import GCS_RETRY_S, JOB_TIMEOUT_S
from launcher.storage.tracking import check_store_reach
from launcher.worker import deps

ADDRESS_ENVS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")  # Ray's own order of precedence
ID_PREFIX = "launcher-"
# How long Ray waits after SIGTERM before it SIGKILLs a stopped job: long enough
# for the run to abort its workers and write its summary (Ray's default is 3 s).
STOP_GRACE_S = 30
# Environment worth passing to the job when set here; never credentials.
# Not credentials: the cluster has its own (its service account; MLflow's token set there).
PASSED_ENV = ("STORAGE_EMULATOR_HOST", GCS_RETRY_S, "MLFLOW_EXPERIMENT_NAME")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
CONNECT_TIMEOUT_S = 10.0   # every request to the job server: connecting (then JOB_TIMEOUT_S for each part of the answer)


def request_timeout_s() -> float:
    return float(JOB_TIMEOUT_S.get())
FOLLOW_CHECK_S = 10.0  # while following a job's logs, check that its server still answers this often
# `launcher logs --follow` and `submit --follow` exit like `launcher run` would.
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 130}
# A head just started by `ray up` answers HTTP before its job agent has registered; Ray
# then refuses a submission with this text after a 10 s wait of its own. Try again this long.
NO_AGENT = "No available agent to submit job"
AGENT_WAIT_S = 120.0
AGENT_RETRY_S = 2.0
FIX_ADDRESS = ("pass the head's dashboard address, e.g. --address http://127.0.0.1:8265 "
               "(on a `ray up` cluster, `ray dashboard cluster.yaml` tunnels it to localhost)")


# -- addresses and credentials ----------------------------------------------------------

def resolve_address(given: str | None) -> str:
    """The job server's URL: --address, else RAY_API_SERVER_ADDRESS, else RAY_ADDRESS.

    Raises:
        UserError: none given, or not an http(s):// URL with a host.
    """
    source, address = "--address", given
    if not address:
        for env in ADDRESS_ENVS:
            if os.environ.get(env):
                source, address = env, os.environ[env]
                break
    if not address:
        raise UserError("no Ray cluster to submit to: --address is not given and neither "
                        f"{' nor '.join(ADDRESS_ENVS)} is set", FIX_ADDRESS)
    parts = urlsplit(address)
    try:
        parts.port  # noqa: B018 -- raises on a malformed port
    except ValueError:
        raise UserError(f"{source} {address!r} has a malformed port", FIX_ADDRESS) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"{source} {address!r} is not the dashboard's http:// address "
                        "(jobs are submitted over HTTP, not to the GCS or ray:// client port)", FIX_ADDRESS)
    return address.rstrip("/")


def auth_headers() -> dict[str, str]:
    """Ray's token header when a token is at hand (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token) and RAY_AUTH_MODE is not 'disabled'.

    A Ray 2.60 head turns token authentication on by itself when a token exists on it,
    but Ray's client only sends one when RAY_AUTH_MODE=token was set before Ray was
    imported; passing the header ourselves works either way. The token is sent only to the address the user named.
    """
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return {}
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
        with contextlib.suppress(OSError):
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast (a dropped SYN otherwise waits minutes: Ray's requests set no timeout)."""
    parts = urlsplit(address)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            return
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise Unreachable(f"cannot reach the Ray job server at {address}: {why}",
                          "is the cluster up, with its dashboard on? " + FIX_ADDRESS) from None


@contextlib.contextmanager
def _without_address_env() -> Iterator[None]:
    """Ray's client lets RAY_ADDRESS override the address it is given; ours must win."""
    saved = {env: os.environ.pop(env) for env in ADDRESS_ENVS if env in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _bounded_client_class():
    """Ray's JobSubmissionClient with a timeout on every HTTP request (Ray sets none: a server
    that accepts the connection and never answers would hang the command forever)."""
    from ray.job_submission import JobSubmissionClient

    class BoundedJobClient(JobSubmissionClient):
        def _do_request(self, *args, **kwargs):  # listed in launcher._ray.OVERRIDDEN
            kwargs.setdefault("timeout", (CONNECT_TIMEOUT_S, request_timeout_s()))
            return super()._do_request(*args, **kwargs)

    return BoundedJobClient


def connect(address: str | None):
    """A JobSubmissionClient for the resolved address, or one line: UserError, Unreachable."""
    url = resolve_address(address)
    _check_reachable(url)
    from ray.exceptions import AuthenticationError

    try:
        with _without_address_env():
            return _bounded_client_class()(url, headers=auth_headers())
    except AuthenticationError:
        raise UserError(f"the Ray cluster at {url} refused the request: its authentication token is missing or wrong",
                        "put the cluster's token in RAY_AUTH_TOKEN or ~/.ray/auth_token (on the head: "
                        "`ray get-auth-token`)") from None
    except OSError as exc:  # requests' timeouts and connection errors
        raise Unreachable(f"the Ray job server at {url} did not answer within {request_timeout_s():g}s "
                          f"({type(exc).__name__})", "is the head overloaded or stuck? check its dashboard "
                          f"log (/tmp/ray/session_latest/logs/dashboard.log), the address, or raise "
                          f"{JOB_TIMEOUT_S}") from None
    except (ConnectionError, RuntimeError) as exc:
        raise UserError(f"{url} does not answer as a Ray job server: {_first_line(exc)}", FIX_ADDRESS) from None


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


@contextlib.contextmanager
def _job_errors(client, job_id: str) -> Iterator[None]:
    """Ray's 404 for an unknown id (a RuntimeError with the HTTP body) as a UserError."""
    try:
        yield
    except OSError as exc:  # requests' and aiohttp's connection errors are OSErrors
        raise Unreachable(f"lost the connection to the Ray job server at {client.get_address()}: "
                          f"{_first_line(exc)}", "is the cluster still up? `launcher status` and "
                          "`launcher logs --follow` can be run again at any time") from None
    except RuntimeError as exc:
        if "does not exist" in str(exc) or "status code 404" in str(exc):
            raise UserError(f"no job {job_id!r} on the Ray cluster at {client.get_address()}",
                            f"`launcher jobs --address {client.get_address()}` lists the jobs") from None
        raise Unreachable(f"the Ray job server at {client.get_address()} failed: {_first_line(exc)}",
                          "check the head's dashboard log (/tmp/ray/session_latest/logs/dashboard.log)") from None


# -- what a submission sends -------------------------------------------------------------

def run_argv(spec) -> list[str]:
    """`launcher run` flags for every field of a validated spec (the cluster's address aside:
    inside the job Ray's RAY_ADDRESS names it)."""
    argv = flags.to_argv(spec, skip=("address",))
    for key, value in sorted(spec.params.items()):
        argv += ["--param", f"{key}={value}"]
    return argv


PROGRAM_FIELDS = ("framework", "backend", "workers", "cpus_per_worker", "gpus_per_worker", "storage", "name",
                  "max_failures", "mlflow")


def entrypoint(spec, program=None, program_args: list[str] | tuple[str, ...] = (), job_dir: bool = True) -> str:
    """The job's shell command: the cluster's ``python`` (the one Ray runs on) runs the launcher.
    A program runs from the job's working directory, which is its shipped folder."""
    if program is None:
        return shlex.join(["python", "-m", "launcher", "run", *run_argv(spec)])
    # A program's run takes only the flags that shape its workers and its run folder.
    shaping = flags.to_argv(spec, skip=tuple(f.name for f in schema.fields(type(spec)) if f.name not in PROGRAM_FIELDS))
    return shlex.join(["python", "-m", "launcher", "run", *shaping, *program.to_argv(),
                       "--job-dir-arg" if job_dir else "--no-job-dir", "--", *program_args])


def runtime_env(environ: dict[str, str] | None = None, workload: str | None = None,
                program=None) -> dict[str, Any]:
    """The job's runtime environment: this launcher's code and the user workload's or
    program's folder (:mod:`launcher.driver.code`), and the variables the run needs to
    reach its storage."""
    from launcher.driver import code

    environ = os.environ if environ is None else environ
    env_vars = {k: environ[k] for k in PASSED_ENV if environ.get(k)}
    env_vars.update(deps.pip_env(environ))  # pip's options, for the nodes' installs of a program's dependencies
    env_vars["RAY_JOB_STOP_WAIT_TIME_S"] = str(STOP_GRACE_S)
    if program is not None:
        env_vars.update(dict(program.env))  # a job file's env: the driver on the cluster passes it on to the ranks
    shipped = code.runtime_env(workload, joining_cluster=True,
                               program=program.runtime_env() if program is not None else None)
    return code.merge(shipped, {"env_vars": env_vars})


def job_id_for(name: str, taken: set[str]) -> str:
    """launcher-<run name>, then -2, -3, ... for later launches of the same run."""
    base = ID_PREFIX + name
    if base not in taken:
        return base
    n = 2
    while f"{base}-{n}" in taken:
        n += 1
    return f"{base}-{n}"


@dataclass(frozen=True)
class Submitted:
    job_id: str
    address: str
    name: str
    entrypoint: str


def submit(spec, address: str | None, program=None, program_args: list[str] | tuple[str, ...] = (),
           job_dir: bool = True) -> Submitted:
    """Submit a validated spec (and the user's program, if any) as a Ray job; returns its id."""
    from launcher.driver import code

    if program is not None:
        code.check_size(program.folder, what=f"the {'package' if program.kind == 'module' else 'script'}'s folder")
    check_store_reach(spec.mlflow, address or os.environ.get("RAY_ADDRESS"),
                      "a submitted run's driver runs on the cluster's head node",
                      "or use `launcher run --address` to drive the run from here")
    client = connect(address)
    command = entrypoint(spec, program, program_args, job_dir)
    env = runtime_env(workload=spec.workload if program is None else None, program=program)
    metadata = {"launcher_run": spec.name, "launcher_version": __version__}
    jobs = client.list_jobs()
    for j in jobs:
        status = str(getattr(j.status, "value", j.status))
        if (j.metadata or {}).get("launcher_run") == spec.name and status not in TERMINAL:
            raise UserError(f"run {spec.name} is already {status} as job {j.submission_id} on this cluster "
                            "(two launches of one run would write the same checkpoints)",
                            f"wait for it (`launcher logs {j.submission_id} --follow`), stop it, or pass "
                            "another --name")
    taken = {j.submission_id for j in jobs if j.submission_id}
    agent_wait_until = time.monotonic() + AGENT_WAIT_S
    said_waiting = False
    clashes = 0
    while clashes < 5:  # someone may take the id between our look and our submit
        job_id = job_id_for(spec.name, taken)
        try:
            client.submit_job(entrypoint=command, submission_id=job_id, runtime_env=env, metadata=metadata)
        except RuntimeError as exc:
            if "already exists" in str(exc):
                taken.add(job_id)
                clashes += 1
                continue
            if NO_AGENT in str(exc) and time.monotonic() < agent_wait_until:
                if not said_waiting:
                    print(f"waiting for the job agent of the head at {client.get_address()} "
                          "(a head that just started registers it within a minute)", file=sys.stderr, flush=True)
                    said_waiting = True
                time.sleep(AGENT_RETRY_S)
                continue
            if NO_AGENT in str(exc):
                raise Unreachable(f"the Ray job server at {client.get_address()} has had no job agent for "
                                  f"{AGENT_WAIT_S:.0f} s", "check the head's dashboard_agent log "
                                  "(/tmp/ray/session_latest/logs/dashboard_agent.log) and `ray status`") from None
            raise UserError(f"the Ray job server at {client.get_address()} refused the job: "
                            f"{_ray_reason(exc)}") from None
        return Submitted(job_id, client.get_address(), spec.name, command)
    raise UserError(f"could not find a free job id for run {spec.name}", "pass another --name")


def _ray_reason(exc: BaseException) -> str:
    """The last meaningful line of a server-side traceback Ray sends back."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and line.strip() != "."]
    return lines[-1].rstrip(".") if lines else type(exc).__name__


# -- watching and stopping ---------------------------------------------------------------

def info(address: str | None, job_id: str) -> dict[str, Any]:
    """The job's details (status, message, entrypoint, times, metadata...) as a plain dict."""
    client = connect(address)
    with _job_errors(client, job_id):
        details = client.get_job_info(job_id)
    dump = getattr(details, "model_dump", None) or details.dict
    out = dump()
    out["status"] = str(getattr(details.status, "value", details.status))
    out["type"] = str(getattr(details.type, "value", details.type))
    return out


def list_jobs(address: str | None) -> list[dict[str, Any]]:
    """The cluster's jobs that the launcher submitted, oldest first."""
    client = connect(address)
    jobs = [j for j in client.list_jobs() if (j.metadata or {}).get("launcher_run")]
    jobs.sort(key=lambda j: j.start_time or 0)
    return [{"job_id": j.submission_id, "run": j.metadata["launcher_run"],
             "status": str(getattr(j.status, "value", j.status)), "start_time": j.start_time,
             "end_time": j.end_time} for j in jobs]


def logs(address: str | None, job_id: str) -> str:
    client = connect(address)
    with _job_errors(client, job_id):
        return client.get_job_logs(job_id)


def follow(address: str | None, job_id: str, write: Callable[[str], None]) -> str:
    """Stream the job's logs through ``write`` until it ends; returns its final status."""
    import asyncio

    client = connect(address)
    with _job_errors(client, job_id):
        client.get_job_status(job_id)  # an unknown id is a clear error, not a closed socket

        async def pump() -> None:
            async for chunk in client.tail_job_logs(job_id):
                write(chunk)

        async def watch() -> None:
            """The log stream alone can wait forever on a server that stopped answering:
            check on the job's status now and then, within a bounded wait."""
            ended = None
            while True:
                await asyncio.sleep(FOLLOW_CHECK_S)
                try:
                    status = await asyncio.wait_for(asyncio.to_thread(client.get_job_status, job_id),
                                                    timeout=request_timeout_s())
                except (asyncio.TimeoutError, OSError, RuntimeError):
                    raise Unreachable(f"the Ray job server at {client.get_address()} stopped answering while "
                                      f"following job {job_id} (no answer within {request_timeout_s():g}s)",
                                      f"the job may still be running: `launcher status {job_id}` or `launcher logs "
                                      f"{job_id} --follow` again once the head answers") from None
                if str(status.value) in TERMINAL:
                    ended = ended or time.monotonic()
                    if time.monotonic() - ended > FOLLOW_CHECK_S:  # the stream did not close: stop anyway
                        return

        async def both() -> None:
            tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(watch())]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            for task in done:
                task.result()  # an exception (the job server gone) is raised here

        asyncio.run(both())
        # The log stream closes when the job ends; the status can lag it a moment.
        return _wait_terminal(client, job_id, timeout_s=60.0)


def stop(address: str | None, job_id: str, wait_s: float = STOP_GRACE_S + 30) -> tuple[bool, str]:
    """Ask Ray to stop the job (SIGTERM, SIGKILL after STOP_GRACE_S) and wait for it to end.

    Returns (whether it was still running, its status after waiting).
    """
    client = connect(address)
    with _job_errors(client, job_id):
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL:
            return False, status
        client.stop_job(job_id)
        return True, _wait_terminal(client, job_id, timeout_s=wait_s)


def _wait_terminal(client, job_id: str, timeout_s: float, poll_s: float = 0.5) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL or time.monotonic() > deadline:
            return status
        time.sleep(poll_s)


def exit_code(status: str) -> int:
    """0 SUCCEEDED, 1 FAILED, 130 STOPPED (like an interrupted `launcher run`); 1 otherwise."""
    return EXIT_CODES.get(status, 1)


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
