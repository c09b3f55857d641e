"""MLflow tracking (``--mlflow``): one MLflow run per launcher run, fed by its run log.

The run log (:mod:`launcher.storage.runlog`) is the record; this is a reader of
what it writes, as TensorBoard is. When a run is tracked, :class:`Tracking`:

* at the launch's start (before any worker), finds the run's MLflow run or
  creates it: the id is kept in ``<run>/mlflow.jsonl`` (and the run folder's
  URI as the tag ``launcher.run_dir``, so a launch that died between creating
  the MLflow run and writing that line finds it too). Every later launch, and
  every restart or preemption inside a launch, goes on in the same MLflow run;
* logs the spec as params (a value changed by a later launch, which MLflow
  refuses to overwrite, becomes the tag ``changed.<key>``), every metrics row
  as metrics at its global step, each rank's usage samples, and at the end the
  summary (metrics, tags, ``launcher/summary-launch<N>.json``), the exported
  model as the artifact ``model/``, and the status;
* makes a run whose storage folder is itself a tracked run's folder (a tuning
  trial, in its tuning run's folder) a child of that run.

A folder given to ``--mlflow`` holds an SQLite store (``mlflow.db``, artifacts
in ``artifacts/``), MLflow's default since its file store went into
maintenance; a folder that already holds a file store stays one. Writes after
the start go through a thread of their own: a tracking server that stalls never
holds up training, the driver's event pump or the run's lock; what it refuses
is said once, and the run log still has it all.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from launcher import _deferred
from launcher.errors import Unreachable, UserError
from launcher.storage.runlog import read_jsonl
from launcher.storage.store import Storage
from launcher.storage.tracking_values import metric_key, number, params_of, report_metrics, summary_metrics
from launcher.summary import USAGE_FIELDS, RunStatus

RECORD_FILE = "mlflow.jsonl"
RUN_DIR_TAG = "launcher.run_dir"
DEFAULT_EXPERIMENT = "launcher"  # MLFLOW_EXPERIMENT_NAME chooses another
CLOSE_S = 60.0  # how long the end of a launch waits for MLflow to take what is queued
BATCH = 1000  # MLflow's most metrics in one log_batch
# A tracking server that does not answer is given up on in seconds, not MLflow's minutes of retries
# (the user's own settings win).
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
MLFLOW_STATUS = {RunStatus.SUCCEEDED: "FINISHED", RunStatus.FAILED: "FAILED"}  # the rest: KILLED


def store_uri(uri: str) -> tuple[str, str | None]:
    """(the URI MLflow is given, where a new experiment keeps its artifacts: None for the store's
    default) for a normalised ``--mlflow`` (:func:`launcher.storage.uri.normalize_tracking`)."""
    if uri.startswith("file://"):
        folder = uri[len("file://"):]
        legacy = os.path.isfile(os.path.join(folder, "0", "meta.yaml")) and \
            not os.path.exists(os.path.join(folder, "mlflow.db"))
        if legacy:  # an existing file store: MLflow refuses it unless asked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            return uri, None
        return "sqlite:///" + os.path.join(folder, "mlflow.db"), os.path.join(folder, "artifacts")
    if uri.startswith("sqlite:///"):
        return uri, os.path.join(os.path.dirname(uri[len("sqlite:///"):]) or ".", "artifacts")
    return uri, None


def check_store_reach(uri: str | None, address: str | None, where: str, alternative: str = "") -> None:
    """A local MLflow store (a folder, ``sqlite:``) whose writers run on another machine, a cluster
    at ``address`` (a loopback or no address is this machine), would be written there, where nobody
    looks: refused, in one line. ``where``: who writes it, and where; ``alternative``: a fix besides
    a tracking server."""
    host = urlsplit(address if address and "://" in address else f"ray://{address or ''}").hostname
    if uri and uri.startswith(("file:", "sqlite:")) and host not in (None, "127.0.0.1", "localhost", "::1"):
        raise UserError(f"--mlflow {uri} is a store on this machine, but {where} ({host}) and would write it "
                        "there", "give a tracking server the cluster can reach (--mlflow http://HOST:5000)"
                        + (f", {alternative}" if alternative else ""))


def unanswered(exc: BaseException) -> tuple[str, str]:
    """(what happened, what to check) for a tracking server's failure, from the exception's words:
    the library's own text is not for the user."""
    text = str(exc)
    check = "check that it is up and the address is right (mlflow server --host, --port), or leave --mlflow out"
    if re.search(r"\b(401|403)\b|Unauthorized|Forbidden|PERMISSION_DENIED|UNAUTHENTICATED", text):
        return ("refused the credentials", "set MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD, to what the server accepts")
    if re.search(r"\b404\b|ENDPOINT_NOT_FOUND|Not Found", text):
        return "answered, but not as an MLflow tracking server (404)", "give the server's own address and port"
    if re.search(r"Name or service not known|nodename nor servname|Failed to resolve|getaddrinfo", text):
        return "did not answer: its host name does not resolve", check
    if re.search(r"timed out|Timeout", text, re.IGNORECASE):
        return "did not answer in time", check
    if re.search(r"Connection refused|NewConnectionError|Max retries exceeded", text):
        return "did not answer (connection refused)", check
    return f"did not take the request ({_first_line(exc)})", check


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def _quiet() -> None:
    """MLflow's first open of an SQLite store logs its schema migrations, and SQLAlchemy warns from
    MLflow's code: neither is for the user. Set once, for the process (the driver's threads share
    logging and warnings, so a setting put back afterwards could undo another thread's)."""
    for name in ("alembic", "mlflow.store.db.utils", "mlflow.store.db"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"mlflow(\.|$)")


class Tracking:
    """One launcher run's MLflow run, as one launch sees it.

    Args:
        uri: the normalised ``--mlflow``.
        storage, name: the run's folder (``<storage>/<name>/``).
        note: says something to the user (the driver's progress notes).
    """

    def __init__(self, uri: str, storage: Storage, name: str, note: Callable[[str], None] = print) -> None:
        self.uri, self.storage, self.name, self.note = uri, storage, name, note
        self.store, self.artifact_root = store_uri(uri)
        self.client = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.parent: str | None = None
        self.resumed = False
        self.failed = False
        self._usage_steps: dict[int, int] = {}
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._connecting: threading.Thread | None = None
        self._connect_error: BaseException | None = None

    # -- the start: synchronous, before any worker ---------------------------------------------
    def connect(self) -> None:
        """Open the store (a server that answers, a database that opens) and find the experiment,
        before any worker starts (:meth:`connect_soon` does it while Ray starts).

        Raises:
            Unreachable: a tracking server that does not answer.
            UserError: a store that cannot be opened (a database file in a folder that cannot be written).
        """
        if self._connecting is not None:
            self._connecting.join()
            self._connecting = None
            if self._connect_error is not None:
                raise self._connect_error
        self._connect_now()

    def _connect_now(self) -> None:
        if self.client is None:
            _deferred.require("mlflow", "--mlflow")
            with self._said():
                from mlflow.tracking import MlflowClient

                for key, value in HTTP_DEFAULTS.items():
                    os.environ.setdefault(key, value)
                client = MlflowClient(self.store)
                self.parent, parent_experiment = self._parent()
                self.experiment_id = parent_experiment or self._experiment(client)
                self.client = client

    def connect_soon(self) -> None:
        """:meth:`connect` in a thread, while Ray starts (importing MLflow and opening its store take
        1 to 3 s); the next :meth:`connect` or :meth:`start` waits for it and raises what it raised."""
        def connect() -> None:
            try:
                self._connect_now()
            except BaseException as exc:  # noqa: BLE001 - raised again by the caller's connect()
                self._connect_error = exc

        self._connecting = threading.Thread(target=connect, name="launcher-mlflow-connect", daemon=True)
        self._connecting.start()

    def start(self, launch: int | None, params: dict[str, str], tags: dict[str, str]) -> None:
        """Find or create the MLflow run, log the launch's params and tags, mark it running; raises
        as :meth:`connect` does."""
        self.connect()
        with self._said():
            self._open(launch, params, tags)
        self._thread = threading.Thread(target=self._send, name="launcher-mlflow", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def _said(self) -> Iterator[None]:
        """MLflow's, the database's and the network's errors as one line for the user."""
        _quiet()
        try:
            yield
        except (Unreachable, UserError):
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the store raised, said in our words
            if self.store.startswith(("http://", "https://")):
                what, fix = unanswered(exc)
                raise Unreachable(f"the MLflow tracking server at {self.store} {what}", fix) from None
            raise UserError(f"--mlflow {self.uri}: MLflow cannot open the store ({_first_line(exc)})",
                            "give a folder or database this machine can write, or a tracking server's "
                            "http:// address") from None

    def _open(self, launch: int | None, params: dict[str, str], tags: dict[str, str]) -> None:
        client = self.client
        run = self._existing()
        if run is None:
            tags = {**tags, RUN_DIR_TAG: self.storage.uri_of(self.name)}
            if self.parent:
                tags["mlflow.parentRunId"] = self.parent
            run = client.create_run(self.experiment_id, run_name=self.name, tags=tags)
            self.run_id = run.info.run_id
            self._remember(launch)
        else:
            self.resumed = True
            self.run_id = run.info.run_id
            client.update_run(self.run_id, status="RUNNING")
            for key, value in tags.items():
                client.set_tag(self.run_id, key, value)
        self._log_params(run.data.params, params, launch)

    def _experiment(self, client) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        found = client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        return client.create_experiment(name, artifact_location=self.artifact_root)

    def _records(self, *parts: str) -> list[dict[str, Any]]:
        return [r for r in read_jsonl(self.storage.read_text(*parts)) if r.get("tracking_uri") == self.store]

    def _parent(self) -> tuple[str | None, str | None]:
        """The run (and its experiment) whose folder holds this run's folder: a tuning run's, for a trial."""
        records = self._records(RECORD_FILE)  # <storage>/mlflow.jsonl: the storage is a tracked run's folder
        if not records:
            return None, None
        return records[-1]["run_id"], records[-1].get("experiment_id")

    def _existing(self):
        """This run's MLflow run: by the id kept in the run folder, else by its folder's tag."""
        for record in reversed(self._records(self.name, RECORD_FILE)):
            with contextlib.suppress(Exception):  # deleted from MLflow, or another store's id
                run = self.client.get_run(record["run_id"])
                if run.info.lifecycle_stage != "deleted":
                    return run
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{RUN_DIR_TAG}` = '{self.storage.uri_of(self.name)}'",
            max_results=1, order_by=["attributes.start_time DESC"])
        if runs:
            self._remember(None, runs[0].info.run_id)
        return runs[0] if runs else None

    def _remember(self, launch: int | None, run_id: str | None = None) -> None:
        self.storage.append_text(json.dumps({
            "tracking_uri": self.store, "experiment_id": self.experiment_id, "run_id": run_id or self.run_id,
            "parent_run_id": self.parent, "launch": launch, "time": time.time()}, sort_keys=True) + "\n",
            self.name, RECORD_FILE)

    def _log_params(self, logged: dict[str, str], params: dict[str, str], launch: int | None) -> None:
        from mlflow.entities import Param, RunTag

        new = [Param(k, v) for k, v in params.items() if k not in logged]
        changed = [RunTag(f"changed.{k}", f"{v} (launch {launch or '?'})") for k, v in params.items()
                   if k in logged and logged[k] != v]
        items = [*new, *changed]
        for i in range(0, len(items), 100):  # MLflow's most params in one batch
            chunk = items[i:i + 100]
            self.client.log_batch(self.run_id, params=[p for p in chunk if isinstance(p, Param)],
                                  tags=[t for t in chunk if isinstance(t, RunTag)])

    # -- what the run log records -------------------------------------------------------------------
    def begin(self, launch: int, spec: dict[str, Any]) -> None:
        """A launch begins (see :meth:`start`): the spec as params, what runs as tags."""
        tags = {f"launcher.{k}": str(spec[k]) for k in ("workload", "framework", "backend") if spec.get(k)}
        self.start(launch, params_of(spec), {**tags, "launcher.launch": str(launch)})

    def record(self, m: dict[str, Any]) -> None:
        """A metrics row (an epoch's, a checkpoint's, a program's hypertune report) at its global step."""
        step = m.get("global_step")
        self.metrics(report_metrics(m), int(step) if number(step) else 0,
                     m.get("time") if number(m.get("time")) else None)

    def summary(self, summary: dict[str, Any], launch: int) -> None:
        """The launch's end: its summary's figures, file and status, and the exported model."""
        self.metrics(summary_metrics(summary), int(summary.get("steps_completed") or 0))
        self.tags({k: v for k, v in (("launcher.status", summary.get("status")),
                                     ("launcher.checkpoint", summary.get("checkpoint")),
                                     ("launcher.model", summary.get("model"))) if v})
        self.text(json.dumps(summary, indent=1, sort_keys=True, default=str),
                  f"launcher/summary-launch{launch}.json")
        if summary.get("model"):
            self.artifacts("model", "model")
        self.end(RunStatus.parse(summary.get("status")))

    # -- during the launch: queued, sent by a thread ----------------------------------------------
    def metrics(self, values: dict[str, float], step: int, when: float | None = None) -> None:
        if values:
            stamp = int(1000 * (when or time.time()))
            self._put(lambda: self._batch([(k, v, stamp, step) for k, v in values.items()]))

    def usage(self, by_rank: dict[int, list[list[float]]]) -> None:
        """Each rank's usage samples as ``usage/<figure>/rank<N>``, stepped per sample, at its time."""
        rows = []
        for rank, samples in sorted(by_rank.items()):
            for sample in samples:
                values = dict(zip(USAGE_FIELDS, sample))
                step = self._usage_steps[rank] = self._usage_steps.get(rank, -1) + 1
                rows += [(f"usage/{k}/rank{rank}", float(values[k]), int(1000 * values["time"]), step)
                         for k in USAGE_FIELDS[1:] if not (k.startswith("gpu") and not values[k])]
        if rows:
            self._put(lambda: self._batch(rows))

    def tags(self, tags: dict[str, str]) -> None:
        if tags:
            self._put(lambda: self.client.log_batch(self.run_id, tags=_tags(tags)))

    def text(self, text: str, path: str) -> None:
        self._put(lambda: self.client.log_text(self.run_id, text, path))

    def artifacts(self, part: str, path: str | None = None) -> None:
        """Log the run folder's ``part``, a file or a folder (the exported model), as artifacts under
        ``path``; from gs:// it is copied to a temporary folder first."""
        def send() -> None:
            import pyarrow.fs

            info = self.storage.fs.get_file_info(self.storage.path(self.name, part))
            if info.type == pyarrow.fs.FileType.NotFound:
                return
            if self.storage.is_local:
                local = self.storage.path(self.name, part)
                self._log_local(local, path, info.type == pyarrow.fs.FileType.Directory)
                return
            with tempfile.TemporaryDirectory(prefix="launcher-mlflow-") as folder:
                local = os.path.join(folder, os.path.basename(part))
                if info.type == pyarrow.fs.FileType.Directory:
                    os.makedirs(local)
                    self.storage.download_dir(local, self.name, part)
                else:
                    pyarrow.fs.copy_files(info.path, local, source_filesystem=self.storage.fs)
                self._log_local(local, path, info.type == pyarrow.fs.FileType.Directory)
        self._put(send)

    def _log_local(self, local: str, path: str | None, folder: bool) -> None:
        if folder:
            self.client.log_artifacts(self.run_id, local, path)
        else:
            self.client.log_artifact(self.run_id, local, path)

    def end(self, status: RunStatus) -> bool:
        """Mark the run ended and wait (up to :data:`CLOSE_S`) for MLflow to take everything queued;
        False when some of it was not taken (said once)."""
        self._put(lambda: self.client.set_terminated(self.run_id, MLFLOW_STATUS.get(status, "KILLED")))
        self._queue.put(None)
        if self._thread is None:
            return True
        self._thread.join(CLOSE_S)
        if self._thread.is_alive():
            self.note(f"MLflow at {self.store} took more than {CLOSE_S:.0f}s to take this launch's last "
                      f"{self._queue.qsize()} record(s); they are left unsent (the run log has them)")
            return False
        return not self.failed

    def label(self) -> str:
        """Where to look: the run's page on a tracking server, else its id, store and how to see it."""
        if self.store.startswith(("http://", "https://")):
            return f"{self.store.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"run {self.run_id} in {self.store} (mlflow ui --backend-store-uri {self.store})"

    def _put(self, call: Callable[[], None]) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(call)

    def _batch(self, rows: list[tuple[str, float, int, int]]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(metric_key(k), v, stamp, step) for k, v, stamp, step in rows]
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + BATCH])

    def _send(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - a record MLflow refused: the run log keeps it
                if not self.failed:
                    self.failed = True
                    why = (f"the server {unanswered(exc)[0]}" if self.store.startswith(("http://", "https://"))
                           else _first_line(exc))
                    self.note(f"MLflow at {self.store} did not take a record ({why}); training goes on, and "
                              "the run log keeps every record")


def _tags(tags: dict[str, str]):
    from mlflow.entities import RunTag

    return [RunTag(k, str(v)[:8000]) for k, v in tags.items()]

