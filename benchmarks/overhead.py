"""Launcher overhead: the same 1-epoch job (digits-mlp, or any workload or training function
given with ``--workload``) under several launchers, alternating.

* ``launcher-cold``: ``launcher run`` starting its own local Ray (and stopping it);
* ``launcher-warm``: ``launcher run`` with a warm local head from ``launcher up``;
* ``torchrun``: ``benchmarks/torchrun_session.py`` under torchrun, the same
  training code without Ray;
* ``horovodrun`` (where Horovod's torch extension loads): the same script
  with ``--comm horovod`` under ``horovodrun -np N -H localhost:N``.

Runs go A B C D A B C D ... so drift in the machine's state hits all alike.
The warm head is started (``launcher up``, not timed) just before each
``launcher-warm`` run and stopped after it: a second Ray on the machine slows
a cold start (measured: ``ray.init`` 7.5 s instead of 4.3 s), and a user with a
warm head never starts a cold one.
Every run is a fresh process timed from outside (wall clock, start to exit),
with OMP_NUM_THREADS=1 and one torch thread per worker in all of them
(the session sets the torch thread count from cpus_per_worker = 1). Besides
wall time, each reports its steady-state training throughput (samples/s of the
epoch, from the training loop itself) and, for the launcher, time to first step.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from benchmarks import raywork, results
from benchmarks.raywork import failure_reason, last_json, torchrun_port
from launcher import driver
from launcher.driver import PHASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("launcher-cold", "launcher-warm", "torchrun", "horovodrun")
THREADS = 1  # OMP_NUM_THREADS and torch threads per worker, equal for every launcher


def horovodrun_reason() -> str | None:
    """None when horovodrun can run the torch loop here, else why not."""
    if not shutil.which("horovodrun") and not os.path.exists(_horovodrun()):
        return "horovodrun is not installed"
    return raywork.backend_or_reason("horovod", "torch")[1]


def _horovodrun() -> str:
    return os.path.join(os.path.dirname(sys.executable), "horovodrun")


def variants(note: Callable[[str], None]) -> tuple[str, ...]:
    reason = horovodrun_reason()
    if reason:
        note(f"horovodrun: unavailable: {reason}")
        return VARIANTS[:3]
    return VARIANTS


@dataclass(frozen=True)
class Job:
    """What every variant trains: a workload or a training function, for ``epochs``."""

    workload: str = "digits-mlp"
    epochs: int = 1
    data: str | None = None
    params: tuple[str, ...] = ()  # KEY=VALUE

    def args(self) -> list[str]:
        """The flags both ``launcher run`` and torchrun_session.py take."""
        out = ["--workload", self.workload, "--epochs", str(self.epochs)]
        out += ["--data", self.data] if self.data else []
        for kv in self.params:
            out += ["--param", kv]
        return out


def _command(variant: str, workers: int, storage: str, index: int, job: Job = Job()) -> list[str]:
    script = os.path.join(ROOT, "benchmarks", "torchrun_session.py")
    if variant == "torchrun":
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        return [torchrun, *torchrun_port(), f"--nproc-per-node={workers}", script, *job.args()]
    if variant == "horovodrun":
        return [_horovodrun(), "-np", str(workers), "-H", f"localhost:{workers}", sys.executable, script,
                *job.args(), "--comm", "horovod"]
    return [sys.executable, "-m", "launcher", "run", *job.args(), "--workers", str(workers),
            "--storage", storage, "--name", f"overhead_{variant.replace('-', '_')}_{index}", "--json"]


def run(repeats: int, workers: int, note: Callable[[str], None], job: Job = Job()) -> list[dict]:
    samples = []
    chosen = variants(note)
    note(f"every worker: OMP_NUM_THREADS={THREADS}, torch threads {THREADS}")
    if driver.running_head():
        note("note: your warm local Ray is running and slows the cold starts; `launcher down` first "
             "for clean figures")
    with tempfile.TemporaryDirectory(prefix="launcher-overhead-") as tmp:
        cold_state, warm_state = os.path.join(tmp, "cold-state"), os.path.join(tmp, "warm-state")
        base = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
        base.pop("RAY_ADDRESS", None)
        os.environ[driver.STATE_ENV] = warm_state
        try:
            for i in range(repeats):
                for variant in chosen:
                    if variant == "launcher-warm":
                        driver.up()
                    env = {**base, driver.STATE_ENV: warm_state if variant == "launcher-warm" else cold_state}
                    cmd = _command(variant, workers, os.path.join(tmp, "runs"), i, job)
                    env["BENCH_LAUNCHED"] = repr(time.time())
                    start = time.perf_counter()
                    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                    wall = time.perf_counter() - start
                    if variant == "launcher-warm":
                        driver.down()
                    if res.returncode != 0:
                        # One failed run (e.g. a Ray health check timing out on a loaded machine)
                        # is reported and counted; the other runs still give their figures.
                        why = failure_reason(res.stderr, res.returncode, 200)
                        samples.append({"variant": variant, "repeat": i, "wall_s": wall, "failed": why,
                                        "stderr_tail": res.stderr.splitlines()[-40:]})
                        note(f"{i + 1}/{repeats} {variant:<14} FAILED after {wall:.1f}s: {why}")
                        continue
                    out = last_json(res.stdout)
                    first = (out.get("startup") or {}).get("time_to_first_step_s") or out.get("first_step_s")
                    samples.append({"variant": variant, "repeat": i, "wall_s": wall, "first_step_s": first,
                                    "phases": (out.get("startup") or {}).get("phases"),
                                    "samples_per_s": out.get("samples_per_s"), "threads": out.get("threads", THREADS),
                                    "accuracy": out.get("accuracy") or out.get("metrics", {}).get("accuracy")})
                    note(f"{i + 1}/{repeats} {variant:<14} wall {wall:6.2f}s"
                         + (f"  first step after {first:.2f}s" if first else "")
                         + (f"  {out['samples_per_s']:,.0f} samples/s" if out.get("samples_per_s") else ""))
        finally:
            driver.down()
            os.environ.pop(driver.STATE_ENV, None)
    return samples


def _median(values: list) -> float | None:
    values = [v for v in values if v]
    return statistics.median(values) if values else None


def summarize(samples: list[dict]) -> list[dict]:
    failed = [s for s in samples if s.get("failed")]
    samples = [s for s in samples if not s.get("failed")]
    base = _median([s["wall_s"] for s in samples if s["variant"] == "torchrun"])  # None: every torchrun failed
    base_rate = _median([s.get("samples_per_s") for s in samples if s["variant"] == "torchrun"])
    rows = []
    for variant in VARIANTS:
        mine = [s for s in samples if s["variant"] == variant]
        if not mine:
            continue
        walls = [s["wall_s"] for s in mine]
        rates = [s.get("samples_per_s") for s in mine if s.get("samples_per_s")]
        rate = _median(rates)
        rows.append({"variant": variant, "runs": len(walls),
                     "failed_runs": sum(1 for f in failed if f["variant"] == variant), "wall_s_median": statistics.median(walls),
                     "wall_s_min": min(walls), "wall_s_max": max(walls),
                     "vs_torchrun": statistics.median(walls) / base if base else None,
                     "first_step_s_median": _median([s["first_step_s"] for s in mine]),
                     "samples_per_s_median": rate, "samples_per_s_min": min(rates) if rates else None,
                     "samples_per_s_max": max(rates) if rates else None,
                     "throughput_vs_torchrun": rate / base_rate if rate and base_rate else None})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'launcher':<15} {'runs':>4} {'wall median':>12} {'min-max':>15} {'x torchrun':>10} {'first step':>11}"
             f" {'samples/s (min-max)':>24} {'x torchrun':>10}"]
    for r in rows:
        first = f"{r['first_step_s_median']:.2f}s" if r["first_step_s_median"] else "-"
        rate = (f"{r['samples_per_s_median']:,.0f} ({r['samples_per_s_min']:,.0f}-{r['samples_per_s_max']:,.0f})"
                if r.get("samples_per_s_median") else "-")
        ratio = f"{r['throughput_vs_torchrun']:.2f}" if r.get("throughput_vs_torchrun") else "-"
        runs = f"{r['runs']}" + (f"+{r['failed_runs']}F" if r.get("failed_runs") else "")
        vs = f"{r['vs_torchrun']:.2f}" if r.get("vs_torchrun") else "-"
        lines.append(f"{r['variant']:<15} {runs:>4} {r['wall_s_median']:>11.2f}s "
                     f"{r['wall_s_min']:>6.2f}-{r['wall_s_max']:<6.2f}s {vs:>10} {first:>11}"
                     f" {rate:>24} {ratio:>10}")
    if any(r.get("failed_runs") for r in rows):
        lines.append("(+NF: N runs failed and are left out of the figures; see the JSON samples)")
    return "\n".join(lines)


def phase_medians(samples: list[dict]) -> dict[str, dict[str, float]]:
    """Per launcher variant, the median seconds of each start-up phase the runs reported
    (:mod:`launcher.driver.startup`), in the order the phases happen."""
    order = {name: i for i, (name, _, _) in enumerate(PHASES)}  # the summary's JSON sorts its keys
    out: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        runs = [s["phases"] for s in samples if s["variant"] == variant and s.get("phases")]
        if runs:
            names = sorted({name for run in runs for name in run}, key=lambda n: order.get(n, len(order)))
            out[variant] = {n: statistics.median(r[n] for r in runs if n in r) for n in names}
    return out


def format_phases(medians: dict[str, dict[str, float]]) -> str:
    if not medians:
        return ""
    variants = list(medians)
    names = list(dict.fromkeys(n for v in variants for n in medians[v]))
    width = max(len(n) for n in names)
    lines = ["start-up phases, median seconds:", f"{'phase':<{width}} " + " ".join(f"{v:>14}" for v in variants)]
    for n in names:
        cells = [f"{medians[v][n]:>14.2f}" if n in medians[v] else f"{'-':>14}" for v in variants]
        lines.append(f"{n:<{width}} " + " ".join(cells))
    return "\n".join(lines)


def write_results(rows: list[dict], samples: list[dict], out_dir: str, info: dict | None = None) -> list[str]:
    """overhead.json, overhead.csv and a bar chart (PNG) of wall times against 2x and 3x torchrun."""
    fig, ax = results.new_figure()
    xs = range(len(rows))
    med = [r["wall_s_median"] for r in rows]
    err = [[m - r["wall_s_min"] for m, r in zip(med, rows)], [r["wall_s_max"] - m for m, r in zip(med, rows)]]
    ax.bar(list(xs), med, yerr=err, capsize=6, color=["#c0504d", "#4f81bd", "#9bbb59", "#8064a2"][:len(rows)])
    torchrun = next((r["wall_s_median"] for r in rows if r["variant"] == "torchrun"), None)
    for factor, style in ((2, "--"), (3, ":")) if torchrun else ():
        ax.axhline(factor * torchrun, color="grey", linestyle=style, label=f"{factor}x torchrun")
    ax.set_xticks(list(xs), [r["variant"] for r in rows])
    ax.set_ylabel("wall time, 1-epoch digits-mlp job (s)")
    ax.set_title("Launcher overhead (median, min-max)")
    if torchrun:  # the 2x / 3x lines are the only labelled artists
        ax.legend()
    return results.write(out_dir, "overhead", rows, {"samples": samples, "machine": info,
                                                     "phases_median_s": phase_medians(samples),
                                                     "threads_per_worker": THREADS}, fig)
