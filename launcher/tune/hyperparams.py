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

import difflib
import itertools
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from launcher.errors import UserError

DEFAULT_METRIC_TAG = "training/hptuning/metric"  # cloudml-hypertune's default tag
REVERSE = "~"  # prefix of a reverse-log parameter's key in the search space (it searches a mirror)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=False, frozen=True)


class Param(_Strict):
    parameterName: str = Field(min_length=1)
    type: Literal["DOUBLE", "INTEGER", "DISCRETE", "CATEGORICAL"]
    minValue: float | None = None
    maxValue: float | None = None
    discreteValues: list[float] | None = None
    categoricalValues: list[str] | None = None
    scaleType: Literal["UNIT_LINEAR_SCALE", "UNIT_LOG_SCALE", "UNIT_REVERSE_LOG_SCALE"] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "Param":
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
        return self

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


class Hyperparameters(_Strict):
    goal: Literal["MAXIMIZE", "MINIMIZE"]
    hyperparameterMetricTag: str | None = None
    maxTrials: int = Field(1, ge=1)
    maxParallelTrials: int = Field(1, ge=1)
    maxFailedTrials: int = Field(0, ge=0)
    enableTrialEarlyStopping: bool = False
    algorithm: Literal["ALGORITHM_UNSPECIFIED", "GRID_SEARCH", "RANDOM_SEARCH"] = "ALGORITHM_UNSPECIFIED"
    params: list[Param] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> "Hyperparameters":
        names = [p.parameterName for p in self.params]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"parameter {twice[0]} is listed twice")
        if self.algorithm == "GRID_SEARCH":
            doubles = [p.parameterName for p in self.params if p.type == "DOUBLE"]
            if doubles:
                raise ValueError(f"GRID_SEARCH cannot search DOUBLE parameter {doubles[0]} (a range has no grid); "
                                 "make it DISCRETE with discreteValues, or use RANDOM_SEARCH")
        return self

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
    try:
        return Hyperparameters.model_validate(raw)
    except ValidationError as exc:
        raise UserError(*_one_line(exc, raw, source)) from None


def _one_line(exc: ValidationError, raw: dict, source: str) -> tuple[str, str]:
    """pydantic's first error as (what is wrong, how to fix it)."""
    errors = exc.errors()
    # An unknown key first: a misspelt key also shows up as the right one "missing".
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = [str(p) for p in err["loc"]]
    where = _where(loc, raw)
    kind = err["type"]
    if kind == "extra_forbidden":
        model = Param if "params" in loc[:1] else Hyperparameters
        known = list(model.model_fields)
        close = difflib.get_close_matches(loc[-1], known, n=1)
        inside = _where(loc[:-1], raw)
        return (f"{source}: unknown key {loc[-1]!r}" + (f" in {inside}" if inside else ""),
                f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(known)}")
    if kind == "missing":
        return f"{source}: {where} is missing", "see the hyperparameters example in the README"
    if kind == "value_error":
        message = str(err.get("ctx", {}).get("error", err["msg"]))
        return f"{source}: {message}", "see the hyperparameters example in the README"
    got = err.get("input")
    expected = err["msg"][0].lower() + err["msg"][1:]
    return f"{source}: {where} = {got!r}: {expected}", "see the hyperparameters example in the README"


def _where(loc: list[str], raw: dict) -> str:
    """'params[1] (lr).minValue' style: the parameter's name helps more than its index."""
    out = []
    i = 0
    while i < len(loc):
        part = loc[i]
        if part == "params" and i + 1 < len(loc) and loc[i + 1].isdigit():
            index = int(loc[i + 1])
            params = raw.get("params") or []
            name = params[index].get("parameterName") if index < len(params) and isinstance(params[index],
                                                                                             dict) else None
            out.append(f"params[{index}]" + (f" ({name})" if name else ""))
            i += 2
            continue
        if part in ("function-after", "literal_error") or part.startswith("function-"):
            i += 1
            continue
        out.append(part)
        i += 1
    return ".".join(out)
