"""One tuning trial, inside Ray Tune's trial actor: a whole distributed run of its own.

:func:`run_trial` is Ray Tune's function trainable. It turns the values Tune
sampled into the trial's job (:meth:`~launcher.tune.study.Study.trial_spec`)
and runs it as any launch does: a run folder ``trial_<id>`` under the tuning
run's folder, checkpoints there, Ray Train's restarts after failures and
preemptions. Because the run's name is the trial's id, a trial that Ray Tune
starts again (its actor's node was lost, or the tuning run is launched again)
resumes from that run's last checkpoint instead of starting over.

The run's own driver (:func:`launcher.driver.launch.run` or
:func:`launcher.driver.script.run_script`) hands each epoch's metrics (or each
hypertune entry of a program) to :class:`Reporter`, which reports them to Tune
from the driver's pump thread; Tune's schedulers (ASHA) act on them.
"""

from __future__ import annotations

import queue
import re
import sys
import threading
from typing import Any

PREFIX = "trial_"
# Bookkeeping in a built-in run's epoch report that is not a metric.
NOT_METRICS = ("samples", "train_time_s", "global_step", "world_size", "time", "step_in_epoch", "notice", "held")


def trial_name(trial_id: str) -> str:
    """The trial's run name (a valid run name: letters, digits, underscores)."""
    return PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", trial_id)


class TrialFailed(RuntimeError):
    """The trial's run ended without succeeding; the message is its summary's error."""


class Reporter:
    """Hands a run's metrics to Ray Tune: an epoch's for a workload, a hypertune entry's for a program.

    ``tune.report`` blocks until Tune's trial actor takes the result, so a thread of its own
    makes the calls: the run's pump never waits on Tune. When Tune stops the trial (ASHA),
    its report raises SystemExit there; the trial's actor is ended by Tune right after.
    """

    def __init__(self, program: bool) -> None:
        self.program = program
        self.sent = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._deliver, name="launcher-tune-report", daemon=True)
        self._thread.start()

    def __call__(self, metrics: dict[str, Any]) -> None:
        if self.program:
            from launcher.worker.vertex import metric_values

            values = dict(metric_values(metrics))
            if metrics.get("global_step") is not None:
                values["global_step"] = int(metrics["global_step"])
        else:
            values = {k: float(v) for k, v in metrics.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_METRICS}
        self.sent += 1
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

    from launcher.summary import RunStatus

    trial_id = tune.get_context().get_trial_id()
    values = study.hp.values(config)
    spec = study.trial_spec(values, trial_name(trial_id))
    reporter = Reporter(program=study.program is not None)
    print(f"trial {trial_id}: {values}", flush=True)
    if study.program is not None:
        from launcher.driver.script import run_script

        code, summary = run_script(spec, study.program, study.trial_args(values), job_dir=study.job_dir,
                                   out=sys.stdout, progress_out=sys.stderr, trial_id=trial_id, on_metrics=reporter)
    else:
        from launcher.driver import launch

        summary = launch.run(spec, show_progress=False, on_epoch=reporter)
    if summary.status == RunStatus.SUCCEEDED and not reporter.sent and summary.metrics:
        # A run that was already complete trains nothing: its final metrics are the result.
        reporter({**summary.metrics, "epoch": summary.epochs_completed})
    reporter.close()
    if summary.status != RunStatus.SUCCEEDED:
        raise TrialFailed(f"{summary.status}: {summary.error or 'no error given'}")
