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
import logging
import os
import posixpath
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from launcher.driver import session
from launcher.errors import UserError
from launcher.predict.formats.base import column
from launcher.predict.model import Model, ModelRef
from launcher.storage import Storage
from launcher.storage.uri import normalize_storage

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
        if not lines:  # numpy would warn (with its source line) before the caller's one line
            return np.empty((0, 1), dtype=np.float64)
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
        # An object (a model with named inputs) travels as its JSON text: Arrow takes no dicts in an array column.
        value = np.asarray(json.dumps(instance) if isinstance(instance, dict) else instance)
        yield {"file": posixpath.basename(row["path"]), "row": i, "instance": value}


def _unpacked(column: np.ndarray) -> list:
    """A batch's instance column as a list of instances (objects decoded from their JSON text)."""
    return [json.loads(v) if isinstance(v, str) and v.startswith("{") else v for v in column]


class Predictor:
    """Ray Data's callable class: one model per actor, a batch of instances in, predictions out."""

    def __init__(self, ref: ModelRef) -> None:
        self.model = Model(ref)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        instances = _unpacked(batch["instance"])
        if self.model.hook is not None:  # the run's predict hook makes the predictions
            return {"file": batch["file"], "row": batch["row"],
                    "prediction": column(self.model.predict(instances))}
        out = self.model.run(self.model.inputs(instances))
        return {"file": batch["file"], "row": batch["row"], **self.model.columns(out)}


def _bound(ref: ModelRef) -> type:
    """A :class:`Predictor` for ``ref`` that takes no constructor arguments: Ray Data puts
    arguments in the object store, and Ray's core worker then warns that a restarted actor
    could lose them."""

    class BoundPredictor(Predictor):
        def __init__(self) -> None:
            super().__init__(ref)

    return BoundPredictor


def check_first(ref: ModelRef, fs, path: str) -> None:
    """Try the first file's first instance on the driver: a wrong shape or type is one line now
    (a run's workload checks it with its preprocessing; any other model is loaded to check it)."""
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
        first = _unpacked([json.dumps(i) if isinstance(i, dict) else i for i in instances[:1]])
        if ref.format == "workload" and not ref.info.get("predict"):
            workloads.get(ref.info["workload"]).preprocess(np.asarray(first), ref.info.get("params") or {})
        else:
            model = Model(ref)
            try:
                model.predict(first) if model.hook is not None else model.inputs(first)
            finally:
                model.close()
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        shape = ref.info.get("input_shape")
        takes = (f"instances of shape {'x'.join(map(str, shape))}" if shape else
                 "instances as docs/guides/predictions.md describes for its format")
        raise UserError(f"--input {posixpath.basename(path)}: {exc}", f"the model ({ref.what}) takes {takes}") from None


STAGING = "_temporary"   # where Ray Data writes; the files move up when all are written
PARTIAL = "_PARTIAL"     # written first: the folder holds an unfinished prediction
SUCCESS = "_SUCCESS"     # written last, with the summary: the folder holds a complete one


def check_folder(out, output: str) -> None:
    """UserError when ``--output``, or a folder on its way (on this machine), is a file."""
    import pyarrow.fs as pafs

    path = out.path()
    while True:
        kind = out.fs.get_file_info(path).type
        if kind == pafs.FileType.File:
            what = f"--output {output}" + ("" if path == out.path() else f": {out.to_uri(path)}")
            raise UserError(f"{what} is a file, not a folder", "give a new folder for the predictions (JSON lines "
                            "files, written there with a _SUCCESS marker)")
        parent = posixpath.dirname(path)
        if kind == pafs.FileType.Directory or not out.is_local or parent == path:
            return
        path = parent


def prepare_output(out, output: str) -> str | None:
    """Check ``--output`` before anything runs. A complete prediction (``_SUCCESS``) or
    files of unknown origin are never overwritten; an interrupted predict's output (its
    ``_PARTIAL`` marker or staging folder, no ``_SUCCESS``) is replaced, and a line says so."""
    files = out.list_files()
    if SUCCESS in files:
        raise UserError(f"--output {output} already holds a complete prediction ({SUCCESS})",
                        "give a new folder: predictions never overwrite earlier ones")
    if PARTIAL in files or STAGING in out.list_dirs():
        for name in files:
            out.remove_file(name)
        out.remove_dir(STAGING)
        return (f"--output {output} held the partial output of an interrupted predict (no {SUCCESS}): "
                "replacing it")
    if files:
        raise UserError(f"--output {output} already holds files", "give a new folder: predictions never "
                        "overwrite earlier ones")
    return None


def predict(ref: ModelRef, pattern: str, output: str, *, workers: int = 1, address: str | None = None,
            verbose: bool = False, progress: bool = True, note=None) -> PredictSummary:
    """Predict every instance in ``pattern``'s files into JSON lines under ``output``;
    ``note(text)`` is told what starts once the checks pass.

    The output is written whole or marked unfinished: Ray Data writes into
    ``output/_temporary/``, the files then move up, and ``_SUCCESS`` (the summary as
    JSON) is written last. A predict interrupted before that leaves ``_PARTIAL`` and
    no ``_SUCCESS``, and raises KeyboardInterrupt; once ``_SUCCESS`` is written an
    interrupt changes nothing and the summary is returned.
    """
    fs, paths = input_files(pattern)
    out = Storage.resolve(normalize_storage(output))
    check_folder(out, output)
    check_first(ref, fs, paths[0])
    replacing = prepare_output(out, output)
    out.check_writable()
    say = note or (lambda text: None)
    summary = None
    try:
        # The marker first, then the first line: an interrupt once a user saw it leaves the marker.
        out.write_text(json.dumps({"started": time.time(), "model": ref.uri, "inputs": len(paths)}), PARTIAL)
        if replacing:
            say(replacing)
        say(f"predicting {len(paths)} file(s) with {ref.uri} ({ref.what}, {ref.format}) on "
            f"{workers} worker(s)")
        # One CPU per model replica, and one more for the read tasks (else they wait forever).
        with session.connect(address, workers=workers + 1, cpus_per_worker=1, verbose=verbose):
            seconds = _write_predictions(ref, fs, paths, out, workers, address, verbose, progress)
            summary = _finish(out, len(paths), ref, seconds)
    except KeyboardInterrupt:
        if summary is None and not out.exists(SUCCESS):
            if out.exists(PARTIAL) or STAGING in out.list_dirs():
                say(f"the output {out.uri_of()} is unfinished ({PARTIAL}, no {SUCCESS}): the same command "
                    "replaces it")
            else:  # interrupted while the marker was being written
                say(f"nothing was written to the output {out.uri_of()}")
            raise
        summary = summary or _read_summary(out)
    return summary


def _write_predictions(ref: ModelRef, fs, paths: list[str], out, workers: int, address: str | None,
                       verbose: bool, progress: bool) -> float:
    """Run the pipeline into the staging folder; returns how long it took."""
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    # Ray Data's bars on a terminal; elsewhere its progress would be INFO log lines.
    ctx.enable_progress_bars = progress and sys.stderr.isatty()
    if not verbose:  # Ray Data's own warnings (progress bars off, ...) only with -v
        logging.getLogger("ray.data").setLevel(logging.ERROR)
    started = time.time()
    ds = ray.data.read_binary_files(paths, filesystem=fs, include_paths=True)
    ds = ds.flat_map(_instances)
    # On this machine no node goes away, so a replica is not restarted: Ray's core worker
    # warns about restarting actors whose arguments sit in the object store otherwise.
    # Ray Data takes max_restarts only among its deprecated extra arguments (Ray 2.60).
    joined = bool(address or os.environ.get("RAY_ADDRESS"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        ds = ds.map_batches(_bound(ref), batch_size=BATCH, compute=ray.data.ActorPoolStrategy(size=workers),
                            num_cpus=1, batch_format="numpy", **({} if joined else {"max_restarts": 0}))
    ds.write_json(out.path(STAGING), filesystem=out.fs)
    return time.time() - started


def _finish(out, files: int, ref: ModelRef, seconds: float) -> PredictSummary:
    """Move the staged files up, then write ``_SUCCESS`` (the summary), then tidy up."""
    staged = out.list_files(STAGING)
    for name in staged:
        out.fs.move(out.path(STAGING, name), out.path(name))
    rows = sum(1 for _ in read_predictions(out))
    summary = PredictSummary(rows=rows, files=files, seconds=seconds, output=out.uri_of())
    out.write_text(json.dumps({**summary.to_json(), "model": ref.uri, "output_files": len(staged),
                               "finished": time.time()}), SUCCESS)
    out.remove_file(PARTIAL)
    out.remove_dir(STAGING)
    return summary


def _read_summary(out) -> PredictSummary:
    done = json.loads(out.read_text(SUCCESS) or "{}")
    return PredictSummary(rows=int(done.get("rows", 0)), files=int(done.get("files", 0)),
                          seconds=float(done.get("seconds", 0.0)), output=out.uri_of())


def read_predictions(out) -> Iterator[dict[str, Any]]:
    """Every prediction written under a storage folder, in file order (markers left out)."""
    for name in sorted(n for n in out.list_files() if not n.startswith("_")):
        for line in (out.read_text(name) or "").splitlines():
            if line.strip():
                yield json.loads(line)
