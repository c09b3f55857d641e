"""The ``hyperparameters:`` block of a tuning YAML, in AI Platform's spelling, checked.

The block is the one AI Platform Training's ``gcloud ai-platform jobs submit
training --config`` file holds (``trainingInput: {hyperparameters: ...}``);
at the top level of the file it is accepted as well. Every mistake is one
line naming the key, the value and what would be valid: an unknown key gets
the closest valid one. :class:`Study` turns the parameters into a Ray Tune
search space and a trial's sampled values back into what the trial runs
with (JobSpec fields, workload params, or ``--name value`` arguments).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Literal

from launcher import schema
from launcher.errors import UserError
from launcher.schema import option

DEFAULT_METRIC_TAG = "training/hptuning/metric"  # cloudml-hypertune's default tag
REVERSE = "~"  # prefix of a reverse-log parameter's key in the search space (it searches a mirror)
HINT = "see the hyperparameters example in the tuning guide"
ParamType = Literal["DOUBLE", "INTEGER", "DISCRETE", "CATEGORICAL"]
ScaleType = Literal["UNIT_LINEAR_SCALE", "UNIT_LOG_SCALE", "UNIT_REVERSE_LOG_SCALE"]


def _key(default: Any = None, **kw: Any) -> Any:
    """A YAML-only key (no command-line flag)."""
    return option(default, cli=False, **kw)


@dataclass(frozen=True)
class Param:
    """One entry of ``params``: what AI Platform calls a ParameterSpec."""

    LABEL = "parameterName"
    HINT = HINT

    parameterName: str = option(
        help="the parameter's name: a tunable field, a workload param or a program's --NAME", cli=False)
    type: ParamType = option(help="DOUBLE, INTEGER, DISCRETE or CATEGORICAL", cli=False)
    minValue: float | None = _key(help="the range's lower end (DOUBLE, INTEGER)")
    maxValue: float | None = _key(help="the range's upper end (DOUBLE, INTEGER)")
    discreteValues: tuple[float, ...] | None = _key(help="the values a DISCRETE parameter takes")
    categoricalValues: tuple[str, ...] | None = _key(help="the values a CATEGORICAL parameter takes")
    scaleType: ScaleType | None = _key(help="how a range is searched (linear, log, reverse log)")

    def check(self) -> None:
        """ValueError for values that contradict each other (a rule pydantic-style types cannot say)."""
        name, kind = self.parameterName, self.type
        if kind in ("DOUBLE", "INTEGER"):
            if self.minValue is None or self.maxValue is None:
                raise ValueError(f"parameter {name}: a {kind} parameter needs minValue and maxValue")
            for key in ("minValue", "maxValue"):
                value = getattr(self, key)
                if not math.isfinite(value):
                    raise ValueError(f"parameter {name}: {key} must be a finite number, got {value}")
                if kind == "INTEGER" and value != int(value):
                    raise ValueError(f"parameter {name}: {key} of an INTEGER parameter must be a whole "
                                     f"number, got {value:g}")
            if self.minValue >= self.maxValue:
                raise ValueError(f"parameter {name}: minValue {self.minValue:g} must be below maxValue "
                                 f"{self.maxValue:g}")
            if self.scaleType in ("UNIT_LOG_SCALE", "UNIT_REVERSE_LOG_SCALE") and self.minValue <= 0:
                raise ValueError(f"parameter {name}: {self.scaleType} needs minValue > 0 (a logarithm), got "
                                 f"{self.minValue:g}; use UNIT_LINEAR_SCALE or a positive range")
        else:
            for key in ("minValue", "maxValue", "scaleType"):
                if getattr(self, key) is not None:
                    raise ValueError(f"parameter {name}: {key} applies to DOUBLE and INTEGER parameters, not "
                                     f"{kind}")
        wanted = {"DISCRETE": "discreteValues", "CATEGORICAL": "categoricalValues"}.get(kind)
        for key in ("discreteValues", "categoricalValues"):
            values = getattr(self, key)
            if key == wanted and not values:
                raise ValueError(f"parameter {name}: a {kind} parameter needs a non-empty {key} list")
            if key != wanted and values is not None:
                raise ValueError(f"parameter {name}: {key} applies to "
                                 f"{'DISCRETE' if key == 'discreteValues' else 'CATEGORICAL'} parameters, not "
                                 f"{kind}")
            if key == wanted and len(set(values)) != len(values):
                raise ValueError(f"parameter {name}: {key} lists a value twice")
        if self.discreteValues and not all(math.isfinite(v) for v in self.discreteValues):
            raise ValueError(f"parameter {name}: discreteValues must be finite numbers")

    # -- the search space ---------------------------------------------------------------
    @property
    def key(self) -> str:
        """The key in Ray Tune's search space (a reverse-log parameter searches its mirror)."""
        return REVERSE + self.parameterName if self.scaleType == "UNIT_REVERSE_LOG_SCALE" else self.parameterName

    def domain(self):
        """This parameter as a Ray Tune search domain."""
        from ray import tune

        lo, hi = self.minValue, self.maxValue
        if self.type == "DOUBLE":
            return tune.uniform(lo, hi) if self.scaleType in (None, "UNIT_LINEAR_SCALE") else tune.loguniform(lo, hi)
        if self.type == "INTEGER":  # Ray's integer bounds exclude the upper one
            if self.scaleType in (None, "UNIT_LINEAR_SCALE"):
                return tune.randint(int(lo), int(hi) + 1)
            return tune.lograndint(int(lo), int(hi) + 1)
        if self.type == "DISCRETE":
            return tune.choice([_number(v) for v in self.discreteValues])
        return tune.choice(list(self.categoricalValues))

    def value(self, sampled: Any) -> Any:
        """The parameter's value from what Tune sampled: a reverse-log parameter is sampled on
        a log scale and mirrored, so values crowd toward maxValue rather than minValue."""
        if self.scaleType == "UNIT_REVERSE_LOG_SCALE":
            mirrored = self.minValue + self.maxValue - sampled
            return int(round(mirrored)) if self.type == "INTEGER" else mirrored
        return sampled

    def grid(self) -> list[Any]:
        """Every value, for GRID_SEARCH (which has no DOUBLE parameters)."""
        if self.type == "INTEGER":
            return list(range(int(self.minValue), int(self.maxValue) + 1))
        if self.type == "DISCRETE":
            return [_number(v) for v in self.discreteValues]
        return list(self.categoricalValues)

    def extremes(self) -> list[Any]:
        """The values a check tries before anything starts: the range's ends, or every choice."""
        if self.type in ("DOUBLE", "INTEGER"):
            cast = int if self.type == "INTEGER" else float
            return [cast(self.minValue), cast(self.maxValue)]
        return self.grid()


@dataclass(frozen=True)
class Hyperparameters:
    """The ``hyperparameters`` block: AI Platform's HyperparameterSpec."""

    HINT = HINT

    goal: Literal["MAXIMIZE", "MINIMIZE"] = option(help="whether the metric is maximised or minimised", cli=False)
    params: tuple[Param, ...] = option(help="the parameters searched", cli=False, min_items=1)
    hyperparameterMetricTag: str | None = _key(help="the metric the trials are ranked by")
    maxTrials: int = _key(1, help="how many trials run in all", ge=1)
    maxParallelTrials: int = _key(1, help="how many trials run at once", ge=1)
    maxFailedTrials: int = _key(0, help="how many trials may fail before the study stops", ge=0)
    enableTrialEarlyStopping: bool = _key(False, help="stop trials that trail the others (ASHA)")
    algorithm: Literal["ALGORITHM_UNSPECIFIED", "GRID_SEARCH", "RANDOM_SEARCH"] = _key(
        "ALGORITHM_UNSPECIFIED", help="how the values are chosen")

    def check(self) -> None:
        names = [p.parameterName for p in self.params]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"parameter {twice[0]} is listed twice")
        if self.algorithm == "GRID_SEARCH":
            doubles = [p.parameterName for p in self.params if p.type == "DOUBLE"]
            if doubles:
                raise ValueError(f"GRID_SEARCH cannot search DOUBLE parameter {doubles[0]} (a range has no grid); "
                                 "make it DISCRETE with discreteValues, or use RANDOM_SEARCH")

    @property
    def mode(self) -> str:
        return "max" if self.goal == "MAXIMIZE" else "min"

    def metric(self) -> str:
        return self.hyperparameterMetricTag or DEFAULT_METRIC_TAG

    def space(self) -> dict[str, Any]:
        return {p.key: p.domain() for p in self.params}

    def values(self, config: dict[str, Any]) -> dict[str, Any]:
        """parameterName -> value, from a trial's config (Tune's sampled values)."""
        return {p.parameterName: p.value(config[p.key]) for p in self.params}

    def grid_points(self) -> list[dict[str, Any]]:
        """GRID_SEARCH's trials, in order, at most maxTrials of them."""
        grids = [p.grid() for p in self.params]
        points = []
        for combo in itertools.product(*grids):
            points.append({p.key: v for p, v in zip(self.params, combo)})
            if len(points) == self.maxTrials:
                break
        return points


def _number(v: float) -> int | float:
    return int(v) if float(v).is_integer() else float(v)


def parse(raw: Any, source: str) -> Hyperparameters:
    """The hyperparameters block from a YAML mapping (already loaded), or UserError."""
    if not isinstance(raw, dict):
        raise UserError(f"{source}: hyperparameters must be a mapping (goal: ..., params: [...]), "
                        f"got a {type(raw).__name__}")
    return schema.build(Hyperparameters, raw, source)
