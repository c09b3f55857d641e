"""The whole ``ray up`` rehearsal: the real ``ray up`` over real SSH to this machine, a run, ``ray down``.

:func:`rehearse_up` takes a generated cluster file and, on this machine:

1. starts the local Compute Engine API (:class:`LoopbackAPI`: the head VM it
   creates has networkIP and natIP 127.0.0.1, and the ``ssh-keys`` Ray's
   bootstrap puts in the project's metadata are installed for the VM's sshd)
   and the "VM", a real sshd on a free loopback port in a PID namespace
   (:mod:`launcher.lab.sshd`);
2. runs ``launcher cluster up --skip-preflight`` (Ray's own ``ray up -y``,
   and the deletion of what it made if it fails) in a subprocess whose Google
   API clients are pointed at the local API by a ``sitecustomize`` module on
   PYTHONPATH and ``LAUNCHER_COMPUTE_ENDPOINT`` (the head's sessions get the
   module too, so the autoscaler Ray starts on the head talks to the same
   API): bootstrap, the head's insert, SSH, the file mounts (rsync of the
   project), the initialization and setup commands, ``ray start --head``;
3. ``ray exec ... 'ray status'``, then ``launcher submit --follow`` of a short
   run (digits-mlp, one epoch) whose checkpoints go to the Cloud Storage
   emulator, and lists them there;
4. ``launcher cluster down`` (``ray down -y``, then the VMs and disks it
   left), then checks that the API holds no VM or disk and that no process of
   the rehearsal's Ray is left; stopping sshd ends its PID namespace.

With an injected failure (``fail_head_setup``: the head's setup ends with a
command that exits 1; ``stockout``: the zone has none of the head's machine
type, and its insert fails with ZONE_RESOURCE_POOL_EXHAUSTED), ``launcher
cluster up`` must fail, and the rehearsal checks it left nothing in the API.

What the rehearsal's copy of the file changes, and why (also in
docs/guides/compute-engine.md): :mod:`launcher.lab.up_copy`.
Workers stay simulated (min_workers is 0 in the copy, and the run fits on
the head) unless one worker VM is asked to join (``join``). What the rehearsal
saw, and how it is said: :mod:`launcher.lab.up_report`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Callable

import yaml

from cluster.compute import ENDPOINT_ENV
from launcher import _deferred
from launcher.errors import LauncherError, UserError
from launcher.lab.compute_api import ComputeAPI
from launcher.lab.compute_world import World
from launcher.lab.rehearsal import _rehearsal_copy, format_call
from launcher.lab.sshd import LoopbackSSHD, free_port
from launcher.lab.up_copy import package_sources, prepare_vm_home, read_steps, snapshot_mounts, up_copy, write_sitecustomize
from launcher.lab.up_report import UpReport, checkpoints, ray_processes, say_setup, up_summary
from launcher.settings import REHEARSAL_KEEP

HEAD_LABEL = ("ray-node-type", "head")  # the label Ray's GCP provider gives the head VM (TAG_RAY_NODE_KIND)
LOOPBACK = "127.0.0.1"
WORKER_IP = "127.0.0.2"  # the worker VM's address: another loopback address, its own sshd
RUN_NAME = "rehearsal"

class RehearsalFailed(LauncherError):
    """A stage of the rehearsal failed (its output's end is printed before)."""


class LoopbackAPI(ComputeAPI):
    """The local Compute Engine API, whose head VM is this machine, reached through ``sshd``; with ``workers``
    (more sshds), the worker VMs it creates are those, in order, at each one's address."""

    def __init__(self, project: str, sshd: LoopbackSSHD, world: World | None = None,
                 workers: tuple[LoopbackSSHD, ...] = ()) -> None:
        super().__init__(project, world)
        self.sshd, self.workers, self.placed = sshd, workers, 0
        self.on_vm: dict[str, LoopbackSSHD] = {}  # worker VM name -> the sshd that is that VM

    def answer(self, method: str, path: str, query: dict[str, str], body: dict) -> dict:
        with self._lock:
            result = super().answer(method, path, query, body)
            if method == "DELETE" and path.rsplit("/", 1)[-1] in self.on_vm:
                self.on_vm.pop(path.rsplit("/", 1)[-1]).stop()  # a deleted VM's processes end with it
            if method == "POST" and path.endswith("/setCommonInstanceMetadata"):
                for vm in (self.sshd, *self.workers):  # what each VM's guest agent does
                    vm.authorize(self.metadata.get("items", []))
            elif method == "POST" and path.endswith("/instances"):
                instance = self.instances.get(str(body.get("name", "")))
                head = instance and instance["labels"].get(HEAD_LABEL[0]) == HEAD_LABEL[1]
                vm = self.sshd if head else None
                if instance and not head and self.placed < len(self.workers):
                    vm, self.placed = self.workers[self.placed], self.placed + 1
                    self.on_vm[instance["name"]] = vm
                if vm is not None:
                    for nic in instance["networkInterfaces"]:
                        nic["networkIP"] = vm.ip
                        for access in nic.get("accessConfigs", []):
                            access["natIP"] = vm.ip
            return result


class _Stages:
    """Runs and times the rehearsal's stages; prints each one's title, API requests and outcome."""

    def __init__(self, api: LoopbackAPI, report: UpReport, say: Callable[[str], None], logs: str) -> None:
        self.api, self.report, self.say, self.logs, self.seen = api, report, say, logs, 0

    @contextlib.contextmanager
    def stage(self, title: str):
        self.say(f"== {title}")
        start = time.monotonic()
        try:
            yield
        finally:
            self.report.stages.append((title, time.monotonic() - start))
            self.requests()
            self.say(f"   ({time.monotonic() - start:.1f} s)")

    def requests(self) -> None:
        """The new API requests: each one that changes something, the reads counted."""
        new = self.api.calls[self.seen:]
        self.seen = len(self.api.calls)
        reads = [c for c in new if c.verb in ("list", "get", "projects.get") or c.verb.endswith(".get")]
        for call in new:
            if call not in reads:
                self.say("   api: " + format_call(call))
        if reads:
            self.say(f"   api: {len(reads)} reads (instance lists, gets, project and IAM lookups)")

    def run(self, name: str, argv: list[str], env: dict[str, str], timeout_s: float,
            show: Callable[[str], bool] = lambda line: False) -> str:
        """Run one command to its end; its output goes to a log, the lines ``show`` picks are printed."""
        self.say("   $ " + shlex.join(argv))
        log = os.path.join(self.logs, name + ".log")
        with open(log, "w+", encoding="utf-8", errors="replace") as out:
            try:
                rc = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = None
            out.seek(0)
            text = _plain(out.read())
        for line in text.splitlines():
            if show(line):
                self.say("   | " + line.rstrip())
        if rc != 0:
            for line in text.splitlines()[-30:]:
                self.say("   ! " + line.rstrip())
            what = "timed out" if rc is None else f"exit {rc}"
            raise RehearsalFailed(f"the rehearsal's {name} failed ({what})", "its output's end is above")
        return text


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "")


def _ray_step(line: str) -> bool:
    """The lines of ``ray up``'s output worth printing: its numbered steps and what it runs."""
    s = line.strip()
    return bool(re.search(r"\[\d+/\d+\]", s)) or any(p in s for p in (
        "Launched a new head", "Fetching the new head", "Success.", "Local node IP", "Ray runtime started",
        "Destroying cluster", "Requested", "terminated", "Stopped all", "Stopped only"))


def rehearse_up(config: dict, emulator_url: str, bucket: str, quotas: dict[str, float] | None = None,
                workers: int = 2, say: Callable[[str], None] = print, timeout_s: float = 600,
                stockout: tuple[str, ...] = (), fail_head_setup: bool = False, fresh: bool = False,
                join: bool = False) -> UpReport:
    """Rehearse ``ray up`` -> ``launcher submit`` -> ``ray down`` of ``config`` on this machine.

    Args:
        emulator_url: the Cloud Storage emulator (``http://127.0.0.1:PORT``) the run checkpoints to.
        bucket: a bucket in it; the run's storage is ``gs://BUCKET/rehearsal``.
        workers: the run's workers (each 1 CPU, on the head).
        timeout_s: the most any one command may take.
        stockout: machine types (``*``: all) out of stock in the zone.
        fail_head_setup: the head's setup fails (a last command exits 1).
        fresh: the head VM starts without this project's venv: its setup commands make it (uv, Python,
            every install, from this machine's package sources: :func:`package_sources`); each step is timed.
        join: one VM of the first worker type joins: a second sshd (127.0.0.2) that the head's autoscaler
            launches through the local API, sets up over SSH and starts Ray on, as it does a real worker.

    Raises:
        RehearsalFailed: a stage failed (what it printed last is said first); the cluster is taken down.
        UserError: the lab or cluster extra is not installed (from _deferred.require).
    """
    for extra in ("lab", "cluster"):
        _deferred.require(extra, "`launcher cluster rehearse --up`")
    report = UpReport(fresh=fresh, injected=" and ".join(
        ([f"a stock-out of {', '.join(stockout)}"] if stockout else []) + (["a failing head setup"]
                                                                           if fail_head_setup else [])))
    root = tempfile.mkdtemp(prefix="lrh-", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        paths = {k: os.path.join(root, k) for k in ("sshd", "site", "laptop", "vm", "logs", "tmp", "mounts",
                                                    "sshd-w", "vm-w")}
        for path in paths.values():
            os.makedirs(path, exist_ok=True)
        ray_tmp = root  # RAY_TMPDIR: Ray's sessions and ray_current_cluster under root/ray
        sources = package_sources() if fresh else {}

        def vm(home: str, folder: str, ip: str, port: int | None = None, identity: str | None = None) -> LoopbackSSHD:
            prepare_vm_home(home, fresh)
            # PYTHONPATH on a node: the sitecustomize, then ~/launcher (the project `ray up` synced there), which
            # stands in for the skipped `pip install ~/launcher` (the venv is shared; its own install may be
            # elsewhere). A fresh node imports what its own install put in its venv.
            path = os.pathsep.join([paths["site"]] + ([] if fresh else [os.path.join(home, "launcher")]))
            env = {"HOME": home, "PYTHONPATH": path, "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
            return LoopbackSSHD(folder, {**env, **sources.get("env", {})}, ip, port, identity)

        # with a worker: the head's autoscaler reaches it with the key Ray puts in the head's home
        sshd = vm(paths["vm"], paths["sshd"], LOOPBACK, identity=os.path.join(paths["vm"], "ray_bootstrap_key.pem")
                  if join else None)
        if join:
            _check_worker_port()
        worker = vm(paths["vm-w"], paths["sshd-w"], WORKER_IP, 22) if join else None
        for line in sources.get("said", []):
            say(line)
        provider = _rehearsal_copy(config)["provider"]
        world = World.with_limits(quotas or {}, provider["availability_zone"])
        world.stocked_out |= set(stockout)
        api = LoopbackAPI(provider["project_id"], sshd, world, (worker,) if worker else ())
        with api:
            write_sitecustomize(paths["site"], api.url)
            with sshd, (worker or contextlib.nullcontext()):
                try:
                    _up_run_down(config, api, sshd, paths, ray_tmp, report, emulator_url, bucket, workers, say,
                                 timeout_s, fail_head_setup, sources.get("drop", ()), worker)
                except RehearsalFailed:
                    say(f"   sshd's log ends: {sshd.log_tail()}")
                    raise
            report.calls = api.calls
    finally:
        if REHEARSAL_KEEP.get():
            say(f"kept the rehearsal's folder (logs, the VM's home, Ray's sessions): {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    say(up_summary(report))
    return report


def _up_run_down(config, api, sshd, paths, ray_tmp, report, emulator_url, bucket, workers, say, timeout_s,
                 fail_head_setup=False, drop=(), worker=None):
    ports = {k: free_port() for k in ("gcs", "object_manager", "dashboard", "client", "agent")}
    worker_ports = {k: free_port() for k in ("object_manager", "agent", "metrics")}
    config, report.commands = up_copy(config, sshd, ports, fail_head_setup, report.fresh, drop,
                                      (worker, worker_ports) if worker else None)
    if worker:
        report.join = next(n for n, t in config["available_node_types"].items() if t.get("min_workers"))
    # this side's commands import the launcher this process runs (the venv's editable install may point elsewhere)
    python_path = os.pathsep.join(p for p in (paths["site"], _source_root(), os.environ.get("PYTHONPATH")) if p)
    # TMPDIR: where `ray up` caches the bootstrapped file (ray exec and ray down read it), removed with the rest
    env = {**os.environ, "HOME": paths["laptop"], "PYTHONPATH": python_path, "RAY_TMPDIR": ray_tmp,
           "TMPDIR": paths["tmp"], ENDPOINT_ENV: api.url,
           "RAY_USAGE_STATS_ENABLED": "0", "STORAGE_EMULATOR_HOST": emulator_url}
    # The head VM's Ray runs in sshd's clean environment, with Ray's default authentication; this
    # side talks to it as a laptop with the defaults does (a token mode set here, e.g. by a warm local
    # head earlier in this process, would make the job client ask for a token the head never made).
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    launcher = [sys.executable, "-m", "launcher"]
    stages = _Stages(api, report, say, paths["logs"])
    say(f"rehearsing `ray up` of cluster {config['cluster_name']!r} on this machine: local Compute Engine API at "
        f"{api.url}; the head VM is {sshd.user}@127.0.0.1 through sshd on port {sshd.port} (own PID namespace)")
    for remote, local in snapshot_mounts(config, paths["mounts"]):
        say(f"file mount {remote}: a copy of {local} as rsync sends it (.gitignore and rsync_exclude applied; "
            "`ray up` would otherwise hash every file under it first, .venv included)")
    cluster_file = os.path.join(paths["laptop"], "cluster.yaml")
    with open(cluster_file, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    up_command = launcher + ["cluster", "up", "--skip-preflight", cluster_file]
    if report.injected:
        _injected_up(stages, up_command, env, timeout_s, api, ray_tmp, report, say)
        return
    up, started = False, time.monotonic()
    try:
        with stages.stage("`launcher cluster up --skip-preflight` (Ray's `ray up -y`: bootstrap, the head's insert, "
                          "SSH, file mounts, initialization and setup commands, ray start --head)"):
            up = True
            try:
                stages.run("cluster-up", up_command, env, timeout_s, _ray_step)
            finally:
                report.steps = read_steps(paths["vm"], [c for c, _ in report.commands])
                say_setup(report, say)
        dashboard = f"http://127.0.0.1:{ports['dashboard']}"
        _wait_dashboard(dashboard, 60)
        if worker:
            with stages.stage(f"a worker VM ({report.join}) joins: the head's autoscaler inserts it through the "
                              "local API, runs its setup over SSH (sshd at 127.0.0.2) and starts Ray on it"):
                _wait_joined(stages, ray, cluster_file, env, timeout_s, report, started)
                report.worker_steps = read_steps(paths["vm-w"], [c for c, _ in report.commands])
                for command, seconds, rc in report.worker_steps:
                    say(f"   worker setup: [{seconds:5.1f} s{f', exit {rc}' if rc else ''}] {command}")
                say(f"   the worker's setup commands took {sum(s for _, s, _ in report.worker_steps):.1f} s; "
                    f"in `ray status` {report.joined_s:.0f} s after the head's `ray up` began")
        with stages.stage("`ray status` on the head (ray exec, over SSH)"):
            stages.run("ray-status", [ray, "exec", cluster_file, "ray status"], env, timeout_s, _after("Autoscaler"))
        guard_log = os.path.join(paths["vm"], "launcher-setup-guard.log")  # the head's start commands began it
        if os.path.exists(guard_log):
            with open(guard_log, encoding="utf-8") as f:
                say(f"   the head's worker setup guard (~/launcher-setup-guard.log): {f.readline().strip()}")
        with stages.stage(f"`launcher submit --follow` to {dashboard}: digits-mlp, 1 epoch, {workers} workers, "
                          f"checkpoints to gs://{bucket}/{RUN_NAME} (the Cloud Storage emulator)"):
            out = stages.run("launcher-submit", launcher + [
                "submit", "--address", dashboard, "--workload", "digits-mlp", "--epochs", "1",
                "--workers", str(workers), "--storage", f"gs://{bucket}/{RUN_NAME}", "--name", RUN_NAME,
                "--follow"], env, timeout_s, _summary_line)
            ended = re.findall(r"^job \S+: (\w+)\s*$", out, re.MULTILINE)
            report.job_status = ended[-1] if ended else ""
            report.checkpoints = checkpoints(emulator_url, bucket, RUN_NAME)
            say(f"   checkpoints in the emulator's gs://{bucket}/{RUN_NAME}: {len(report.checkpoints)} objects"
                + (f" (e.g. {report.checkpoints[0]})" if report.checkpoints else ""))
    except BaseException:
        if up:  # take down what was made, then the first failure is the one raised
            with contextlib.suppress(Exception):
                _down(stages, launcher, cluster_file, env, timeout_s, api, ray_tmp, report, say)
        raise
    _down(stages, launcher, cluster_file, env, timeout_s, api, ray_tmp, report, say)


def _check_worker_port() -> None:
    """The worker VM's sshd needs port 22 of WORKER_IP: the head's autoscaler dials port 22 (Ray drops
    ``ssh_proxy_command`` from the head's copy of the cluster file)."""
    with socket.socket() as s:
        try:
            s.bind((WORKER_IP, 22))
        except OSError as exc:
            raise UserError(f"--worker needs port 22 of {WORKER_IP} for the worker VM's sshd (the head's autoscaler "
                            f"dials port 22), and it is not free here ({exc.strerror})",
                            "stop the sshd that listens on every address (or run as root), or rehearse without "
                            "--worker") from None


def _wait_joined(stages, ray, cluster_file, env, timeout_s, report, started) -> None:
    """Poll `ray status` on the head until the worker type has an active node (or timeout_s passes)."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        done = subprocess.run([ray, "exec", cluster_file, "ray status"], env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout_s)
        text = _plain(done.stdout + done.stderr)
        active = text.partition("Active:")[2].partition("Pending:")[0]
        if re.search(rf"^\s*1 {re.escape(report.join)}\s*$", active, re.MULTILINE):
            report.joined_s = time.monotonic() - started
            return
        time.sleep(5)
    for line in text.splitlines()[-20:]:
        stages.say("   ! " + line.rstrip())
    raise RehearsalFailed(f"no {report.join} worker joined the head in {timeout_s:.0f} s",
                          f"the head's autoscaler log (monitor.*) in the kept folder says why: {REHEARSAL_KEEP}=1")


def _injected_up(stages, up_command, env, timeout_s, api, ray_tmp, report, say) -> None:
    """`launcher cluster up` with the injected failure: it must fail, and leave nothing in the API."""
    with stages.stage(f"`launcher cluster up --skip-preflight` with {report.injected} (it must fail and delete "
                      "what `ray up` made)"):
        try:
            stages.run("cluster-up", up_command, env, timeout_s,
                       lambda line: _ray_step(line) or line.startswith(("`ray up` failed", "deleted ", "  ray-")))
        except RehearsalFailed:
            report.failed_as_injected = True
        report.left = sorted(api.instances) + sorted(api.disks)
        report.ray_left = ray_processes(ray_tmp)
        deleted = [c.target for c in api.calls if c.verb == "delete" and not c.refusal]
        say(f"   `launcher cluster up` {'failed, as injected' if report.failed_as_injected else 'did NOT fail'}; "
            f"deleted: {', '.join(deleted) or 'nothing'}; left in the API: {', '.join(report.left) or 'nothing'}")


def _down(stages, launcher, cluster_file, env, timeout_s, api, ray_tmp, report, say) -> None:
    with stages.stage("`launcher cluster down` (`ray down -y`: ray stop on the head, Ray's provider deletes the VMs; "
                      "then the VMs and disks it left)"):
        try:
            stages.run("cluster-down", launcher + ["cluster", "down", cluster_file], env, timeout_s,
                       lambda line: _ray_step(line) or line.startswith(("no VMs", "deleted ")))
        finally:
            report.left = sorted(api.instances) + sorted(api.disks)
            report.ray_left = ray_processes(ray_tmp)
            say(f"   left in the API: {', '.join(report.left) or 'nothing'}; Ray processes of the rehearsal "
                f"left: {len(report.ray_left) or 'none'}")


def _source_root() -> str:
    """The folder this launcher is imported from (the checkout: launcher/lab/ray_up.py is three down)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _after(marker: str) -> Callable[[str], bool]:
    """A line filter: the non-empty lines from the first one that contains ``marker`` on."""
    seen = []

    def show(line: str) -> bool:
        if marker in line:
            seen.append(line)
        return bool(seen) and bool(line.strip()) and not line.startswith(("Shared connection", "Connection to"))

    return show


def _summary_line(line: str) -> bool:
    s = line.strip()
    return s.startswith(("submitted", "job ", "run ", "Job ", "epoch", "status", "checkpoint", "summary",
                         "SUCCEEDED", "final", "metrics", "accuracy", "loss")) or "SUCCEEDED" in s


def _wait_dashboard(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url + "/api/version", timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RehearsalFailed(f"the head's dashboard at {url} did not answer in {timeout_s:.0f} s",
                                      "see the head's logs under RAY_TMPDIR") from None
            time.sleep(0.5)
