"""Where a rank's training time goes: the step-time breakdown every session keeps.

Each rank adds up, per epoch, the seconds of its training time spent in each phase:

* ``data``       waiting for the next batch (the loader's ``next``);
* ``sync``       waiting for the gradients of the other ranks: from the moment this rank's
                 last gradient was computed (a post-accumulate-grad hook on the parameters;
                 after the first updates only on those whose gradient came last)
                 to the start of the optimizer's update (its step pre-hook; for Horovod, the
                 end of ``synchronize``). Only where the backend lets it be told apart (torch
                 with DDP or Horovod); elsewhere it is part of compute;
* ``optimizer``  the optimizer's update itself;
* ``checkpoint`` the step checkpoints and those a preemption notice asked for;
* ``notice``     asking Ray Train for preemption notices and resize requests (a barrier:
                 it holds the time a rank waits there for the others);
* ``compute``    the rest of the step: forward, backward and the loop's own code.

Nothing here reads the device: on a GPU these are the host's times, so work the host queued
shows where the host first waits for it (usually the synchronisation or a metric's read).

At an epoch's end the ranks' figures are gathered (with the epoch's other figures, one
all-reduce) and :func:`breakdown` makes the report's fields: the share of the epoch's training
time per phase (mean over the ranks), each rank's busy time (data + compute + optimizer: what
the rank did itself, not waiting for the others), and the straggler, a rank whose busy time is
more than :data:`STRAGGLER_FACTOR` times the ranks' median.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from launcher.settings import STEP_HOOKS
from launcher.summary import TIME_PHASES

PHASES = TIME_PHASES
MEASURED = ("sync", "optimizer", "checkpoint", "notice")  # data is the loader's; compute the rest
STRAGGLER_FACTOR = 1.2
LEARN_UPDATES = 3  # updates watched on every parameter before the hooks stay on the last ones only
WORDS = {"data": "waiting for data", "compute": "computing", "sync": "synchronising gradients",
         "optimizer": "in the optimizer step", "checkpoint": "checkpointing",
         "notice": "checking for preemption notices"}
SHARE_KEYS = tuple(f"time_{p}" for p in PHASES)  # a report's share of training time per phase


class StepClock:
    """One rank's seconds per measured phase (:data:`MEASURED`) in the epoch under way, and the
    hooks that measure gradient synchronisation and the optimizer's update."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(MEASURED, 0.0)
        self._ready: float | None = None    # this rank's last gradient was computed
        self._update: float | None = None   # the optimizer's update began
        self._handles: list[Any] = []
        self.hooks = STEP_HOOKS.get() != "0"
        self._grad_hooks: dict[int, Any] = {}  # id of a parameter -> its hook's handle
        self._last_param: int | None = None   # the parameter whose gradient came last
        self._lasts: set[int] = set()
        self._learning = LEARN_UPDATES

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def reset(self, carried: dict[str, float] | None = None) -> None:
        self.seconds = {p: float((carried or {}).get(p, 0.0)) for p in MEASURED}
        self._ready = self._update = None

    def state(self) -> dict[str, float]:
        return dict(self.seconds)

    # -- hooks -------------------------------------------------------------------------------
    def watch_gradients(self, module) -> None:
        """Note when each of ``module``'s gradients is computed (the last one marks the end of
        this rank's backward pass; DDP waits for the other ranks after it)."""
        if not self.hooks:
            return
        for p in module.parameters():
            if p.requires_grad and id(p) not in self._grad_hooks:
                self._grad_hooks[id(p)] = p.register_post_accumulate_grad_hook(self._grad_done)
        self._learning = LEARN_UPDATES

    def watch_optimizer(self, optimizer) -> None:
        """Time ``optimizer``'s update; with Horovod's optimizer, whose ``step`` synchronises
        first, the update starts when ``synchronize`` returns (both hooks run twice there: around
        Horovod's step and around the update inside it)."""
        if not self.hooks:
            return
        self._handles.append(optimizer.register_step_pre_hook(self._update_begins))
        self._handles.append(optimizer.register_step_post_hook(self._update_done))
        synchronize = getattr(optimizer, "synchronize", None)
        if callable(synchronize) and hasattr(optimizer, "_allreduce_grad_async"):  # Horovod's
            def timed_synchronize(*args, **kwargs):
                out = synchronize(*args, **kwargs)
                self._update = time.perf_counter()
                return out

            optimizer.synchronize = timed_synchronize

    def _grad_done(self, param) -> None:
        self._ready = time.perf_counter()
        if self._learning:
            self._last_param = id(param)

    def _update_begins(self, *_args) -> None:
        self._update = time.perf_counter()

    def _update_done(self, *_args) -> None:
        if self._update is None:  # the outer hook of a Horovod step: already counted
            return
        now = time.perf_counter()
        if self._ready is not None and self._ready < self._update:
            self.seconds["sync"] += self._update - self._ready
        self.seconds["optimizer"] += now - self._update
        self._ready = self._update = None
        if self._learning and self._last_param is not None:
            self._lasts.add(self._last_param)
            self._learning -= 1
            if not self._learning:  # a hook per parameter costs a call each: keep those that came last
                for key in [k for k in self._grad_hooks if k not in self._lasts]:
                    self._grad_hooks.pop(key).remove()

    def step_done(self) -> None:
        """A step ended: a gradient computed without an update (accumulation, a skipped fp16
        step) keeps its mark only until the next step's backward replaces it."""
        self._update = None

    def close(self) -> None:
        for handle in [*self._handles, *self._grad_hooks.values()]:
            handle.remove()
        self._handles, self._grad_hooks = [], {}
        self._lasts, self._last_param = set(), None


def own_row(data_s: float, clock: StepClock, seconds: float) -> list[float]:
    """This rank's figures for the epoch's gather: seconds per phase (in :data:`PHASES` order;
    compute is what the others leave of ``seconds``), then ``seconds``."""
    measured = [clock.seconds[p] for p in MEASURED]
    compute = max(0.0, seconds - data_s - sum(measured))
    return [data_s, compute, *measured, seconds]


def breakdown(rows: np.ndarray) -> dict[str, Any]:
    """The report's fields from every rank's :func:`own_row` (an array, one column per rank)."""
    phases, seconds = rows[:len(PHASES)], rows[len(PHASES)]
    if not len(seconds) or np.any(seconds <= 0):
        return {}
    shares = phases / seconds
    out: dict[str, Any] = {k: round(float(np.mean(shares[i])), 4) for i, k in enumerate(SHARE_KEYS)}
    busy = phases[PHASES.index("data")] + phases[PHASES.index("compute")] + phases[PHASES.index("optimizer")]
    out["busy_s_ranks"] = [round(float(b), 3) for b in busy]
    straggler = find_straggler(busy)
    if straggler is not None:
        out["straggler_rank"], out["straggler_factor"] = straggler
    return out


def find_straggler(busy: np.ndarray) -> tuple[int, float] | None:
    """(rank, its busy time over the median) for the slowest rank, when it is over
    :data:`STRAGGLER_FACTOR`; None with one rank or none that slow."""
    if len(busy) < 2:
        return None
    median = float(np.median(busy))
    rank = int(np.argmax(busy))
    if median <= 0 or busy[rank] <= STRAGGLER_FACTOR * median:
        return None
    return rank, round(float(busy[rank]) / median, 2)


def largest_share(metrics: dict[str, Any]) -> tuple[str, float] | None:
    """(phase, share) of the phase that took most of the training time in ``metrics``."""
    shares = [(p, metrics[k]) for p, k in zip(PHASES, SHARE_KEYS) if isinstance(metrics.get(k), (int, float))]
    return max(shares, key=lambda s: s[1]) if shares else None


def describe(metrics: dict[str, Any]) -> str:
    """The progress line's words: the largest share, and the straggler where there is one."""
    top = largest_share(metrics)
    parts = [f"{100 * top[1]:.0f}% {WORDS[top[0]]}"] if top else []
    if isinstance(metrics.get("straggler_rank"), int):
        parts.append(f"straggler rank {metrics['straggler_rank']} ({metrics['straggler_factor']:.1f}x the median)")
    return "  ".join(parts)


def combine(reports: list[dict[str, Any]]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """A launch's breakdown from its epoch reports: the share per phase over all their training
    time (each epoch weighted by its time), and each straggler rank with the epochs it was named
    in and its largest factor (the slowest first)."""
    timed = [r for r in reports if isinstance(r.get(SHARE_KEYS[0]), (int, float))
             and float(r.get("train_time_s") or 0) > 0]
    total = sum(float(r["train_time_s"]) for r in timed)
    shares = {p: round(sum(float(r[k]) * float(r["train_time_s"]) for r in timed) / total, 4)
              for p, k in zip(PHASES, SHARE_KEYS)} if total else {}
    named: dict[int, dict[str, Any]] = {}
    for r in timed:
        if isinstance(r.get("straggler_rank"), int):
            s = named.setdefault(r["straggler_rank"], {"rank": r["straggler_rank"], "epochs": 0, "factor": 0.0})
            s["epochs"] += 1
            s["factor"] = max(s["factor"], float(r["straggler_factor"]))
    return shares, sorted(named.values(), key=lambda s: -s["factor"])
