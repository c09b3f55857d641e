"""What a run log's rows become in MLflow: params from a launch's spec, metrics from a metrics
row and from the summary, under names MLflow takes (:class:`launcher.storage.tracking.Tracking`
logs them)."""

from __future__ import annotations

import json
import re
from typing import Any

from launcher.measures import pick_metrics
from launcher.summary import TIME_PHASES

# The report's numbers worth a chart beside the metrics (the rest of its bookkeeping is not).
REPORT_NUMBERS = ("epoch", "samples_per_s", "world_size", "data_wait_fraction", "peak_rss_mb_max", "peak_gpu_mb_max")
SUMMARY_NUMBERS = ("samples_per_s", "wall_s", "steps_lost", "time_lost_s", "restarts", "preemptions",
                   "preemption_notices", "epochs_completed", "steps_completed")


def params_of(spec: dict[str, Any]) -> dict[str, str]:
    """A launch's spec as MLflow params: every field that is set, and the workload's parameters
    under their own names (``param.<name>`` where one is also a field's)."""
    out = {k: _text(v) for k, v in spec.items() if v is not None and k not in ("params", "mlflow")}
    for k, v in (spec.get("params") or {}).items():
        out["param." + k if k in out else k] = _text(v)
    return {metric_key(k): v for k, v in out.items()}


def report_metrics(m: dict[str, Any]) -> dict[str, float]:
    """A metrics row's numbers for MLflow: the metrics, the rate and sizes, the time shares."""
    out: dict[str, float] = dict(pick_metrics(m))
    for key in REPORT_NUMBERS:
        if number(m.get(key)):
            out[key] = float(m[key])
    for phase in TIME_PHASES:
        if number(m.get(f"time_{phase}")):
            out[f"time/{phase}"] = float(m[f"time_{phase}"])
    return {metric_key(k): float(v) for k, v in out.items()}


def summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    return {f"summary/{k}": float(summary[k]) for k in SUMMARY_NUMBERS if number(summary.get(k))}


def number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return text[:6000]  # MLflow's longest param value


def metric_key(k: str) -> str:
    """A name MLflow takes: letters, digits, and _ - . space / (anything else becomes _)."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", str(k))[:250]
