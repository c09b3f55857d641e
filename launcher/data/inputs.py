"""The inputs ``launcher data shard`` reads: each local input checked and offered as pieces of samples.

:func:`read_input` takes a local path and returns an :class:`Input` (what kinds of shard it
can become, how many samples and about how many bytes it holds, the index's ``fields``, and
its samples in pieces), or one line saying why it cannot be sharded:

* a folder of class folders (``ROOT/CLASS/FILE``, the ImageFolder and Vertex AI layout):
  WebDataset samples ``KEY.EXT`` (the file) and ``KEY.cls`` (the class number), classes
  numbered in name order and named in ``fields["classes"]``, the files in an order drawn
  from ``shuffle_seed``; a file pillow does not read as an image is left out and named;
* a ``.csv`` or ``.parquet`` table: pyarrow batches (or rows for ``jsonl``);
* a ``.npz`` of equal-length arrays: one column per array, each sample's array as raw
  bytes, its shape and dtype in ``fields``;
* a ``.jsonl`` file: every line checked to be a JSON object before anything is written.

:mod:`launcher.data.writer` cuts the pieces into shards and writes them.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Iterator

from launcher.data import formats
from launcher.errors import UserError

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

    def say_skipped(self, note: Callable[[str], None]) -> None:
        """Name each file left out since the last call (once each)."""
        for entry in self.skipped[self.said:]:
            note(f"left out {entry}")
        self.said = len(self.skipped)


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


def visible(names) -> list[str]:
    """``names`` sorted, hidden ones (a leading dot) left out."""
    return sorted(n for n in names if not n.startswith("."))


def _files_under(folder: str) -> list[str]:
    """Every file below ``folder`` in a fixed order (hidden files and folders left out)."""
    found = []
    for here, dirs, files in os.walk(folder):
        dirs[:] = visible(dirs)
        found += [os.path.join(here, f) for f in visible(files)]
    return found


def _image_input(root: str, shuffle_seed: int | None = None) -> Input:
    entries = visible(os.listdir(root))
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


def output_kind(source: Input, kind: str | None) -> str:
    """The kind of shard to write ``source`` as: ``kind``, checked, or the input's default."""
    if kind is None:
        return source.kinds[0]
    if formats.check_kind(kind) not in source.kinds:
        raise UserError(f"INPUT {source.path} cannot be written as {kind} shards",
                        f"use --kind {' or '.join(source.kinds)}, or leave --kind out")
    return kind
