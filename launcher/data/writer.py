"""Making a shard set: ``launcher data shard`` (local data -> shards + index) and ``launcher data index``.

:func:`shard` reads one local input and writes its samples to shards of about
``shard_mb`` MiB (or exactly ``samples_per_shard`` samples), in input order but for an
image folder, whose files go in an order drawn from ``shuffle_seed`` (class folders
come sorted, and a reader shuffles only within a window of neighbouring samples):

* a folder of class folders (``ROOT/CLASS/FILE``, the ImageFolder and Vertex AI
  layout) -> WebDataset ``tar`` shards, each sample ``KEY.EXT`` (the file) and
  ``KEY.cls`` (the class number); classes are numbered in name order and named in
  the index's ``fields["classes"]``;
* a ``.csv`` or ``.parquet`` table -> ``parquet`` shards with the same columns
  (or ``jsonl`` with ``kind="jsonl"``);
* a ``.npz`` of equal-length arrays -> ``parquet`` shards, one column per array,
  each sample's array as raw bytes, its shape and dtype in ``fields``;
* a ``.jsonl`` file -> ``jsonl`` shards (or ``parquet``).

Sizes are measured on the samples before a parquet file compresses them, so
parquet shards come out at ``shard_mb`` or less. ``unfinished.json`` (the input, the
kind and the planned count) goes first; each shard is written to a local file, then
put in place through :class:`~launcher.storage.Storage`; ``index.json`` goes last and
``unfinished.json`` is removed after it. A set cut off on the way (Ctrl-C, SIGTERM, a
bad line late in the input, storage that stops answering) is therefore known as
unfinished by every reader and by :func:`index`, the line that ends the command says
so, and writing it again replaces the shards the cut-off try left. :func:`index`
writes the index for shard files that are already in a folder.

An image folder's files are checked as they are written: a file pillow does not
recognise as an image (a ``README.txt``, text saved as ``notes.png``) is left out and
named, instead of failing a training read later.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Iterator

from launcher import faultpoint
from launcher.data import formats
from launcher.data.index import (INDEX, UNFINISHED, ShardError, ShardIndex, ShardInfo, normalise, read_index_text,
                                  read_unfinished, shard_files, storage_error, unfinished_text)
from launcher.errors import LauncherError, Unreachable, UserError
from launcher.storage import Storage

Note = Callable[[str], None] | None
MIB = 1024 * 1024
BATCH_ROWS = 65536  # rows per piece read from a table
INPUTS = "a folder of class folders (ROOT/CLASS/FILE), or a .csv, .parquet, .npz or .jsonl file"


@dataclass
class Input:
    """One input to shard: what it can be written as (the first kind is the default), how many
    samples and about how many bytes it holds, the index's ``fields``, and its samples in pieces."""

    path: str
    kinds: tuple[str, ...]
    samples: int
    nbytes: int
    fields: dict
    pieces: Callable[[str], Iterator[tuple[object, int]]]  # kind -> (a list or pyarrow batch, its bytes)
    skipped: list[str] = field(default_factory=list)  # files left out while writing (not images), with why
    said: int = 0  # how many of them the progress lines named


def shard(input: str, output: str, *, kind: str | None = None, shard_mb: float = 64.0,
          samples_per_shard: int | None = None, shuffle_seed: int | None = 0, note: Note = None) -> ShardIndex:
    """Write the local data ``input`` as a shard set in ``output`` (a local folder or gs://BUCKET/PREFIX).

    Args:
        input: a folder of class folders, or a .csv, .parquet, .npz or .jsonl file.
        output: where the set goes; it must not hold an ``index.json`` already.
        kind: the shards' kind (default: tar for images, parquet for tables and arrays, jsonl for jsonl).
        shard_mb: cut a shard before it would pass this many MiB (one larger sample makes a shard alone).
        samples_per_shard: cut every this many samples instead.
        shuffle_seed: an image folder's files are written in an order drawn from this seed, so
            that each shard holds every class (a reader shuffles only within a window of
            neighbouring samples); None keeps the folders' order. Tables, arrays and JSON lines
            keep their rows' order.
        note: called with a line of progress after each shard.

    Returns:
        The index written (``uri`` is where the set is, the location to give the training code).

    Raises:
        UserError: bad sizes, an input that is missing, empty or of no known kind, an output that
            already holds a set or cannot be written (one line says which and what to do).
        Unreachable: Cloud Storage (or its emulator) did not answer.
    """
    limit = _size_limit(shard_mb, samples_per_shard)
    source = read_input(input, shuffle_seed)
    kind = _output_kind(source, kind)
    storage = Storage.resolve(normalise(output))
    _check_output(storage, source.path, note)
    planned = -(-source.samples // samples_per_shard) if samples_per_shard else max(1, math.ceil(source.nbytes / limit))
    total = f"{planned}" if samples_per_shard else f"~{planned}"
    _begin(storage, {"input": source.path, "kind": kind, "samples": source.samples, "shards": total})
    shards: list[ShardInfo] = []
    try:
        with _scratch(storage) as scratch:
            for pieces in _cut(source.pieces(kind), limit, samples_per_shard):
                name = f"shard-{len(shards):05d}{formats.EXTENSIONS[kind]}"
                shards.append(_write_shard(storage, kind, pieces, name, os.path.join(scratch, f".{name}.part"),
                                           source.fields))
                faultpoint.pause("shard-written")
                if note:
                    info = shards[-1]
                    note(f"shard {len(shards)}/{total}: {info.samples:,} samples, {formats.size_text(info.bytes)}")
                    _say_skipped(source, note)
        if not shards:
            raise UserError(f"INPUT {source.path} holds no file pillow reads as an image "
                            f"({len(source.skipped)} left out)", "put the images in their class folders")
        made = _write_index(storage, ShardIndex(storage.uri, kind, tuple(shards), source.fields))
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM as the CLI turns it into one
        raise KeyboardInterrupt(_left_unfinished(storage, source, len(shards), total)) from None
    except LauncherError as exc:
        raise _unfinished_error(exc, _left_unfinished(storage, source, len(shards), total)) from None
    if note and source.skipped:
        _say_skipped(source, note)
        note(f"left out {len(source.skipped)} file{'s' if len(source.skipped) > 1 else ''} that pillow does not "
             "read as images (named above)")
    _end(storage)
    return made


def index(folder: str, *, kind: str | None = None, overwrite: bool = False, note: Note = None) -> ShardIndex:
    """Write ``index.json`` for the shard files already in ``folder`` (local or gs://), in name order.

    Each shard is read to count its samples (a parquet file's footer is enough) and hashed.
    The kind is guessed from the files' endings (.parquet, .jsonl, .tar, .tfrecord[s]) unless
    given; other files are left out. With ``overwrite``, an existing index is replaced and
    its ``fields`` (array shapes, class names) are kept.

    Raises:
        UserError: no such folder, no shard files, several kinds without ``kind``, an index
            already there without ``overwrite``, a shard that cannot be read.
        Unreachable: Cloud Storage (or its emulator) did not answer.
    """
    storage = Storage.resolve(normalise(folder))
    old = read_index_text(storage)
    if old is not None and not overwrite:
        raise UserError(f"{storage.uri} already has an {INDEX}", "pass --overwrite to write it again")
    if storage.is_local and not os.path.isdir(storage.uri):
        raise UserError(f"{storage.uri} is not a folder", "pass the folder that holds the shard files")
    unfinished = read_unfinished(storage)
    if unfinished is not None and old is None:  # with an index, the note is one its writer could not remove
        again = f"launcher data shard {unfinished.get('input') or 'INPUT'} {storage.uri}"
        raise UserError(unfinished_text(storage, unfinished) + "; indexing it would pass a part off as the whole",
                        f"run `{again}` again to write it whole")
    kind, names = _pick_shards(_list_files(storage), kind, storage.uri)
    fields = _kept_fields(old, storage.uri, kind)
    shards = []
    with _scratch(storage) as scratch:
        for n, name in enumerate(names, 1):
            shards.append(_index_one(storage, name, kind, scratch))
            if note:
                note(f"shard {n}/{len(names)}: {name}, {shards[-1].samples:,} samples")
    return _write_index(storage, ShardIndex(storage.uri, kind, tuple(shards), fields))


# -- the inputs ---------------------------------------------------------------------------------

def read_input(path: str, shuffle_seed: int | None = None) -> Input:
    """The input at the local ``path``, checked (UserError: missing, empty or of no known kind)."""
    if "://" in path:
        raise UserError(f"INPUT {path} is not a local path",
                        "download it first (gcloud storage cp -r URI LOCAL_FOLDER), then shard the copy")
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        return _image_input(path, shuffle_seed)
    if not os.path.isfile(path):
        raise UserError(f"INPUT {path} does not exist", f"pass {INPUTS}")
    ending = os.path.splitext(path)[1].lower()
    readers = {".csv": _table_input, ".parquet": _table_input, ".npz": _npz_input, ".jsonl": _jsonl_input}
    if ending not in readers:
        raise UserError(f"INPUT {path}: not a kind of input `launcher data shard` reads", f"pass {INPUTS}")
    return readers[ending](path)


def _visible(names) -> list[str]:
    return sorted(n for n in names if not n.startswith("."))


def _files_under(folder: str) -> list[str]:
    """Every file below ``folder`` in a fixed order (hidden files and folders left out)."""
    found = []
    for here, dirs, files in os.walk(folder):
        dirs[:] = _visible(dirs)
        found += [os.path.join(here, f) for f in _visible(files)]
    return found


def _image_input(root: str, shuffle_seed: int | None = None) -> Input:
    entries = _visible(os.listdir(root))
    loose = [e for e in entries if not os.path.isdir(os.path.join(root, e))]
    if loose:
        shards = [e for e in loose if os.path.splitext(e)[1].lower() in formats.ENDINGS]
        fix = (f"to index shard files, run `launcher data index {root}`" if shards
               else "put each file in the folder of its class (ROOT/CLASS/FILE)")
        raise UserError(f"INPUT {root} has files at its top level ({', '.join(loose[:3])}"
                        f"{', ...' if len(loose) > 3 else ''}), not only class folders", fix)
    if not entries:
        raise UserError(f"INPUT {root} is empty", f"pass {INPUTS}")
    files: list[tuple[str, int]] = []
    for number, name in enumerate(entries):
        found = _files_under(os.path.join(root, name))
        if not found:
            raise UserError(f"INPUT {root}: the class folder {name} holds no files",
                            "put its images in, or remove the folder")
        files += [(f, number) for f in found]
    if shuffle_seed is not None:  # sorted by class, a shard would hold one or two classes
        import numpy as np

        files = [files[i] for i in np.random.default_rng(shuffle_seed).permutation(len(files))]
    overhead = formats.tar_member_bytes(0) * 2
    nbytes = sum(formats.tar_member_bytes(os.path.getsize(f)) + overhead for f, _ in files)

    def pieces(kind: str) -> Iterator[tuple[list, int]]:
        n = 0
        for file, label in files:
            with open(file, "rb") as f:
                data = f.read()
            problem = _not_an_image(data)
            if problem:
                made.skipped.append(f"{os.path.relpath(file, root)} ({problem})")
                continue
            ext = os.path.splitext(file)[1][1:].lower() or "bin"
            cls = str(label).encode()
            size = formats.tar_member_bytes(len(data)) + formats.tar_member_bytes(len(cls))
            yield [{formats.KEY: f"{n:08d}", ext: data, "cls": cls}], size
            n += 1

    made = Input(root, ("tar",), len(files), nbytes, {"classes": entries}, pieces)
    return made


def _not_an_image(data: bytes) -> str | None:
    """Why pillow cannot take ``data`` as an image (None: it can). Only the header is parsed, so
    it costs little beside reading the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.size  # noqa: B018  (parsed with the header)
    except UnidentifiedImageError:
        return "not an image pillow recognises"
    except (OSError, ValueError, SyntaxError) as exc:  # pillow raises SyntaxError for a broken header
        return f"a damaged image: {formats.error_text(exc)}"
    return None


def _say_skipped(source: Input, note: Callable[[str], None]) -> None:
    """Name each file left out since the last call (once each)."""
    for entry in source.skipped[source.said:]:
        note(f"left out {entry}")
    source.said = len(source.skipped)


def _table_input(path: str) -> Input:
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet as pq

    csv = path.lower().endswith(".csv")
    try:  # a CSV is read whole (its column types are inferred over every row); a parquet file in batches
        batches = pyarrow.csv.read_csv(path).to_batches(max_chunksize=BATCH_ROWS) if csv else None
        meta = None if csv else pq.ParquetFile(path).metadata
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"INPUT {path} cannot be read ({formats.error_text(exc)})",
                        "check that it is a valid table file") from None
    if csv:
        rows, nbytes = sum(b.num_rows for b in batches), sum(b.nbytes for b in batches)
    else:
        rows = meta.num_rows
        nbytes = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    if rows == 0:
        raise UserError(f"INPUT {path} holds no rows", "pass a table with data in it")

    def pieces(kind: str) -> Iterator[tuple[object, int]]:
        for batch in batches if csv else pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
            yield (batch if kind == "parquet" else batch.to_pylist()), batch.nbytes

    return Input(path, ("parquet", "jsonl"), rows, nbytes, {}, pieces)


def _npz_input(path: str) -> Input:
    import numpy as np
    import pyarrow as pa

    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise UserError(f"INPUT {path} cannot be read as .npz ({formats.error_text(exc)})",
                        "write it with numpy.savez, without object arrays") from None
    if not arrays:
        raise UserError(f"INPUT {path} holds no arrays", "pass an .npz with one array per field")
    single = [name for name, a in arrays.items() if a.ndim == 0]
    if single:
        raise UserError(f"INPUT {path}: {single[0]} is a single value, not one per sample",
                        "give every array the samples along its first axis")
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise UserError(f"INPUT {path}: arrays of different lengths ("
                        + ", ".join(f"{k} {v:,}" for k, v in lengths.items()) + ")",
                        "give every array one entry per sample")
    rows = next(iter(lengths.values()))
    if rows == 0:
        raise UserError(f"INPUT {path} holds no samples (its arrays are empty)", "pass arrays with data in them")
    columns, fields = {}, {}
    for name, a in arrays.items():
        a = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False))
        width = a.nbytes // rows
        columns[name] = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), rows, [None, pa.py_buffer(a)])
        fields[name] = {"shape": list(a.shape[1:]), "dtype": _dtype_name(a.dtype)}
    table = pa.table(columns)

    def pieces(kind: str) -> Iterator[tuple[object, int]]:
        for batch in table.to_batches(max_chunksize=BATCH_ROWS):
            yield batch, batch.nbytes

    return Input(path, ("parquet",), rows, table.nbytes, fields, pieces)


def _dtype_name(dtype) -> str:
    """"float32" where the name says it all, else numpy's code ("<U5")."""
    import numpy as np

    try:
        return dtype.name if np.dtype(dtype.name) == dtype else dtype.str
    except TypeError:
        return dtype.str


def _jsonl_input(path: str) -> Input:
    rows = 0
    with open(path, "rb") as f:  # every line checked before the first shard is written
        for number, line in enumerate(f, 1):
            if line.strip():
                _json_object(line, number, path)
                rows += 1
    if rows == 0:
        raise UserError(f"INPUT {path} holds no lines", "pass a file with one JSON object per line")

    def pieces(kind: str) -> Iterator[tuple[object, int]]:
        if kind == "parquet":
            yield from _jsonl_batches(path)
            return
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield [_json_object(line, number, path)], len(line)

    return Input(path, ("jsonl", "parquet"), rows, os.path.getsize(path), {}, pieces)


def _json_object(line: bytes, number: int, path: str) -> dict:
    try:
        sample = json.loads(line)
    except ValueError as exc:
        raise UserError(f"INPUT {path}: line {number} is not JSON ({exc})", "write one JSON object per line") from None
    if not isinstance(sample, dict):
        raise UserError(f"INPUT {path}: line {number} is not a JSON object", "write one JSON object per line")
    return sample


def _jsonl_batches(path: str) -> Iterator[tuple[object, int]]:
    import pyarrow as pa
    import pyarrow.json

    try:
        table = pyarrow.json.read_json(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"INPUT {path} cannot be read as parquet columns ({formats.error_text(exc)})",
                        "give every line the same keys, each of one type, or leave --kind out") from None
    for batch in table.to_batches(max_chunksize=BATCH_ROWS):
        yield batch, batch.nbytes


def _output_kind(source: Input, kind: str | None) -> str:
    if kind is None:
        return source.kinds[0]
    if formats.check_kind(kind) not in source.kinds:
        raise UserError(f"INPUT {source.path} cannot be written as {kind} shards",
                        f"use --kind {' or '.join(source.kinds)}, or leave --kind out")
    return kind


# -- cutting and writing ------------------------------------------------------------------------

def _size_limit(shard_mb: float, samples_per_shard: int | None) -> float:
    if samples_per_shard is not None and samples_per_shard < 1:
        raise UserError(f"--samples-per-shard must be >= 1, got {samples_per_shard}")
    if not 0 < shard_mb < math.inf:
        raise UserError(f"--shard-mb must be > 0, got {shard_mb:g}", "for example --shard-mb 64")
    return shard_mb * MIB


def _cut(pieces: Iterator[tuple[object, int]], limit: float, per_shard: int | None) -> Iterator[list]:
    """Group pieces (lists of samples or pyarrow batches, with their bytes) into shards: exactly
    ``per_shard`` samples each, or as many as stay within ``limit`` bytes (at least one)."""
    shard: list = []
    rows, size = 0, 0.0
    for piece, nbytes in pieces:
        start, n = 0, len(piece)
        each = nbytes / n if n else 0.0
        while start < n:
            if per_shard:
                take = min(n - start, per_shard - rows)
            else:
                room = math.floor((limit - size) / each) if each else n - start
                if room < 1 and rows:
                    yield shard
                    shard, rows, size = [], 0, 0.0
                    continue
                take = min(n - start, max(1, room))
            shard.append(piece[start:start + take])
            rows, size, start = rows + take, size + take * each, start + take
            if rows == per_shard or (not per_shard and size >= limit):
                yield shard
                shard, rows, size = [], 0, 0.0
    if rows:
        yield shard


def _write_shard(storage: Storage, kind: str, pieces: list, name: str, local: str, fields: dict) -> ShardInfo:
    """Write one shard to the local file ``local``, measure it, and put it in the set as ``name``."""
    try:
        if isinstance(pieces[0], list):
            formats.write_shard(kind, [sample for piece in pieces for sample in piece], local, fields)
        else:
            _write_batches(pieces, local)
        info = ShardInfo(name, sum(len(p) for p in pieces), os.path.getsize(local), formats.sha256_of(local))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(local)
        raise
    _put(storage, local, name)
    return info


def _write_batches(batches: list, path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_batches(batches), path)


@contextlib.contextmanager
def _scratch(storage: Storage) -> Iterator[str]:
    """Where shards are written before they are put in place: the output folder itself when it is
    local (a rename puts them there), a temporary folder otherwise."""
    if storage.is_local:
        yield storage.uri
        return
    with tempfile.TemporaryDirectory(prefix="launcher-shards-") as folder:
        yield folder


def _put(storage: Storage, local: str, name: str) -> None:
    """Move the finished local file ``local`` to ``name`` in the set."""
    if storage.is_local:
        try:
            os.replace(local, storage.path(name))
        except OSError as exc:
            raise storage_error(exc, storage, storage.uri_of(name), "write") from None
        return
    start = time.monotonic()
    try:
        with open(local, "rb") as src, storage.fs.open_output_stream(storage.path(name)) as dst:
            shutil.copyfileobj(src, dst, formats.CHUNK)
    except OSError as exc:
        raise storage_error(exc, storage, storage.uri_of(name), "write", time.monotonic() - start) from None
    finally:
        os.remove(local)


def _check_output(storage: Storage, input_path: str, note: Note = None) -> None:
    """The output holds no set yet, is not inside the input folder, and can be written. The shards
    of an unfinished set there (a try that was cut off) are removed; shard files that no try of
    ours left are refused (they would stand beside the new index)."""
    if read_index_text(storage) is not None:
        raise UserError(f"OUTPUT {storage.uri} already holds a shard set ({INDEX})",
                        "pass another OUTPUT, or remove that set first")
    if not storage.is_local:
        storage.check_writable()
    elif os.path.isdir(input_path) and os.path.commonpath([storage.uri, input_path]) == input_path:
        raise UserError(f"OUTPUT {storage.uri} is inside INPUT {input_path}",
                        "pass an OUTPUT outside the input folder (its shards would be read as a class)")
    elif os.path.isfile(storage.uri):
        raise UserError(f"OUTPUT {storage.uri} is a file", "pass a folder (it is made if missing) or gs://BUCKET/PREFIX")
    else:
        try:
            storage.makedirs()
        except OSError as exc:
            raise storage_error(exc, storage, storage.uri, "write to") from None
    left = shard_files(_list_files(storage))
    if not left:
        return
    unfinished = read_unfinished(storage)
    if unfinished is None:
        raise UserError(f"OUTPUT {storage.uri} holds {len(left)} shard files ({', '.join(left[:2])}"
                        f"{', ...' if len(left) > 2 else ''}) and no {INDEX}",
                        f"index them with `launcher data index {storage.uri}`, remove them, or pass another OUTPUT")
    if note:
        note(f"{unfinished_text(storage, unfinished, len(left))}: removing its shards")
    for name in left:
        try:
            storage.fs.delete_file(storage.path(name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error(exc, storage, storage.uri_of(name), "remove") from None


def _begin(storage: Storage, plan: dict) -> None:
    """Write ``unfinished.json``: from now until the index, the folder is an unfinished set."""
    try:
        storage.write_text(json.dumps(plan, indent=1) + "\n", UNFINISHED)
    except OSError as exc:
        raise storage_error(exc, storage, storage.uri_of(UNFINISHED), "write") from None


def _end(storage: Storage) -> None:
    """The index is written: the set is whole, so its ``unfinished.json`` goes."""
    try:
        storage.fs.delete_file(storage.path(UNFINISHED))
    except FileNotFoundError:
        pass
    except OSError as exc:  # the index stands, and a reader trusts it over the note
        raise storage_error(exc, storage, storage.uri_of(UNFINISHED), "remove") from None


def _left_unfinished(storage: Storage, source: Input, written: int, total: str) -> str:
    """What the cut-off command leaves behind, and what to do about it, in one phrase."""
    return (f"{storage.uri} now holds an unfinished shard set ({written} of {total} shards), which no reader "
            f"takes; run `launcher data shard {source.path} {storage.uri}` again to write it whole "
            "(it replaces them)")


def _unfinished_error(exc: LauncherError, left: str) -> LauncherError:
    """``exc``'s line, with what the cut-off write left behind; the same exit code."""
    kind = UserError if exc.exit_code == UserError.exit_code else Unreachable
    return kind(exc.what, f"{exc.fix}; {left}" if exc.fix else left)


def _write_index(storage: Storage, index: ShardIndex) -> ShardIndex:
    try:
        storage.write_text(index.to_json(), INDEX)
    except OSError as exc:
        raise storage_error(exc, storage, storage.uri_of(INDEX), "write") from None
    return index


# -- indexing shards already there --------------------------------------------------------------

def _list_files(storage: Storage) -> list[str]:
    start = time.monotonic()
    try:
        return storage.list_files()
    except OSError as exc:
        raise storage_error(exc, storage, storage.uri, "list", time.monotonic() - start) from None


def _pick_shards(names: list[str], kind: str | None, uri: str) -> tuple[str, list[str]]:
    """(kind, the shard files) among a folder's files."""
    by_kind: dict[str, list[str]] = {}
    for name in _visible(names):
        found = formats.ENDINGS.get(os.path.splitext(name)[1].lower())
        if found:
            by_kind.setdefault(found, []).append(name)
    if kind is not None:
        formats.check_kind(kind)
    elif len(by_kind) > 1:
        counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(by_kind.items()))
        raise UserError(f"{uri} holds shards of several kinds ({counts})", "pass --kind to index one kind")
    if kind is None and by_kind:
        kind = next(iter(by_kind))
    if not by_kind.get(kind):
        endings = ", ".join(e for e, k in formats.ENDINGS.items() if kind in (None, k))
        raise UserError(f"{uri} holds no shard files ({endings})",
                        "pass the folder that holds them, or make a set with `launcher data shard`")
    return kind, by_kind[kind]


def _kept_fields(old: str | None, uri: str, kind: str) -> dict:
    """The fields of the index being replaced, when it is readable and of the same kind."""
    if old is None:
        return {}
    try:
        previous = ShardIndex.from_json(old, uri)
    except UserError:
        return {}
    return previous.fields if previous.kind == kind else {}


def _index_one(storage: Storage, name: str, kind: str, scratch: str) -> ShardInfo:
    """Count, measure and hash one shard (gs:// ones through a local copy)."""
    local = storage.path(name)
    if not storage.is_local:
        local = os.path.join(scratch, f".{name}.part")
        try:
            with storage.fs.open_input_stream(storage.path(name)) as src, open(local, "wb") as dst:
                shutil.copyfileobj(src, dst, formats.CHUNK)
        except OSError as exc:
            raise storage_error(exc, storage, storage.uri_of(name), "read") from None
    try:
        samples = formats.count_samples(kind, local)
    except ShardError as exc:
        raise ShardError(name, storage.uri, exc.problem, "replace or remove it, then index the folder again") from None
    info = ShardInfo(name, samples, os.path.getsize(local), formats.sha256_of(local))
    if not storage.is_local:
        os.remove(local)
    return info
