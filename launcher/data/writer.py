"""Making a shard set: ``launcher data shard`` (local data -> shards + index) and ``launcher data index``.

:func:`shard` takes the samples of one local input (:mod:`launcher.data.inputs` reads
it) and writes them to shards of about ``shard_mb`` MiB (or exactly
``samples_per_shard`` samples), in input order but for an image folder, whose files
go in an order drawn from ``shuffle_seed``. Sizes are measured on the samples before a
parquet file compresses them, so parquet shards come out at ``shard_mb`` or less.

``unfinished.json`` (the input, the kind and the planned count) goes first; each shard
is written to a local file, then put in place through :class:`~launcher.storage.Storage`;
``index.json`` goes last and ``unfinished.json`` is removed after it. A set cut off on
the way (Ctrl-C, SIGTERM, a bad line late in the input, storage that stops answering) is
therefore known as unfinished by every reader and by :func:`index`, the line that ends
the command says so, and writing it again replaces the shards the cut-off try left.
:func:`index` writes the index for shard files that are already in a folder.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from typing import Callable, Iterator

from launcher import faultpoint
from launcher.data import formats
from launcher.data.index import (INDEX, UNFINISHED, ShardError, ShardIndex, ShardInfo, normalise, read_index_text,
                                  read_unfinished, shard_files, storage_error, unfinished_text)
from launcher.data.inputs import Input, output_kind, read_input, visible
from launcher.errors import LauncherError, Unreachable, UserError
from launcher.storage import Storage

Note = Callable[[str], None] | None
MIB = 1024 * 1024


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
    kind = output_kind(source, kind)
    storage = Storage.resolve(normalise(output))
    _check_output(storage, source.path, note)
    planned = -(-source.samples // samples_per_shard) if samples_per_shard else max(1, math.ceil(source.nbytes / limit))
    total = f"{planned}" if samples_per_shard else f"~{planned}"
    plan = {"input": source.path, "kind": kind, "samples": source.samples, "shards": total}
    _write(storage, UNFINISHED, json.dumps(plan, indent=1) + "\n")  # until the index: an unfinished set
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
                    source.say_skipped(note)
        if not shards:
            raise UserError(f"INPUT {source.path} holds no file pillow reads as an image "
                            f"({len(source.skipped)} left out)", "put the images in their class folders")
        made = ShardIndex(storage.uri, kind, tuple(shards), source.fields)
        _write(storage, INDEX, made.to_json())
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM as the CLI turns it into one
        raise KeyboardInterrupt(_left_unfinished(storage, source, len(shards), total)) from None
    except LauncherError as exc:
        raise _unfinished_error(exc, _left_unfinished(storage, source, len(shards), total)) from None
    if note and source.skipped:
        source.say_skipped(note)
        note(f"left out {len(source.skipped)} file{'s' if len(source.skipped) > 1 else ''} that pillow does not "
             "read as images (named above)")
    _remove(storage, UNFINISHED)  # the set is whole (a reader trusts the index over a note left behind)
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
    made = ShardIndex(storage.uri, kind, tuple(shards), fields)
    _write(storage, INDEX, made.to_json())
    return made


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
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_batches(pieces), local)
        info = ShardInfo(name, sum(len(p) for p in pieces), os.path.getsize(local), formats.sha256_of(local))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(local)
        raise
    _put(storage, local, name)
    return info


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
        _remove(storage, name)


def _write(storage: Storage, name: str, text: str) -> None:
    try:
        storage.write_text(text, name)
    except OSError as exc:
        raise storage_error(exc, storage, storage.uri_of(name), "write") from None


def _remove(storage: Storage, name: str) -> None:
    try:
        storage.remove_file(name)
    except OSError as exc:
        raise storage_error(exc, storage, storage.uri_of(name), "remove") from None


def _left_unfinished(storage: Storage, source: Input, written: int, total: str) -> str:
    """What the cut-off command leaves behind, and what to do about it, in one phrase."""
    return (f"{storage.uri} now holds an unfinished shard set ({written} of {total} shards), which no reader "
            f"takes; run `launcher data shard {source.path} {storage.uri}` again to write it whole "
            "(it replaces them)")


def _unfinished_error(exc: LauncherError, left: str) -> LauncherError:
    """``exc``'s line, with what the cut-off write left behind; the same exit code."""
    kind = UserError if exc.exit_code == UserError.exit_code else Unreachable
    return kind(exc.what, f"{exc.fix}; {left}" if exc.fix else left)


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
    for name in visible(names):
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
