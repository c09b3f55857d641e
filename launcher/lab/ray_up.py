"""The whole ``ray up`` rehearsal: the real ``ray up`` over real SSH to this machine, a run, ``ray down``.

:func:`rehearse_up` takes a generated cluster file and, on this machine:

1. starts the local Compute Engine API (:class:`LoopbackAPI`: the head VM it
   creates has networkIP and natIP 127.0.0.1, and the ``ssh-keys`` Ray's
   bootstrap puts in the project's metadata are installed for the VM's sshd)
   and the "VM", a real sshd on a free loopback port in a PID namespace
   (:mod:`launcher.lab.sshd`);
2. runs Ray's own CLI, ``ray up -y``, in a subprocess whose Google API client
   is pointed at the local API by a ``sitecustomize`` module on PYTHONPATH (the
   head's sessions get it too, so the autoscaler Ray starts on the head talks
   to the same API): bootstrap, the head's insert, SSH, the file mounts
   (rsync of the project), the initialization and setup commands, ``ray start
   --head``;
3. ``ray exec ... 'ray status'``, then ``launcher submit --follow`` of a short
   run (digits-mlp, one epoch) whose checkpoints go to the Cloud Storage
   emulator, and lists them there;
4. ``ray down -y``, then checks that the API holds no VM and that no process
   of the rehearsal's Ray is left; stopping sshd ends its PID namespace.

What the rehearsal's copy of the file changes, and why (also in
docs/guides/compute-engine.md): see :func:`up_copy` and :data:`SKIPS`.
Workers stay simulated: min_workers is 0 in the copy, and the run fits on
the head, so the autoscaler launches none.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

import yaml

from launcher import _deferred
from launcher.errors import LauncherError, UserError
from launcher.lab.compute_api import Call, ComputeAPI
from launcher.lab.compute_world import World
from launcher.lab.rehearsal import SERVICES, _rehearsal_copy, format_call
from launcher.lab.sshd import LoopbackSSHD, free_port

HEAD_LABEL = ("ray-node-type", "head")  # the label Ray's GCP provider gives the head VM (TAG_RAY_NODE_KIND)
LOOPBACK = "127.0.0.1"
RUN_NAME = "rehearsal"
KEEP = "LAUNCHER_REHEARSAL_KEEP"  # set: the rehearsal's folder stays (to read its logs)

# Setup commands the rehearsal does not run as they are: (test, what it runs instead, why).
SKIPPED = "skipped"
CHECKED = "checked"


@dataclass
class UpReport:
    """What the up -> run -> down rehearsal saw."""

    stages: list[tuple[str, float]] = field(default_factory=list)
    commands: list[tuple[str, str]] = field(default_factory=list)  # (command, "ran" | "skipped: why" | ...)
    job_status: str = ""
    checkpoints: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    ray_left: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.job_status == "SUCCEEDED" and bool(self.checkpoints) and not self.left and not self.ray_left


class RehearsalFailed(LauncherError):
    """A stage of the rehearsal failed (its output's end is printed before)."""


class LoopbackAPI(ComputeAPI):
    """The local Compute Engine API, whose head VM is this machine, reached through ``sshd``."""

    def __init__(self, project: str, sshd: LoopbackSSHD, world: World | None = None) -> None:
        super().__init__(project, world)
        self.sshd = sshd

    def answer(self, method: str, path: str, query: dict[str, str], body: dict) -> dict:
        with self._lock:
            result = super().answer(method, path, query, body)
            if method == "POST" and path.endswith("/setCommonInstanceMetadata"):
                self.sshd.authorize(self.metadata.get("items", []))  # what the VM's guest agent does
            elif method == "POST" and path.endswith("/instances"):
                instance = self.instances.get(str(body.get("name", "")))
                if instance and instance["labels"].get(HEAD_LABEL[0]) == HEAD_LABEL[1]:
                    for nic in instance["networkInterfaces"]:
                        nic["networkIP"] = LOOPBACK
                        for access in nic.get("accessConfigs", []):
                            access["natIP"] = LOOPBACK
            return result


def _pinned_only(command: str) -> bool:
    """``pip install`` of name==version requirements only (no path, no unpinned name)."""
    words = [w for w in shlex.split(command)[2:] if not w.startswith("-") and "://" not in w]
    return bool(words) and all(re.fullmatch(r"[A-Za-z0-9_.\-\[\],]+==[A-Za-z0-9_.+!\-]+", w) for w in words)


# (test, replacement kind, why); the first that matches decides. Everything else runs as it is.
SKIPS: list[tuple[Callable[[str], bool], str, str]] = [
    (lambda c: "nvidia-smi" in c, SKIPPED, "no GPU here: the wait for the NVIDIA driver would time out"),
    (lambda c: "install-horovod" in c or "apt-get" in c, SKIPPED,
     "Horovod's build (apt-get cmake g++, then minutes of compiling) is not rehearsed"),
    (lambda c: c.startswith("pip install") and _pinned_only(c), CHECKED,
     "pip install --dry-run --no-index: ~/launcher-venv (the project's venv) must already have these versions"),
    (lambda c: c.startswith("pip install"), SKIPPED,
     "~/launcher-venv is the project's own venv, which has the project; pip would rebuild it into that venv "
     "(the next command still checks the version that imports)"),
]


def rehearsed_command(command: str) -> tuple[str, str]:
    """(what the rehearsal runs, what it says about it) for one setup command."""
    for test, kind, why in SKIPS:
        if test(command.strip()):
            if kind == CHECKED:
                rest = command.strip()[len("pip install"):]
                return f"pip install --dry-run --no-index{rest}", f"checked only ({why})"
            return f"echo {shlex.quote('rehearsal skipped: ' + command)}", f"skipped ({why})"
    return command, "ran"


def up_copy(config: dict, sshd: LoopbackSSHD, ports: dict[str, int]) -> tuple[dict, list[tuple[str, str]]]:
    """The cluster file as the rehearsal's ``ray up`` runs it, and what happens to each setup command.

    Changed: SSH (this machine's user, through ``auth.ssh_proxy_command`` to sshd's port, since Ray's SSH
    runner dials port 22), the placeholder token, min_workers 0 (workers stay simulated), free ports for
    ``ray start --head`` (other Rays on this machine keep theirs), and the setup commands in :data:`SKIPS`.
    Initialization, setup and start commands otherwise run as written. (File mounts: :func:`snapshot_mounts`.)
    """
    config = _rehearsal_copy(config)
    config["auth"] = {"ssh_user": sshd.user, "ssh_proxy_command": sshd.proxy_command}
    for name, node_type in config["available_node_types"].items():
        if name != config["head_node_type"]:
            node_type["min_workers"] = 0
    said: list[tuple[str, str]] = []
    for key in ("initialization_commands", "setup_commands", "head_setup_commands"):
        commands = []
        for command in config.get(key) or []:
            run, what = rehearsed_command(command)
            commands.append(run)
            said.append((command, what))
        config[key] = commands
    config["head_start_ray_commands"] = [_head_start(c, ports) for c in config.get("head_start_ray_commands") or []]
    said += [(c, "ran") for c in config["head_start_ray_commands"]]
    return config, said


def snapshot_mounts(config: dict, folder: str) -> list[tuple[str, str]]:
    """Point each local folder of ``file_mounts`` at a copy of what rsync sends from it.

    ``ray up`` first hashes every file under each mount (``hash_runtime_conf``), ignoring rsync_exclude and
    .gitignore: with the project's .venv under the checkout that is gigabytes read on every ``ray up``. The
    copy, made by rsync with the file's own excludes and filters, is what the head receives either way.
    Returns (remote path, source) for each copied mount.
    """
    filters = [a for x in config.get("rsync_exclude") or [] for a in ("--exclude", x)]
    filters += [a for f in config.get("rsync_filter") or [] for a in ("--filter", f"dir-merge,- {f}")]
    copied = []
    for n, (remote, local) in enumerate(sorted((config.get("file_mounts") or {}).items())):
        if not os.path.isdir(os.path.expanduser(local)):
            continue
        target = os.path.join(folder, str(n))
        subprocess.run(["rsync", "-a", *filters, os.path.expanduser(local).rstrip("/") + "/", target + "/"],
                       check=True, capture_output=True)
        config["file_mounts"][remote] = target
        copied.append((remote, local))
    return copied


def _head_start(command: str, ports: dict[str, int]) -> str:
    if "ray start" not in command:
        return command
    command = re.sub(r"--port[= ]\d+", f"--port={ports['gcs']}", command)
    command = re.sub(r"--object-manager-port[= ]\d+", f"--object-manager-port={ports['object_manager']}", command)
    extra = {"--dashboard-port": ports["dashboard"], "--ray-client-server-port": ports["client"],
             "--dashboard-agent-listen-port": ports["agent"]}
    return command + "".join(f" {flag}={value}" for flag, value in extra.items() if flag not in command)


SITECUSTOMIZE = '''\
"""Written by launcher's `ray up` rehearsal: every Google API client built in this process talks to
the local Compute Engine API at {url} (client_options api_endpoint). Nothing else changes."""
import sys

_URL = {url!r}
_SERVICES = {services!r}


def _point(module):
    real = module.build

    def build(service_name, version, *args, **kwargs):
        if service_name in _SERVICES:
            options = dict(kwargs.pop("client_options", None) or {{}})
            options["api_endpoint"] = _URL + "/" + _SERVICES[service_name]
            kwargs["client_options"] = options
            kwargs.pop("discoveryServiceUrl", None)
        return real(service_name, version, *args, **kwargs)

    module.build = build


class _Finder:
    """Wraps googleapiclient.discovery.build when (if ever) the module is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "googleapiclient.discovery":
            return None
        import importlib.util
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            loader, real_exec = spec.loader, spec.loader.exec_module

            def exec_module(module):
                real_exec(module)
                _point(module)

            loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


def write_sitecustomize(folder: str, url: str) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(SITECUSTOMIZE.format(url=url, services=SERVICES))
    return folder


UV_STAND_IN = "#!/bin/sh\necho 'rehearsal: no uv on this machine; ~/launcher-venv is the project venv' >&2\nexit 1\n"


def prepare_vm_home(home: str) -> None:
    """The VM's home as a node looks after its first ``ray up``: the venv (this project's) and uv exist."""
    if sys.prefix == sys.base_prefix:
        raise UserError("the `ray up` rehearsal runs from the project's virtual environment (it becomes the "
                        "head's ~/launcher-venv)", "run it with .venv/bin/launcher (scripts/setup-env makes it)")
    os.makedirs(os.path.join(home, ".local", "bin"), exist_ok=True)
    os.symlink(sys.prefix, os.path.join(home, "launcher-venv"))
    uv = shutil.which("uv")
    target = os.path.join(home, ".local", "bin", "uv")
    if uv:
        os.symlink(uv, target)
    else:
        with open(target, "w", encoding="utf-8") as f:
            f.write(UV_STAND_IN)
        os.chmod(target, 0o755)
    with open(os.path.join(home, ".bashrc"), "w", encoding="utf-8") as f:
        f.write("# the ray up rehearsal's VM home\n")


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
                workers: int = 2, say: Callable[[str], None] = print, timeout_s: float = 600) -> UpReport:
    """Rehearse ``ray up`` -> ``launcher submit`` -> ``ray down`` of ``config`` on this machine.

    Args:
        emulator_url: the Cloud Storage emulator (``http://127.0.0.1:PORT``) the run checkpoints to.
        bucket: a bucket in it; the run's storage is ``gs://BUCKET/rehearsal``.
        workers: the run's workers (each 1 CPU, on the head).
        timeout_s: the most any one command may take.

    Raises:
        RehearsalFailed: a stage failed (what it printed last is said first); the cluster is taken down.
        UserError: the lab extra is not installed.
    """
    for extra in ("lab", "cluster"):
        _deferred.require(extra, "`launcher cluster rehearse --up`")
    report = UpReport()
    root = tempfile.mkdtemp(prefix="lrh-", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        paths = {k: os.path.join(root, k) for k in ("sshd", "site", "laptop", "vm", "logs", "tmp", "mounts")}
        for path in paths.values():
            os.makedirs(path, exist_ok=True)
        ray_tmp = root  # RAY_TMPDIR: Ray's sessions and ray_current_cluster under root/ray
        prepare_vm_home(paths["vm"])
        # PYTHONPATH on the head: the sitecustomize, then ~/launcher (the project `ray up` synced there), which
        # stands in for the skipped `pip install ~/launcher` (the venv is shared; its own install may be elsewhere)
        head_path = os.pathsep.join([paths["site"], os.path.join(paths["vm"], "launcher")])
        sshd = LoopbackSSHD(paths["sshd"], {"HOME": paths["vm"], "PYTHONPATH": head_path,
                                            "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"})
        provider = _rehearsal_copy(config)["provider"]
        world = World.with_limits(quotas or {}, provider["availability_zone"])
        api = LoopbackAPI(provider["project_id"], sshd, world)
        with api:
            write_sitecustomize(paths["site"], api.url)
            with sshd:
                try:
                    _up_run_down(config, api, sshd, paths, ray_tmp, report, emulator_url, bucket, workers, say,
                                 timeout_s)
                except RehearsalFailed:
                    say(f"   sshd's log ends: {sshd.log_tail()}")
                    raise
            report.calls = api.calls
    finally:
        if os.environ.get(KEEP):
            say(f"kept the rehearsal's folder (logs, the VM's home, Ray's sessions): {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    say(up_summary(report))
    return report


def _up_run_down(config, api, sshd, paths, ray_tmp, report, emulator_url, bucket, workers, say, timeout_s):
    ports = {k: free_port() for k in ("gcs", "object_manager", "dashboard", "client", "agent")}
    config, report.commands = up_copy(config, sshd, ports)
    # this side's commands import the launcher this process runs (the venv's editable install may point elsewhere)
    python_path = os.pathsep.join(p for p in (paths["site"], _source_root(), os.environ.get("PYTHONPATH")) if p)
    # TMPDIR: where `ray up` caches the bootstrapped file (ray exec and ray down read it), removed with the rest
    env = {**os.environ, "HOME": paths["laptop"], "PYTHONPATH": python_path, "RAY_TMPDIR": ray_tmp,
           "TMPDIR": paths["tmp"],
           "RAY_USAGE_STATS_ENABLED": "0", "STORAGE_EMULATOR_HOST": emulator_url}
    # The head VM's Ray runs in sshd's clean environment, with Ray's default authentication; this
    # side talks to it as a laptop with the defaults does (a token mode set here, e.g. by a warm local
    # head earlier in this process, would make the job client ask for a token the head never made).
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    stages = _Stages(api, report, say, paths["logs"])
    say(f"rehearsing `ray up` of cluster {config['cluster_name']!r} on this machine: local Compute Engine API at "
        f"{api.url}; the head VM is {sshd.user}@127.0.0.1 through sshd on port {sshd.port} (own PID namespace)")
    for remote, local in snapshot_mounts(config, paths["mounts"]):
        say(f"file mount {remote}: a copy of {local} as rsync sends it (.gitignore and rsync_exclude applied; "
            "`ray up` would otherwise hash every file under it first, .venv included)")
    cluster_file = os.path.join(paths["laptop"], "cluster.yaml")
    with open(cluster_file, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    up = False
    try:
        with stages.stage("`ray up -y` (Ray's CLI: bootstrap, the head's insert, SSH, file mounts, "
                          "initialization and setup commands, ray start --head)"):
            up = True
            stages.run("ray-up", [ray, "up", "-y", cluster_file], env, timeout_s, _ray_step)
            for command, what in report.commands:
                say(f"   setup: {what}: {command}")
        dashboard = f"http://127.0.0.1:{ports['dashboard']}"
        _wait_dashboard(dashboard, 60)
        with stages.stage("`ray status` on the head (ray exec, over SSH)"):
            stages.run("ray-status", [ray, "exec", cluster_file, "ray status"], env, timeout_s, _after("Autoscaler"))
        with stages.stage(f"`launcher submit --follow` to {dashboard}: digits-mlp, 1 epoch, {workers} workers, "
                          f"checkpoints to gs://{bucket}/{RUN_NAME} (the Cloud Storage emulator)"):
            out = stages.run("launcher-submit", [
                sys.executable, "-m", "launcher", "submit", "--address", dashboard, "--workload", "digits-mlp", "--epochs", "1",
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
                _down(stages, ray, cluster_file, env, timeout_s, api, ray_tmp, report, say)
        raise
    _down(stages, ray, cluster_file, env, timeout_s, api, ray_tmp, report, say)


def _down(stages, ray, cluster_file, env, timeout_s, api, ray_tmp, report, say) -> None:
    with stages.stage("`ray down -y` (ray stop on the head, then Ray's provider deletes the VMs)"):
        try:
            stages.run("ray-down", [ray, "down", "-y", cluster_file], env, timeout_s, _ray_step)
        finally:
            report.left = sorted(api.instances)
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


def _emulator_client(emulator_url: str):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="rehearsal", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": emulator_url})


def create_bucket(emulator_url: str, bucket: str) -> None:
    """A bucket in the Cloud Storage emulator at ``emulator_url`` for the rehearsal's run."""
    _emulator_client(emulator_url).create_bucket(bucket)


def checkpoints(emulator_url: str, bucket: str, prefix: str) -> list[str]:
    """The checkpoint objects under gs://BUCKET/PREFIX in the emulator."""
    client = _emulator_client(emulator_url)
    return sorted(b.name for b in client.list_blobs(bucket, prefix=prefix + "/") if "checkpoint" in b.name)


def ray_processes(ray_tmp: str) -> list[str]:
    """Processes whose command line names the rehearsal's Ray folder (raylet, GCS, workers, dashboard)."""
    folder = os.path.join(ray_tmp, "ray") + os.sep
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if folder in cmdline:
            found.append(f"{pid} {cmdline[:120]}")
    return found


def up_summary(report: UpReport) -> str:
    took = sum(s for _, s in report.stages)
    inserts = [c for c in report.calls if c.verb == "insert" and not c.refusal]
    deletes = [c for c in report.calls if c.verb == "delete" and not c.refusal]
    lines = [f"summary: {'OK' if report.ok else 'FAILED'} in {took:.0f} s; {len(report.calls)} API requests, "
             f"{len(inserts)} VM insert(s), {len(deletes)} delete(s); run {report.job_status or 'not finished'}, "
             f"{len(report.checkpoints)} checkpoint object(s) in the emulator",
             f"  left in the API: {', '.join(report.left) or 'nothing'}; Ray processes left: "
             f"{len(report.ray_left) or 'none'}",
             "  workers stayed simulated (min_workers 0 in the rehearsal's copy; the run fits on the head)"]
    return "\n".join(lines)
