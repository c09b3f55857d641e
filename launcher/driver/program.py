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
the code compiles, every module it imports at the top is in the folder,
installed here or declared, local wheels named in ``requirements.txt`` are in
the folder, and the folder is not too big to ship.

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

import ast
import importlib.util
import os
import re
import shlex
import shutil
import sys
import tempfile
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from launcher import frameworks
from launcher.driver import archives, session
from launcher.errors import UserError
from launcher.storage.uri import URI_LIKE
from launcher.worker.deps import WORKING_DIR_VAR, env_key, pip_env  # WORKING_DIR_VAR: the node's copy of the folder

SHEBANG = re.compile(rb"^#!.*\bpython[0-9.]*\b")
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_LOCAL_SUFFIXES = (".whl", ".tar.gz", ".zip", ".tar.bz2")


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
    return dataclasses.replace(program, libraries=check_imports(program, full, f"--script {path}"))


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
    path = module_file(folder, module)
    if path is None:
        raise UserError(f"--module {module}: no {module.replace('.', '/')}.py (or package with __main__.py) "
                        f"in {folder}", "run from the folder that holds the package, or pass --package FOLDER")
    requirements, sources = declared_requirements(folder)
    program = Program("module", folder, module, tuple(requirements), tuple(sources))
    return dataclasses.replace(program, libraries=check_imports(program, path, f"--module {module}"))


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
    declared = [a.declared_requirements(_setup_py_dependencies) for a in opened]
    lenient = any(d is None or d for d in declared)
    with tempfile.TemporaryDirectory(prefix="launcher-package-") as tree:
        for archive in opened:  # later ones over earlier ones, as the installs would
            archive.extract_sources(tree)
        program = Program("module", tree, module)
        entry = module_file(tree, module)
        return check_imports(program, entry, f"--module {module} in {holder.name}", declared=lenient,
                      where=" or ".join(a.name for a in opened),
                      fix="declare it in setup.py's install_requires (or pyproject.toml's dependencies), build "
                          "the package again, or fix the import")


def module_file(folder: str, module: str) -> str | None:
    """The file ``python -m module`` runs from ``folder``, or None."""
    base = os.path.join(folder, *module.split("."))
    for candidate in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


# -- dependencies ----------------------------------------------------------------------------

def declared_requirements(folder: str) -> tuple[list[str], list[str]]:
    """The pip requirements a folder declares, and the files they came from.

    Local files named in ``requirements.txt`` (a wheel, an sdist, a folder)
    must be inside the folder; they are rewritten to the node's copy of it.

    Raises:
        UserError: a requirements line or a declaration that cannot work on another node.
    """
    out: list[str] = []
    sources: list[str] = []
    req = os.path.join(folder, "requirements.txt")
    if os.path.isfile(req):
        sources.append("requirements.txt")
        out += _requirements_file(folder, req)
    pyproject = os.path.join(folder, "pyproject.toml")
    setup = os.path.join(folder, "setup.py")
    if os.path.isfile(pyproject):
        deps = _pyproject_dependencies(pyproject)
        if deps is not None:
            sources.append("pyproject.toml")
            out += deps
    if os.path.isfile(setup) and "pyproject.toml" not in sources:
        deps = _setup_py_dependencies(setup)
        sources.append("setup.py")
        # A computed install_requires: let pip build the package to find them.
        out += deps if deps is not None else [WORKING_DIR_VAR]
    unique: list[str] = []
    for line in out:
        if line not in unique:
            unique.append(line)
    return unique, sources


def _requirements_file(folder: str, path: str) -> list[str]:
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    for number, raw in enumerate(lines, 1):
        line = raw.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        where = f"{os.path.join(os.path.basename(folder), 'requirements.txt')} line {number}"
        if line.startswith(("-r", "--requirement", "-c", "--constraint", "-e", "--editable")):
            raise UserError(f"{where}: {line!r}: nested requirement files and editable installs are not "
                            "supported", "list the packages in requirements.txt itself")
        if line.startswith("-"):
            raise UserError(f"{where}: {line!r}: pip options are not supported here",
                            "list only packages (names, versions, or files inside the package folder)")
        out.append(_local_requirement(folder, line, where) if _looks_local(line) else line)
    return out


def _looks_local(line: str) -> bool:
    return line.startswith((".", "/", "~", "file:")) or line.endswith(_LOCAL_SUFFIXES)


def _local_requirement(folder: str, line: str, where: str) -> str:
    """A file or folder named in requirements.txt, as the node's copy of it."""
    path = line[len("file:"):] if line.startswith("file:") else line
    full = os.path.abspath(os.path.join(folder, os.path.expanduser(path)))
    inside = full == folder or full.startswith(folder + os.sep)
    if not os.path.exists(full):
        raise UserError(f"{where}: {line}: no such file", "put the file inside the package folder and name it "
                        "relative to it, e.g. ./deps/mylib-1.0-py3-none-any.whl")
    if not inside:
        raise UserError(f"{where}: {line} is outside {folder}, so other nodes would not have it",
                        "copy it into the package folder and name it relative to it")
    rel = os.path.relpath(full, folder)
    return WORKING_DIR_VAR if rel == "." else f"{WORKING_DIR_VAR}/{rel}"


def _pyproject_dependencies(path: str) -> list[str] | None:
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid TOML ({exc})", "fix the file, or remove it") from None
    deps = (data.get("project") or {}).get("dependencies")
    if deps is None:
        return None
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise UserError(f"{path}: [project] dependencies must be a list of strings")
    return list(deps)


def _setup_py_dependencies(path: str, source: bytes | None = None) -> list[str] | None:
    """``install_requires`` when setup.py spells it as a list of strings; None when it is computed.
    ``source``: the file's content, when it is not on disk (inside an archive)."""
    try:
        tree = ast.parse(_read(path) if source is None else source, path)
    except SyntaxError as exc:
        raise UserError(f"{path}: syntax error at line {exc.lineno}: {exc.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "setup":
            for kw in node.keywords:
                if kw.arg == "install_requires":
                    try:
                        value = ast.literal_eval(kw.value)
                    except ValueError:
                        return None
                    return [str(v) for v in value] if isinstance(value, (list, tuple)) else None
            return []
    return None


# -- imports ---------------------------------------------------------------------------------

def check_imports(program: Program, entry: str, what: str, declared: bool | None = None, where: str | None = None,
                  fix: str | None = None) -> frozenset[str]:
    """Compile the entry file and the folder's modules it imports; every module imported at
    the top must be in the folder, installed here, or declared as a dependency. Returns the
    libraries (top-level names, the standard library's left out) they import.

    ``declared``: whether dependencies are declared (default: the program's requirements);
    ``where``, ``fix``: the folder as the message names it, and how to fix a missing import.

    Raises:
        UserError: a syntax error, or a module nothing provides.
    """
    declared = bool(program.requirements) if declared is None else declared
    seen: set[str] = set()
    libraries: set[str] = set()
    todo = [entry]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        rel = os.path.relpath(path, program.folder)
        try:
            tree = ast.parse(_read(path), path)
        except SyntaxError as exc:
            raise UserError(f"{what}: {rel} line {exc.lineno}: syntax error: {exc.msg}",
                            f"run `python -m py_compile {path}` to see it") from None
        except ValueError as exc:  # null bytes: not a text file
            raise UserError(f"{what}: {rel} is not Python source ({exc})") from None
        package = _package_of(program.folder, path)
        for name, line in top_level_imports(tree, package):
            local = _local_module(program.folder, name)
            if local:
                todo.append(local)
                continue
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names:
                libraries.add(top)
            if top in sys.stdlib_module_names or _importable(top):
                continue
            if declared:
                continue  # import names and distribution names differ (yaml/PyYAML): pip will tell
            raise UserError(f"{what}: {rel} line {line} imports {top}, which is not in {where or program.folder}, "
                            "not installed here and not declared as a dependency",
                            fix or f"add {release_for_torch(top) or top} to "
                            f"{os.path.join(program.folder, 'requirements.txt')}, or fix the import")
    return frozenset(libraries)


def release_for_torch(library: str) -> str | None:
    """``"torchvision==0.28.0 (the release for the torch 2.13.0+cpu installed here)"`` for
    torchvision where torch is installed; None for anything else (or without torch).

    torchvision is released in step with torch, 0.N with torch 2.(N - 15) (0.28 with 2.13),
    their patch releases alike (but for 2.0.x, whose torchvision patches were one ahead:
    0.15.2 with 2.0.1), and each torchvision pins its torch: an unpinned one is the newest,
    which would bring a torch other than the one the workers run."""
    if library != "torchvision":
        return None
    from importlib import metadata

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", torch)
    if not found or found[1] != "2":
        return None
    minor, patch = int(found[2]), int(found[3])
    return f"torchvision==0.{minor + 15}.{patch + (minor == 0)} (the release for the torch {torch} installed here)"


# Libraries through which a program trains across processes: one that imports none of them, but
# scikit-learn or XGBoost, trains on its own (AI Platform's single-replica frameworks).
DISTRIBUTED_LIBRARIES = frozenset({"torch", "tensorflow", "keras", "tf_keras", "horovod", "jax", "ray", "mpi4py",
                                   "lightning", "pytorch_lightning", "accelerate", "deepspeed"})
SINGLE_PROCESS_FRAMEWORKS = {"sklearn": "scikit-learn", "xgboost": "XGBoost"}  # --framework -> its name


def single_process_framework(program: "Program") -> str | None:
    """"sklearn" or "xgboost" for a program whose modules import that library at their top and no
    library that trains across processes (XGBoost first: its packages use scikit-learn too); else None."""
    if program.libraries & DISTRIBUTED_LIBRARIES:
        return None
    for framework in ("xgboost", "sklearn"):
        if framework in program.libraries:
            return framework
    return None


def top_level_imports(tree: ast.Module, package: str) -> list[tuple[str, int]]:
    """Absolute names of the modules imported by module-level statements (not inside
    functions or try/except, which are often optional), with their line numbers."""
    out = []
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If):  # `if __name__ == "__main__":` and version checks
            body = node.body + node.orelse + body
        elif isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base = parts[:len(parts) - node.level + 1] if node.level <= len(parts) + 1 else []
                name = ".".join(filter(None, [*base, node.module or ""]))
                if name:
                    out.append((name, node.lineno))
                    if not node.module:  # from . import model
                        out += [(f"{name}.{alias.name}", node.lineno) for alias in node.names]
            elif node.module != "__future__":
                out.append((node.module, node.lineno))
                out += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return out


def _package_of(folder: str, path: str) -> str:
    rel = os.path.relpath(os.path.dirname(path), folder)
    return "" if rel == "." else rel.replace(os.sep, ".")


def _local_module(folder: str, name: str) -> str | None:
    base = os.path.join(folder, *name.split("."))
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _importable(top: str) -> bool:
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
