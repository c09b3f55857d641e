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

from launcher.errors import UserError
from launcher.lab.rehearsal import SERVICES, _rehearsal_copy
from launcher.lab.sshd import LoopbackSSHD

FAILING_SETUP = "echo 'rehearsal: the injected head setup failure' >&2; exit 1"

# Setup commands the rehearsal does not run as they are: (test, what it runs instead, why).
SKIPPED = "skipped"
CHECKED = "checked"


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


def up_copy(config: dict, sshd: LoopbackSSHD, ports: dict[str, int],
            fail_head_setup: bool = False) -> tuple[dict, list[tuple[str, str]]]:
    """The cluster file as the rehearsal's ``ray up`` runs it, and what happens to each setup command.

    Changed: SSH (this machine's user, through ``auth.ssh_proxy_command`` to sshd's port, since Ray's SSH
    runner dials port 22), the placeholder token, min_workers 0 (workers stay simulated), free ports for
    ``ray start --head`` (other Rays on this machine keep theirs), and the setup commands in :data:`SKIPS`;
    ``fail_head_setup`` adds :data:`FAILING_SETUP` last to the head's setup commands.
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
    if fail_head_setup:
        config["head_setup_commands"].append(FAILING_SETUP)
        said.append((FAILING_SETUP, "injected"))
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
