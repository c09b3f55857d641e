"""One shard file of each kind, read and written, and a local copy checked against the index.

What one sample is, per kind:

* ``parquet``: a row, as a dict column -> value; a column that the index's
  ``fields`` gives a ``shape`` and ``dtype`` holds each sample's array as raw
  bytes and comes back as a numpy array of that shape and dtype;
* ``jsonl``: one JSON object per line, as a dict;
* ``tar`` (WebDataset): the members that share a key (the name up to the first
  dot after the last "/"), as ``{"__key__": key, EXT: bytes, ...}``;
* ``tfrecord``: one record, as ``{"record": bytes}`` (a serialised
  tf.train.Example); TensorFlow is imported only for this kind.

Every function here takes a local file; fetching a shard is the cache's job.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

from launcher import _deferred
from launcher.data.index import KINDS, ShardError, ShardInfo
from launcher.errors import UserError

EXTENSIONS = {"parquet": ".parquet", "jsonl": ".jsonl", "tar": ".tar", "tfrecord": ".tfrecord"}
# File endings `launcher data index` takes as shards of each kind.
ENDINGS = {".parquet": "parquet", ".jsonl": "jsonl", ".tar": "tar", ".tfrecord": "tfrecord", ".tfrecords": "tfrecord"}
CHUNK = 8 * 1024 * 1024
KEY = "__key__"
RECORD = "record"


def sha256_of(path: str) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def size_text(n: float) -> str:
    """A size as people read it: 812 B, 12.3 KiB, 64.0 MiB, 1.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def verify(path: str, info: ShardInfo, where: str) -> None:
    """Check a local copy of shard ``info`` of the set ``where`` against the index's size and sha256.

    Raises:
        ShardError: no file at ``path``, or one whose size or digest differs from the index's.
    """
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise ShardError(info.name, where, f"no copy at {path}") from None
    if size != info.bytes:
        raise ShardError(info.name, where, f"{size:,} bytes where the index says {info.bytes:,} "
                         "(cut off, or changed after it was indexed)")
    if sha256_of(path) != info.sha256:
        raise ShardError(info.name, where, "its sha256 differs from the index's (damaged, or changed after "
                         "it was indexed)")


def read_shard(kind: str, path: str, fields: dict | None = None) -> list:
    """The samples of the local shard file ``path`` of kind ``kind``, in order (see the module's docstring).

    Raises:
        UserError: an unknown kind.
        ShardError: no such file, or one that cannot be read as ``kind``.
    """
    reader = _READERS.get(check_kind(kind))
    if not os.path.isfile(path):
        raise ShardError(path, "", "no such file")
    try:
        return reader(path, fields or {})
    except UserError:  # a ShardError, or an extra not installed: one line already
        raise
    except Exception as exc:  # each library's own parse errors: pyarrow's, tarfile's, TensorFlow's
        raise ShardError(path, "", f"not a readable {kind} shard ({error_text(exc)})") from None


def count_samples(kind: str, path: str) -> int:
    """How many samples the local shard ``path`` holds: parquet from its footer, the others by reading.

    Raises:
        ShardError: a file that cannot be read as ``kind``.
    """
    if check_kind(kind) == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception as exc:  # pyarrow.ArrowInvalid and friends
            raise ShardError(path, "", f"not a readable parquet shard ({error_text(exc)})") from None
    if kind == "tar":
        try:
            return len(list(_tar_groups(path, read=False)))
        except ShardError:
            raise
        except Exception as exc:  # tarfile.TarError, EOFError, zlib.error
            raise ShardError(path, "", f"not a readable tar shard ({error_text(exc)})") from None
    return len(read_shard(kind, path))


def write_shard(kind: str, samples: list, path: str, fields: dict | None = None) -> None:
    """Write ``samples`` (as :func:`read_shard` returns them) to the local file ``path`` as one shard.

    Raises:
        UserError: an unknown kind, or a sample that this kind cannot hold (one line says which).
    """
    _WRITERS[check_kind(kind)](samples, path, fields or {})


def check_kind(kind: str) -> str:
    """``kind`` itself when it is a shard kind (UserError listing the valid ones otherwise)."""
    if kind not in KINDS:
        raise UserError(f"unknown shard kind {kind!r}", f"valid: {', '.join(KINDS)}")
    return kind


def error_text(exc: Exception) -> str:
    """A library's error in a few words: its type and the first line of its message."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


# -- parquet ------------------------------------------------------------------------------------

def array_fields(fields: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """column -> (per-sample shape, dtype) for the fields that describe arrays."""
    return {name: (tuple(spec["shape"]), spec["dtype"]) for name, spec in fields.items()
            if isinstance(spec, dict) and "shape" in spec and "dtype" in spec}


def _read_parquet(path: str, fields: dict) -> list:
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as f:  # not read_table: its dataset machinery costs a first read 0.3 s of imports
        table = f.read()
    arrays = array_fields(fields)
    columns = {}
    for name in table.column_names:
        if name in arrays:
            columns[name] = _column_arrays(table.column(name).to_pylist(), name, *arrays[name], path)
        else:
            columns[name] = table.column(name).to_pylist()
    absent = sorted(set(arrays) - set(columns))
    if absent:
        raise ShardError(path, "", f"no column {', '.join(absent)} (the index's fields name it)")
    return [dict(zip(columns, values)) for values in zip(*columns.values())] if columns else \
        [{} for _ in range(table.num_rows)]


def _column_arrays(values: list, name: str, shape: tuple[int, ...], dtype: str, path: str) -> list:
    """Each row's raw bytes as an array of ``shape`` and ``dtype``."""
    import numpy as np

    kind = np.dtype(dtype)
    width = int(np.prod(shape, dtype=np.int64)) * kind.itemsize
    if any(v is None or len(v) != width for v in values):
        raise ShardError(path, "", f"column {name}: a value is not {width} bytes, as a {list(shape)} "
                         f"{dtype} array is")
    # A copy: arrays over the bytes object would be read-only (torch.from_numpy warns on those).
    flat = np.frombuffer(b"".join(values), dtype=kind).copy()
    return list(flat.reshape((len(values), *shape)))


def _write_parquet(samples: list, path: str, fields: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = array_fields(fields)
    rows = [{k: (_array_bytes(v, k, *arrays[k]) if k in arrays else v) for k, v in s.items()} for s in samples]
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise UserError(f"samples cannot be written as parquet: {error_text(exc)}",
                        "give every sample the same columns, each of one type") from None
    pq.write_table(table, path)


def _array_bytes(value, name: str, shape: tuple[int, ...], dtype: str) -> bytes:
    import numpy as np

    array = np.asarray(value)
    if array.shape != shape or array.dtype != np.dtype(dtype):
        raise UserError(f"column {name}: a sample is a {list(array.shape)} {array.dtype} array, "
                        f"the fields say {list(shape)} {dtype}", "convert it, or fix the fields")
    return np.ascontiguousarray(array).tobytes()


# -- jsonl --------------------------------------------------------------------------------------

def _read_jsonl(path: str, fields: dict) -> list:
    samples = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                sample = json.loads(line)
            except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
                raise ShardError(path, "", f"line {number} is not JSON ({error_text(exc)})") from None
            if not isinstance(sample, dict):
                raise ShardError(path, "", f"line {number} is not a JSON object")
            samples.append(sample)
    return samples


def json_line(sample: dict) -> bytes:
    """One sample as a jsonl line (UserError for a value JSON cannot hold)."""
    try:
        return (json.dumps(sample, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n").encode()
    except (TypeError, ValueError) as exc:
        raise UserError(f"a sample cannot be written as JSON ({exc})",
                        "write parquet shards instead (--kind parquet), or convert the value") from None


def _write_jsonl(samples: list, path: str, fields: dict) -> None:
    lines = []
    for sample in samples:
        if not isinstance(sample, dict):
            raise UserError(f"a jsonl sample must be a dict, got {type(sample).__name__}")
        lines.append(json_line(sample))
    with open(path, "wb") as f:
        f.writelines(lines)


# -- tar (WebDataset) ---------------------------------------------------------------------------

def split_member(name: str) -> tuple[str, str] | None:
    """(key, extension) of a WebDataset member name; None for a name with no extension."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= slash + 1:  # no dot, or a name that starts with one: not part of a sample
        return None
    return name[:dot], name[dot + 1:]


def _tar_groups(path: str, read: bool = True):
    """The samples of a WebDataset tar, in order (the members' bytes left out unless ``read``)."""
    sample: dict | None = None
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            parts = split_member(member.name) if member.isfile() else None
            if parts is None:
                continue
            key, ext = parts
            if sample is not None and sample[KEY] != key:
                yield sample
                sample = None
            if sample is None:
                sample = {KEY: key}
            if ext in sample:
                raise ShardError(path, "", f"the key {key} has two members ending in .{ext}")
            sample[ext] = tar.extractfile(member).read() if read else None
    if sample is not None:
        yield sample


def _read_tar(path: str, fields: dict) -> list:
    return list(_tar_groups(path))


def tar_member_bytes(size: int) -> int:
    """What a member of ``size`` bytes takes in a tar: a 512-byte header and its data in 512-byte blocks."""
    return 512 + -(-size // 512) * 512


def _write_tar(samples: list, path: str, fields: dict) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for sample in samples:
            key = sample.get(KEY) if isinstance(sample, dict) else None
            if not isinstance(key, str) or not key or "." in key.rpartition("/")[2]:
                raise UserError(f"tar sample key {key!r}: each sample needs a {KEY} with no dot after its "
                                "last '/'", "name samples like 000123 or class/000123")
            for ext, value in sample.items():
                if ext != KEY:
                    _add_member(tar, f"{key}.{ext}", value)


def _add_member(tar: tarfile.TarFile, name: str, value) -> None:
    data = value.encode() if isinstance(value, str) else value
    if not isinstance(data, (bytes, bytearray)):
        raise UserError(f"tar member {name}: a {type(value).__name__}, not bytes or text",
                        "encode the value (e.g. str(label).encode())")
    info = tarfile.TarInfo(name)  # fixed owner and time: the same samples make the same bytes
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


# -- tfrecord -----------------------------------------------------------------------------------

def _tensorflow():
    _deferred.require("tensorflow", "a tfrecord shard")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf


def _read_tfrecord(path: str, fields: dict) -> list:
    tf = _tensorflow()
    return [{RECORD: record.numpy()} for record in tf.data.TFRecordDataset(path)]


def _write_tfrecord(samples: list, path: str, fields: dict) -> None:
    bad = [i for i, s in enumerate(samples) if not (isinstance(s, dict) and isinstance(s.get(RECORD), bytes))]
    if bad:
        raise UserError(f"tfrecord sample {bad[0]} is not {{'record': bytes}}",
                        "serialise each tf.train.Example (example.SerializeToString())")
    tf = _tensorflow()
    with tf.io.TFRecordWriter(path) as writer:
        for sample in samples:
            writer.write(sample[RECORD])


_READERS = {"parquet": _read_parquet, "jsonl": _read_jsonl, "tar": _read_tar, "tfrecord": _read_tfrecord}
_WRITERS = {"parquet": _write_parquet, "jsonl": _write_jsonl, "tar": _write_tar, "tfrecord": _write_tfrecord}
