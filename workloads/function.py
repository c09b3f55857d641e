"""Training functions: the user's own training loop, named like a workload.

``--workload FILE.py:NAME`` may name a plain function instead of a
:class:`~workloads.base.Workload`. Which kind it is follows from its one
parameter:

* ``def train(session): ...`` is a *session function*: the launcher calls it on
  every worker with a :class:`launcher.worker.session.TorchSession`, which
  prepares the model for the backend, hands out a resumable data loader and
  saves what the function registers;
* ``def train_loop_per_worker(config): ...`` is a *Ray Train function*, written for
  Ray Train's ``TorchTrainer``: it gets the run's hyper-parameters as ``config``
  and talks to Ray's own API (``ray.train.report``, ``get_checkpoint``).

`@training_function(...)` attaches hyper-parameter defaults, ``--param``s and a data
description to either kind, as a workload's ``Defaults`` and ``Param`` do::

    @workloads.training_function(epochs=3, batch_size=64, lr=3e-4,
                        params=[Param("layers", int, 2, "transformer blocks")])
    def train(session): ...

Without it a function trains 1 epoch of batch 32 at lr 0.001 and takes any
``--param key=value`` (values read as numbers or booleans where they look like
one). Nothing here imports the launcher, Ray or a framework.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable, Iterable, Mapping

from workloads.base import Defaults, Param, Workload

SESSION = "session"
RAY_TRAIN = "ray-train"
_RAY_PARAMS = ("config", "train_loop_config")
_ATTRIBUTE = "__launcher_defaults__"
FALLBACK = Defaults(epochs=1, batch_size=32, lr=0.001)


class FunctionError(ValueError):
    """A function that cannot be a training function; str() says why and how to fix it."""


def training_function(*, epochs: int = FALLBACK.epochs, batch_size: int = FALLBACK.batch_size,
                      lr: float = FALLBACK.lr, params: Iterable[Param] = (), data: str | None = None,
                      description: str | None = None, framework: str | None = None) -> Callable[[Callable], Callable]:
    """Decorator: the hyper-parameter defaults, the ``--param``s and what ``--data`` must be.

    ``params`` given: only those parameters are accepted (typed, as a Workload's).
    ``data``: what ``--data`` points at (the run then requires it).
    ``framework``: "torch" or "tensorflow" (default: the one the function's module imports).
    """
    if framework not in (None, "torch", "tensorflow"):
        raise FunctionError(f"training_function(framework={framework!r}): use 'torch' or 'tensorflow'")
    declared = {"defaults": Defaults(epochs=epochs, batch_size=batch_size, lr=lr), "params": tuple(params),
                "data": data, "description": description, "framework": framework}

    def attach(fn: Callable) -> Callable:
        setattr(fn, _ATTRIBUTE, declared)
        return fn

    return attach


def _imported(fn: Callable) -> set[str]:
    """The modules ``fn``'s module imported: each module it holds, and the module of each class
    and function it imported by name (``from torch.utils.data import DataLoader``)."""
    found = set()
    for value in getattr(fn, "__globals__", {}).values():
        if inspect.ismodule(value):  # its name as ModuleType reads it: a module loaded on first use stays unloaded
            found.add(types.ModuleType.__getattribute__(value, "__name__"))
        elif inspect.isclass(value) or inspect.isfunction(value):
            found.add(getattr(value, "__module__", "") or "")
    return found


def _uses(found: set[str], *packages: str) -> bool:
    """Whether any of ``found`` is one of ``packages`` or inside one."""
    return any(name == p or name.startswith(p + ".") for name in found for p in packages)


def framework_of(fn: Callable) -> tuple[str, ...]:
    """The frameworks a function can train with: the declared one, else the one its module
    imported (TensorFlow or Keras, torch); both where that says nothing."""
    declared = (getattr(fn, _ATTRIBUTE, None) or {}).get("framework")
    if declared:
        return (declared,)
    found = _imported(fn)
    tf, torch = _uses(found, "tensorflow", "tf_keras", "keras"), _uses(found, "torch")
    if tf != torch:
        return ("tensorflow",) if tf else ("torch",)
    return ("torch", "tensorflow")


def ray_train_framework(fn: Callable) -> tuple[str, ...]:
    """What a Ray Train function trains: XGBoost where its module imports xgboost (or Ray Train's
    XGBoost helpers) and not torch, then on Ray Train's XGBoost backend; else torch."""
    found = _imported(fn)
    return ("xgboost",) if _uses(found, "xgboost", "ray.train.xgboost") and not _uses(found, "torch") else ("torch",)


def required_parameters(fn: Callable) -> list[str]:
    """The names of the parameters a call of ``fn`` must give (none for a class or a builtin)."""
    if not inspect.isfunction(fn):
        return []
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def kind_of(fn: Callable) -> str | None:
    """SESSION or RAY_TRAIN for a function of one required parameter; None for anything else
    (a zero-argument callable is a workload factory)."""
    required = required_parameters(fn)
    if len(required) != 1:
        return None
    return RAY_TRAIN if required[0] in _RAY_PARAMS else SESSION


def ray_config(spec: Any) -> dict[str, Any]:
    """The ``config`` a Ray Train function gets: its ``--param``s and the run's hyper-parameters
    under the names Ray Train's examples use (``lr``, ``batch_size``, ``epochs``, ``seed``) and the
    launcher's (``batch_size_per_worker``, ``num_workers``)."""
    return {**spec.params, "lr": spec.lr, "batch_size": spec.batch_size, "batch_size_per_worker": spec.batch_size,
            "epochs": spec.epochs, "num_epochs": spec.epochs, "seed": spec.seed, "num_workers": spec.workers}


def _literal(value: Any) -> Any:
    """A free-form --param value: a number or a boolean where it reads as one, else the text."""
    if not isinstance(value, str):
        return value
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            pass
    return value


def _defined_at(fn: Callable) -> str | None:
    """``file:line`` of the function's ``def`` (below any decorator)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    line = code.co_firstlineno
    try:
        lines, start = inspect.getsourcelines(fn)
        line = start + next(i for i, text in enumerate(lines) if text.lstrip().startswith(("def ", "async def ")))
    except (OSError, TypeError, StopIteration):
        pass
    return f"{code.co_filename}:{line}"


class TrainingFunction(Workload):
    """A user's training function seen as a workload: it owns its data and model, so the
    launcher neither loads data for it nor builds a model for it."""

    def __init__(self, fn: Callable, where: str, kind: str) -> None:
        declared = getattr(fn, _ATTRIBUTE, None) or {}
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        super().__init__(
            name=fn.__name__, description=declared.get("description") or (doc[0] if doc else
                                                                          f"training function {fn.__name__}"),
            defaults=declared.get("defaults", FALLBACK),
            frameworks=framework_of(fn) if kind == SESSION else ray_train_framework(fn),
            data_help=declared.get("data"), params=tuple(declared.get("params", ())))
        self.fn, self.kind = fn, kind
        self.free_params = "params" not in declared or not declared["params"]
        self.source = _defined_at(fn) or where

    def resolve_params(self, given: Mapping[str, Any]) -> dict[str, Any]:
        if self.free_params:
            return {key: _literal(value) for key, value in given.items()}
        return super().resolve_params(given)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out.update(kind=("training function (your loop, given a launcher session)" if self.kind == SESSION
                         else "Ray Train function (train_loop_per_worker(config))"), defined_at=self.source)
        if self.free_params:
            out["params"] = "any --param KEY=VALUE (declare them with @workloads.training_function(params=...))"
        return out
