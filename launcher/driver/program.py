"""The user's own training program: a script (``--script FILE``) or a trainer package
(``--package DIR --module trainer.task``, or built: ``--package trainer-0.1.tar.gz,gs://B/x.whl``),
checked on the driver and shipped to every node.

A :class:`Program` knows its folder (shipped with Ray's runtime environment as
the job's ``working_dir``), what to start in it (``python FILE`` or ``python -m
MODULE``) and the dependencies its folder declares (``requirements.txt``,
``pyproject.toml``'s ``[project] dependencies``, ``setup.py``'s
``install_requires``), which Ray installs on each node through the runtime
environment's working directory, then installed once per node on top of
the node's environment (see :mod:`launcher.worker.deps`). Everything that can be checked without running the
user's code is checked here, before Ray starts: the folder and the module exist,
and (:mod:`launcher.driver.dependencies`) the code compiles, every module it imports
at the top is in the folder, installed here or declared, and local wheels named in
``requirements.txt`` are in the folder. Whether a program trains on its own
(scikit-learn, XGBoost) is read from its imports (:func:`single_process_framework`).

A built package (an sdist or a wheel, a local file or a ``gs://`` object; see
:mod:`launcher.driver.archives`) is fetched once here, checked the same way from
inside the archive (it is whole, it holds the module, the module's imports), and
shipped as a small folder holding the archives; each node installs them into its
overlay environment, with what they declare, and runs the module from there.

A Vertex AI ``containerSpec`` (:func:`from_container`) ships nothing: each rank runs the
container's command and args in its image, which Ray starts for the ranks alone (Ray
Train's ``worker_runtime_env`` ``{"image_uri": IMAGE}``; Ray starts images with podman on
the node). Where that cannot happen (a local Ray without podman) :func:`check_container`
says in one line what would have run.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from launcher import frameworks
from launcher.driver import archives, session
from launcher.driver.dependencies import check_imports, declared_requirements, local_module, setup_py_dependencies
from launcher.errors import UserError
from launcher.storage.uri import URI_LIKE
from launcher.worker.deps import WORKING_DIR_VAR, env_key, pip_env  # WORKING_DIR_VAR: the node's copy of the folder

SHEBANG = re.compile(rb"^#!.*\bpython[0-9.]*\b")
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class Program:
    """What to run on every worker, from which folder, with which declared dependencies."""

    kind: str                   # "script" or "module"
    folder: str                 # absolute; shipped as working_dir
    target: str                 # the script's path relative to folder, or the dotted module
    requirements: tuple[str, ...] = ()
    sources: tuple[str, ...] = field(default=(), compare=False)  # where the requirements were read
    archives: tuple[str, ...] = ()  # built packages in folder (file names, in install order); () for a folder
    packages: tuple[str, ...] = field(default=(), compare=False)  # where those came from (paths, gs:// URIs)
    env: tuple[tuple[str, str], ...] = ()  # variables every rank gets (a Vertex pythonPackageSpec's env)
    image: str | None = None        # kind "command": the image the ranks run in (a containerSpec's imageUri)
    argv: tuple[str, ...] = ()      # kind "command": what each rank runs in it, before the run's args
    # the libraries its modules import at their top (the entry module and the folder's modules it imports)
    libraries: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def label(self) -> str:
        """How runs and summaries name it: ``script:train.py``, ``module:trainer.task``, or for built
        packages ``module:trainer.task (trainer-0.1.tar.gz)`` (by file name: a run may continue
        from the same archive fetched from elsewhere)."""
        label = f"{self.kind}:{self.target}"
        if self.image:
            return f"container:{self.image} ({shlex.join(self.argv)})"
        return f"{label} ({', '.join(self.archives)})" if self.archives else label

    def command(self, folder: str | None = None) -> list[str]:
        """The command a worker runs in ``folder`` (default: the driver's folder)."""
        if self.image:
            return list(self.argv)
        if self.kind == "module":
            return [sys.executable, "-m", self.target]
        return [sys.executable, os.path.join(folder or self.folder, self.target)]

    def runtime_env(self) -> dict[str, Any]:
        """``working_dir`` (+ excludes): the folder, on every node. A container's program is in
        its image: only the launcher's own packages go (``py_modules``, on this machine too), for
        the rank's wrapper that Ray starts in the image (see :meth:`worker_runtime_env`)."""
        from launcher.driver import code

        if self.image:
            return {"py_modules": code.launcher_modules(), "excludes": ["__pycache__/", "*.pyc"]}
        return {"working_dir": self.folder, "excludes": list(code.EXCLUDES)}

    def worker_runtime_env(self) -> dict[str, Any]:
        """The ranks' own runtime environment (Ray Train's ``RunConfig.worker_runtime_env``):
        a container's image, for the ranks alone. The run's controller and mailbox stay in the
        node's environment, where the launcher's code is; Ray allows ``image_uri`` only with
        ``env_vars`` and ``config``."""
        return {"image_uri": self.image} if self.image else {}

    def to_config(self, shipped: bool) -> dict[str, Any]:
        """What a worker needs to find and start the program (see launcher.worker.script)."""
        return {"kind": self.kind, "target": self.target, "folder": self.folder, "shipped": shipped,
                "requirements": list(self.requirements), "archives": list(self.archives),
                "env_key": env_key(list(self.requirements), self.folder) if self.requirements else None,
                "pip_env": pip_env(),  # the nodes' pip takes the driver's index options
                **({"command": list(self.argv), "image": self.image} if self.image else {})}

    def to_argv(self) -> list[str]:
        """The flags that name this program, for a command run in the shipped folder."""
        if self.image:
            raise UserError(f"a containerSpec job ({self.image}) is not sent with `launcher submit` yet",
                            "copy the job file to the cluster's head and run `launcher run --config FILE` there")
        if self.archives:
            return ["--package", ",".join(self.archives), "--module", self.target]
        if self.kind == "module":
            return ["--package", ".", "--module", self.target]
        return ["--script", self.target]


# -- building one from the flags -----------------------------------------------------------

def from_flags(script: str | None, package: str | None, module: str | None) -> Program | None:
    """The program the flags name (None: a workload run).

    Raises:
        UserError: a flag combination or a program that cannot run.
    """
    if script and (package or module):
        raise UserError("--script and --package/--module name two programs", "give one of them")
    if script:
        return from_script(script)
    if package or module:
        if not (package and module):
            missing = "--module" if package else "--package"
            raise UserError(f"{missing} is missing: a trainer package is run as --package DIR --module NAME",
                            "for example --package . --module trainer.task")
        return from_package(package, module)
    return None


def from_container(image: str, command: tuple[str, ...], env: dict[str, str] | None = None) -> Program:
    """A Vertex AI containerSpec as the run's program: each rank runs ``command`` (then the
    run's args) in ``image``. No folder of the user's is shipped; its folder is an empty one
    here (the ranks run in the image's working directory)."""
    folder = os.path.join(tempfile.gettempdir(), "launcher-container")
    os.makedirs(folder, exist_ok=True)
    return Program("command", folder, os.path.basename(command[0]), env=tuple(sorted((env or {}).items())),
                   image=image, argv=tuple(command))


def check_container(program: Program, args: list[str] | tuple[str, ...], spec) -> None:
    """UserError (one line: what would run, why not here) when the ranks would run on this
    machine (a local Ray, or the warm head) and it has no podman, which Ray starts images with.
    On a cluster (``--address``, RAY_ADDRESS, a submitted job) the nodes decide; nothing here
    can see whether they have podman or the image (see docs/guides/job-files.md)."""
    if not program.image:
        return
    joining = bool(spec.address or os.environ.get("RAY_ADDRESS")) or session.in_ray_job()
    if joining or shutil.which("podman"):
        return
    names = [name for name, _ in program.env] + ["CLUSTER_SPEC"] + \
        list(frameworks.get(spec.framework).program_env_names) + \
        ["AIP_MODEL_DIR", "AIP_CHECKPOINT_DIR", "AIP_TENSORBOARD_LOG_DIR"]
    docker = " (docker is, but Ray starts images with podman)" if shutil.which("docker") else ""
    raise UserError(f"container job: {spec.workers} rank(s) would each run {shlex.join([*program.argv, *args])} "
                    f"in image {program.image}, with env {', '.join(names)}; not on this machine: a local Ray, "
                    f"and no podman on PATH to start the image{docker}",
                    "run it on a cluster whose nodes have podman and the image (`launcher cluster config "
                    "--container-image IMAGE`), with --address or on its head")


def from_script(path: str) -> Program:
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise UserError(f"--script {path}: no such file", "give the path of a Python training script")
    if not os.path.isfile(full):
        raise UserError(f"--script {path}: not a file", "give the path of a Python training script, not a folder")
    if not full.endswith(".py"):
        with open(full, "rb") as f:
            if not SHEBANG.match(f.readline(200)):
                raise UserError(f"--script {path}: not a Python script (no .py suffix and no python shebang)",
                                "rename it to end with .py, or start it with #!/usr/bin/env python3")
    folder = os.path.dirname(full)
    requirements, sources = declared_requirements(folder)
    program = Program("script", folder, os.path.basename(full), tuple(requirements), tuple(sources))
    return dataclasses.replace(program, libraries=check_imports(folder, full, f"--script {path}", bool(requirements)))


def from_package(package: str, module: str) -> Program:
    """A trainer package's folder, or built packages (``a.tar.gz,gs://B/b.whl``), with the module to run."""
    if not MODULE_NAME.match(module):
        raise UserError(f"--module {module}: not a dotted module name", "for example --module trainer.task")
    if "," in package or archives.is_archive_name(package) or URI_LIKE.match(package):
        return from_archives(archives.split_uris(package), module)
    folder = os.path.abspath(os.path.expanduser(package))
    if not os.path.exists(folder):
        raise UserError(f"--package {package}: no such folder", "give the folder that holds your trainer package "
                        "(the one with setup.py, and trainer/ inside it), or its sdist (.tar.gz) or wheel (.whl)")
    if not os.path.isdir(folder):
        raise UserError(f"--package {package}: not a folder, and not an sdist or wheel (.tar.gz or .whl)",
                        "give the folder that holds the package (e.g. --package . --module trainer.task), or "
                        "what python setup.py sdist or pip wheel built from it")
    path = local_module(folder, module, "__main__.py")
    if path is None:
        raise UserError(f"--module {module}: no {module.replace('.', '/')}.py (or package with __main__.py) "
                        f"in {folder}", "run from the folder that holds the package, or pass --package FOLDER")
    requirements, sources = declared_requirements(folder)
    program = Program("module", folder, module, tuple(requirements), tuple(sources))
    return dataclasses.replace(program, libraries=check_imports(folder, path, f"--module {module}", bool(requirements)))


def from_archives(uris: list[str], module: str) -> Program:
    """Built packages, installed in order on every node, ``module`` run from what they install.

    Raises:
        UserError: a name that is not an sdist or wheel, a file or object that does not exist, a
            corrupt archive, no archive with the module, or a module that cannot run.
        Unreachable: Cloud Storage did not answer.
    """
    if not uris:
        raise UserError("--package is empty", "give a folder, or sdists and wheels separated by commas")
    for uri in uris:
        if URI_LIKE.match(uri) and not uri.startswith(archives.REMOTE_SCHEMES):
            raise UserError(f"--package {uri}: only local paths and gs:// URIs are supported",
                            "copy it to gs://BUCKET/... or download it first")
        if not archives.is_archive_name(uri):
            folder = not URI_LIKE.match(uri) and os.path.isdir(os.path.expanduser(uri))
            raise UserError(f"--package {uri}: " + ("a folder, with other packages" if folder else
                                                    "not an sdist or wheel (.tar.gz or .whl)"),
                            "give one folder, or built packages (.tar.gz, .whl) separated by commas")
    opened = [archives.open_archive(uri, archives.local_copy(uri)) for uri in uris]
    names = [a.name for a in opened]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"--package: two archives are named {twice[0]}", "give each package once")
    holders = [a for a in opened if a.module_file(module)]
    if not holders:
        raise UserError(f"--module {module}: no {module.replace('.', '/')}.py (or package with __main__.py) in "
                        + "; ".join(f"{a.name} (it has: {', '.join(a.top_level()) or 'no Python packages'})"
                                    for a in opened),
                        "check --module, or build the archive from the folder that holds the package")
    libraries = _check_archived_module(opened, holders[-1], module)
    folder = archives.ship_folder([a.path for a in opened])
    return Program("module", folder, module, tuple(f"{WORKING_DIR_VAR}/{n}" for n in names), tuple(names),
                   archives=tuple(names), libraries=libraries,
                   packages=tuple(u if URI_LIKE.match(u) else os.path.abspath(os.path.expanduser(u)) for u in uris))


def _check_archived_module(opened: list, holder, module: str) -> frozenset[str]:
    """The module's code, as the archives would install it, compiles and imports only what is
    in them, installed here or declared by one of them (unknown declarations: not refused);
    returns the libraries it imports."""
    declared = [a.declared_requirements(setup_py_dependencies) for a in opened]
    lenient = any(d is None or d for d in declared)
    with tempfile.TemporaryDirectory(prefix="launcher-package-") as tree:
        for archive in opened:  # later ones over earlier ones, as the installs would
            archive.extract_sources(tree)
        entry = local_module(tree, module, "__main__.py")
        return check_imports(tree, entry, f"--module {module} in {holder.name}", declared=lenient,
                             where=" or ".join(a.name for a in opened),
                             fix="declare it in setup.py's install_requires (or pyproject.toml's dependencies), "
                                 "build the package again, or fix the import")


# Libraries through which a program trains across processes: one that imports none of them, but
# scikit-learn or XGBoost, trains on its own (AI Platform's single-replica frameworks).
DISTRIBUTED_LIBRARIES = frozenset({"torch", "tensorflow", "keras", "tf_keras", "horovod", "jax", "ray", "mpi4py",
                                   "lightning", "pytorch_lightning", "accelerate", "deepspeed"})
SINGLE_PROCESS_FRAMEWORKS = {"sklearn": "scikit-learn", "xgboost": "XGBoost"}  # --framework -> its name


def single_process_framework(program: Program) -> str | None:
    """"sklearn" or "xgboost" for a program whose modules import that library at their top and no
    library that trains across processes (XGBoost first: its packages use scikit-learn too); else None."""
    if program.libraries & DISTRIBUTED_LIBRARIES:
        return None
    for framework in ("xgboost", "sklearn"):
        if framework in program.libraries:
            return framework
    return None
