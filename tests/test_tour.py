"""The README's five-minute tour as a newcomer walks it (issue 50, items 1, 2 and 7; issue 49's
node names): what each step prints, writes or leaves behind.

The unit tests read the README, the parser and the printed tables. The integration tests run
the real commands as processes: ``launcher up`` then the tour's first command and ``launcher
down`` (once, in a fixture); ``launcher serve`` of that run's model and a Ctrl-C; ``launcher
preemption demo`` to its end and cut short by a Ctrl-C, after which Ray's note of the current
cluster is as it was and no process of the lab is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from launcher.cli.main import build_parser, main
from launcher.driver import localhead, session
from launcher.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tour() -> list[str]:
    """The tour's commands, in the README's order (comments dropped)."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = text.split("## A five-minute tour", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_tour_measures_cold_starts_before_it_starts_the_warm_head_and_stops_it():
    commands = tour()
    assert commands[0] == "launcher run --workers 4 --epochs 3", commands
    up = commands.index("launcher up")
    # `bench overhead` warns that a warm head spoils its cold figures: it comes first.
    assert commands.index("launcher bench overhead") < up, commands
    assert "launcher down" in commands[up + 1:], "the tour leaves its warm head running"
    down = commands.index("launcher down", up)
    assert all(not c.startswith("launcher bench") for c in commands[up:down]), commands


def test_workloads_columns_stay_apart(capsys):
    assert main(["workloads"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0]
    assert header.split() == ["NAME", "FRAMEWORKS", "DESCRIPTION"], header
    frameworks, description = header.index("FRAMEWORKS"), header.index("DESCRIPTION")
    rows = [line for line in lines[1:] if not line.startswith(" ")]
    assert rows and any(row.startswith("digits-mlp") for row in rows)
    for row in rows:
        # Two spaces at least before each column, and each column starts where its header does.
        assert row[frameworks - 2:frameworks] == "  " and row[frameworks] != " ", row
        assert row[description - 2:description] == "  " and row[description] != " ", row
    digits = next(row for row in rows if row.startswith("digits-mlp"))
    assert "torch, tensorflow  scikit-learn's" in re.sub(r" {2,}", "  ", digits), digits


def test_a_long_workload_name_does_not_run_into_its_frameworks():
    from launcher.cli.run import workload_lines

    long = {"name": "a-rather-long-workload-name-of-mine", "frameworks": ["torch", "tensorflow"],
            "description": "mine", "data": "none", "params": {}}
    row = workload_lines([long])[1]
    assert row.startswith("a-rather-long-workload-name-of-mine  torch, tensorflow  mine"), row


def _image_note(image: str) -> str:
    from launcher import jobfiles

    pool = {"machineSpec": {"machineType": "n1-standard-4"}, "replicaCount": 1,
            "pythonPackageSpec": {"executorImageUri": image, "packageUris": ["trainer-0.1.tar.gz"],
                                  "pythonModule": "trainer.task"}}
    job = jobfiles.read({"displayName": "job", "jobSpec": {"workerPoolSpecs": [pool]}}, "job.yaml")
    notes = [n for n in job.notes if "executorImageUri is not used" in n]
    assert len(notes) == 1, job.notes
    return notes[0]


def test_an_image_note_names_the_images_framework():
    from importlib import metadata

    torch, tf = metadata.version("torch"), metadata.version("tensorflow")
    note = _image_note("us-docker.pkg.dev/vertex-ai/training/pytorch-cpu.2-4.py310:latest")
    assert f"PyTorch {torch}" in note and "TensorFlow" not in note, note
    assert "the image has PyTorch 2.4" in note, note  # the version here is not the image's
    note = _image_note("us-docker.pkg.dev/vertex-ai/training/tf-cpu.2-17.py310:latest")
    assert f"TensorFlow {tf}" in note and "PyTorch" not in note, note
    # An image of no known framework: what the nodes have, both frameworks named.
    note = _image_note("us-central1-docker.pkg.dev/me/trainers/digits:v3")
    assert f"PyTorch {torch}" in note and f"TensorFlow {tf}" in note, note


def _subparser(parser, *names):
    for name in names:
        action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = action.choices[name]
    return parser


def test_every_flag_of_bench_overhead_has_help(capsys):
    overhead = _subparser(build_parser(), "bench", "overhead")
    missing = [a.option_strings for a in overhead._actions if a.option_strings and not a.help]
    assert missing == []
    with pytest.raises(SystemExit):
        main(["bench", "overhead", "--help"])
    out = capsys.readouterr().out
    assert re.search(r"--repeats REPEATS\s+rounds of the variants", out), out


def test_bench_overhead_refuses_a_bad_repeat_count_in_one_line(capsys):
    assert main(["bench", "overhead", "--repeats", "0"]) == 2
    err = capsys.readouterr().err
    assert "--repeats" in err and len(err.strip().splitlines()) == 1, err


def test_the_warm_head_takes_every_run_a_cold_start_takes():
    """Whatever a launch without the head accepts (its own Ray is sized to the request) fits on
    a head of the default size."""
    cores = 2
    head = localhead.default_cpus(cores)
    assert head == localhead.LOCAL_OVERSUBSCRIPTION * cores == session.LOCAL_OVERSUBSCRIPTION * cores
    for workers in range(1, 20):
        for cpus_per_worker in (0.5, 1, 2):
            try:
                session.check_local_fit(workers, cpus_per_worker, cores=cores)
            except UserError:  # refused cold: nothing to compare
                continue
            node = session.NodeResources("head", head, 0)
            session.check_fits([node], workers, cpus_per_worker, 0)


def test_a_run_that_does_not_fit_elsewhere_keeps_the_general_hint():
    with pytest.raises(UserError) as refused:
        session.check_fits([session.NodeResources("n", 2, 0)], 4, 1, 0)
    assert "room for 2" in str(refused.value) and "lower --workers" in str(refused.value)
    assert "launcher down" not in str(refused.value)


def test_up_and_down_refuse_or_report_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(localhead.STATE_ENV, str(tmp_path / "state"))
    assert main(["up", "--num-cpus", "0"]) == 2
    err = capsys.readouterr().err
    assert "--num-cpus must be >= 1" in err and len(err.strip().splitlines()) == 1, err
    assert main(["down"]) == 0
    assert capsys.readouterr().out.strip() == "no warm local Ray was running"


def test_serve_is_ready_at_its_first_health_answer_not_when_ray_serve_says_so():
    """Ray Serve's run() returned seconds after the server answered: readiness is the answer."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from launcher.predict import serve

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    release = threading.Event()
    try:
        started = time.time()
        serve._deployed(release.wait, server.server_address[1])  # run() still going
        assert time.time() - started < 2.0
    finally:
        release.set()
        server.shutdown()
        server.server_close()

    def fails():
        raise RuntimeError("the deployment failed")

    with pytest.raises(RuntimeError, match="the deployment failed"):
        serve._deployed(fails, server.server_address[1])  # nothing answers there now
    started = time.time()
    serve._deployed(lambda: time.sleep(0.3), None)  # on a cluster: run() returning is the sign
    assert time.time() - started >= 0.3


# -- integration: real processes --------------------------------------------------------------------


def _env(tmp_path) -> dict:
    """The environment of a new shell: an in-process launch earlier in the session leaves Ray's address
    and its Ray Train settings in this process. (A warm head's processes inherit what `launcher up`
    had; a run that changed a Ray Train setting would give its controller other settings than its
    workers, and only the workers would find ready processes.)"""
    env = {**os.environ, localhead.STATE_ENV: str(tmp_path / "state"), "PYTHONUNBUFFERED": "1"}
    for name in [k for k in env if k.startswith("RAY_TRAIN_")] + ["RAY_ADDRESS", "RAY_AUTH_MODE",
                                                                    "LAUNCHER_RAY_TRAIN_SET"]:
        env.pop(name, None)
    return env


def _launcher(env, *argv, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _gone(pid: int, timeout_s: float = 15) -> bool:
    import psutil

    end = time.time() + timeout_s
    while time.time() < end:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def warm_tour(tmp_path_factory) -> dict:
    """`launcher up`, runs on that warm head and `launcher down`, as processes: what each printed, the
    head's state file, its ready processes and how long `launcher down` took. On the head: `launcher
    up` again, a default run (which starts its actors in the processes the warm-up left), a probe of
    the head's actors, a run too big for the head, then the tour's first command. The serve test then
    serves the model the tour's run trained (after `launcher down`, as the README's serve comes before
    `launcher up`: it starts a Ray of its own), instead of training one of its own."""
    from launcher.lab.gcs_emulator import free_port

    folder = tmp_path_factory.mktemp("tour")
    env, port = _env(folder), str(free_port())
    state, storage = str(folder / "state"), str(folder / "runs")
    first = tour()[0].split()[1:]  # run --workers 4 --epochs 3
    seen: dict = {"port": port, "storage": storage, "head": None, "ran": None}
    seen["up"] = _launcher(env, "up", "--port", port, timeout=300)
    try:
        if seen["up"].returncode == 0:
            seen["head"] = json.load(open(folder / "state" / "local-head.json"))
            seen["ready"] = _ready_processes(state, 4)
            seen["again"] = _launcher(env, "up", timeout=60)
            # A setting the warm-up did not have: a run's settings travel in its config, not in
            # the runtime environment an idle process must match.
            seen["default"] = _launcher({**env, "LAUNCHER_USAGE_S": "2"}, "run", "--storage", storage,
                                        "--epochs", "1", "--json")
            probe = ("import ray; ray.init(address='127.0.0.1:%s', logging_level='ERROR');"
                     "print(sorted({a['ActorClassName'] for a in ray._private.state.actors().values()}))" % port)
            seen["actors"] = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                                            env={**env, "RAY_AUTH_MODE": "token"}, timeout=120)
            seen["after"] = _ready_processes(state, 4)
            seen["too_big"] = _launcher(env, "run", "--storage", storage, "--workers",
                                        str(localhead.default_cpus() + 1), timeout=120)
            seen["ran"] = _launcher(env, *first, "--storage", storage, "--json")
    finally:
        started = time.time()
        seen["down"] = _launcher(env, "down", timeout=120)
        seen["took"] = time.time() - started
    return seen


@pytest.mark.integration
def test_after_launcher_up_the_tours_first_run_runs_and_down_stops_the_head_in_seconds(warm_tour):
    up, ran, down, port, head = (warm_tour[k] for k in ("up", "ran", "down", "port", "head"))
    cpus = localhead.default_cpus()
    assert up.returncode == 0 and f"with {cpus} CPUs" in up.stdout, up.stdout + up.stderr
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert f"using the warm local Ray at 127.0.0.1:{port}" in ran.stderr
    summary = json.loads(ran.stdout)
    assert summary["status"] == "succeeded" and summary["workers"] == 4, summary
    assert down.returncode == 0 and down.stdout.strip() == "stopped the warm local Ray", down
    assert f"stopping the warm local Ray at 127.0.0.1:{port} (pid {head['pid']})" in down.stderr, down.stderr
    took = warm_tour["took"]
    assert took < 20, f"launcher down took {took:.1f}s"  # Ray's drain made it 30 s
    assert _gone(head["pid"], 1), "the head's `ray start` outlived `launcher down`"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()


@pytest.mark.integration
def test_the_warm_head_keeps_processes_ready_between_runs_and_refuses_a_run_too_big_for_it(warm_tour):
    """The warm-up was a run like the user's: it left one idle process per actor of a default run
    (2 workers, Ray Train's controller and its synchronisation actor), torch loaded. The next default
    run, with a setting of its own, started its actors in them (they ended with it) and left as
    many again."""
    up = warm_tour["up"]
    assert up.returncode == 0, up.stderr[-3000:]
    assert "warming it up" in up.stderr and "processes ready for the next run" in up.stderr
    ready, after = warm_tour["ready"], warm_tour["after"]
    assert len(ready) == 4, ready
    assert "already running" in warm_tour["again"].stdout
    default = warm_tour["default"]
    assert default.returncode == 0, default.stderr[-3000:]
    assert f"using the warm local Ray at 127.0.0.1:{warm_tour['port']}" in default.stderr
    assert json.loads(default.stdout)["status"] == "succeeded"
    # Nothing preempts this machine and the run could not restart: neither Ray Train's preemption
    # watcher nor the launcher's progress board was started on the head.
    actors = warm_tour["actors"]
    assert "RayTrainWorker" in actors.stdout, actors.stderr[-1500:]
    assert "PreemptionWatcher" not in actors.stdout and "ProgressBoard" not in actors.stdout, actors.stdout
    assert len(after) == 4 and not after & ready, (ready, after)
    # A run asking for more CPUs than the head has: one line, naming what helps.
    cpus = localhead.default_cpus()
    too_big = warm_tour["too_big"]
    assert too_big.returncode == 2 and f"room for {cpus}" in too_big.stderr, too_big.stderr
    error = [line for line in too_big.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, too_big.stderr
    assert "`launcher down`" in error[0] and f"launcher up --num-cpus {cpus + 1}" in error[0], error[0]


def _ready_processes(state_dir: str, expected: int, timeout_s: float = 120.0) -> set[int]:
    """Idle Ray worker processes of a warm head's torch runs (their job's settings name
    ``state_dir``) that have torch loaded, once there are ``expected`` (they start after the run)."""
    deadline = time.time() + timeout_s
    while len(found := _ready_now(state_dir)) < expected and time.time() < deadline:
        time.sleep(0.5)
    return found


def _ready_now(state_dir: str) -> set[int]:
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                idle = f.read().startswith(b"ray::IDLE")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{pid}/maps", "rb") as f:
                torch_loaded = b"libtorch" in f.read()
        except OSError:
            continue
        if idle and torch_loaded and f"LAUNCHER_STATE_DIR={state_dir}".encode() in environ \
                and b"LAUNCHER_PRELOAD=torch" in environ:
            found.add(int(pid))
    return found


@pytest.mark.integration
def test_serve_says_serving_when_it_answers_and_a_ctrl_c_then_stops_it(tmp_path, warm_tour):
    """Before: /healthz answered seconds before "serving" (1 to 6 s here), and a Ctrl-C once it
    served exited 0 without a word. It serves the tour's first run (the warm_tour fixture's, its
    warm head stopped since), with a state folder of its own: no warm head, its own Ray."""
    import http.client

    from launcher.lab.gcs_emulator import free_port

    env = _env(tmp_path)
    trained = warm_tour["ran"]
    assert trained is not None and trained.returncode == 0, "the tour's first run trained no model to serve"
    name = json.loads(trained.stdout)["name"]
    port = free_port()
    log = open(tmp_path / "serve.err", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--run", name, "--storage",
                             warm_tour["storage"], "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    first_answer: list[float] = []

    def poll() -> None:
        while proc.poll() is None and not first_answer:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    first_answer.append(time.time())
            except (OSError, http.client.HTTPException):
                time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        line = proc.stdout.readline()
        said = time.time()
        log.seek(0)
        assert line.startswith("serving "), line + log.read()[-3000:]
        poller.join(30)
        assert first_answer, "the server never answered /healthz"
        assert said - first_answer[0] < 3.0, f"'serving' came {said - first_answer[0]:.1f}s after /healthz answered"
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    err = log.read()
    log.close()
    assert code == 0, err[-3000:]
    assert f"stopped the model server at http://127.0.0.1:{port}" in err, err[-3000:]
    listed = _launcher(env, "serve", "--list", timeout=60)
    assert "no model server is running on this machine" in listed.stdout, listed.stdout


# -- the preemption demo: nothing of its lab is left ----------------------------------------------


def _current_cluster_file() -> str:
    from ray._common.utils import get_ray_address_file

    return get_ray_address_file(None)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _lab_of(stderr: str) -> tuple[str, str, str]:
    """(GCS port, folder, lab id) from the demo's 'lab: Ray head at ...' line."""
    found = re.search(r"lab: Ray head at \S+:(\d+), its files in (\S+) ", stderr)
    assert found, stderr[-3000:]
    port, folder = found.groups()
    return port, folder, os.path.basename(folder).removeprefix("launcher-lab-")


def _lab_processes(port: str, folder: str, lab_id: str, timeout_s: float = 20) -> list[str]:
    """The processes whose command line names the lab's folder or port, or whose environment
    names the lab, once they have had ``timeout_s`` to go."""
    import psutil

    end = time.time() + timeout_s
    while True:
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmd = " ".join(proc.info["cmdline"] or [])
                ours = folder in cmd or f":{port}" in cmd or f"port={port}" in cmd
                ours = ours or proc.environ().get("LAUNCHER_LAB_ID") == lab_id
                if ours and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{proc.pid} {cmd[:150]}")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if not found or time.time() > end:
            return found
        time.sleep(0.5)


@pytest.mark.integration
@pytest.mark.chaos
def test_the_preemption_demo_leaves_nothing_behind_and_names_its_nodes(tmp_path):
    env = _env(tmp_path)
    note_before = _read(_current_cluster_file())
    demo = _launcher(env, "preemption", "demo", "--storage", str(tmp_path / "runs"), "--json", timeout=600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    port, folder, lab_id = _lab_of(demo.stderr)
    assert _read(_current_cluster_file()) == note_before
    assert not os.path.exists(folder), os.listdir(folder)
    assert _lab_processes(port, folder, lab_id) == []
    assert "Raylet is terminated" not in demo.stderr  # a node's processes go together
    # Every node by its own name and id: the preempted one can be told from the others.
    added = re.findall(r"lab: node added: (worker \d+) \(Ray node (ffff\.\.\.\d+)\)", demo.stderr)
    assert len(added) >= 3 and len({name for name, _ in added}) == len(added), added
    noticed = re.search(r"lab: preemption notice: (worker \d+) \(Ray node (\S+)\)", demo.stderr)
    removed = re.search(r"lab: node removed: (worker \d+) \(Ray node (\S+)\)", demo.stderr)
    assert noticed and removed and noticed.groups() == removed.groups(), demo.stderr[-3000:]
    assert noticed.groups() in added
    assert f"watcher on {noticed[1]}: drained Ray node {noticed[2]} with reason PREEMPTION" in demo.stderr
    assert "node ffffffff" not in demo.stderr and "ffffffffffff..." not in demo.stderr
    assert json.loads(demo.stdout)["preemptions"] == 1


@pytest.mark.integration
@pytest.mark.chaos
def test_a_ctrl_c_mid_demo_leaves_nothing_behind(tmp_path):
    env = _env(tmp_path)
    note_before = _read(_current_cluster_file())
    log = open(tmp_path / "demo.err", "w+")
    # Its own process group, which a terminal's Ctrl-C signals as a whole.
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "preemption", "demo", "--storage",
                             str(tmp_path / "runs")], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log,
                            text=True, start_new_session=True)
    try:
        end = time.time() + 300
        while time.time() < end and proc.poll() is None:
            log.seek(0)
            if "starting 2 torch/native workers" in log.read():
                break
            time.sleep(0.5)
        time.sleep(2)
        assert proc.poll() is None, "the demo ended before the Ctrl-C"
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log.seek(0)
    err = log.read()
    log.close()
    assert code == 130, err[-3000:]
    port, folder, lab_id = _lab_of(err)
    assert _read(_current_cluster_file()) == note_before
    assert not os.path.exists(folder)
    assert _lab_processes(port, folder, lab_id) == []
