"""One tuning trial, inside Ray Tune's trial actor: a whole distributed run of its own.

:func:`run_trial` is Ray Tune's function trainable. It turns the values Tune
sampled into the trial's job (:meth:`~launcher.tune.study.Study.trial_spec`)
and runs it as any launch does: a run folder ``trial_<id>`` under the tuning
run's folder, checkpoints there, Ray Train's restarts after failures and
preemptions. Because the run's name is the trial's id, a trial that Ray Tune
starts again (its actor's node was lost, or the tuning run is launched again)
resumes from that run's last checkpoint instead of starting over.

The run's own driver (:func:`launcher.driver.launch.run`, for a workload or a program) hands each epoch's metrics (or each
hypertune entry of a program) to :class:`Reporter`, which reports them to Tune
from the driver's pump thread; Tune's schedulers (ASHA) act on them.

When Tune stops a trial (ASHA, or the search is interrupted), :func:`trainable`'s
``cleanup`` aborts the trial's run before Tune ends the trial's process: Ray Train's
controller stops the workers and gives their placement group back. Without that, the
killed trial's placement group stayed reserved, and later trials waited for CPUs forever.
"""

from __future__ import annotations

import queue
import re
import sys
import threading
from typing import Any

from launcher.driver.script import ProgramRun
from launcher.driver.trainer import stop_running
from launcher.summary import RunStatus
from launcher.worker.vertex import metric_values

PREFIX = "trial_"
# Bookkeeping in a built-in run's epoch report that is not a metric.
NOT_METRICS = ("samples", "train_time_s", "global_step", "world_size", "time", "step_in_epoch", "notice", "held")


def trial_name(trial_id: str) -> str:
    """The trial's run name (a valid run name: letters, digits, underscores)."""
    return PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", trial_id)


class TrialFailed(RuntimeError):
    """The trial's run ended without succeeding; the message is its summary's error."""


FINISH_S = 120.0  # how long a trial Tune stops at its last epoch gets to end its run (export, summary)


class _Progress:
    """How far this process's trial got (a trial actor runs one trial): whether its run
    reported its last epoch, and whether the run returned (its summary written). Not
    whether ``run_trial`` returned: that waits for its last report, which Tune answers
    only after ``cleanup``."""

    def __init__(self) -> None:
        self.final = threading.Event()
        self.ran = threading.Event()


_PROGRESS = _Progress()


class Reporter:
    """Hands a run's metrics to Ray Tune: an epoch's for a workload, a hypertune entry's for a program.

    ``tune.report`` blocks until Tune's trial actor takes the result, so a thread of its own
    makes the calls: the run's pump never waits on Tune. When Tune stops the trial (ASHA),
    its report raises SystemExit there; the trial's actor is ended by Tune right after.
    """

    def __init__(self, program: bool, last_epoch: int | None = None) -> None:
        self.program = program
        self.last_epoch = last_epoch  # a workload's: its report for this epoch is its last
        self.sent = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._deliver, name="launcher-tune-report", daemon=True)
        self._thread.start()

    def __call__(self, metrics: dict[str, Any]) -> None:
        if self.program:
            values = dict(metric_values(metrics))
            if metrics.get("global_step") is not None:
                values["global_step"] = int(metrics["global_step"])
        else:
            values = {k: float(v) for k, v in metrics.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_METRICS}
        self.sent += 1
        if self.last_epoch is not None and values.get("epoch", 0) >= self.last_epoch:
            _PROGRESS.final.set()
        self._queue.put(values)

    def _deliver(self) -> None:
        from ray import tune

        while True:
            values = self._queue.get()
            if values is None:
                return
            try:
                tune.report(values)
            except SystemExit:  # Tune is stopping this trial
                return
            except Exception as exc:  # noqa: BLE001 - a lost report must not end the run
                print(f"launcher: could not report to Ray Tune: {type(exc).__name__}: {exc}", file=sys.stderr)

    def close(self, timeout_s: float = 60.0) -> None:
        """Wait until every report is delivered (the trial's last result must reach Tune)."""
        self._queue.put(None)
        self._thread.join(timeout_s)


def run_trial(config: dict[str, Any], study) -> None:
    """Ray Tune's trainable: run one trial to its end; raise TrialFailed unless it succeeded."""
    from ray import tune

    global _PROGRESS
    _PROGRESS = progress = _Progress()
    trial_id = tune.get_context().get_trial_id()
    values = study.hp.values(config)
    spec = study.trial_spec(values, trial_name(trial_id))
    reporter = Reporter(program=study.program is not None,
                        last_epoch=None if study.program is not None else spec.epochs)
    print(f"trial {trial_id}: {values}", flush=True)
    try:
        from launcher.driver import launch

        if study.program is not None:
            job = ProgramRun(study.program, tuple(study.trial_args(values)), job_dir=study.job_dir, trial_id=trial_id)
            summary = launch.run(spec, job, out=sys.stdout, progress_out=sys.stderr, on_report=reporter)
        else:
            summary = launch.run(spec, show_progress=False, on_report=reporter)
    finally:
        progress.ran.set()
    if summary.status == RunStatus.SUCCEEDED and not reporter.sent and summary.metrics:
        # A run that was already complete trains nothing: its final metrics are the result.
        reporter({**summary.metrics, "epoch": summary.epochs_completed})
    reporter.close()
    if summary.status != RunStatus.SUCCEEDED:
        raise TrialFailed(f"{summary.status}: {summary.error or 'no error given'}")


def trainable(study):
    """Ray Tune's trainable for ``study``: :func:`run_trial`, whose run is aborted when Tune stops it."""
    from ray import tune
    from ray.tune.trainable import wrap_function

    base = wrap_function(tune.with_parameters(run_trial, study=study))

    class Trial(base):  # type: ignore[misc, valid-type]
        def cleanup(self) -> None:
            on_stop()
            super().cleanup()

    Trial.__name__ = Trial.__qualname__ = base.__name__
    return Trial


def on_stop() -> None:
    """Tune is stopping this process's trial: unless its run is at its end already (Tune
    stops a trial after its last result too, ASHA at max_t), abort the run, so that its
    workers and their placement group are gone before Tune ends the trial's process."""
    progress = _PROGRESS
    if progress.final.is_set() and progress.ran.wait(FINISH_S):
        return

    if stop_running("stopped by Ray Tune (early stopping, or the search was interrupted)"):
        progress.ran.wait(FINISH_S)  # its summary says so (cancelled) before the process ends
