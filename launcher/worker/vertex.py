"""The environment a trainer package expects, as Vertex AI and AI Platform set it.

Pure functions (no Ray), used by the script worker for each rank:

* the output folders (``AIP_MODEL_DIR``, ``AIP_CHECKPOINT_DIR``,
  ``AIP_TENSORBOARD_LOG_DIR``) under the run's folder;
* ``CLUSTER_SPEC``: worker pool 0 is the primary replica (rank 0), pool 1 the
  others, with this rank's task and ``environment: cloud``;
* for TensorFlow, ``TF_CONFIG`` with a ``chief`` (rank 0) and ``worker`` tasks;
* the cloudml-hypertune metrics file, read back by :func:`read_metrics`.
"""

from __future__ import annotations

import json
import os
from typing import Any

METRIC_FILE_ENV = "CLOUD_ML_HP_METRIC_FILE"
TRIAL_ENV = "CLOUD_ML_TRIAL_ID"
HYPERTUNE_BOOKKEEPING = ("timestamp", "trial", "global_step", "checkpoint_path")


def output_dirs(run_uri: str) -> dict[str, str]:
    """Vertex AI's output folders under a run's folder (``gs://...`` or a local path), with
    the trailing slash Vertex gives them."""
    base = run_uri.rstrip("/")
    return {"AIP_MODEL_DIR": f"{base}/model/", "AIP_CHECKPOINT_DIR": f"{base}/checkpoints/",
            "AIP_TENSORBOARD_LOG_DIR": f"{base}/logs/"}


def pools(addresses: list[str]) -> dict[str, list[str]]:
    """Rank 0 in worker pool 0, the other ranks in pool 1 (left out when empty)."""
    out = {"workerpool0": addresses[:1]}
    if addresses[1:]:
        out["workerpool1"] = addresses[1:]
    return out


def cluster_spec(addresses: list[str], rank: int, job: dict[str, Any] | None = None) -> dict[str, Any]:
    """Vertex AI's CLUSTER_SPEC for ``rank`` among ``addresses`` (one host:port per rank)."""
    task = {"type": "workerpool0", "index": 0} if rank == 0 else {"type": "workerpool1", "index": rank - 1}
    spec: dict[str, Any] = {"cluster": pools(addresses), "environment": "cloud", "task": task}
    if job:
        spec["job"] = job
    return spec


def tf_config(addresses: list[str], rank: int, trial: str | None = None) -> dict[str, Any]:
    """TF_CONFIG as Vertex AI gives a TensorFlow trainer: a chief (rank 0) and workers."""
    cluster: dict[str, list[str]] = {"chief": addresses[:1]}
    if addresses[1:]:
        cluster["worker"] = addresses[1:]
    task: dict[str, Any] = {"type": "chief", "index": 0} if rank == 0 else {"type": "worker", "index": rank - 1}
    if trial:
        task["trial"] = trial
    return {"cluster": cluster, "task": task, "environment": "cloud"}


def tf_addresses(tf_config_text: str) -> list[str]:
    """Every rank's host:port from a TF_CONFIG in Ray's form (one ``worker`` list, in rank order)."""
    cluster = json.loads(tf_config_text).get("cluster", {})
    return list(cluster.get("chief", [])) + list(cluster.get("worker", []))


def read_metrics(path: str, after: float = 0.0) -> list[dict[str, Any]]:
    """The hypertune entries in ``path`` written after ``after`` (their timestamp), oldest first,
    as numbers: ``{"global_step": 100, "timestamp": ..., "accuracy": 0.93}``.

    The library rewrites the whole file on every report, so a line may be read half
    written: such a line is skipped and read again next time.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        parsed = {k: _number(v) for k, v in entry.items()}
        when = parsed.get("timestamp")
        if isinstance(when, (int, float)) and when > after:
            out.append(parsed)
    return sorted(out, key=lambda e: e["timestamp"])


def metric_values(entry: dict[str, Any]) -> dict[str, float]:
    """The reported metrics of one hypertune entry (its tags), without the bookkeeping."""
    return {k: v for k, v in entry.items() if k not in HYPERTUNE_BOOKKEEPING and isinstance(v, (int, float))}


def _number(value: Any) -> Any:
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    return value


def notice_file(folder: str, attempt: str, rank: int) -> str:
    return os.path.join(folder, f"launcher-preemption-{attempt[:12]}-{rank}.json")
