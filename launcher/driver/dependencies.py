"""What a user's program needs: the dependencies its folder declares, and the modules its code
imports, checked before anything starts.

:func:`declared_requirements` reads ``requirements.txt``, ``pyproject.toml``'s ``[project]
dependencies`` and ``setup.py``'s ``install_requires`` (local wheels and folders named in
``requirements.txt`` must be inside the folder, and become the node's copy of it).
:func:`check_imports` compiles the entry file and the folder's modules it imports, and
refuses a module imported at the top that is not in the folder, not installed here and
not declared. :mod:`launcher.driver.program` builds a program with them.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys

from launcher.errors import UserError
from launcher.worker.deps import WORKING_DIR_VAR  # the node's copy of the folder

LOCAL_SUFFIXES = (".whl", ".tar.gz", ".zip", ".tar.bz2")


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
        deps = setup_py_dependencies(setup)
        sources.append("setup.py")
        # A computed install_requires: let pip build the package to find them.
        out += deps if deps is not None else [WORKING_DIR_VAR]
    return list(dict.fromkeys(out)), sources


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
    return line.startswith((".", "/", "~", "file:")) or line.endswith(LOCAL_SUFFIXES)


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


def setup_py_dependencies(path: str, source: bytes | None = None) -> list[str] | None:
    """``install_requires`` when setup.py spells it as a list of strings; None when it is computed.
    ``source``: the file's content, when it is not on disk (inside an archive)."""
    try:
        tree = ast.parse(read_bytes(path) if source is None else source, path)
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


def check_imports(folder: str, entry: str, what: str, declared: bool, where: str | None = None,
                  fix: str | None = None) -> frozenset[str]:
    """Compile the entry file and the folder's modules it imports; every module imported at
    the top must be in the folder, installed here, or declared as a dependency. Returns the
    libraries (top-level names, the standard library's left out) they import.

    ``declared``: whether dependencies are declared (an import nothing here provides may then be one
    of them); ``where``, ``fix``: the folder as the message names it, and how to fix a missing import.

    Raises:
        UserError: a syntax error, or a module nothing provides.
    """
    seen: set[str] = set()
    libraries: set[str] = set()
    todo = [entry]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        rel = os.path.relpath(path, folder)
        try:
            tree = ast.parse(read_bytes(path), path)
        except SyntaxError as exc:
            raise UserError(f"{what}: {rel} line {exc.lineno}: syntax error: {exc.msg}",
                            f"run `python -m py_compile {path}` to see it") from None
        except ValueError as exc:  # null bytes: not a text file
            raise UserError(f"{what}: {rel} is not Python source ({exc})") from None
        package = _package_of(folder, path)
        for name, line in top_level_imports(tree, package):
            local = local_module(folder, name)
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
            raise UserError(f"{what}: {rel} line {line} imports {top}, which is not in {where or folder}, "
                            "not installed here and not declared as a dependency",
                            fix or f"add {release_for_torch(top) or top} to "
                            f"{os.path.join(folder, 'requirements.txt')}, or fix the import")
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


def local_module(folder: str, name: str, package_file: str = "__init__.py") -> str | None:
    """The file of the module ``name`` in ``folder``: ``NAME.py``, or ``package_file`` in the package's
    folder (``__main__.py``: what ``python -m NAME`` runs); None when it is not there."""
    base = os.path.join(folder, *name.split("."))
    for candidate in (base + ".py", os.path.join(base, package_file)):
        if os.path.isfile(candidate):
            return candidate
    return None


def _importable(top: str) -> bool:
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
