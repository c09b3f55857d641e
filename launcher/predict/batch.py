"""``launcher predict``: batch prediction over files, on Ray Data.

The input files (a file, a folder or a glob; local or ``gs://``) are read by
Ray Data (``read_binary_files``) and split into instances: ``.npy`` (one
instance per row), ``.npz`` (its ``x`` or ``instances`` array, or its only one),
``.csv`` (numeric rows; a header line is skipped), JSON lines (``.jsonl``
or ``.json``: each line ``{"instances": [...]}`` as AI Platform's batch
prediction takes, or one instance) and images (``.png``, ``.jpg``, ``.bmp``:
a folder of them for the image workloads, one instance each). A pool of ``--workers`` actors loads the
model once each and predicts batch after batch; the results are written as
JSON lines (``{"file", "row", "prediction", "scores"}``) to the output folder.
The first file is tried on the driver first, so a wrong shape is one line
before any worker starts.
"""

from __future__ import annotations

import fnmatch
import io
import json
import posixpath
import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from launcher.errors import UserError
from launcher.predict.model import Model, ModelRef

IMAGES = (".png", ".jpg", ".jpeg", ".bmp")
EXTENSIONS = (".npy", ".npz", ".csv", ".jsonl", ".json") + IMAGES
BATCH = 256
CHECK_BYTES = 64 << 20  # the first file is tried on the driver when it is at most this big


@dataclass
class PredictSummary:
    rows: int
    files: int
    seconds: float
    output: str

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "files": self.files, "seconds": round(self.seconds, 2),
                "rows_per_s": round(self.rows_per_s, 1), "output": self.output}


def input_files(pattern: str) -> tuple[Any, list[str]]:
    """(filesystem, paths) for a file, a folder (its files with a known extension) or a glob."""
    from launcher.storage import Storage
    from launcher.storage.uri import normalize_storage

    import pyarrow.fs as pafs

    glob = any(c in pattern for c in "*?[")
    base = pattern.rsplit("/", 1)[0] if glob else pattern
    store = Storage.resolve(normalize_storage(base.rstrip("/") or "/"))
    fs, root = store.fs, store.path()
    try:
        info = fs.get_file_info(root)
    except Exception as exc:  # noqa: BLE001 - an outage, named in one line
        raise UserError(f"--input {pattern}: cannot read {base} ({type(exc).__name__})") from None
    if info.type == pafs.FileType.File and not glob:
        return fs, [root]
    if info.type != pafs.FileType.Directory:
        raise UserError(f"--input {pattern}: nothing at {base}", "give a file, a folder or a glob such as "
                        "data/*.npy")
    found = sorted(f.path for f in fs.get_file_info(pafs.FileSelector(root, recursive=False))
                   if f.type == pafs.FileType.File)
    if glob:
        found = [p for p in found if fnmatch.fnmatch(posixpath.basename(p), pattern.rsplit("/", 1)[-1])]
    else:
        found = [p for p in found if p.endswith(EXTENSIONS)]
    if not found:
        raise UserError(f"--input {pattern}: no {'matching' if glob else 'input'} files",
                        f"instances go in {', '.join(EXTENSIONS)} files")
    bad = [p for p in found if not p.endswith(EXTENSIONS)]
    if bad:
        raise UserError(f"--input {pattern}: {posixpath.basename(bad[0])} is not a {'/'.join(EXTENSIONS)} file",
                        "narrow the glob to the instance files")
    return fs, found


def parse(path: str, data: bytes) -> np.ndarray | list:
    """The instances in one file's bytes; ValueError naming what is wrong."""
    name = posixpath.basename(path)
    if path.lower().endswith(IMAGES):  # one image, one instance: (H, W) grey or (H, W, 3) colour pixels
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as image:
                pixels = np.asarray(image.convert("L" if image.mode in ("L", "1", "P", "I;16") else "RGB"))
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"{name} is not a readable image ({exc})") from None
        return pixels[None]
    if path.endswith(".npy"):
        return np.load(io.BytesIO(data), allow_pickle=False)
    if path.endswith(".npz"):
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            keys = list(arrays.keys())
            key = next((k for k in ("x", "instances") if k in keys), keys[0] if len(keys) == 1 else None)
            if key is None:
                raise ValueError(f"{name} holds {', '.join(keys)}: name the instances x or instances")
            return arrays[key]
    text = data.decode("utf-8")
    if path.endswith(".csv"):
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            float(lines[0].split(",")[0])
        except (ValueError, IndexError):
            lines = lines[1:]  # a header
        return np.loadtxt(io.StringIO("\n".join(lines)), delimiter=",", ndmin=2, dtype=np.float64)
    out: list = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise ValueError(f"{name} line {number} is not JSON") from None
        if isinstance(item, dict):
            if "instances" not in item:
                raise ValueError(f"{name} line {number}: an object needs an instances list")
            out.extend(item["instances"])
        else:
            out.append(item)
    return out


def _instances(row: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Ray Data's flat_map: one file's row -> one row per instance."""
    for i, instance in enumerate(parse(row["path"], row["bytes"])):
        yield {"file": posixpath.basename(row["path"]), "row": i, "instance": np.asarray(instance)}


class Predictor:
    """Ray Data's callable class: one model per actor, a batch of instances in, predictions out."""

    def __init__(self, ref: ModelRef) -> None:
        self.model = Model(ref)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        scores = self.model.scores(np.stack(list(batch["instance"])))
        return {"file": batch["file"], "row": batch["row"], "prediction": scores.argmax(axis=1).astype(np.int64),
                "scores": np.round(scores.astype(np.float64), 7)}


def check_first(ref: ModelRef, fs, path: str) -> None:
    """Try the first file's first instance on the driver: a wrong shape or type is one line now."""
    import workloads

    size = fs.get_file_info(path).size
    if size is None or size > CHECK_BYTES:
        return
    with fs.open_input_stream(path) as f:
        data = f.read()
    try:
        instances = parse(path, data)
        if len(instances) == 0:
            raise ValueError("it holds no instances")
        workloads.get(ref.info["workload"]).preprocess(np.asarray(instances[:1]), ref.info.get("params") or {})
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        shape = "x".join(map(str, ref.input_shape))
        raise UserError(f"--input {posixpath.basename(path)}: {exc}",
                        f"the model ({ref.info['workload']}) takes instances of shape {shape}") from None


def predict(ref: ModelRef, pattern: str, output: str, *, workers: int = 1, address: str | None = None,
            verbose: bool = False, progress: bool = True, note=None) -> PredictSummary:
    """Predict every instance in ``pattern``'s files into JSON lines under ``output``;
    ``note(text)`` is told what starts once the checks pass."""
    from launcher.driver import session
    from launcher.storage import Storage
    from launcher.storage.uri import normalize_storage

    fs, paths = input_files(pattern)
    check_first(ref, fs, paths[0])
    out = Storage.resolve(normalize_storage(output))
    if out.list_files():
        raise UserError(f"--output {output} already holds files", "give a new folder: predictions never "
                        "overwrite earlier ones")
    out.check_writable()
    if note is not None:
        note(f"predicting {len(paths)} file(s) with {ref.uri} ({ref.info.get('workload')}, {ref.framework}) on "
             f"{workers} worker(s)")
    # One CPU per model replica, and one more for the read tasks (else they wait forever).
    with session.connect(address, workers=workers + 1, cpus_per_worker=1, verbose=verbose):
        import logging
        import sys

        import ray

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        # Ray Data's bars on a terminal; elsewhere its progress would be INFO log lines.
        ctx.enable_progress_bars = progress and sys.stderr.isatty()
        if not verbose:
            logging.getLogger("ray.data").setLevel(logging.WARNING)
        started = time.time()
        ds = ray.data.read_binary_files(paths, filesystem=fs, include_paths=True)
        ds = ds.flat_map(_instances)
        ds = ds.map_batches(Predictor, fn_constructor_kwargs={"ref": ref}, batch_size=BATCH, concurrency=workers,
                            num_cpus=1, batch_format="numpy")
        ds.write_json(out.path(), filesystem=out.fs)
        seconds = time.time() - started
    rows = sum(1 for _ in read_predictions(out))
    return PredictSummary(rows=rows, files=len(paths), seconds=seconds, output=out.uri_of())


def read_predictions(out) -> Iterator[dict[str, Any]]:
    """Every prediction written under a storage folder, in file order."""
    for name in sorted(out.list_files()):
        for line in (out.read_text(name) or "").splitlines():
            if line.strip():
                yield json.loads(line)
