"""The code a run needs on every node, as Ray runtime-environment entries.

The launcher's own packages (``launcher``, ``workloads``) go as ``py_modules``
whenever the run joins a cluster, so the cluster runs the driver's version.
A user workload's folder goes as the job's ``working_dir``: for
``FILE.py:NAME`` the file's folder (its helper modules travel with it), for
``package.module:NAME`` the folder holding the package, unless it is installed
in the environment (then the cluster needs it installed, like any other
dependency). Ray honours ``.gitignore`` and ``.rayignore`` in that folder;
:data:`EXCLUDES` are left out as well. The folder's size is checked first, by
Ray's own walk, so an oversize folder is one clear line, not a long upload
that fails.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sysconfig
from pathlib import Path
from typing import Any, Mapping

import launcher
import workloads
from launcher import _ray
from launcher.errors import UserError
from launcher.settings import CODE_LIMIT_MB, PREFIX
from workloads.user import SHIPPED_ENV, parse_reference

EXCLUDES = [".git", "__pycache__", "*.pyc", ".venv", "venv", ".ipynb_checkpoints", ".pytest_cache", "runs",
            "bench-results", "*.egg-info"]


def launcher_modules() -> list[str]:
    """The folders of the launcher's own packages."""
    return [os.path.dirname(os.path.abspath(m.__file__)) for m in (launcher, workloads)]


def workload_folder(workload: str) -> str | None:
    """The folder that holds a user workload's code (None: a built-in or an installed module)."""
    if not workloads.is_reference(workload):
        return None
    ref = parse_reference(workload)
    if ref.path:
        return os.path.dirname(ref.path)

    top = ref.module.split(".")[0]
    found = importlib.util.find_spec(top)
    origin = (list(found.submodule_search_locations or []) or [found.origin])[0] if found else None
    if not origin or _installed(origin):
        return None
    return os.path.dirname(origin)  # the folder holding the package (or the single module)


def _installed(path: str) -> bool:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    return any(os.path.abspath(path).startswith(os.path.abspath(r) + os.sep) for r in roots)


def workload_runtime_env(workload: str) -> dict[str, Any]:
    """``working_dir`` (+ excludes, + the variable that tells workers to load the shipped file)
    for a user workload; {} for a built-in one or an installed module.

    Raises:
        UserError: the folder is over the size limit.
    """
    folder = workload_folder(workload)
    if folder is None:
        return {}
    check_size(folder)
    env: dict[str, Any] = {"working_dir": folder, "excludes": list(EXCLUDES)}
    if parse_reference(workload).path:
        env["env_vars"] = {SHIPPED_ENV: "1"}  # workers: load the shipped copy, not a file at the same path
    return env


# Variables a run's workers read that a Ray started before the launch never saw: the launcher's
# own settings (LAUNCHER_*) and these. A launch's own local Ray passes its whole environment
# on to its workers; a cluster or the warm head gets these through the runtime environment.
PASSED_ENV = ("STORAGE_EMULATOR_HOST", "MLFLOW_EXPERIMENT_NAME")


def passed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launch's settings its workers must see, from ``environ``."""
    return {k: v for k, v in environ.items() if v and (k.startswith(PREFIX) or k in PASSED_ENV)}


def runtime_env(workload: str | None, joining_cluster: bool, program: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a run ships: joining a cluster, the launcher's packages and the user's code;
    on this machine (a local Ray, the warm head) only a user module's folder, which the
    workers would not find on their path otherwise (a file is found by its path).
    ``program``: a script's or package's runtime environment, shipped as given."""
    if program:
        if joining_cluster:
            return merge({"py_modules": launcher_modules(), "excludes": ["__pycache__/", "*.pyc"]}, program)
        return program
    user = workload_runtime_env(workload) if workload else {}
    if joining_cluster:
        return merge({"py_modules": launcher_modules(), "excludes": ["__pycache__/", "*.pyc"]}, user)
    if user and workloads.is_reference(workload) and not parse_reference(workload).path:
        return user
    return {}


def check_size(folder: str, limit_mb: float | None = None, what: str = "the workload's folder") -> int:
    """Bytes Ray would ship from ``folder`` (walked as Ray walks it); UserError above the limit."""
    limit_mb = limit_mb if limit_mb is not None else float(CODE_LIMIT_MB.get())
    limit = int(limit_mb * 1024 * 1024)

    total = 0
    biggest: list[tuple[int, str]] = []

    class TooBig(Exception):
        pass

    def count(path: Path) -> None:
        nonlocal total
        if path.is_file():
            size = path.stat().st_size
            total += size
            biggest.append((size, str(path.relative_to(folder))))
            if total > limit:
                raise TooBig

    quiet = logging.getLogger("launcher.code-walk")  # Ray's walk logs an ERROR when we stop it early
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    try:
        _ray.dir_travel(Path(folder), [_ray.excludes_matcher(Path(folder), EXCLUDES)], count,
                        include_gitignore=True, logger=quiet)
    except TooBig:
        largest = ", ".join(f"{name} ({size / 2**20:.0f} MiB)" for size, name in sorted(biggest, reverse=True)[:3])
        raise UserError(f"{what} {folder} holds over {limit_mb:g} MiB to ship to every worker "
                        f"(largest: {largest})",
                        "keep data out of it (pass --data), list big files in a .rayignore there, or raise "
                        f"{CODE_LIMIT_MB}") from None
    return total


def merge(*envs: dict[str, Any]) -> dict[str, Any]:
    """Runtime environments merged: lists and env_vars added up, other keys from the last one."""
    out: dict[str, Any] = {}
    for env in envs:
        for key, value in env.items():
            if key in ("py_modules", "excludes"):
                out[key] = [*out.get(key, []), *[v for v in value if v not in out.get(key, [])]]
            elif key == "env_vars":
                out[key] = {**out.get(key, {}), **value}
            else:
                out[key] = value
    return out
