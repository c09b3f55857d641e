"""launcher.driver.jobs and its commands: runs submitted as Ray jobs to a real Ray head.

The integration tests start their own head (`ray start --head --block` with a
dashboard on a free loopback port, token authentication on with a token of
their own) in a process group they own, and end only that group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from launcher.driver import jobs as submit
from launcher.cli.main import build_parser, main
from launcher.cli.options import spec_from_args
from launcher import settings
from launcher.lab.gcs_emulator import free_port
from launcher.storage import Storage

HEAD_START_S = 120


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *needles: str, exit_code: int = 2) -> str:
    assert code == exit_code, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# -- without Ray -------------------------------------------------------------------------

def test_run_argv_round_trips_the_spec():
    args = build_parser().parse_args(["run", "--workload", "resnet18-synthetic", "--workers", "3", "--lr", "0.05",
                                      "--cpus-per-worker", "0.5", "--param", "image_size=32", "--name", "r1",
                                      "--checkpoint-every-steps", "7", "--address", "ray://elsewhere:10001"])
    spec = spec_from_args(args)
    again = spec_from_args(build_parser().parse_args(["run", *submit.run_argv(spec)]))
    assert again == dataclasses.replace(spec, address=None)
    assert "--address" not in submit.run_argv(spec)  # inside the job, Ray's RAY_ADDRESS names the cluster
    command = submit.entrypoint(spec)
    assert command.startswith("python -m launcher run ") and "--param image_size=32" in command


@pytest.mark.parametrize("flag,expected", [
    ([], False), (["--hvd-fp16"], True), (["--hvd-fp16", "true"], True), (["--hvd-fp16", "false"], False),
    (["--hvd-fp16", "no"], False),
])
def test_submit_takes_boolean_flags_like_run(flag, expected):
    # `submit --hvd-fp16 false` used to be taken as true, and a bare `submit --hvd-fp16` was an error.
    for command in ("run", "submit"):
        spec = spec_from_args(build_parser().parse_args([command, "--backend", "horovod", *flag]))
        assert spec.hvd_fp16 is expected, (command, flag)
        again = spec_from_args(build_parser().parse_args(["run", *submit.run_argv(spec)]))
        assert again.hvd_fp16 is expected


def test_a_bad_boolean_is_one_line(capsys):
    code, out, err = run_cli(capsys, "submit", "--backend", "horovod", "--hvd-fp16", "maybe")
    one_line_error(code, err, "--hvd-fp16", "expected true or false, got 'maybe'")


def test_job_ids_are_readable_and_unique():
    assert submit.job_id_for("digits_1", set()) == "launcher-digits_1"
    assert submit.job_id_for("digits_1", {"launcher-digits_1"}) == "launcher-digits_1-2"
    assert submit.job_id_for("d", {"launcher-d", "launcher-d-2", "launcher-d-3"}) == "launcher-d-4"


def test_runtime_env_carries_code_and_storage_env_but_no_credentials():
    env = submit.runtime_env({"STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443",
                              "GOOGLE_APPLICATION_CREDENTIALS": "/home/me/key.json", "RAY_AUTH_TOKEN": "t"})
    assert sorted(os.path.basename(p) for p in env["py_modules"]) == ["launcher", "workloads"]
    assert env["env_vars"]["STORAGE_EMULATOR_HOST"] == "http://127.0.0.1:4443"
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in env["env_vars"] and "RAY_AUTH_TOKEN" not in env["env_vars"]
    assert int(env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"]) >= 10
    assert "__pycache__/" in env["excludes"]


def test_a_warm_head_run_passes_the_launchers_settings_but_no_credentials():
    from launcher.driver import code

    passed = code.passed_env({"LAUNCHER_FAULT_PAUSE": "setup:8", "STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443",
                              "MLFLOW_EXPERIMENT_NAME": "e", "LAUNCHER_CACHE": "", "OMP_NUM_THREADS": "1",
                              "GOOGLE_APPLICATION_CREDENTIALS": "/home/me/key.json", "RAY_AUTH_TOKEN": "t"})
    assert passed == {"LAUNCHER_FAULT_PAUSE": "setup:8", "STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443",
                      "MLFLOW_EXPERIMENT_NAME": "e"}


def test_auth_token_sources(monkeypatch, tmp_path):
    for env in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(env, raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("abc123\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token_file))
    assert submit.auth_headers() == {"Authorization": "Bearer abc123"}
    monkeypatch.setenv("RAY_AUTH_TOKEN", "fromenv")
    assert submit.auth_headers() == {"Authorization": "Bearer fromenv"}
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert submit.auth_headers() == {}


# Bad input exits 2; a job server that does not answer is an outage, not bad input: exit 1.
@pytest.mark.parametrize("argv,env,needles,exit_code", [
    (["status", "j"], {}, ["no Ray cluster to submit to", "--address http://"], 2),
    (["status", "j", "--address", "127.0.0.1:8265"], {}, ["is not the dashboard's http:// address"], 2),
    (["logs", "j"], {"RAY_ADDRESS": "ray://head:10001"}, ["RAY_ADDRESS 'ray://head:10001' is not the dashboard"], 2),
    (["stop", "j", "--address", "http://127.0.0.1:{free}"], {},
     ["cannot reach the Ray job server", "is the cluster up"], 1),
    (["submit", "--address", "http://127.0.0.1:{free}", "--epochs", "1"], {},
     ["cannot reach the Ray job server", "is the cluster up"], 1),
])
def test_bad_addresses_are_one_line(capsys, monkeypatch, argv, env, needles, exit_code):
    for name in submit.ADDRESS_ENVS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    port = str(free_port())
    code, out, err = run_cli(capsys, *[a.replace("{free}", port) for a in argv])
    one_line_error(code, err, *needles, exit_code=exit_code)
    assert out == ""


def test_a_server_that_never_answers_is_a_bounded_wait(capsys, monkeypatch):
    import socket
    import threading
    import time

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()  # and silence
    monkeypatch.setenv("LAUNCHER_JOB_TIMEOUT_S", "2")
    started = time.time()
    try:
        code, out, err = run_cli(capsys, "status", "j", "--address", f"http://127.0.0.1:{server.getsockname()[1]}")
    finally:
        server.close()
    assert time.time() - started < 30
    one_line_error(code, err, "did not answer within 2s", "LAUNCHER_JOB_TIMEOUT_S", exit_code=1)


class _AgentlessJobServer:
    """A loopback HTTP server that answers the calls Ray's JobSubmissionClient makes for a
    submission, and refuses the first ``refusals`` submissions as a head whose job agent has
    not registered yet does (Ray 2.60's job_head: HTTP 500, "No available agent ...")."""

    def __init__(self, refusals: int) -> None:
        import http.server
        import ray

        server = self
        self.refusals, self.posts = refusals, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, code: int, body) -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/api/version":
                    self._answer(200, {"version": "4", "ray_version": ray.__version__, "ray_commit": "x"})
                elif self.path == "/api/jobs/":
                    self._answer(200, [])
                else:  # /api/packages/...: not there yet, so the client uploads it
                    self._answer(404, "not found")

            def do_PUT(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer(200, "")

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                server.posts += 1
                if server.posts <= server.refusals:
                    self._answer(500, "No available agent to submit job, please try again later.")
                else:
                    self._answer(200, {"submission_id": request["submission_id"], "job_id": None})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_head_whose_job_agent_is_not_up_yet_is_waited_for_then_given_up_on(capsys, monkeypatch, tmp_path):
    """Right after `ray up` the dashboard answers before the head's job agent registers: the
    submission waits for it (saying so once) instead of failing; an agent that never comes is one line."""
    monkeypatch.setattr(submit, "AGENT_RETRY_S", 0.05)
    argv = ["submit", "--workload", "digits-mlp", "--epochs", "1", "--storage", str(tmp_path / "runs"),
            "--name", "agentless"]
    late = _AgentlessJobServer(refusals=3)
    try:
        code, out, err = run_cli(capsys, *argv, "--address", late.url)
    finally:
        late.close()
    assert code == 0, err
    assert late.posts == 4 and out.strip() == "launcher-agentless"
    assert err.count("waiting for the job agent") == 1
    never = _AgentlessJobServer(refusals=10**6)
    monkeypatch.setattr(submit, "AGENT_WAIT_S", 0.5)
    try:
        code, out, err = run_cli(capsys, *argv, "--address", never.url)
    finally:
        never.close()
    assert never.posts > 1
    assert code == 1 and "has had no job agent for" in err and "dashboard_agent.log" in err, err
    assert "Traceback" not in err


# -- against a real Ray head -------------------------------------------------------------

@contextlib.contextmanager
def ray_head(num_cpus: int = 2):
    """A Ray head with a dashboard on loopback; yields its http:// job server address.

    It runs under `ray start --block` in a new session; stopping means ending that
    process group (and any process left that names this head's temp dir), never `ray stop`.
    """
    temp = tempfile.mkdtemp(prefix="lsub-")  # short: Ray's socket paths live under it
    dashboard = free_port()
    env = {k: v for k, v in os.environ.items() if k not in submit.ADDRESS_ENVS}
    token = secrets.token_hex(16)
    env.update({
        # The job's `python` must be this one (with Ray and our dependencies).
        "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,  # Ray 2.60's default, with our own token
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # else SIGTERM drains the node for 30 s
    })
    ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    cmd = [ray, "start", "--head", "--block", f"--port={free_port()}", "--node-ip-address=127.0.0.1",
           f"--dashboard-port={dashboard}", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
           f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
           f"--metrics-export-port={free_port()}", f"--num-cpus={num_cpus}", f"--temp-dir={temp}",
           "--disable-usage-stats"]
    log = open(os.path.join(temp, "head.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_job_server(proc, address, token, temp)
        yield address, token
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in _pids_naming(temp):  # any process of this head that left the group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _pids_naming(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
    return pids


def _wait_for_job_server(proc, address: str, token: str, temp: str) -> None:
    import requests

    deadline = time.time() + HEAD_START_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("ray start failed:\n" + open(os.path.join(temp, "head.log")).read()[-3000:])
        with contextlib.suppress(requests.RequestException):
            r = requests.get(address + "/api/jobs/", headers={"Authorization": f"Bearer {token}"}, timeout=2)
            if r.status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"no job server at {address} after {HEAD_START_S}s")


@pytest.fixture(scope="module")
def head():
    with ray_head() as (address, token), pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_TOKEN", token)
        for name in submit.ADDRESS_ENVS:
            mp.delenv(name, raising=False)
        yield address


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 1.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.integration
def test_submit_a_trainer_package(head, capsys, tmp_path):
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                           "trainer_package")
    storage = str(tmp_path / "runs")
    code, out, err = run_cli(capsys, "submit", "--address", head, "--package", example, "--module", "trainer.task",
                             "--workers", "2", "--storage", storage, "--name", "sub_pkg", "--follow", "--",
                             "--epochs", "1")
    assert code == 0, out + err
    assert "run sub_pkg: succeeded" in out and "exit status rank 0: 0, rank 1: 0" in out, out
    run_dir = os.path.join(storage, "sub_pkg")
    assert f"[rank 0] exported the model to {run_dir}/model/ after 22 steps" in out  # --job-dir, AIP_MODEL_DIR
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["workload"] == "module:trainer.task" and summary["metrics"]["accuracy"] > 0.5, summary
    code, out, _ = run_cli(capsys, "status", "launcher-sub_pkg", "--address", head, "--json")
    shipped = json.loads(out)["runtime_env"]
    assert shipped["working_dir"].startswith("gcs://") and len(shipped["py_modules"]) == 2  # the package, our code


@pytest.mark.integration
def test_submit_follow_to_succeeded(head, capsys, tmp_path):
    storage = str(tmp_path / "runs")
    code, out, err = run_cli(capsys, "submit", "--address", head, "--workers", "2", "--epochs", "1",
                             "--storage", storage, "--name", "sub_ok", "--follow")
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0] == "launcher-sub_ok"
    assert "run sub_ok: succeeded" in out and "epochs 1/1" in out, out
    assert "job launcher-sub_ok: SUCCEEDED" in err
    # The run joined the head through the RAY_ADDRESS Ray gave the job; it started no Ray of its own.
    assert "connecting to Ray at " in out and "starting a local Ray" not in out
    summary = json.load(open(os.path.join(storage, "sub_ok", "summary.json")))
    assert (summary["status"], summary["workers"], summary["epochs_completed"]) == ("succeeded", 2, 1)
    assert summary["checkpoint"] and os.path.isdir(summary["checkpoint"])

    code, out, _ = run_cli(capsys, "status", "launcher-sub_ok", "--address", head)
    assert code == 0 and out.startswith("job launcher-sub_ok: SUCCEEDED") and "run: sub_ok" in out
    code, out, _ = run_cli(capsys, "status", "launcher-sub_ok", "--address", head, "--json")
    details = json.loads(out)
    assert details["status"] == "SUCCEEDED" and details["driver_exit_code"] == 0
    assert len(details["runtime_env"]["py_modules"]) == 2  # launcher/ and workloads/, shipped
    code, out, _ = run_cli(capsys, "logs", "launcher-sub_ok", "--address", head)
    assert code == 0 and "run sub_ok: succeeded" in out

    # The same run again is a new job with the next id; the run is already complete.
    code, out, err = run_cli(capsys, "submit", "--address", head, "--epochs", "1", "--storage", storage,
                             "--name", "sub_ok", "--follow", "--json")
    assert code == 0, out + err
    assert json.loads(out.splitlines()[0])["job_id"] == "launcher-sub_ok-2"
    assert "nothing to train" in out

    code, out, _ = run_cli(capsys, "jobs", "--address", head, "--json")
    assert [(j["job_id"], j["run"], j["status"]) for j in json.loads(out) if j["run"] == "sub_ok"][:2] == [
        ("launcher-sub_ok", "sub_ok", "SUCCEEDED"), ("launcher-sub_ok-2", "sub_ok", "SUCCEEDED")]


@pytest.mark.integration
@pytest.mark.gcs
def follow_a_job_server_that_stops_answering(head: str, job: str, capsys, monkeypatch) -> None:
    """`logs --follow` while the head's job server freezes (SIGSTOP): one line, in bounded time."""
    import psutil

    port = int(head.rsplit(":", 1)[1])
    (server,) = {psutil.Process(c.pid) for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid}
    monkeypatch.setattr(submit, "FOLLOW_CHECK_S", 1.0)
    monkeypatch.setenv(settings.JOB_TIMEOUT_S, "3")
    result = {}
    follower = threading.Thread(target=lambda: result.update(code=main(["logs", job, "--address", head, "--follow"])))
    follower.start()
    wait_for(lambda: "epoch" in capsys.readouterr().out or None, 60, "the followed logs", poll_s=0.2)
    server.suspend()
    frozen = time.time()
    try:
        follower.join(60)
        took = time.time() - frozen
    finally:
        server.resume()
    assert not follower.is_alive() and result["code"] == 1, result
    err = capsys.readouterr().err
    one_line_error(1, err, f"stopped answering while following job {job}", exit_code=1)
    assert took < 20, took  # a check every 1 s, each answer awaited 3 s (and the request's own 3 s)


@pytest.mark.integration
def test_stop_a_long_run(head, capsys, bucket, monkeypatch):
    # Storage on the Cloud Storage emulator: the job reaches it only through the
    # STORAGE_EMULATOR_HOST that submit passes on (the head was started without it).
    storage = f"gs://{bucket}/runs"
    code, out, err = run_cli(capsys, "submit", "--address", head, "--workers", "1", "--epochs", "1000",
                             "--storage", storage, "--name", "sub_long")
    assert code == 0, err
    job = out.strip()
    assert job == "launcher-sub_long"
    code, out, err = run_cli(capsys, "submit", "--address", head, "--storage", storage, "--name", "sub_long")
    one_line_error(code, err, "run sub_long is already", "as job launcher-sub_long")
    # Stop it once it trains (an epoch line in its logs), not while it starts.
    wait_for(lambda: "epoch 1/1000" in submit.logs(head, job), 150, "the first epoch")
    follow_a_job_server_that_stops_answering(head, job, capsys, monkeypatch)
    code, out, err = run_cli(capsys, "stop", job, "--address", head)
    assert code == 0, err
    assert out.strip() == f"job {job}: STOPPED"
    code, out, _ = run_cli(capsys, "logs", job, "--address", head, "--follow")
    assert code == 130 and "epoch 1/1000" in out
    # The run caught SIGTERM in the grace Ray gave it and recorded itself as cancelled.
    summary = json.loads(Storage.resolve(storage).read_text("sub_long", "summary.json"))
    assert summary["status"] == "cancelled" and 1 <= summary["epochs_completed"] < 1000
    code, out, _ = run_cli(capsys, "stop", job, "--address", head)
    assert code == 0 and "had already ended: STOPPED" in out


@pytest.mark.integration
def test_bad_flags_and_unknown_jobs_against_a_head(head, capsys, tmp_path):
    before = run_cli(capsys, "jobs", "--address", head, "--json")[1]
    code, out, err = run_cli(capsys, "submit", "--address", head, "--workers", "0")
    one_line_error(code, err, "workers must be >= 1")
    code, out, err = run_cli(capsys, "submit", "--address", head, "--workload", "mnist")
    one_line_error(code, err, "unknown workload 'mnist'")
    assert run_cli(capsys, "jobs", "--address", head, "--json")[1] == before  # nothing was submitted
    # Data is checked where the run runs, so a missing file fails the job, not the submission.
    code, out, err = run_cli(capsys, "submit", "--address", head, "--workload", "mnist-mlp", "--data",
                             "/no/such/mnist", "--name", "sub_nodata", "--storage", str(tmp_path), "--follow")
    assert code == 1, out + err
    assert "launcher-sub_nodata: FAILED" in err and "/no/such/mnist" in out
    for command in ("status", "logs", "stop"):
        code, out, err = run_cli(capsys, command, "launcher-nope", "--address", head)
        one_line_error(code, err, "no job 'launcher-nope'", "launcher jobs --address")


@pytest.mark.integration
def test_a_wrong_token_is_one_line(head, capsys, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-token")
    code, out, err = run_cli(capsys, "status", "launcher-sub_ok", "--address", head)
    one_line_error(code, err, "refused", "token")
