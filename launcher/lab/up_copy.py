"""The ``ray up`` rehearsal's copy of a cluster file, and the head VM's home on this machine.

:func:`up_copy` is the file as :mod:`launcher.lab.ray_up` runs it: SSH through
the loopback sshd, the placeholder token, workers simulated, free ports for
the head, each setup command run, checked or skipped (:data:`SKIPS`), and,
when asked, an injected failure of the head's setup. :func:`snapshot_mounts`
copies the file mounts as rsync sends them; :func:`write_sitecustomize`
points every Google API client of the processes it reaches at the local API;
:func:`prepare_vm_home` makes the VM's home as a node has it after its first
``ray up``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import Callable

from cluster import config as cluster_config
from launcher.errors import UserError
from launcher.lab.rehearsal import SERVICES, _rehearsal_copy
from launcher.lab.sshd import LoopbackSSHD

FAILING_SETUP = "echo 'rehearsal: the injected head setup failure' >&2; exit 1"

# Setup commands the rehearsal does not run as they are: (test, what it runs instead, why).
SKIPPED = "skipped"
CHECKED = "checked"


# Options of `pip install` / `uv pip install` in the generated file that take a value.
_VALUED = {"--python", "--index-strategy", "--extra-index-url", "--index-url", "-i", "--find-links", "-f"}


def _install_words(command: str) -> list[str] | None:
    """The requirements of a ``pip install`` or ``uv pip install`` command (None: not one)."""
    words = shlex.split(command)
    for head in (["pip", "install"], ["uv", "pip", "install"]):
        n = len(head)
        if [os.path.basename(w) for w in words[:n]] == head:
            rest, found = words[n:], []
            while rest:
                word = rest.pop(0)
                if word in _VALUED:
                    rest = rest[1:]
                elif not word.startswith("-"):
                    found.append(word)
            return found
    return None


def _pinned_only(command: str) -> bool:
    """``pip install`` of name==version requirements only (no path, no unpinned name)."""
    words = [w for w in _install_words(command) or [] if "://" not in w]
    return bool(words) and all(re.fullmatch(r"[A-Za-z0-9_.\-\[\],]+==[A-Za-z0-9_.+!\-]+", w) for w in words)


def _installs(command: str) -> bool:
    return _install_words(command) is not None


# (test, replacement kind, why, also when the install is fresh); the first that matches decides.
# Everything else runs as it is.
SKIPS: list[tuple[Callable[[str], bool], str, str, bool]] = [
    (lambda c: "nvidia-smi" in c, SKIPPED, "no GPU here: the wait for the NVIDIA driver would time out", True),
    (lambda c: "install-horovod" in c or "apt-get" in c, SKIPPED,
     "Horovod's build (apt-get cmake g++, then minutes of compiling) is not rehearsed", True),
    (lambda c: _installs(c) and _pinned_only(c), CHECKED,
     "pip install --dry-run --no-index: ~/launcher-venv (the project's venv) must already have these versions",
     False),
    (_installs, SKIPPED,
     "~/launcher-venv is the project's own venv, which has the project; pip would rebuild it into that venv "
     "(the next command still checks the version that imports)", False),
]


def rehearsed_command(command: str, fresh: bool = False) -> tuple[str, str]:
    """(what the rehearsal runs, what it says about it) for one setup command; ``fresh``: the VM starts
    without the project's venv, so every install runs."""
    for test, kind, why, when_fresh in SKIPS:
        if (when_fresh or not fresh) and test(command.strip()):
            if kind == CHECKED:
                return (f"pip install --dry-run --no-index {shlex.join(_install_words(command) or [])}",
                        f"checked only ({why})")
            return f"echo {shlex.quote('rehearsal skipped: ' + command)}", f"skipped ({why})"
    return command, "ran"


# What the said list of up_copy puts before what happens to a command of the worker VM.
ON_WORKER = "on the worker: "

# Each setup command the rehearsal runs appends "N START END EXIT" here (the VM's home), for the
# node's set-up time per step.
STEPS_FILE = ".rehearsal-steps"


def timed(n: int, command: str) -> str:
    """``command`` as the copy runs it: the same, its times and exit status appended to STEPS_FILE."""
    return (f"__t=$(date +%s.%N); {command}\n__rc=$?; echo \"{n} $__t $(date +%s.%N) $__rc\" >> ~/{STEPS_FILE}; "
            "(exit $__rc)")


def read_steps(home: str, commands: list[str]) -> list[tuple[str, float, int]]:
    """(command, seconds, exit status) of each timed setup command that ran, in order."""
    try:
        with open(os.path.join(home, STEPS_FILE), encoding="utf-8") as f:
            rows = [line.split() for line in f if line.strip()]
    except FileNotFoundError:
        return []
    return [(commands[int(n)], float(end) - float(start), int(rc)) for n, start, end, rc in rows
            if n.isdigit() and int(n) < len(commands)]


def up_copy(config: dict, sshd: LoopbackSSHD, ports: dict[str, int], fail_head_setup: bool = False,
            fresh: bool = False, drop: tuple[str, ...] = (),
            worker: tuple[LoopbackSSHD, dict[str, int]] | None = None) -> tuple[dict, list[tuple[str, str]]]:
    """The cluster file as the rehearsal's ``ray up`` runs it, and what happens to each setup command.

    Changed: SSH (this machine's user, through ``auth.ssh_proxy_command`` to sshd's port, since Ray's SSH
    runner dials port 22), the placeholder token, min_workers 0 (workers stay simulated), free ports for
    ``ray start --head`` (other Rays on this machine keep theirs), and the setup commands in :data:`SKIPS`;
    ``fail_head_setup`` adds :data:`FAILING_SETUP` last to the head's setup commands; ``fresh`` (a VM
    without the project's venv) runs every install, without the ``drop`` text (a package index this
    machine cannot reach: :func:`package_sources`). Each setup command is :func:`timed`; the said list
    holds the original commands in that order (:func:`read_steps` indexes it).
    ``worker`` (a second sshd and its free ports): the first worker type keeps one worker
    (min_workers = max_workers = 1), which the head's autoscaler launches, sets up over SSH and
    starts, as it does a real one. Ray drops the proxy command from the head's copy of the file, so the
    autoscaler dials the worker's address on port 22, where the worker's sshd listens.
    Initialization, setup and start commands otherwise run as written. (File mounts: :func:`snapshot_mounts`.)
    """
    config = _rehearsal_copy(config)
    config["auth"] = {"ssh_user": sshd.user, "ssh_proxy_command": sshd.proxy_command}
    joins = next((name for name in config["available_node_types"] if name != config["head_node_type"]), None)
    for name, node_type in config["available_node_types"].items():
        if name != config["head_node_type"]:
            node_type["min_workers"] = node_type["max_workers"] = int(bool(worker) and name == joins)
    if worker:
        config["max_workers"] = 1
    said: list[tuple[str, str]] = []
    def rehearsed(key: str, where: str = "") -> None:
        commands = []
        for command in config.get(key) or []:
            run, what = rehearsed_command(command, fresh)
            for text in drop:
                run = run.replace(text, "")
            commands.append(timed(len(said), run))
            said.append((command, where + what))
        config[key] = commands

    for key in ("initialization_commands", "setup_commands", "head_setup_commands"):
        rehearsed(key)
    if fail_head_setup:
        config["head_setup_commands"].append(timed(len(said), FAILING_SETUP))
        said.append((FAILING_SETUP, "injected"))
    config["head_start_ray_commands"] = [_head_start(c, ports) for c in config.get("head_start_ray_commands") or []]
    said += [(c, "ran") for c in config["head_start_ray_commands"]]
    if worker:
        rehearsed("worker_setup_commands", ON_WORKER)
        starts = [_worker_start(c, ports["gcs"], worker[0].ip, worker[1])
                  for c in config.get("worker_start_ray_commands") or []]
        config["worker_start_ray_commands"] = [run for run, _ in starts]
        said += [(run, ON_WORKER + what) for run, what in starts]
    return config, said


def _worker_start(command: str, gcs_port: int, ip: str, ports: dict[str, int]) -> tuple[str, str]:
    """A worker's start command as the rehearsal runs it, and what it says about it: ``ray start`` joins the
    head's GCS at its rehearsal port, from the worker VM's own address and free ports."""
    if "preemption watch" in command:
        return (f"echo {shlex.quote('rehearsal skipped: ' + command)}",
                "skipped (no Compute Engine metadata server on this machine to watch for a notice)")
    if "ray start" not in command:
        return command, "ran"
    command = re.sub(r"(--address[= ]\S*?):6379\b", rf"\g<1>:{gcs_port}", command)
    command = re.sub(r"--object-manager-port[= ]\d+", f"--object-manager-port={ports['object_manager']}", command)
    extra = {"--node-ip-address": ip, "--dashboard-agent-listen-port": ports["agent"],
             "--metrics-export-port": ports["metrics"]}
    return command + "".join(f" {flag}={value}" for flag, value in extra.items() if flag not in command), "ran"


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


def prepare_vm_home(home: str, fresh: bool = False) -> None:
    """The VM's home as a node looks after its first ``ray up``: the venv (this project's) and uv exist.
    ``fresh``: as a new VM has it, with neither (its setup commands make them)."""
    if sys.prefix == sys.base_prefix:
        raise UserError("the `ray up` rehearsal runs from the project's virtual environment (it becomes the "
                        "head's ~/launcher-venv)", "run it with .venv/bin/launcher (scripts/setup-env makes it)")
    os.makedirs(os.path.join(home, ".local", "bin"), exist_ok=True)
    with open(os.path.join(home, ".bashrc"), "w", encoding="utf-8") as f:
        f.write("# the ray up rehearsal's VM home\n")
    if fresh:
        return
    os.symlink(sys.prefix, os.path.join(home, "launcher-venv"))
    uv = shutil.which("uv")
    target = os.path.join(home, ".local", "bin", "uv")
    if uv:
        os.symlink(uv, target)
    else:
        with open(target, "w", encoding="utf-8") as f:
            f.write(UV_STAND_IN)
        os.chmod(target, 0o755)


# pip's settings that say where packages come from, and uv's variable for each (uv reads no pip.conf).
_PIP_TO_UV = {"find-links": ("UV_FIND_LINKS", ","), "constraint": ("UV_CONSTRAINT", " "),
              "cert": ("SSL_CERT_FILE", " ")}  # a CA bundle of its own (a proxy's) for pip: uv's too


def package_sources(probe_s: float = 5.0) -> dict:
    """Where a fresh head's installs get packages, as this machine gets them: pip's own settings here
    (its configuration files and PIP_* variables) handed to the VM's pip and, translated, to uv; and
    the CPU torch index left out of the installs when it does not answer from here (torch then comes
    from PyPI or those settings). Returns {"env": {...}, "drop": (...), "said": [lines]}."""
    import urllib.request

    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    values: dict[str, list[str]] = {}
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in _PIP_TO_UV:
            values.setdefault(name, []).extend(value.strip().strip("'\"").split())
    for name, (variable, sep) in _PIP_TO_UV.items():
        found = list(dict.fromkeys(values.get(name, []) + os.environ.get(f"PIP_{name.upper().replace('-', '_')}",
                                                                           "").split()))
        if found:
            env[variable] = sep.join(found)
    # No Python downloads: uv uses a Python 3.11 on the machine, or says there is none.
    env["UV_PYTHON_DOWNLOADS"] = "never"
    shown = ", ".join(re.sub(r"//[^/@\s]+@", "//***@", f"{k}={v}")  # no credentials of an index URL
                      for k, v in sorted(env.items()) if k.startswith(("UV_", "SSL_")))
    said = [f"fresh head: its setup makes ~/launcher-venv and installs into it; package sources as pip has them "
            f"here: {shown}"]
    drop: tuple[str, ...] = ()
    try:
        probe = urllib.request.Request(cluster_config.CPU_TORCH_INDEX + "/", method="HEAD")
        urllib.request.urlopen(probe, timeout=probe_s).close()
    except Exception as exc:  # noqa: BLE001 - any failure: the index is not reachable from here
        drop = (f" --extra-index-url {cluster_config.CPU_TORCH_INDEX}",)
        said.append(f"fresh head: {cluster_config.CPU_TORCH_INDEX} does not answer from here "
                    f"({type(exc).__name__}): the rehearsal's installs leave it out, and torch comes from the other "
                    "sources")
    return {"env": env, "drop": drop, "said": said}
