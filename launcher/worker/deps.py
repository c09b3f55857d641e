"""A program's declared dependencies, installed once per node on top of the node's environment.

Ray's own ``pip`` runtime environment clones the whole virtualenv Ray runs from
(measured here: 4.1 GB of torch and TensorFlow, 34 s per node and per Ray
session, then a cold import of torch from the copy). Instead, each node gets a
small overlay environment per set of requirements: a venv without packages of
its own whose ``.pth`` file puts the node's site-packages behind it, into
which pip installs only what is missing (what the node already has is
"already satisfied"). It is kept in ``LAUNCHER_ENV_CACHE`` (default
``~/.cache/launcher/envs``) under a hash of the requirements and of the local
files they name, so later launches start at once; a file lock makes the ranks
of one node wait for one install, and a ``.ready`` marker written last means no
half-built environment is ever used.

pip's own options come from the environment (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``,
``PIP_NO_INDEX``, ...): the driver's ``PIP_*`` variables go with the program
(:func:`pip_env`) and are set for the install on every node, so a private index or
a local folder of wheels named on the driver is what every node's pip uses.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import site
import subprocess
import sys
import sysconfig

from launcher.settings import ENV_CACHE
from launcher.storage.datacache import node_lock

WORKING_DIR_VAR = "{folder}"  # in a requirement: the program's folder, as shipped to this node
PIP_OPTIONS = ["--disable-pip-version-check", "--no-input", "--no-build-isolation", "--no-warn-conflicts"]
PIP_ENV_PREFIX = "PIP_"  # pip reads every option from PIP_<OPTION> as well


def pip_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``PIP_*`` variables of ``environ`` (default: this process's): pip's options, to pass on."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(PIP_ENV_PREFIX)}


class DependencyError(RuntimeError):
    """pip could not install the requirements; str() is pip's own reason, on one line."""


def env_key(requirements: list[str], folder: str) -> str:
    """A hash of the requirements and of the content of the local files they name."""
    h = hashlib.sha256(f"{sys.version_info[:2]}\n".encode())
    for line in requirements:
        h.update(line.encode() + b"\n")
        if line.startswith(WORKING_DIR_VAR):
            path = os.path.join(folder, line[len(WORKING_DIR_VAR):].lstrip("/"))
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def cache_root() -> str:
    return os.path.expanduser(ENV_CACHE.get())


def python_of(env: str) -> str:
    return os.path.join(env, "bin", "python")


def ensure(requirements: list[str], key: str, folder: str, root: str | None = None,
           pip_environ: dict[str, str] | None = None) -> tuple[str, bool]:
    """(the python to run the program with, whether this call installed anything).

    ``pip_environ``: variables set for pip over this process's (the driver's ``PIP_*``, see :func:`pip_env`).

    Raises:
        DependencyError: pip failed; the message is its reason.
    """
    root = root or cache_root()
    # The overlay reads this environment's site-packages: one per base environment.
    base = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    key = f"{key}-{base}"
    env = os.path.join(root, key)
    ready = os.path.join(env, ".ready")
    if os.path.exists(ready):
        return python_of(env), False
    os.makedirs(root, exist_ok=True)
    with node_lock(os.path.join(root, f"{key}.lock")):
        if os.path.exists(ready):  # another rank of this node built it while we waited
            return python_of(env), False
        shutil.rmtree(env, ignore_errors=True)  # a build that died half way
        _overlay(env)
        wanted = [line.replace(WORKING_DIR_VAR, folder) for line in requirements]
        done = subprocess.run([sys.executable, "-m", "pip", "--python", python_of(env), "install", *PIP_OPTIONS,
                               *wanted], capture_output=True, text=True, env={**os.environ, **(pip_environ or {})})
        if done.returncode != 0:
            shutil.rmtree(env, ignore_errors=True)
            raise DependencyError(pip_reason(done.stdout + "\n" + done.stderr))
        with open(ready, "w") as f:
            f.write("\n".join(requirements) + "\n")
    return python_of(env), True


def _overlay(env: str) -> None:
    """A venv with nothing of its own; this environment's site-packages behind it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True, capture_output=True)
    purelib = subprocess.run([python_of(env), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    base = [p for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
            if os.path.isdir(p)]
    with open(os.path.join(purelib, "_launcher_base_env.pth"), "w") as f:
        # addsitedir, not a bare path: the base's own .pth files (editable installs,
        # namespace packages) must be processed too.
        f.write("".join(f"import site; site.addsitedir({p!r})\n" for p in dict.fromkeys(base)))


def pip_reason(output: str) -> str:
    """pip's own reason (its last ERROR line), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    if errors:
        return errors[-1][len("ERROR:"):].strip()
    return lines[-1][:300] if lines else "pip failed without a message"
