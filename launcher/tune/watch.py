"""What the tuning driver sees while Ray Tune runs: progress lines, and when to stop the search.

:class:`Watch` is a Ray Tune callback and stopper. Ray Tune pickles it with
the experiment's state and brings it back when a tuning run is restored, so
it holds nothing itself: it reports to this launch's :class:`Tally` (set by
:func:`start`), which prints a line as each trial starts and ends, tracks the
best value so far (earlier launches' trials included), and asks Ray Tune to
stop the whole search when a trial reports without the metric (bad input, said
in one line) or once ``maxFailedTrials`` trials have failed.
"""

from __future__ import annotations

import os
from typing import Any, TextIO

from ray.tune import Callback
from ray.tune.schedulers import ASHAScheduler, TrialScheduler
from ray.tune.stopper import Stopper

from launcher import faultpoint
from launcher.tune.results import best, earlier_stops, error_line
from launcher.tune.trial import PREFIX, trial_name

# What Ray Tune adds to every result: not the trials' metrics.
TUNE_KEYS = ("time_this_iter_s", "time_total_s", "timestamp", "training_iteration", "iterations_since_restore",
             "time_since_restore", "pid", "done", "epoch", "global_step")


class Tally:
    """This launch's view of the search."""

    def __init__(self, study, out: TextIO, lock, storage) -> None:
        self.study, self.out, self.lock, self.storage = study, out, lock, storage
        self.metric, self.mode = study.metric(), study.hp.mode
        self.trials: list = []
        self.failed = 0
        self.bad_metric: str | None = None
        self.why_stopped: str | None = None
        self.best: tuple[float, str] | None = None
        self.seen_metric: set[str] = set()
        self.started: set[str] = set()
        self.ended: set[str] = set()
        self.interrupted = False  # Ctrl-C or SIGTERM ended the search (set by launcher.tune.search)
        self.stopped: set[str] = set()  # trials ASHA stopped (this launch, and earlier ones from trials.json)

    def recall(self, table: list[dict[str, Any]]) -> None:
        """Take in what the last launch's rows (trials.json) recorded: the trials ASHA stopped
        (Ray Tune's saved state does not keep them), and the best value so far."""
        self.stopped |= {name.removeprefix(PREFIX) for name in earlier_stops(self.study, table)}
        top = best(self.study, table)
        if top is not None:
            self.best = (float(top[self.metric]), top["trial"])

    def ended_with(self, trial_id: str, value: Any) -> None:
        """A trial's final value: the best so far when it beats every earlier one (ties: the earlier)."""
        if not isinstance(value, (int, float)):
            return
        if self.best is None or (value > self.best[0] if self.mode == "max" else value < self.best[0]):
            self.best = (float(value), trial_name(trial_id))

    def note(self, text: str) -> None:
        print(f"[tune] {text}", file=self.out, flush=True)

    def counts(self, trials) -> str:
        """"3/8 done, 2 running; best ...": trials that ended before this launch count as done."""
        before = sum(1 for t in trials if t.status in ("TERMINATED", "ERROR") and t.trial_id not in self.started)
        done = before + len(self.ended)
        running = len(self.started - self.ended)
        best = f"; best {self.metric} {self.best[0]:.4g} ({self.best[1]})" if self.best else ""
        return f"{done}/{self.study.hp.maxTrials} done, {running} running{best}"


_TALLY: Tally | None = None


def start(study, out: TextIO, lock, storage) -> Tally:
    """A new tally for this launch; every Watch reports to it."""
    global _TALLY
    _TALLY = Tally(study, out, lock, storage)
    return _TALLY


class EarlyStopping(ASHAScheduler):
    """ASHA, noting which trials it stops: Ray Tune marks them terminated, as if they had
    ended, and a fast trial can even finish its run before its actor is stopped."""

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        action = super().on_trial_result(tune_controller, trial, result)
        # ASHA also says STOP to a trial that reached max_t: that one has ended.
        early = result.get(self._time_attr, 0) < self._max_t
        if action == TrialScheduler.STOP and early and _TALLY is not None:
            _TALLY.stopped.add(trial.trial_id)
        return action


class Watch(Callback, Stopper):
    """Ray Tune's hooks, forwarded to the current :class:`Tally`."""

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        pass

    # -- Stopper ------------------------------------------------------------------------
    def __call__(self, trial_id: str, result: dict) -> bool:
        return False

    def stop_all(self) -> bool:
        t = _TALLY
        if t is None:
            return False
        if t.lock is not None:
            t.lock.refresh()
        return t.bad_metric is not None or t.why_stopped is not None

    # -- Callback -----------------------------------------------------------------------
    def on_step_end(self, iteration, trials, **info) -> None:
        if os.environ.get(faultpoint.ENV) and any(trial.status == "PENDING" for trial in trials):
            faultpoint.pause("tune-trials")

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        t = _TALLY
        t.started.add(trial.trial_id)
        values = t.study.hp.values(trial.config)
        t.note(f"{trial_name(trial.trial_id)} started: {format_values(values)}")

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        t = _TALLY
        if t.metric not in result:
            if trial.trial_id not in t.seen_metric and t.bad_metric is None:
                reported = sorted(k for k, v in result.items() if k not in TUNE_KEYS
                                  and isinstance(v, (int, float)) and not isinstance(v, bool))
                t.bad_metric = (f"hyperparameterMetricTag {t.metric!r} is not among the metrics "
                                f"{trial_name(trial.trial_id)} reported: {', '.join(reported) or 'none'}")
                t.note(f"stopping: {t.bad_metric}")
            return
        t.seen_metric.add(trial.trial_id)

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        t = _TALLY
        t.ended.add(trial.trial_id)
        last = trial.last_result or {}
        how = "stopped early (ASHA)" if trial.trial_id in t.stopped else "finished"
        value = last.get(t.metric)
        t.ended_with(trial.trial_id, value)  # a trial's final value counts, as on AI Platform
        shown = f"{t.metric} {value:.4g}" if isinstance(value, (int, float)) else "no metric"
        t.note(f"{trial_name(trial.trial_id)} {how}: {shown}; {t.counts(trials)}")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        t = _TALLY
        t.ended.add(trial.trial_id)
        t.failed += 1
        t.note(f"{trial_name(trial.trial_id)} failed: {error_line(trial)}; {t.counts(trials)}")
        limit = t.study.hp.maxFailedTrials
        if limit and t.failed >= limit and t.why_stopped is None:
            t.why_stopped = f"maxFailedTrials reached: {t.failed} trial(s) failed"
            t.note(f"stopping: {t.why_stopped}")

    def on_experiment_end(self, trials, **info) -> None:
        _TALLY.trials = list(trials)


def format_values(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
