"""A shard set's ``index.json``: which shards, how many samples each, their sizes and digests.

The index is the only thing a reader trusts: it is written after every shard
is in place, so a folder without one is a set whose writing did not finish
(or not a set at all). ``launcher data shard`` also writes ``unfinished.json``
before its first shard and removes it after the index: a folder that holds it
and no index is a set cut off while it was written, and every reader, ``data
index`` and a new ``data shard`` into the folder say so instead of taking the
shards there for a whole set. Loading it checks everything a reader relies on and
turns each problem into one :class:`~launcher.errors.UserError` line; reading
``gs://`` goes through :class:`~launcher.storage.Storage`, whose outage errors
pass through as they are.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import posixpath
import re
import time
from dataclasses import dataclass, field

from launcher.errors import UserError
from launcher.storage import Storage, gcs

INDEX = "index.json"
UNFINISHED = "unfinished.json"  # written before the first shard, removed after the index
FORMAT = "launcher-shards/1"
KINDS = ("parquet", "jsonl", "tar", "tfrecord")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# What to do about an index that cannot be used.
REINDEX = "write the set again with `launcher data shard`, or index its shards with `launcher data index --overwrite`"


class ShardError(UserError):
    """A shard that is missing or damaged when it is read: names the shard, the set and the remedy.

    ``shard`` is the shard's name in the index (or a local path when there is no
    index at hand), ``where`` the set's URI (may be empty), ``problem`` what is wrong.
    """

    def __init__(self, shard: str, where: str, problem: str, fix: str | None = None) -> None:
        self.shard, self.where, self.problem = shard, where, problem
        what = f"{shard} of {where}: {problem}" if where else f"{shard}: {problem}"
        super().__init__(what, fix or f"fetch it again; if it persists, {REINDEX}")

    def __reduce__(self):  # Ray pickles errors raised in workers: keep every argument
        return type(self), (self.shard, self.where, self.problem, self.fix)


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the index lists it: a name relative to the set, its samples, size and sha256."""

    name: str
    samples: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ShardIndex:
    """A shard set: where it is (``uri``), the kind of its shards, the shards in order, and ``fields``
    (per-column array shapes and dtypes, class names; see :func:`launcher.data.formats.read_shard`)."""

    uri: str
    kind: str
    shards: tuple[ShardInfo, ...]
    fields: dict = field(default_factory=dict, hash=False)

    @property
    def samples(self) -> int:
        """How many samples the set holds."""
        return self._starts[-1]

    @property
    def bytes(self) -> int:
        """How many bytes its shards take."""
        return sum(info.bytes for info in self.shards)

    @functools.cached_property
    def _starts(self) -> tuple[int, ...]:
        starts = [0]
        for info in self.shards:
            starts.append(starts[-1] + info.samples)
        return tuple(starts)

    def offsets(self):
        """The global index of each shard's first sample, then the total (``len(shards) + 1`` int64s)."""
        import numpy as np

        return np.array(self._starts, dtype=np.int64)

    def shard_of(self, i: int) -> tuple[int, int]:
        """(shard number, index inside that shard) of the global sample ``i``.

        Raises:
            IndexError: ``i`` is not in ``range(self.samples)``.
        """
        if not 0 <= i < self.samples:
            raise IndexError(f"sample {i} is outside the set's {self.samples} samples")
        n = bisect.bisect_right(self._starts, i) - 1
        return n, i - self._starts[n]

    def shard_uri(self, n: int) -> str:
        """Where shard ``n`` is (a local path or a gs:// URI)."""
        return posixpath.join(self.uri, self.shards[n].name)

    def to_json(self) -> str:
        """The text of ``index.json`` (the set's location is where the file lives, so it is not in it)."""
        body = {"format": FORMAT, "kind": self.kind, "samples": self.samples, "fields": self.fields,
                "shards": [{"name": s.name, "samples": s.samples, "bytes": s.bytes, "sha256": s.sha256}
                           for s in self.shards]}
        return json.dumps(body, indent=1) + "\n"

    @classmethod
    def load(cls, uri: str) -> "ShardIndex":
        """Read and check ``uri/index.json`` (``uri``: a local folder or gs://BUCKET/PREFIX).

        Raises:
            UserError: no index there, or one that is not a valid index (one line says which).
            Unreachable: Cloud Storage (or its emulator) did not answer.
        """
        uri = normalise(uri)
        storage = Storage.resolve(uri)
        text = read_index_text(storage)
        if text is None:
            raise _not_a_set(storage)
        return cls.from_json(text, uri)

    @classmethod
    def from_json(cls, text: str, uri: str) -> "ShardIndex":
        """An index from the text of ``uri``'s ``index.json``, checked (UserError on any problem)."""
        where = posixpath.join(uri, INDEX)
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where} is not JSON ({exc.msg} at line {exc.lineno})", REINDEX) from None
        if not isinstance(body, dict):
            raise UserError(f"{where} is not a JSON object", REINDEX)
        if body.get("format") != FORMAT:
            raise UserError(f"{where}: format {body.get('format')!r}, expected {FORMAT!r}", REINDEX)
        kind = body.get("kind")
        if kind not in KINDS:
            raise UserError(f"{where}: unknown kind {kind!r} (valid: {', '.join(KINDS)})", REINDEX)
        fields = body.get("fields", {})
        _check_fields(fields, where)
        shards = tuple(_shard_info(entry, n, where) for n, entry in enumerate(_shard_list(body, where)))
        index = cls(uri=uri, kind=kind, shards=shards, fields=fields)
        _check_names_and_total(index, body.get("samples"), where)
        return index


def normalise(uri: str) -> str:
    """A set's location as the index keeps it: gs:// URIs tidied, local paths made absolute
    (workers run in other folders)."""
    if uri.startswith("gs://"):
        return gcs.parse_gs_uri(uri, what="shard set").uri
    if "://" in uri:
        raise UserError(f"shard set {uri!r}: the {uri.split('://')[0]}:// scheme is not supported",
                        "use a local folder or gs://BUCKET/PREFIX")
    return os.path.abspath(os.path.expanduser(uri))


def read_index_text(storage: Storage) -> str | None:
    """The text of ``index.json`` under ``storage`` (None: there is none), storage errors explained."""
    start = time.monotonic()
    try:
        return storage.read_text(INDEX)
    except OSError as exc:
        raise storage_error(exc, storage, storage.uri_of(INDEX), "read", time.monotonic() - start) from None


def read_unfinished(storage: Storage) -> dict | None:
    """What ``unfinished.json`` under ``storage`` says (None: there is none): the set's writing
    started there and did not end. A damaged note still counts (as an empty dict)."""
    start = time.monotonic()
    try:
        text = storage.read_text(UNFINISHED)
    except OSError as exc:
        raise storage_error(exc, storage, storage.uri_of(UNFINISHED), "read", time.monotonic() - start) from None
    if text is None:
        return None
    try:
        note = json.loads(text)
    except ValueError:
        return {}
    return note if isinstance(note, dict) else {}


def unfinished_text(storage: Storage, note: dict, written: int | None = None) -> str:
    """``URI holds an unfinished shard set (N shard files of about M, from INPUT)``."""
    if written is None:
        try:
            written = len(shard_files(storage.list_files()))
        except OSError as exc:
            raise storage_error(exc, storage, storage.uri, "list") from None
    planned = f" of about {note['shards']}" if note.get("shards") else ""
    source = f", from {note['input']}" if note.get("input") else ""
    return (f"{storage.uri} holds an unfinished shard set ({written} shard file{'s' if written != 1 else ''}"
            f"{planned}{source}): its writing was stopped before the index")


def shard_files(names: list[str]) -> list[str]:
    """The names among ``names`` that ``launcher data shard`` gives its shards (shard-00042.parquet)."""
    return [n for n in names if SHARD_NAME_RE.match(n)]


SHARD_NAME_RE = re.compile(r"^shard-\d{5,}\.(parquet|jsonl|tar|tfrecord)$")


def _not_a_set(storage: Storage) -> UserError:
    """Why the folder without an index cannot be read, and what to do: an unfinished set, a file
    that is the input rather than a set, or shards that were never indexed."""
    uri = storage.uri
    note = read_unfinished(storage)
    if note is not None:
        again = f"launcher data shard {note['input']} {uri}" if note.get("input") else f"launcher data shard INPUT {uri}"
        return UserError(unfinished_text(storage, note), f"run `{again}` again: it replaces them")
    if storage.is_local and os.path.isfile(uri):
        return UserError(f"{uri} is a file, not a shard set (a folder with an {INDEX})",
                         f"make a set of it with `launcher data shard {uri} OUTPUT_FOLDER`, then pass OUTPUT_FOLDER")
    return UserError(f"{uri} has no {INDEX}: not a shard set",
                     f"make one with `launcher data shard INPUT {uri}`, or index shard files already "
                     f"there with `launcher data index {uri}`")


def storage_error(exc: OSError, storage: Storage, uri: str, action: str, waited_s: float | None = None) -> UserError:
    """One line for a filesystem error: the storage layer's own for gs:// (``waited_s``: how long the
    call went on, when timed), the OS's reason for a local path."""
    if not storage.is_local:
        return gcs.explain(exc, uri, action, waited_s)
    reason = exc.strerror or str(exc).splitlines()[0]
    return UserError(f"cannot {action} {uri}: {reason}", "check the path and its permissions")


def _check_fields(fields, where: str) -> None:
    """``fields`` is an object; each array field has a shape of whole numbers and a numpy dtype."""
    if not isinstance(fields, dict):
        raise UserError(f"{where}: 'fields' is not a JSON object", REINDEX)
    for name, spec in fields.items():
        if not (isinstance(spec, dict) and ("shape" in spec or "dtype" in spec)):
            continue
        shape, dtype = spec.get("shape"), spec.get("dtype")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise UserError(f"{where}: field {name}: shape {shape!r} is not a list of whole numbers", REINDEX)
        if not isinstance(dtype, str) or not _is_dtype(dtype):
            raise UserError(f"{where}: field {name}: dtype {dtype!r} is not a numpy dtype", REINDEX)


def _is_dtype(name: str) -> bool:
    import numpy as np

    try:
        return not np.dtype(name).hasobject  # object arrays have no bytes of their own to store
    except TypeError:
        return False


def _shard_list(body: dict, where: str) -> list:
    shards = body.get("shards")
    if not isinstance(shards, list) or not shards:
        raise UserError(f"{where}: 'shards' must be a non-empty list", REINDEX)
    return shards


def _shard_info(entry, n: int, where: str) -> ShardInfo:
    if not isinstance(entry, dict):
        raise UserError(f"{where}: shard entry {n} is not a JSON object", REINDEX)
    missing = [k for k in ("name", "samples", "bytes", "sha256") if k not in entry]
    if missing:
        raise UserError(f"{where}: shard entry {n} lacks {', '.join(missing)}", REINDEX)
    name = entry["name"]
    if not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/"):
        raise UserError(f"{where}: shard entry {n} has the name {name!r}, not a path inside the set", REINDEX)
    for key in ("samples", "bytes"):
        value = entry[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UserError(f"{where}: shard {name}: {key} is {value!r}, not a whole number >= 0", REINDEX)
    if not isinstance(entry["sha256"], str) or not SHA256_RE.match(entry["sha256"]):
        raise UserError(f"{where}: shard {name}: sha256 {entry['sha256']!r} is not 64 hex digits", REINDEX)
    return ShardInfo(name, entry["samples"], entry["bytes"], entry["sha256"])


def _check_names_and_total(index: ShardIndex, total, where: str) -> None:
    seen: set[str] = set()
    for info in index.shards:
        if info.name in seen:
            raise UserError(f"{where}: the shard {info.name} is listed twice", REINDEX)
        seen.add(info.name)
    if total != index.samples:
        raise UserError(f"{where}: 'samples' is {total!r}, its shards hold {index.samples}", REINDEX)
