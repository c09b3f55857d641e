"""Launcher overhead: the same 1-epoch digits-mlp job under three launchers, alternating.

* ``launcher-cold``: ``launcher run`` starting its own local Ray (and stopping it);
* ``launcher-warm``: ``launcher run`` with a warm local head from ``launcher up``;
* ``torchrun``: ``benchmarks/torchrun_digits.py`` under torchrun, the same
  training code without Ray.

Runs go A B C A B C ... so drift in the machine's state hits all three alike.
Every run is a fresh process timed from outside (wall clock, start to exit),
with OMP_NUM_THREADS=1 and one torch thread per worker in all three.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("launcher-cold", "launcher-warm", "torchrun")


def _command(variant: str, workers: int, storage: str, index: int) -> list[str]:
    if variant == "torchrun":
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        return [torchrun, f"--nproc-per-node={workers}", os.path.join(ROOT, "benchmarks", "torchrun_digits.py"),
                "--epochs", "1"]
    return [sys.executable, "-m", "launcher", "run", "--epochs", "1", "--workers", str(workers),
            "--storage", storage, "--name", f"overhead_{variant.replace('-', '_')}_{index}", "--json"]


def run(repeats: int, workers: int, note: Callable[[str], None]) -> list[dict]:
    from launcher import localhead

    samples = []
    with tempfile.TemporaryDirectory(prefix="launcher-overhead-") as tmp:
        cold_state, warm_state = os.path.join(tmp, "cold-state"), os.path.join(tmp, "warm-state")
        base = {**os.environ, "OMP_NUM_THREADS": "1"}
        base.pop("RAY_ADDRESS", None)
        os.environ[localhead.STATE_ENV] = warm_state
        try:
            localhead.up()
            for i in range(repeats):
                for variant in VARIANTS:
                    env = {**base, localhead.STATE_ENV: warm_state if variant == "launcher-warm" else cold_state}
                    cmd = _command(variant, workers, os.path.join(tmp, "runs"), i)
                    start = time.perf_counter()
                    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                    wall = time.perf_counter() - start
                    if res.returncode != 0:
                        raise RuntimeError(f"{variant} failed: {res.stderr.strip().splitlines()[-1:]}")
                    out = json.loads(res.stdout.strip().splitlines()[-1])
                    first = (out.get("startup") or {}).get("time_to_first_step_s")
                    samples.append({"variant": variant, "repeat": i, "wall_s": wall, "first_step_s": first,
                                    "accuracy": out.get("accuracy") or out.get("metrics", {}).get("accuracy")})
                    note(f"{i + 1}/{repeats} {variant:<14} wall {wall:6.2f}s"
                         + (f"  first step after {first:.2f}s" if first else ""))
        finally:
            localhead.down()
            os.environ.pop(localhead.STATE_ENV, None)
    return samples


def summarize(samples: list[dict]) -> list[dict]:
    base = statistics.median(s["wall_s"] for s in samples if s["variant"] == "torchrun")
    rows = []
    for variant in VARIANTS:
        walls = [s["wall_s"] for s in samples if s["variant"] == variant]
        firsts = [s["first_step_s"] for s in samples if s["variant"] == variant and s["first_step_s"]]
        rows.append({"variant": variant, "runs": len(walls), "wall_s_median": statistics.median(walls),
                     "wall_s_min": min(walls), "wall_s_max": max(walls),
                     "vs_torchrun": statistics.median(walls) / base,
                     "first_step_s_median": statistics.median(firsts) if firsts else None})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'launcher':<15} {'runs':>4} {'wall median':>12} {'min-max':>15} {'x torchrun':>10} {'first step':>11}"]
    for r in rows:
        first = f"{r['first_step_s_median']:.2f}s" if r["first_step_s_median"] else "-"
        lines.append(f"{r['variant']:<15} {r['runs']:>4} {r['wall_s_median']:>11.2f}s "
                     f"{r['wall_s_min']:>6.2f}-{r['wall_s_max']:<6.2f}s {r['vs_torchrun']:>10.2f} {first:>11}")
    return "\n".join(lines)


def write_results(rows: list[dict], samples: list[dict], out_dir: str) -> list[str]:
    """overhead.json, overhead.csv and a bar chart (PNG) of wall times against 2x and 3x torchrun."""
    from benchmarks import results

    fig, ax = results.new_figure()
    xs = range(len(rows))
    med = [r["wall_s_median"] for r in rows]
    err = [[m - r["wall_s_min"] for m, r in zip(med, rows)], [r["wall_s_max"] - m for m, r in zip(med, rows)]]
    ax.bar(list(xs), med, yerr=err, capsize=6, color=["#c0504d", "#4f81bd", "#9bbb59"])
    torchrun = rows[-1]["wall_s_median"]
    for factor, style in ((2, "--"), (3, ":")):
        ax.axhline(factor * torchrun, color="grey", linestyle=style, label=f"{factor}x torchrun")
    ax.set_xticks(list(xs), [r["variant"] for r in rows])
    ax.set_ylabel("wall time, 1-epoch digits-mlp job (s)")
    ax.set_title("Launcher overhead (median, min-max)")
    ax.legend()
    return results.write(out_dir, "overhead", rows, {"samples": samples}, fig)
