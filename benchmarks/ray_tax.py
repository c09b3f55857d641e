"""Who takes the CPU during a run: the workers against Ray's and the launcher's own processes.

Starts ``launcher run ARGS`` and samples every process that appeared after it started
(psutil, once a second), grouped by what it is: the training workers, Ray Train's
controller and synchronisation actor, the raylet, the GCS, the dashboard and runtime
environment agents, Ray's log monitor, API server (started even without the dashboard)
and autoscaler monitor, idle Ray workers, the launcher's driver and its reaper. Prints each
group's share of one core over the steady part of the run (from --skip seconds after the
first worker appears to two seconds before the end), so a setting can be judged by what it
saves without a long throughput benchmark; the throughput ratio itself is ``launcher bench
scaling``'s.

    python -m benchmarks.ray_tax --skip 20 -- --workload examples/char_lm.py:train \\
        --data /tmp/text.txt --workers 2 --epochs 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import psutil

from benchmarks import machine

# (group, a piece of the command line that names it), first match wins
GROUPS = (
    ("workers", "RayTrainWorker"),
    ("controller", "TrainController"),
    ("sync actor", "SynchronizationActor"),
    ("raylet", "core/src/ray/raylet/raylet"),  # a worker's own command line names the raylet too
    ("gcs", "core/src/ray/gcs/gcs_server"),
    ("dashboard agent", "DashboardAgent"),  # its title once started; its command line before
    ("dashboard agent", "dashboard/agent.py"),
    ("runtime env agent", "RuntimeEnvAgent"),
    ("runtime env agent", "runtime_env/agent/main.py"),
    ("log monitor", "log_monitor.py"),
    ("api server", "dashboard/dashboard.py"),  # started even without the dashboard
    ("autoscaler monitor", "autoscaler/_private/monitor.py"),
    ("idle ray workers", "ray::IDLE"),
    ("launcher reaper", "launcher.driver.reaper"),
    ("other ray actors", "ray::"),
)


def group_of(cmdline: str, driver: bool) -> str:
    if driver:
        return "launcher driver"
    for name, piece in GROUPS:
        if piece in cmdline:
            return name
    return "other"


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def sample(argv: list[str], interval: float = 1.0) -> tuple[list[dict], int, str]:
    """Run ``argv``; return one row per sample and process: t, pid, group, cpu seconds so far."""
    before = {p.pid for p in psutil.process_iter()}
    rows: list[dict] = []
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
        started = time.perf_counter()
        while proc.poll() is None:
            now = time.perf_counter() - started
            for p in psutil.process_iter(["cmdline"]):
                if p.pid in before:
                    continue
                try:
                    # named afresh each time: a Ray worker takes its actor's name (setproctitle) once it starts
                    group = group_of(" ".join(p.info["cmdline"] or []), p.pid == proc.pid)
                    rows.append({"t": now, "pid": p.pid, "group": group, "cpu_s": _cpu(p)})
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            time.sleep(interval)
        log.seek(0)
        return rows, proc.returncode, log.read()


def shares(rows: list[dict], skip: float) -> tuple[dict[str, float], float]:
    """Each group's CPU over the window, in % of one core, and the window's length."""
    worker_times = [r["t"] for r in rows if r["group"] == "workers"]
    if not worker_times:
        raise SystemExit("no training worker was seen: is the run too short, or did it fail?")
    start, end = min(worker_times) + skip, max(r["t"] for r in rows) - 2.0
    if end - start < 5:
        raise SystemExit(f"the steady window is {end - start:.0f} s: run longer or lower --skip")
    used: dict[str, float] = {}
    for pid in {r["pid"] for r in rows}:
        inside = [r for r in rows if r["pid"] == pid and start <= r["t"] <= end]
        if len(inside) >= 2:
            group = inside[-1]["group"]
            used[group] = used.get(group, 0.0) + inside[-1]["cpu_s"] - inside[0]["cpu_s"]
    return {g: 100.0 * s / (end - start) for g, s in used.items()}, end - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", type=float, default=15.0,
                        help="seconds after the first worker appears before the window starts")
    parser.add_argument("run_args", nargs=argparse.REMAINDER, help="after --: arguments for `launcher run`")
    args = parser.parse_args(argv)
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    if not run_args:
        parser.error("give the run's arguments after --")
    rows, code, output = sample([sys.executable, "-m", "launcher", "run", *run_args])
    if code != 0:
        raise SystemExit(f"the run failed (exit {code}): {output[-2000:]}")
    got, window = shares(rows, args.skip)
    print(machine.header(machine.describe(load_average=os.getloadavg()),
                         f"CPU by process group over {window:.0f} s of `launcher run {' '.join(run_args)}`"))
    print(f"{'group':<20} {'% of a core':>11}")
    for group, pct in sorted(got.items(), key=lambda kv: -kv[1]):
        print(f"{group:<20} {pct:>11.1f}")
    besides = sum(p for g, p in got.items() if g != "workers")
    print(f"{'all but the workers':<20} {besides:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
