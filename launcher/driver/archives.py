"""Built trainer packages: an sdist (``python setup.py sdist``: ``trainer-0.1.tar.gz``) or a wheel
(``*.whl``), a local file or a ``gs://`` object, as Vertex AI's ``--python-package-uris`` names them.

Read here without installing anything: each archive is fetched once on the driver
(``gs://`` through :mod:`launcher.storage.datacache`, into this machine's cache),
its listing read and checked (a truncated or corrupt archive is one line), its
modules and top-level packages found (an sdist's ``NAME-VER/trainer/task.py``, or
under ``NAME-VER/src/``; a wheel's ``trainer/task.py``), and the dependencies it
declares read where that is cheap (``Requires-Dist`` in an sdist's ``PKG-INFO`` or a
wheel's ``METADATA``, an sdist's ``*.egg-info/requires.txt``, ``pyproject.toml``,
``setup.py``). :func:`ship_folder` then copies the archives into a small folder
named after their content, which goes to every node as the job's ``working_dir``;
the nodes install them with pip (see :mod:`launcher.worker.deps`).
"""

from __future__ import annotations

import email.parser
import hashlib
import os
import posixpath
import shutil
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field

from launcher.errors import UserError
from launcher.storage import datacache

SUFFIXES = (".tar.gz", ".whl")
REMOTE_SCHEMES = ("gs://",)
CHUNK = 1024 * 1024


def is_archive_name(name: str) -> bool:
    return name.lower().endswith(SUFFIXES)


def split_uris(package: str) -> list[str]:
    """``a.tar.gz,gs://b/c.whl`` as its parts (empty parts dropped)."""
    return [part.strip() for part in package.split(",") if part.strip()]


@dataclass
class Archive:
    """One built package, read: its members (path inside the archive -> tar/zip member name)."""

    shown: str              # as the user named it (a path or a gs:// URI)
    path: str               # the local file (for gs://, this machine's cached copy)
    kind: str               # "sdist" or "wheel"
    root: str = ""          # an sdist's top folder (NAME-VER/); "" for a wheel
    members: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def read(self, rel: str) -> bytes | None:
        """A member's bytes by its path below the archive's root, or None."""
        return self.read_many([rel]).get(rel)

    def read_many(self, rels) -> dict[str, bytes]:
        """Several members' bytes, in one pass over the archive."""
        wanted = {self.members[r]: r for r in rels if r in self.members}
        out: dict[str, bytes] = {}
        if not wanted:
            return out
        try:
            if self.kind == "wheel":
                with zipfile.ZipFile(self.path) as zf:
                    return {rel: zf.read(member) for member, rel in wanted.items()}
            with tarfile.open(self.path, "r:gz") as tf:
                for info in tf:
                    if info.name in wanted and info.isfile():
                        out[wanted[info.name]] = tf.extractfile(info).read()
        except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile, zlib.error) as exc:
            raise _corrupt(self.shown, exc) from None
        return out

    def installed(self) -> dict[str, str]:
        """Its files as an install lays them out (``trainer/task.py``) -> their paths in the archive
        (an sdist's ``src/`` layout is taken as setuptools' usual ``package_dir={"": "src"}``)."""
        if self.kind == "sdist" and any(m.startswith("src/") for m in self.members):
            out = {rel[len("src/"):]: rel for rel in self.members if rel.startswith("src/")}
            for rel in self.members:  # and the top folder's own (setup.py's py_modules, PKG-INFO)
                if not rel.startswith("src/"):
                    out.setdefault(rel, rel)
            return out
        return {rel: rel for rel in self.members}

    def module_file(self, module: str) -> str | None:
        """The file (as installed) ``python -m module`` would run, or None."""
        base = "/".join(module.split("."))
        files = self.installed()
        return next((c for c in (f"{base}.py", f"{base}/__main__.py") if c in files), None)

    def top_level(self) -> list[str]:
        """The top-level packages and modules in it (what ``import X`` would find once installed)."""
        names = set()
        for inner in self.installed():
            parts = inner.split("/")
            if inner.endswith(".py") and (len(parts) > 1 or parts[0] != "setup.py"):
                names.add(parts[0].removesuffix(".py"))
        return sorted(n for n in names if n.isidentifier())

    def declared_requirements(self, setup_py_dependencies) -> list[str] | None:
        """The dependencies the archive declares; None when they cannot be read without building
        it. ``setup_py_dependencies(where, source)`` reads ``install_requires`` from a setup.py."""
        metadata = self._metadata()
        if metadata is not None:
            requires = metadata.get_all("Requires-Dist") or []
            if requires or self.kind == "wheel":  # a wheel's METADATA is complete; an old sdist's may not be
                return [r.strip() for r in requires]
        if self.kind == "wheel":
            return None
        egg = [m for m in self.members if m.endswith(".egg-info/requires.txt") and m.count("/") <= 2]
        if egg:
            lines = (self.read(egg[0]) or b"").decode("utf-8", "replace").splitlines()
            head = lines[:next((i for i, line in enumerate(lines) if line.startswith("[")), len(lines))]
            return [line.strip() for line in head if line.strip()]
        setup = self.read("setup.py")
        if setup is not None:
            return setup_py_dependencies(f"{self.name}: setup.py", setup)
        return None  # pyproject.toml alone: its sdist's PKG-INFO would have said

    def _metadata(self):
        """The parsed PKG-INFO (sdist) or METADATA (wheel), or None."""
        if self.kind == "sdist":
            text = self.read("PKG-INFO")
        else:
            found = [m for m in self.members if m.endswith(".dist-info/METADATA") and m.count("/") == 1]
            text = self.read(found[0]) if found else None
        if text is None:
            return None
        return email.parser.HeaderParser().parsestr(text.decode("utf-8", "replace"))

    def extract_sources(self, dest: str) -> None:
        """Write its Python files under ``dest`` as an install would lay them out."""
        files = {inner: rel for inner, rel in self.installed().items() if inner.endswith(".py")}
        data = self.read_many(files.values())
        for inner, rel in files.items():
            if rel not in data:
                continue
            target = os.path.join(dest, *inner.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(data[rel])


def _corrupt(shown: str, exc: BaseException) -> UserError:
    why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return UserError(f"--package {shown}: the archive is corrupt or truncated ({why})",
                     "build it again (python setup.py sdist, or pip wheel) and upload it again")


def _safe(name: str) -> str | None:
    """A member's name as a relative posix path, or None when it would leave the archive."""
    norm = posixpath.normpath(name.replace("\\", "/"))
    if norm.startswith(("/", "../")) or norm == ".." or norm == ".":
        return None
    return norm


def open_archive(shown: str, path: str) -> Archive:
    """Read an archive's listing and check that it is whole and what it claims to be.

    Raises:
        UserError: not an sdist or wheel, or corrupt.
    """
    kind = "wheel" if path.lower().endswith(".whl") else "sdist"
    try:
        if kind == "wheel":
            return _open_wheel(shown, path)
        return _open_sdist(shown, path)
    except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile, zlib.error) as exc:
        raise _corrupt(shown, exc) from None


def _open_wheel(shown: str, path: str) -> Archive:
    stem = os.path.basename(path)[:-len(".whl")]
    if len(stem.split("-")) not in (5, 6):
        raise UserError(f"--package {shown}: not a wheel's name (NAME-VERSION-PYTHON-ABI-PLATFORM.whl)",
                        "pass the file pip wheel or python -m build wrote, under its own name")
    with zipfile.ZipFile(path) as zf:
        bad = zf.testzip()  # reads every member and checks its CRC
        if bad is not None:
            raise _corrupt(shown, ValueError(f"{bad} fails its CRC check"))
        members = {safe: info.filename for info in zf.infolist()
                   if not info.is_dir() and (safe := _safe(info.filename))}
    archive = Archive(shown, path, "wheel", "", members)
    if not any(m.endswith(".dist-info/METADATA") and m.count("/") == 1 for m in members):
        raise UserError(f"--package {shown}: not a wheel (no *.dist-info/METADATA in it)",
                        "build it with pip wheel or python -m build")
    return archive


def _open_sdist(shown: str, path: str) -> Archive:
    with tarfile.open(path, "r:gz") as tf:
        infos = tf.getmembers()  # reads to the end: a truncated archive fails here
        for info in infos:  # and every file's data, so corrupt content fails here too
            if info.isfile():
                f = tf.extractfile(info)
                while f is not None and f.read(CHUNK):
                    pass
    names = {(safe, info.name) for info in infos if info.isfile() and (safe := _safe(info.name))}
    tops = {safe.split("/")[0] for safe, _ in names}
    if len(tops) != 1 or not all("/" in safe for safe, _ in names):
        raise UserError(f"--package {shown}: not an sdist (an sdist holds one folder, NAME-VERSION/; this holds "
                        f"{', '.join(sorted(tops)[:5]) or 'nothing'})", "build it with python setup.py sdist")
    (top,) = tops
    members = {safe[len(top) + 1:]: name for safe, name in names}
    if "setup.py" not in members and "pyproject.toml" not in members:
        raise UserError(f"--package {shown}: not an sdist (no setup.py or pyproject.toml in {top}/)",
                        "build it with python setup.py sdist")
    return Archive(shown, path, "sdist", top + "/", members)


def local_copy(uri: str, note=None) -> str:
    """The local file for a path or a gs:// URI (fetched into this machine's cache once).

    Raises:
        UserError: no such file (or object).
        Unreachable: Cloud Storage did not answer.
    """
    if uri.startswith("gs://"):
        return datacache.fetch_object(uri, "--package", note)
    full = os.path.abspath(os.path.expanduser(uri))
    if not os.path.exists(full):
        raise UserError(f"--package {uri}: no such file", "give the path of the sdist (.tar.gz) or wheel (.whl) "
                        "that python setup.py sdist or pip wheel wrote")
    if not os.path.isfile(full):
        raise UserError(f"--package {uri}: not a file", "give the sdist (.tar.gz) or wheel (.whl) itself")
    return full


def digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def ship_folder(paths: list[str], root: str | None = None) -> str:
    """A folder holding copies of ``paths`` under their own names, named after their content
    (the same archives: the same folder, so later launches reuse it and Ray's upload of it)."""
    root = root or os.path.join(datacache.cache_root(), "packages")
    h = hashlib.sha256()
    for path in paths:
        h.update(os.path.basename(path).encode() + b"\0" + digest(path).encode() + b"\n")
    folder = os.path.join(root, h.hexdigest()[:16])
    if os.path.isdir(folder):
        return folder
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".part-", dir=root)
    try:
        for path in paths:
            shutil.copyfile(path, os.path.join(tmp, os.path.basename(path)))
        try:
            os.rename(tmp, folder)
        except OSError:  # another launch made it meanwhile: the same content
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
