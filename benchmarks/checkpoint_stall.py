"""Checkpoint stall: the training time one step checkpoint costs, by storage and upload mode.

``launcher run`` trains ``benchmarks/stall_function.py:stall`` (a ~100 MB state, short
steps, a checkpoint every few steps) once per (storage, ``--checkpoint-upload``): local
disk and the Cloud Storage emulator, each synchronous and asynchronous. The function
measures, inside the worker, the median plain step, the mean checkpoint step, and the
``torch.save`` of the same state to local disk. The goal: a step checkpoint costs the step
no more than its local serialisation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable

from benchmarks import results
from benchmarks.raywork import failure_reason, last_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUNCTION = os.path.join(ROOT, "benchmarks", "stall_function.py") + ":stall"
MODES = ("sync", "async")


def run(storages: list[tuple[str, str]], mb: int, steps: int, every: int, note: Callable[[str], None],
        modes: tuple[str, ...] | list[str] = MODES) -> list[dict]:
    """One run per (storage label, URI) and upload mode; one row each."""
    rows = []
    for label, uri in storages:
        for mode in modes:
            cmd = [sys.executable, "-m", "launcher", "run", "--workload", FUNCTION, "--workers", "1",
                   "--storage", uri, "--name", f"stall_{label.replace(' ', '_')}_{mode}",
                   "--checkpoint-every-steps", str(every), "--checkpoint-upload", mode,
                   "--param", f"mb={mb}", "--param", f"steps={steps}", "--keep-checkpoints", "2", "--json"]
            res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ,
                                                                                  "OMP_NUM_THREADS": "1"})
            row = {"storage": label, "upload": mode}
            if res.returncode != 0:
                row["failed"] = failure_reason(res.stderr, res.returncode, 200)
                note(f"{label}, {mode}: FAILED: {row['failed']}")
            else:
                m = last_json(res.stdout)["metrics"]
                row.update({k: round(float(m[k]), 1) for k in ("state_mb", "step_ms", "serialise_ms",
                                                                "checkpoint_step_ms", "stall_ms", "checkpoints")})
                row["stall_vs_serialise"] = round(row["stall_ms"] / row["serialise_ms"], 2) \
                    if row["serialise_ms"] else None
                note(f"{label}, {mode}: a checkpoint costs the step {row['stall_ms']:,.0f} ms "
                     f"(serialising alone: {row['serialise_ms']:,.0f} ms)")
            rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'storage':<16} {'upload':<6} {'state MB':>8} {'step ms':>8} {'ckpt step ms':>12} "
             f"{'stall ms':>9} {'torch.save ms':>13} {'stall/save':>10}"]
    for r in rows:
        if "failed" in r:
            lines.append(f"{r['storage']:<16} {r['upload']:<6} failed: {r['failed']}")
            continue
        ratio = f"{r['stall_vs_serialise']:.2f}" if r["stall_vs_serialise"] is not None else "-"
        lines.append(f"{r['storage']:<16} {r['upload']:<6} {r['state_mb']:>8.0f} {r['step_ms']:>8.1f} "
                     f"{r['checkpoint_step_ms']:>12.1f} {r['stall_ms']:>9.1f} {r['serialise_ms']:>13.1f} {ratio:>10}")
    return "\n".join(lines)


def write_results(rows: list[dict], info: dict, out_dir: str) -> list[str]:
    """checkpoint-stall.json, .csv and .png (stall per storage and mode, against torch.save)."""
    fig, ax = results.new_figure(ncols=1, figsize=(7, 4))
    ok = [r for r in rows if "failed" not in r]
    labels = [f"{r['storage']}\n{r['upload']}" for r in ok]
    ax.bar(range(len(ok)), [r["stall_ms"] for r in ok], label="checkpoint stall")
    ax.plot(range(len(ok)), [r["serialise_ms"] for r in ok], "k_", markersize=30, label="torch.save to local disk")
    ax.set_xticks(range(len(ok)), labels)
    ax.set(ylabel="ms of training per checkpoint", title=f"a ~{ok[0]['state_mb']:.0f} MB state" if ok else "")
    ax.legend()
    payload = {"machine": info, "rows": rows, "definitions": {
        "stall_ms": "mean checkpoint step minus median plain step, timed inside the worker",
        "serialise_ms": "median torch.save of the same state to local disk"}}
    return results.write(out_dir, "checkpoint-stall", rows, payload, fig)
