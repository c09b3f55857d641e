"""A tuning run's definition: the job every trial runs, and what the trials vary.

``launcher tune --config tune.yaml`` reads one YAML file: its
``hyperparameters:`` block says what to search, and any other top-level
key is a JobSpec key (``workload``, ``epochs``, ...), as in ``launcher run
--config``; flags override those. A parameter is, by its name:

- a JobSpec field that a trial may vary (:data:`TUNABLE`: lr, batch_size, ...);
- else a parameter of the workload (``--param NAME=VALUE``);
- for a ``--script`` or ``--package``, an argument: ``--NAME VALUE``, appended to
  the program's arguments as AI Platform does.

:meth:`Study.check` tries every parameter's extreme values against the spec's
own validation before anything starts, so a parameter that maps to nothing,
or a range the job refuses, is one line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from launcher import _deferred, schema
from launcher.errors import UserError
from launcher.spec import JobSpec
from launcher.tune.hyperparams import Hyperparameters, parse

TUNABLE = ("lr", "batch_size", "epochs", "seed", "hvd_fp16", "hvd_fusion_mb", "hvd_backward_passes")
BUILTIN_METRICS = ("accuracy", "loss", "train_loss")  # what a built-in workload reports each epoch
ARG_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")
STATE_DIR = "tune"           # Ray Tune's experiment state, under the tuning run's folder


def load(path: str) -> tuple[Hyperparameters, dict[str, Any]]:
    """The file's hyperparameters and its JobSpec keys (unchecked: flags go over them). AI Platform's
    and Vertex AI's job files are read by :mod:`launcher.jobfiles` instead."""
    raw = schema.load_yaml(path, "--config")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping with a hyperparameters block, got a {type(raw).__name__}",
                        "see the tuning example in the README")
    raw = dict(raw)
    block = raw.pop("hyperparameters", None)
    if block is None:
        known = [f.name for f in schema.fields(JobSpec)]
        stray = [k for k in raw if k not in known]
        hint = f" ({stray[0]!r} is not a JobSpec key either)" if stray else ""
        raise UserError(f"{path}: no hyperparameters block{hint}",
                        "add hyperparameters: {goal: MAXIMIZE, hyperparameterMetricTag: accuracy, params: [...]}")
    schema.check_keys(JobSpec, raw, path)
    return parse(block, f"{path}: hyperparameters"), raw


@dataclass
class Study:
    """A checked tuning run: ``spec`` is the base job (named after the tuning run)."""

    hp: Hyperparameters
    spec: JobSpec
    program: Any = None             # launcher.driver.program.Program for a script or package
    args: list[str] = field(default_factory=list)
    job_dir: bool = False
    source: str = ""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def trial_storage(self) -> str:
        """The storage root the trials' runs go under: the tuning run's own folder."""
        return self.spec.storage.rstrip("/") + "/" + self.name

    def metric(self) -> str:
        if self.hp.hyperparameterMetricTag:
            return self.hp.hyperparameterMetricTag
        if self.program is None:
            raise UserError(f"{self.source}: hyperparameterMetricTag is missing",
                            f"name the metric the trials are ranked by: one of {', '.join(BUILTIN_METRICS)} "
                            "for a built-in workload, or what your workload's evaluate() returns")
        return self.hp.metric()  # a program reports through cloudml-hypertune: its default tag

    def kind(self, name: str) -> str:
        """What a parameter sets: "field", "param" (workload) or "arg" (program)."""
        if self.program is not None:
            return "arg"
        return "field" if name in TUNABLE else "param"

    def trial_spec(self, values: dict[str, Any], name: str) -> JobSpec:
        """The validated spec of one trial: the base job with ``values`` applied."""
        overrides: dict[str, Any] = {"name": name, "storage": self.trial_storage}
        params = dict(self.spec.params)
        for key, value in values.items():
            kind = self.kind(key)
            if kind == "field":
                overrides[key] = value
            elif kind == "param":
                params[key] = _arg(value)  # as --param NAME=VALUE: the workload converts it
        overrides["params"] = params
        return self.spec.merged(overrides, source="the tuning run's trial").validated()

    def trial_args(self, values: dict[str, Any]) -> list[str]:
        """A program trial's arguments: its own, then ``--NAME VALUE`` per parameter."""
        out = list(self.args)
        for key, value in values.items():
            out += [f"--{key}", _arg(value)]
        return out

    def check(self) -> None:
        """UserError unless every parameter maps to something and its extremes are valid, and the
        search's library is installed."""
        if self.hp.algorithm == "ALGORITHM_UNSPECIFIED":
            _deferred.require("tune", f"{self.source}: the default search (algorithm ALGORITHM_UNSPECIFIED, Optuna's)")
        metric = self.metric()
        if self.program is None and not _is_user_workload(self.spec.workload) and metric not in BUILTIN_METRICS:
            raise UserError(f"{self.source}: hyperparameterMetricTag {metric!r} is not reported by "
                            f"{self.spec.workload}", f"it reports {', '.join(BUILTIN_METRICS)} each epoch")
        spec_fields = {f.name for f in schema.fields(JobSpec)}
        for p in self.hp.params:
            name = p.parameterName
            if self.program is not None:
                if not ARG_RE.match(name):
                    raise UserError(f"{self.source}: parameter {name!r} cannot be a command-line flag (--{name})",
                                    "use letters, digits, '_', '-' or '.', starting with a letter")
                continue
            if name in spec_fields and name not in TUNABLE:
                raise UserError(f"{self.source}: parameter {name} is a JobSpec field a trial cannot vary",
                                f"tunable fields: {', '.join(TUNABLE)}; or a workload param (`launcher workloads`)")
            if self.kind(name) == "param":
                known = _workload_params(self.spec.workload)
                if name not in known:
                    raise UserError(f"{self.source}: parameter {name} is neither a tunable JobSpec field "
                                    f"({', '.join(TUNABLE)}) nor a param of workload {self.spec.workload} "
                                    f"({', '.join(known) or 'it has none'})",
                                    "rename it, or tune a --script / --package, which gets it as --" + name)
            first = {q.parameterName: q.extremes()[0] for q in self.hp.params}
            for value in p.extremes():
                try:
                    self.trial_spec({**first, name: value}, "trial_check")
                except UserError as exc:
                    raise UserError(f"{self.source}: parameter {name} = {value!r} is refused by the job: "
                                    f"{exc.args[0]}", "narrow its range") from None

    def to_record(self) -> dict[str, Any]:
        """What tuning.json keeps: a relaunch must define the same search."""
        program = None
        if self.program is not None:
            program = {"kind": self.program.kind, "target": self.program.target, "folder": self.program.folder}
        return {"hyperparameters": schema.to_mapping(self.hp), "spec": self.spec.to_dict(),
                "program": program, "args": list(self.args), "metric": self.metric()}


def same_definition(recorded: dict[str, Any], now: dict[str, Any]) -> str | None:
    """None when a relaunch defines the same search; else what changed (for one line)."""
    for key in ("hyperparameters", "program", "args", "metric"):
        if _canon(recorded.get(key)) != _canon(now.get(key)):
            return key
    old, new = recorded.get("spec") or {}, now.get("spec") or {}
    for key in sorted(set(old) | set(new)):
        if key in ("address", "mlflow"):  # where it runs and whether it is tracked: not the search
            continue
        if _canon(old.get(key)) != _canon(new.get(key)):
            return f"{key} ({old.get(key)!r} then, {new.get(key)!r} now)"
    return None


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _arg(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _is_user_workload(name: str) -> bool:
    import workloads

    return workloads.is_reference(name)


def _workload_params(name: str) -> list[str]:
    import workloads

    return sorted(p.name for p in workloads.get(name).params)
