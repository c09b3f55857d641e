"""A model folder, found, checked and loaded for prediction.

Every run exports ``<run>/model/`` (see :mod:`launcher.worker.export`) with a
``model.json`` describing it; a Vertex AI trainer's ``AIP_MODEL_DIR`` holds a
``model.joblib``, ``model.bst`` or ``saved_model.pb`` and nothing else. :func:`locate`
turns ``--model`` (a run folder or a model folder, local or ``gs://``) or ``--run NAME``
into the model folder and its format (:mod:`launcher.predict.formats`), checked before
any worker starts; :class:`Model` loads it (a ``gs://`` folder is copied to a local
temporary folder first).
"""

from __future__ import annotations

import inspect
import json
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from launcher.errors import UserError
from launcher.predict import formats
from launcher.predict.formats.base import Batch, Loaded, plain
from launcher.storage import Storage
from launcher.storage.uri import DEFAULT_STORAGE, normalize_storage

MODEL_DIR = "model"
DESCRIPTION = "model.json"


@dataclass(frozen=True)
class ModelRef:
    """Where a model folder is (a storage root and the parts under it) and what it holds."""

    storage_uri: str
    parts: tuple[str, ...]
    info: dict[str, Any]

    @property
    def uri(self) -> str:
        return Storage.resolve(self.storage_uri).uri_of(*self.parts)

    @property
    def framework(self) -> str:
        return self.info.get("framework", "torch")

    @property
    def format(self) -> str:
        return self.info["format"]

    @property
    def run(self) -> str | None:
        """The run the folder belongs to (the folder above ``model/``, else the folder's own name)."""
        parts = [p for p in self.parts if p]
        if parts and parts[-1] == MODEL_DIR:
            parts = parts[:-1]
        return parts[-1] if parts else None

    @property
    def what(self) -> str:
        """How a line names the model: its workload, else its format."""
        return str(self.info.get("workload") or self.info["format"])


def locate(model: str | None = None, run: str | None = None, storage: str | None = None) -> ModelRef:
    """The model folder ``--model`` (a run folder or a model folder) or ``--run NAME`` names,
    with its format in ``info["format"]``.

    Raises:
        UserError: nothing there, no model in it (the run did not finish), or one that
            predict and serve cannot take.
    """
    if bool(model) == bool(run):
        raise UserError("give the model with --model RUN_OR_MODEL_DIR or --run NAME (one of them)",
                        "for example --run digits_1, or --model runs/digits_1")
    if run:
        root, parts = normalize_storage(storage or DEFAULT_STORAGE), (run, MODEL_DIR)
        what = f"--run {run}"
    else:
        uri = normalize_storage(model.rstrip("/"))
        root, _, last = uri.rpartition("/")
        if not root or root == "gs:/":
            raise UserError(f"--model {model}: name a run's folder or a model folder", "for example runs/digits_1")
        parts = (last,)
        what = f"--model {model}"
    store = Storage.resolve(root)
    candidates = [parts] if run else [parts + (MODEL_DIR,), parts]
    for candidate in candidates:
        text = store.read_text(*candidate, DESCRIPTION)
        info: dict[str, Any] = {}
        if text is not None:
            try:
                info = json.loads(text)
                if not isinstance(info, dict):
                    raise ValueError("not an object")
            except ValueError:
                raise UserError(f"{store.uri_of(*candidate, DESCRIPTION)} is damaged",
                                "export the model again (run the run again with the same --name)") from None
        files = store.list_files(*candidate) if store.exists(*candidate) else []
        if text is None and not any(m in files for marks in formats.MARKERS.values() for m in marks):
            continue
        info = {**info, "format": _servable(info, files, what, store.uri_of(*candidate))}
        return ModelRef(root, candidate, info)
    where = store.uri_of(*parts)
    exists = store.exists(*parts)
    raise UserError(f"{what}: {'no model in ' + where if exists else 'nothing at ' + where}",
                    f"a run exports its model to <run>/model/ when it finishes; a model folder holds "
                    f"{formats.ACCEPTED}" if exists or run else "check the path (a run's folder, e.g. runs/NAME)")


def _servable(info: dict[str, Any], files: list[str], what: str, where: str) -> str:
    """The folder's format; a model predict and serve cannot take is one line here, before
    Ray starts."""
    found = formats.detect(info, files)
    listed = ", ".join(sorted(files)) or "no files"
    if found is None and info.get("kind") == "training function":
        exported = ", ".join(sorted(info.get("files") or files))
        why = f"; no program was exported, as its model: {info['no_program']}" if info.get("no_program") else ""
        raise UserError(f"{what}: {where} holds a training function's model ({exported}{why}), whose class is in "
                        "your code: predict and serve take a program they can run without it (model.pt2, model.keras, "
                        f"a SavedModel) or {formats.ACCEPTED.split(', saved')[0]}",
                        f"load it as {where}/model.json says and predict in your own code")
    if found is None:
        raise UserError(f"{what}: {where} holds no model predict and serve can load ({listed})",
                        f"a model folder holds {formats.ACCEPTED}, or is a run's export")
    if info.get("predict"):
        try:
            _hook(info)
        except (KeyError, ValueError) as exc:
            raise UserError(f"{what}: the model's predict hook {info['predict']} cannot be loaded ({exc})",
                            "predict from where the run's file is (its path is in model.json)") from None
    if found == "workload":
        import workloads

        try:
            workloads.get(info["workload"])
        except (KeyError, ValueError) as exc:
            raise UserError(f"{what}: the model's workload {info['workload']} cannot be loaded ({exc})",
                            "predict from the folder the run was started in, where its workload file is") from None
    return found


class HookError(RuntimeError):
    """A predict hook that broke its contract (not a bad instance: those raise ValueError)."""


class HookModel:
    """What a ``predict(model, instances)`` hook gets: the model as a function of arrays
    (``model(x)``, or ``model(a, b)`` / ``model(a=..., b=...)`` by its inputs' names) that
    returns its output (several: a dict by name), and what the run knew: ``params``,
    ``data`` and ``info`` (its whole model.json)."""

    def __init__(self, loaded: Loaded) -> None:
        self._loaded = loaded
        self.info = loaded.info
        self.params = loaded.info.get("params") or {}
        self.data = loaded.info.get("data")

    def __call__(self, *arrays: Any, **named: Any) -> Any:
        specs = getattr(self._loaded, "specs", None) or [("x", (), np.dtype(np.float32))]
        dtypes = {n: t for n, _, t in specs}
        given = {**{n: a for (n, _, _), a in zip(specs, arrays)}, **named}
        out = self._loaded.run({n: np.asarray(v, dtype=dtypes.get(n)) for n, v in given.items()})
        return next(iter(out.values())) if len(out) == 1 else out


def _hook(info: dict[str, Any]) -> tuple[Any, bool] | None:
    """(the run's predict hook, whether it takes parameters), or None without one."""
    reference = info.get("predict")
    if not reference:
        return None
    from workloads.user import companion

    fn = companion(reference, reference.rpartition(":")[2])
    if fn is None:
        raise ValueError(f"{reference} defines no predict function")
    try:
        takes = len(inspect.signature(fn).parameters) >= 3
    except (TypeError, ValueError):
        takes = False
    return fn, takes


class Model:
    """A loaded model: ``inputs(instances)`` -> a batch, ``run(batch)`` -> outputs,
    ``answers(outputs)`` -> one prediction per instance (see :mod:`launcher.predict.formats`)."""

    def __init__(self, ref: ModelRef) -> None:
        self.ref = ref
        self._dir = self._local_copy()
        self.loaded = formats.load(ref.format, self._dir, ref.info)
        self.hook = _hook(ref.info)

    def _local_copy(self) -> str:
        store = Storage.resolve(self.ref.storage_uri)
        if store.is_local:
            return store.path(*self.ref.parts)
        d = tempfile.mkdtemp(prefix="launcher-model-")
        store.download_dir(d, *self.ref.parts)
        self._tmp = d
        return d

    def about(self) -> dict[str, Any]:
        return {**self.loaded.about(), "model": self.ref.uri}

    def inputs(self, instances: Any) -> Batch:
        """Raw instances -> the model's input batch; ValueError saying what was expected."""
        return self.loaded.inputs(instances)

    def run(self, batch: Batch) -> Batch:
        return self.loaded.run(batch)

    def answers(self, out: Batch) -> list[Any]:
        return self.loaded.answers(out)

    def columns(self, out: Batch) -> dict[str, np.ndarray]:
        return self.loaded.columns(out)

    def predict(self, instances: Any, parameters: dict[str, Any] | None = None) -> list[Any]:
        """Instances in, one prediction per instance out: through the run's ``predict`` hook
        when it has one, else the format's own inputs and answers."""
        if self.hook is None:
            return self.answers(self.run(self.inputs(instances)))
        fn, takes_parameters = self.hook
        given = HookModel(self.loaded)
        out = fn(given, instances, parameters or {}) if takes_parameters else fn(given, instances)
        out = list(out) if isinstance(out, (list, tuple, np.ndarray)) else out
        if not isinstance(out, list) or len(out) != len(instances):
            raise HookError(f"the predict hook returned {type(out).__name__}"
                            f"{' of ' + str(len(out)) if isinstance(out, list) else ''} for {len(instances)} "
                            "instances: return one prediction per instance")
        return [plain(o) for o in out]

    def close(self) -> None:
        if getattr(self, "_tmp", None):
            shutil.rmtree(self._tmp, ignore_errors=True)
