"""Vertex AI's HyperparameterTuningJob (``studySpec``, ``maxTrialCount``,
``parallelTrialCount``, ``trialJobSpec``): the blocks, and the study in AI Platform's
``hyperparameters`` form, so one set of rules checks both (:func:`_study`). The trial's
job is a Vertex CustomJobSpec, read by :mod:`launcher.jobfiles.vertex`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from launcher import schema
from launcher.errors import UserError
from launcher.jobfiles.common import NOTE_DEFAULT, REFUSE_KEYS, _key
from launcher.jobfiles.vertex import CustomJobSpec
from launcher.schema import option
from launcher.tune.hyperparams import Hyperparameters

@dataclass(frozen=True)
class MetricSpec:
    metricId: str = option(cli=False, help="the metric's tag (hypertune's hyperparameter_metric_tag)")
    goal: Literal["MAXIMIZE", "MINIMIZE"] = option(cli=False, help="MAXIMIZE or MINIMIZE")
    safetyConfig: dict | None = _key(help="refused: safety thresholds are not checked; remove safetyConfig")


@dataclass(frozen=True)
class RangeSpec:
    minValue: float = option(cli=False, help="the range's lower end")
    maxValue: float = option(cli=False, help="the range's upper end")
    defaultValue: float | None = _key(help=NOTE_DEFAULT)


@dataclass(frozen=True)
class ValuesSpec:
    values: tuple[float, ...] = option(cli=False, min_items=1, help="the values")
    defaultValue: float | None = _key(help=NOTE_DEFAULT)


@dataclass(frozen=True)
class CategoriesSpec:
    values: tuple[str, ...] = option(cli=False, min_items=1, help="the values")
    defaultValue: str | None = _key(help=NOTE_DEFAULT)


@dataclass(frozen=True)
class ParameterSpec:
    LABEL = "parameterId"

    parameterId: str = option(cli=False, help="the parameter's name (the program's --NAME)")
    doubleValueSpec: RangeSpec | None = _key(help="a real range")
    integerValueSpec: RangeSpec | None = _key(help="an integer range")
    discreteValueSpec: ValuesSpec | None = _key(help="numbers to pick from")
    categoricalValueSpec: CategoriesSpec | None = _key(help="strings to pick from")
    scaleType: Literal["SCALE_TYPE_UNSPECIFIED", "UNIT_LINEAR_SCALE", "UNIT_LOG_SCALE",
                       "UNIT_REVERSE_LOG_SCALE"] | None = _key(help="how a range is searched")
    conditionalParameterSpecs: tuple[dict, ...] | None = _key(help="refused: every parameter is searched in every trial; remove conditionalParameterSpecs")

    def check(self) -> None:
        given = [k for k in ("doubleValueSpec", "integerValueSpec", "discreteValueSpec", "categoricalValueSpec")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"parameter {self.parameterId}: give exactly one of doubleValueSpec, integerValueSpec, "
                             f"discreteValueSpec, categoricalValueSpec (got {', '.join(given) or 'none'})")


@dataclass(frozen=True)
class StudySpec:
    metrics: tuple[MetricSpec, ...] = option(cli=False, min_items=1, help="the metric the trials are ranked by")
    parameters: tuple[ParameterSpec, ...] = option(cli=False, min_items=1, help="the parameters searched")
    algorithm: Literal["ALGORITHM_UNSPECIFIED", "GRID_SEARCH", "RANDOM_SEARCH"] = _key(
        "ALGORITHM_UNSPECIFIED", help="how the values are chosen (unspecified: Bayesian, Optuna's TPE here)")
    measurementSelectionType: Literal["MEASUREMENT_SELECTION_TYPE_UNSPECIFIED", "LAST_MEASUREMENT",
                                      "BEST_MEASUREMENT"] | None = _key(help="noted: a trial counts with its last report")
    observationNoise: str | None = _key(help="noted: the search (Optuna's TPE) takes no noise setting")
    decayCurveStoppingSpec: dict | None = _key(help="early stopping: ASHA here")
    medianAutomatedStoppingSpec: dict | None = _key(help="early stopping: ASHA here")
    convexAutomatedStoppingSpec: dict | None = _key(help="early stopping: ASHA here")


@dataclass(frozen=True)
class TuningJob:
    studySpec: StudySpec = option(cli=False, help="what is searched")
    trialJobSpec: CustomJobSpec = option(cli=False, help="the job each trial runs")
    maxTrialCount: int = _key(1, ge=1, help="trials in all")
    parallelTrialCount: int = _key(1, ge=1, help="trials at once")
    maxFailedTrialCount: int = _key(0, ge=0, help="failed trials before the study stops")
    displayName: str | None = _key(help="the tuning run's name (made a valid one)")
    labels: dict | None = _key(help="noted: labels are shown in this line only")
    encryptionSpec: dict | None = _key(help=REFUSE_KEYS)


def _study(job: TuningJob, source: str) -> Hyperparameters:
    """A Vertex studySpec in AI Platform's form (checked by the same rules)."""
    study = job.studySpec
    if len(study.metrics) != 1:
        raise UserError(f"{source}: studySpec.metrics lists {len(study.metrics)} metrics: one is searched here",
                        "keep the metric the trials are ranked by")
    params = []
    for p in study.parameters:
        out: dict[str, Any] = {"parameterName": p.parameterId}
        if p.doubleValueSpec is not None:
            out.update(type="DOUBLE", minValue=p.doubleValueSpec.minValue, maxValue=p.doubleValueSpec.maxValue)
        elif p.integerValueSpec is not None:
            out.update(type="INTEGER", minValue=p.integerValueSpec.minValue, maxValue=p.integerValueSpec.maxValue)
        elif p.discreteValueSpec is not None:
            out.update(type="DISCRETE", discreteValues=list(p.discreteValueSpec.values))
        else:
            out.update(type="CATEGORICAL", categoricalValues=list(p.categoricalValueSpec.values))
        if p.scaleType and p.scaleType != "SCALE_TYPE_UNSPECIFIED":
            out["scaleType"] = p.scaleType
        params.append(out)
    stopping = any(getattr(study, k) is not None for k in
                   ("decayCurveStoppingSpec", "medianAutomatedStoppingSpec", "convexAutomatedStoppingSpec"))
    block = {"goal": study.metrics[0].goal, "hyperparameterMetricTag": study.metrics[0].metricId,
             "maxTrials": job.maxTrialCount, "maxParallelTrials": job.parallelTrialCount,
             "maxFailedTrials": job.maxFailedTrialCount, "enableTrialEarlyStopping": stopping,
             "algorithm": study.algorithm, "params": params}
    return schema.build(Hyperparameters, block, f"{source}: studySpec")
