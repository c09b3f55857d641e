"""JobSpec: the one typed, validated description of a training run.

A spec is built from a YAML file (``--config``) and/or CLI flags (flags win),
then :meth:`JobSpec.validated` checks every field and fills the defaults that
depend on others (workload hyper-parameters, the run name). Everything here is
pure: checks that touch the outside world (data files, storage, the Ray
cluster) live in :mod:`launcher.preflight`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import difflib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import workloads
from launcher.errors import UserError
from launcher.storage.gcs import parse_gs_uri

NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,127}$")
URI_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")
FRAMEWORKS = ("torch", "tensorflow")
DEFAULT_STORAGE = "./runs"


@dataclass(frozen=True)
class JobSpec:
    """What to train, how, where and with which resources.

    ``None`` in epochs, batch_size and lr means "the workload's default";
    ``None`` in name means "generate one"; ``None`` in checkpoint_every_steps
    means "once per epoch"; ``None`` in address means "start a local Ray".
    """

    workload: str = workloads.DEFAULT
    framework: str = "torch"
    backend: str = "native"
    workers: int = 2
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    epochs: int | None = None
    batch_size: int | None = None  # per worker; the global batch is workers x batch_size
    lr: float | None = None
    seed: int = 0
    data: str | None = None
    storage: str = DEFAULT_STORAGE
    name: str | None = None
    checkpoint_every_steps: int | None = None
    keep_checkpoints: int = 3
    max_failures: int = 0
    preemption_check_steps: int = 10  # ask Ray Train for a preemption notice every N steps; 0: never
    min_workers: int | None = None  # elastic: carry on with as few as this many workers (None: fixed size)
    address: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    # Horovod only (--backend horovod): fp16 gradient compression, the tensor-fusion
    # buffer in MiB (None: Horovod's 128), backward passes accumulated per optimizer step.
    hvd_fp16: bool = False
    hvd_fusion_mb: float | None = None
    hvd_backward_passes: int = 1

    # -- construction -----------------------------------------------------------
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "spec") -> "JobSpec":
        """Build a spec from a mapping (YAML or flags); unknown keys and wrong types are errors."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                # "num_workers" is how Ray's ScalingConfig spells it: match without the prefix first.
                close = (difflib.get_close_matches(str(key).removeprefix("num_"), known, n=1)
                         or difflib.get_close_matches(str(key), known, n=1))
                hint = f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(known)}"
                raise UserError(f"{source}: unknown key {key!r}", hint)
            kwargs[key] = _coerce(key, value, known[key].type, source)
        return cls(**kwargs)

    def merged(self, overrides: Mapping[str, Any], source: str = "flags") -> "JobSpec":
        """A copy with ``overrides`` (values not None) applied, type-checked like from_mapping."""
        base = dataclasses.asdict(self)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return JobSpec.from_mapping(base, source)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- validation -----------------------------------------------------------------
    def validated(self, now: _dt.datetime | None = None) -> "JobSpec":
        """Check every field and return the spec with all defaults resolved.

        Raises:
            UserError: naming the field, the bad value and what would be valid.
        """
        from launcher import backends  # registry only; imports no framework

        workload = _lookup(workloads.REGISTRY, self.workload, "--workload")
        if self.framework not in FRAMEWORKS:
            raise UserError(f"unknown framework {self.framework!r}", f"valid: {', '.join(FRAMEWORKS)}")
        if self.framework not in workload.frameworks:
            raise UserError(f"workload {workload.name} has no {self.framework} model",
                            f"use --framework {' or '.join(workload.frameworks)}")
        backend = _lookup(backends.REGISTRY, self.backend, "--backend")
        if self.framework not in backend.frameworks:
            raise UserError(f"backend {self.backend} does not support {self.framework}",
                            f"it supports: {', '.join(backend.frameworks)}")
        _at_least("workers", self.workers, 1)
        _positive("cpus_per_worker", self.cpus_per_worker)
        _at_least("gpus_per_worker", self.gpus_per_worker, 0)
        if self.epochs is not None:
            _at_least("epochs", self.epochs, 1)
        if self.batch_size is not None:
            _at_least("batch_size", self.batch_size, 1)
        if self.lr is not None:
            _positive("lr", self.lr)
        _at_least("seed", self.seed, 0)
        if self.checkpoint_every_steps is not None:
            _at_least("checkpoint_every_steps", self.checkpoint_every_steps, 1)
        _at_least("keep_checkpoints", self.keep_checkpoints, 1)
        _at_least("max_failures", self.max_failures, -1)
        self._check_horovod_options()
        _at_least("preemption_check_steps", self.preemption_check_steps, 0)
        if self.min_workers is not None and not 1 <= self.min_workers <= self.workers:
            raise UserError(f"--min-workers {self.min_workers} is outside 1..{self.workers} (--workers)",
                            "give a number of workers the run may shrink to, at most --workers")
        try:
            params = workload.resolve_params(self.params)
        except (KeyError, ValueError) as exc:
            raise UserError(str(exc).strip('"'), "see `launcher workloads` for each workload's params")
        name = self.name or default_name(self.workload, self.framework, self.backend, now)
        check_name(name)
        d = workload.defaults
        return dataclasses.replace(
            self,
            epochs=self.epochs or d.epochs,
            batch_size=self.batch_size or d.batch_size,
            lr=self.lr or d.lr,
            name=name,
            storage=normalize_storage(self.storage),
            data=normalize_data(self.data),
            params=params,
        )


    def _check_horovod_options(self) -> None:
        given = [name for name, default in HOROVOD_OPTIONS.items() if getattr(self, name) != default]
        if given and self.backend != "horovod":
            raise UserError(f"{_flag(given[0])} is a Horovod option, but the backend is {self.backend}",
                            "add --backend horovod, or drop the option")
        if self.hvd_fusion_mb is not None:
            _at_least("hvd_fusion_mb", self.hvd_fusion_mb, 0)
        _at_least("hvd_backward_passes", self.hvd_backward_passes, 1)
        if self.hvd_backward_passes > 1 and self.framework != "torch":
            raise UserError(f"--hvd-backward-passes {self.hvd_backward_passes}: gradient accumulation is "
                            f"implemented for torch runs only, not {self.framework}",
                            "drop the option, or raise --batch-size instead")


# Horovod's options and their defaults (which any backend accepts).
HOROVOD_OPTIONS = {"hvd_fp16": False, "hvd_fusion_mb": None, "hvd_backward_passes": 1}


# -- helpers -------------------------------------------------------------------------

def default_name(workload: str, framework: str, backend: str, now: _dt.datetime | None = None) -> str:
    """<workload>_<framework>_<backend>_<YYYYmmdd_HHMMSS>, dashes turned into underscores."""
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d_%H%M%S")
    return f"{workload}_{framework}_{backend}_{stamp}".replace("-", "_")


def check_name(name: str) -> None:
    """Run names follow the AI Platform job-ID rule."""
    if not NAME_RE.match(name):
        raise UserError(
            f"invalid run name {name!r}: use letters, digits and underscores, start with a letter, "
            "at most 128 characters", "for example --name digits_run_1")


def normalize_storage(storage: str) -> str:
    """A local storage path made absolute (Ray Train needs one); URIs are checked for a known scheme."""
    if URI_LIKE.match(storage) and "://" not in storage:
        raise UserError(f"storage {storage!r} looks like a URI but is malformed",
                        "write scheme://bucket/prefix, or ./path for a local folder")
    if storage.startswith("gs://"):
        return parse_gs_uri(storage).uri
    if "://" in storage:
        scheme = storage.split("://", 1)[0]
        raise UserError(f"storage {storage!r}: the {scheme}:// scheme is not supported",
                        "use a local folder or gs://BUCKET/PREFIX")
    if not storage:
        raise UserError("storage is empty", f"use a local folder, for example {DEFAULT_STORAGE}")
    return os.path.abspath(os.path.expanduser(storage))


def normalize_data(data: str | None) -> str | None:
    if data is None:
        return None
    if data.startswith("gs://"):
        return parse_gs_uri(data, what="--data").uri
    if URI_LIKE.match(data):
        raise UserError(f"--data {data!r}: only local paths and gs:// URIs are supported",
                        "write gs://BUCKET/PREFIX or a local path")
    return os.path.abspath(os.path.expanduser(data))


def _lookup(registry, name: str, flag: str):
    try:
        return registry.get(name)
    except workloads.UnknownName as exc:
        raise UserError(f"{flag}: {exc}") from None


def _at_least(name: str, value: float, low: float) -> None:
    if value < low:
        raise UserError(f"{name} must be >= {low}, got {value}", f"set {_flag(name)} to {low} or more")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise UserError(f"{name} must be > 0, got {value}", f"set {_flag(name)} to a positive number")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def _coerce(key: str, value: Any, annotation: Any, source: str) -> Any:
    """Check a value against the field's annotation ("int", "float | None", ...)."""
    text = str(annotation)
    if value is None:
        if "None" in text:
            return None
        raise UserError(f"{source}: {key} may not be empty", f"give {key} a value or leave the key out")
    if text.startswith("dict"):
        if not isinstance(value, dict):
            raise UserError(f"{source}: {key} must be a mapping of name: value, got {value!r}")
        return dict(value)
    kind = text.split(" |")[0]
    want = _SCALARS[kind]
    if want is bool:
        ok = isinstance(value, bool)
    else:
        ok = (isinstance(value, want) and not isinstance(value, bool)) or (
            want is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise UserError(f"{source}: {key} must be {'an' if kind == 'int' else 'a'} {kind}, "
                        f"got {value!r}", f"for example {key}: {_example(kind)}")
    return want(value)


def _example(kind: str) -> str:
    return {"int": "2", "float": "0.5", "str": "text", "bool": "true"}[kind]
