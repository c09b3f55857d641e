"""Sharded training (``--strategy fsdp``) against data parallel (``ddp``): what each costs a worker.

``launcher bench sharding`` trains ``examples/gpt.py:train`` (a GPT-style character model,
here small enough for 4 workers on a laptop) for one epoch of ``steps`` steps per worker, for
each strategy and worker count, and right after each ``launcher run --json`` the same
function under torchrun (``benchmarks/torchrun_session.py``: the same session less Ray and
checkpoints), as ``benchmarks/function_scaling.py`` pairs them. From each run it keeps:

* ``state_mb``: this worker's bytes of parameters, gradients and optimizer state after the
  first optimizer step (:func:`launcher.worker.sharded.state_bytes`: local shards under
  fsdp, whole tensors under ddp), which the function reports; under fsdp it should be about
  ddp's divided by the worker count;
* ``peak_rss_mb``: the largest worker's peak resident memory (the session's
  ``peak_rss_mb_max``), which also holds the process's own interpreter, torch and Ray;
* ``samples_per_s``: all the epoch's samples over its training time, as the run reports it,
  and ``vs_torchrun``, the median over repeats of launcher/torchrun for each pair.

Then, at ``stall_workers`` workers, two more runs per strategy with a step checkpoint every
``every`` steps, ``--checkpoint-upload sync`` and ``async``: the function times every step,
and the stall is what ``benchmarks/checkpoint_stall.py`` calls it, the checkpoint steps'
mean time over the plain steps' median (training time lost per checkpoint).
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

from benchmarks import results
from benchmarks.checkpoint_stall import MODES
from benchmarks.overhead import Job
from benchmarks.raywork import failure_reason, last_json, torchrun_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt.py") + ":train"
STRATEGIES = ("ddp", "fsdp")
THREADS = 1  # OMP_NUM_THREADS and torch threads in every worker, launcher and torchrun alike
# The goals of issue 45: fsdp's state per worker within 15 % of ddp's divided by N (N >= 2); the
# launcher within 3 % of torchrun under fsdp; an asynchronous checkpoint at most 1/5 of a synchronous one's stall.
STATE_LIMIT, RATIO_LIMIT, STALL_LIMIT = 1.15, 0.97, 0.2


@dataclass(frozen=True)
class Settings:
    """What the benchmark runs: the model's size, the steps, the worker counts and the stall runs."""

    strategies: tuple[str, ...] = STRATEGIES
    workers: tuple[int, ...] = (1, 2, 4)
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    context: int = 64
    batch_size: int = 8      # per worker
    steps: int = 12          # per worker, in the run's one epoch
    repeats: int = 1         # launcher/torchrun pairs per (strategy, workers)
    bare: bool = True        # the torchrun twin of each launcher run
    stall: tuple[str, ...] = STRATEGIES  # the strategies whose checkpoint stall is measured
    stall_workers: int = 2
    every: int = 3           # a step checkpoint every this many steps in the stall runs

    def job(self, workers: int) -> Job:
        """examples/gpt.py at this size, with text for ``steps`` steps per worker at ``workers``."""
        chars = max_chars(self.steps, self.batch_size, workers, self.context)
        params = {"d_model": self.d_model, "layers": self.layers, "heads": self.heads, "context": self.context,
                  "max_chars": chars, "eval_batches": 1}
        return Job(GPT, 1, None, tuple(f"{k}={v}" for k, v in params.items()))

    def args(self, strategy: str, workers: int) -> list[str]:
        """The flags ``launcher run`` and torchrun_session.py both take for one run."""
        return [*self.job(workers).args(), "--batch-size", str(self.batch_size), "--strategy", strategy]


def max_chars(steps: int, batch_size: int, workers: int, context: int) -> int:
    """Characters of text that give ``steps`` training steps per worker (gpt.py trains on the
    first 90 %, in windows of ``context``) and at least one held-out window per worker: exactly
    ``steps`` where ``steps x batch_size >= 9``, more below (the held-out tenth needs the text)."""
    windows = steps * batch_size * workers
    chars = math.ceil((windows * context + 1) / 0.9) + 1
    while chars - int(chars * 0.9) - 1 < workers * context:
        chars += context
    return chars


def _launcher(args: list[str], workers: int, storage: str, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "launcher", "run", *args, "--workers", str(workers), "--cpus-per-worker",
            str(THREADS), "--storage", storage, "--name", name, "--json", *extra]


def _torchrun(args: list[str], workers: int) -> list[str]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, *torchrun_port(), f"--nproc-per-node={workers}",
            os.path.join(ROOT, "benchmarks", "torchrun_session.py"), *args]


def _measure(cmd: list[str], base: dict) -> dict:
    """One run as a subprocess: its figures, or why it failed."""
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    env.pop("RAY_ADDRESS", None)
    start = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    m = {**base, "wall_s": round(time.perf_counter() - start, 2)}
    if res.returncode != 0:
        return {**m, "failed": failure_reason(res.stderr, res.returncode, 200)}
    try:
        out = last_json(res.stdout)
    except (RuntimeError, ValueError) as exc:
        return {**m, "failed": str(exc)[:200]}
    metrics = out.get("metrics") or {}
    figures = {"samples_per_s": out.get("samples_per_s"), "state_mb": metrics.get("state_mb"),
               "peak_rss_mb": out.get("peak_rss_mb_max", metrics.get("peak_rss_mb_max")),
               "step_ms": metrics.get("step_ms"),
               "stall_ms": metrics.get("checkpoint_stall_ms")}
    return {**m, **{k: round(float(v), 3) for k, v in figures.items() if v is not None}}


def run(settings: Settings, note: Callable[[str], None]) -> list[dict]:
    """Every (strategy, workers) ``repeats`` times, launcher then torchrun; then the stall runs."""
    measured: list[dict] = []
    bare = settings.bare
    with tempfile.TemporaryDirectory(prefix="launcher-sharding-") as tmp:
        storage = os.path.join(tmp, "runs")
        for strategy in settings.strategies:
            for n in settings.workers:
                args = settings.args(strategy, n)
                for i in range(settings.repeats):
                    base = {"kind": "throughput", "strategy": strategy, "workers": n, "repeat": i}
                    m = _measure(_launcher(args, n, storage, f"sharding_{strategy}_{n}_{i}"),
                                 {**base, "variant": "launcher"})
                    measured.append(_noted(m, note))
                    if bare:
                        measured.append(_noted(_measure(_torchrun(args, n), {**base, "variant": "torchrun"}), note))
        n = settings.stall_workers
        for strategy in settings.stall:
            for mode in MODES:
                cmd = _launcher(settings.args(strategy, n), n, storage, f"sharding_stall_{strategy}_{mode}",
                                "--checkpoint-every-steps", str(settings.every), "--checkpoint-upload", mode,
                                "--keep-checkpoints", "2")
                base = {"kind": "stall", "strategy": strategy, "workers": n, "variant": "launcher", "upload": mode}
                measured.append(_noted(_measure(cmd, base), note))
    return measured


def _noted(m: dict, note: Callable[[str], None]) -> dict:
    what = f"{m['strategy']}, {m['workers']} worker(s), {m['variant']}" + (f", {m['upload']}" if "upload" in m else "")
    if "failed" in m:
        note(f"{what}: FAILED: {m['failed']}")
    elif m["kind"] == "stall":
        note(f"{what}: a checkpoint costs {m.get('stall_ms', float('nan')):,.1f} ms "
             f"(step {m.get('step_ms', float('nan')):,.1f} ms; wall {m['wall_s']:.1f}s)")
    else:
        note(f"{what}: {m.get('samples_per_s', 0.0):,.1f} samples/s, state {m.get('state_mb', float('nan')):,.2f} MB "
             f"per worker (wall {m['wall_s']:.1f}s)")
    return m


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(measured: list[dict]) -> list[dict]:
    """One row per (strategy, workers): memory, throughput against torchrun, and the stall runs'
    figures where they ran at that worker count."""
    ok = [m for m in measured if "failed" not in m]
    keys = dict.fromkeys((m["strategy"], m["workers"]) for m in measured)
    rows = []
    for strategy, n in keys:
        mine = [m for m in ok if (m["strategy"], m["workers"]) == (strategy, n)]
        runs = [m for m in mine if m["kind"] == "throughput" and m["variant"] == "launcher"]
        twins = {m["repeat"]: m for m in mine if m["kind"] == "throughput" and m["variant"] == "torchrun"}
        ratios = [m["samples_per_s"] / twins[m["repeat"]]["samples_per_s"] for m in runs
                  if twins.get(m["repeat"], {}).get("samples_per_s") and m.get("samples_per_s")]
        stall = {m["upload"]: m.get("stall_ms") for m in mine if m["kind"] == "stall"}
        sync, background = stall.get("sync"), stall.get("async")
        rows.append({"strategy": strategy, "workers": n, "state_mb": _median([m.get("state_mb") for m in runs]),
                     "state_vs_ddp_share": None, "peak_rss_mb": _median([m.get("peak_rss_mb") for m in runs]),
                     "samples_per_s": _median([m.get("samples_per_s") for m in runs]),
                     "torchrun_samples_per_s": _median([m.get("samples_per_s") for m in twins.values()]),
                     "vs_torchrun": _median(ratios), "stall_sync_ms": sync, "stall_async_ms": background,
                     "stall_ratio": round(background / sync, 3) if sync and sync > 0 and background is not None
                     else None})
    for r in rows:
        ddp = [o["state_mb"] for o in rows if o["strategy"] == "ddp" and o["state_mb"]]
        same = [o["state_mb"] for o in rows if (o["strategy"], o["workers"]) == ("ddp", r["workers"]) and o["state_mb"]]
        whole = (same or ddp or [None])[0]  # ddp's state is the same at any worker count
        if r["strategy"] == "fsdp" and r["state_mb"] and whole:
            r["state_vs_ddp_share"] = round(r["state_mb"] / (whole / r["workers"]), 3)
    return rows


def goals(rows: list[dict]) -> list[dict]:
    """The goals checked on the summary rows: one entry per figure that bears on one (``met``
    None where it was not measured)."""
    out = []

    def check(goal: str, row: dict | None, value: float | None, limit: float, at_most: bool) -> None:
        met = None if value is None else (value <= limit if at_most else value >= limit)
        out.append({"goal": goal, "strategy": row["strategy"] if row else None,
                    "workers": row["workers"] if row else None, "value": value, "limit": limit, "met": met})

    fsdp = [r for r in rows if r["strategy"] == "fsdp"]
    state = f"fsdp state per worker <= {STATE_LIMIT} x ddp/N"
    for r in [r for r in fsdp if r["workers"] >= 2] or [None]:
        check(state, r, r and r["state_vs_ddp_share"], STATE_LIMIT, True)
    ratio = f"fsdp launcher/torchrun >= {RATIO_LIMIT}"
    for r in [r for r in fsdp if r["samples_per_s"] is not None] or [None]:
        check(ratio, r, r and r["vs_torchrun"], RATIO_LIMIT, False)
    stall = f"async stall <= {STALL_LIMIT} x sync"
    for r in [r for r in rows if r["stall_sync_ms"] is not None or r["stall_async_ms"] is not None] or [None]:
        check(stall, r, r and r["stall_ratio"], STALL_LIMIT, True)
    return out


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'strategy':<8} {'workers':>7} {'state MB':>9} {'vs ddp/N':>8} {'peak RSS MB':>11} "
             f"{'samples/s':>10} {'torchrun':>9} {'launcher/torchrun':>17} {'stall sync ms':>13} "
             f"{'stall async ms':>14} {'async/sync':>10}"]
    for r in rows:
        lines.append(f"{r['strategy']:<8} {r['workers']:>7} {_cell(r['state_mb'], '.2f'):>9} "
                     f"{_cell(r['state_vs_ddp_share'], '.3f'):>8} {_cell(r['peak_rss_mb'], ',.0f'):>11} "
                     f"{_cell(r['samples_per_s'], ',.1f'):>10} {_cell(r['torchrun_samples_per_s'], ',.1f'):>9} "
                     f"{_cell(r['vs_torchrun'], '.3f'):>17} {_cell(r['stall_sync_ms'], ',.1f'):>13} "
                     f"{_cell(r['stall_async_ms'], ',.1f'):>14} {_cell(r['stall_ratio'], '.3f'):>10}")
    return "\n".join(lines)


def format_goals(checked: list[dict]) -> str:
    """One line per goal: each figure that bears on it, and whether it met the goal."""
    lines = ["# goals"]
    for goal in dict.fromkeys(g["goal"] for g in checked):
        parts = []
        for g in checked:
            if g["goal"] != goal:
                continue
            verdict = "not measured" if g["met"] is None else ("met" if g["met"] else "MISSED")
            where = f"{g['strategy']} N={g['workers']} " if g["strategy"] else ""
            parts.append(where + (f"{g['value']:.3f} " if g["value"] is not None else "") + verdict)
        lines.append(f"{goal}: " + "; ".join(parts))
    return "\n".join(lines)


def write_results(rows: list[dict], checked: list[dict], measured: list[dict], info: dict, settings: Settings,
                  out_dir: str) -> list[str]:
    """sharding.json, .csv and .png (state per worker, samples/s, and the stall by upload mode)."""
    fig, (ax_m, ax_t, ax_s) = results.new_figure(ncols=3, figsize=(15, 4))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = sorted((r for r in rows if r["strategy"] == strategy and r["samples_per_s"] is not None),
                      key=lambda r: r["workers"])
        n = [r["workers"] for r in mine]
        ax_m.plot(n, [r["state_mb"] or 0 for r in mine], marker="o", label=strategy)
        ax_t.plot(n, [r["samples_per_s"] for r in mine], marker="o", label=f"{strategy} via launcher")
        if any(r["torchrun_samples_per_s"] for r in mine):
            ax_t.plot(n, [r["torchrun_samples_per_s"] or 0 for r in mine], marker="x", linestyle="--",
                      label=f"{strategy} via torchrun")
    ddp = next((r["state_mb"] for r in rows if r["strategy"] == "ddp" and r["state_mb"]), None)
    counts = sorted({r["workers"] for r in rows}) or [1]
    if ddp:
        ax_m.plot(counts, [ddp / n for n in counts], color="grey", linestyle=":", label="ddp / N")
    ax_m.set(xlabel="workers", ylabel="MB per worker", title="parameters + gradients + optimizer state")
    ax_t.set(xlabel="workers", ylabel="samples/s", title="throughput")
    stalled = [r for r in rows if r["stall_sync_ms"] is not None or r["stall_async_ms"] is not None]
    for i, mode in enumerate(MODES):
        ax_s.bar([j + 0.4 * i for j in range(len(stalled))], [r[f"stall_{mode}_ms"] or 0 for r in stalled],
                 width=0.4, label=mode)
    ax_s.set_xticks([j + 0.2 for j in range(len(stalled))], [f"{r['strategy']}, {r['workers']} w" for r in stalled])
    ax_s.set(ylabel="ms of training per checkpoint", title=f"checkpoint stall (every {settings.every} steps)")
    for ax in (ax_m, ax_t):
        ax.set_xticks(counts)
    for ax in (ax_m, ax_t, ax_s):
        if ax.has_data():
            ax.legend()
    fig.suptitle(f"examples/gpt.py d_model {settings.d_model}, {settings.layers} layers; {info['cpu_model']} "
                 f"({info['cpu_cores']} cores), {info['date_utc']}", fontsize=8)
    payload = {"machine": info, "settings": asdict(settings), "goals": checked, "measurements": measured,
               "definitions": {
                   "state_mb": "a worker's parameters + gradients + optimizer state after the first optimizer step "
                               "(its shards under fsdp), as launcher.worker.sharded.state_bytes counts them",
                   "state_vs_ddp_share": "fsdp's state_mb over ddp's state_mb / workers (1.0: a perfect split)",
                   "peak_rss_mb": "the largest worker's peak resident memory (process, torch and Ray included)",
                   "samples_per_s": "the epoch's samples over its training time, as the run reports it (median)",
                   "vs_torchrun": "median over repeats of launcher/torchrun samples/s, each pair run back to back",
                   "stall_ms": "mean step with a step checkpoint minus the median plain step, timed in the worker"}}
    return results.write(out_dir, "sharding", rows, payload, fig)
