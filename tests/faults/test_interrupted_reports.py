"""What a stopped or slow launch writes and says: real `launcher run` processes, signalled.

- Ctrl-C while training: Ray Train's controller is aborted with reports it had not passed
  on, while the workers go on storing checkpoints for a moment. Every epoch a checkpoint
  holds still has its row in metrics.jsonl, and a resumed run's rows have no gap.
- Ctrl-C inside the first epoch (held at the first step checkpoint): the summary gives the
  rate the launch trained at, not 0.
- A slow one-off set-up (the fault point ``setup`` waits inside the phase a first Horovod
  build runs in): a start-up phase, left out of the wall time and the progress lines'
  elapsed time. The launch that resumes the Ctrl-C'd run waits it out (it was a test of its
  own, launching the same run: one launch fewer).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from harness import ROOT, Launch

from launcher.driver.startup import SETUP_PHASE
from launcher.faultpoint import ENV, MARK_ENV
from launcher.storage import Storage, complete_checkpoints
from launcher.storage.runlog import read_jsonl

pytestmark = pytest.mark.integration


def newest_epoch(storage: str, name: str) -> int:
    done = complete_checkpoints(Storage.resolve(storage), name)
    return done[-1][0].epoch if done else 0


def metric_rows(storage: str, name: str) -> list[dict]:
    with open(os.path.join(storage, name, "metrics.jsonl")) as f:
        return read_jsonl(f.read())


def epochs_logged(storage: str, name: str) -> list[int]:
    return sorted(r["epoch"] for r in metric_rows(storage, name) if r.get("kind") == "epoch")


def test_ctrl_c_leaves_a_metrics_row_for_every_checkpointed_epoch_and_a_slow_set_up_is_not_run_time(
        warm_head, storage):
    # Ray Train's controller takes the workers' reports every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (0.2 s
    # as the launcher sets it; a value the user sets wins). At 4 s, half a poll after a progress line
    # rank 0 has stored its next epoch's checkpoint and waits to hand its report over (Ray's queue
    # holds one): Ctrl-C then aborts the controller with that report, every time.
    name = "try1"
    launch = Launch("--storage", storage, "--name", name, "--epochs", "30",
                    env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "4"})
    launch.wait_for("epoch 2/30")
    time.sleep(2)
    launch.signal(signal.SIGINT)
    assert launch.finish(timeout_s=120) == 130, launch.stderr[-4000:]
    summary = launch.summary()
    newest = newest_epoch(storage, name)
    assert summary["status"] == "cancelled" and summary["epochs_completed"] == newest >= 3, summary
    assert epochs_logged(storage, name) == list(range(1, newest + 1)), launch.stderr[-3000:]
    assert f"epoch {newest}/30" in launch.stderr  # the progress lines reach where the summary stands
    cut_off = [r["epoch"] for r in metric_rows(storage, name) if r.get("from_checkpoint")]
    assert cut_off and cut_off[-1] == newest, launch.stderr[-3000:]  # the case this test is about happened
    assert launch.stderr.count("the report was cut off") == len(cut_off)

    # The resuming launch first waits out a slow one-off set-up (3 s: long beside the launch's own
    # start-up phases, which the assertions below tell it from).
    wait_s = 3.0
    final = newest + 2
    started = time.time()
    resumed = Launch("--storage", storage, "--name", name, "--epochs", str(final), "--profile-startup",
                     env={ENV: f"setup:{wait_s:g}"})
    assert resumed.finish() == 0, resumed.stderr[-4000:]
    took = time.time() - started
    again = resumed.summary()
    assert again["epochs_completed"] == final, again
    assert epochs_logged(storage, name) == list(range(1, final + 1))  # each epoch once, no gap

    # The set-up is a start-up phase, not run time: out of the wall time and the progress lines' elapsed.
    assert "fault point setup reached" in resumed.stderr
    assert again["setup_s"] >= wait_s and again["startup"]["phases"][SETUP_PHASE] >= wait_s, again
    assert again["wall_s"] <= took - wait_s, (again["wall_s"], took)
    first = re.search(rf"epoch {newest + 1}/{final} .*elapsed ([0-9.]+)s", resumed.stderr)
    assert first and float(first.group(1)) < again["wall_s"], resumed.stderr[-2000:]
    assert "backend set-up (a first Horovod build)" in resumed.stderr  # the start-up profile's row
    runs = subprocess.run([sys.executable, "-m", "launcher", "runs", "--storage", storage, "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    (row,) = json.loads(runs.stdout)
    assert row["wall_s"] == pytest.approx(summary["wall_s"] + again["wall_s"], abs=0.1)  # the launches' own, summed


def test_a_launch_stopped_inside_its_first_epoch_reports_the_rate_it_trained_at(warm_head, storage, tmp_path):
    name = "mid"
    marks = tmp_path / "marks"
    launch = Launch("--storage", storage, "--name", name, "--epochs", "5", "--checkpoint-every-steps", "10",
                    env={ENV: "step-checkpoint:120", MARK_ENV: str(marks)})
    # Rank 0 holds after its first step checkpoint; the driver has logged that step.
    launch.wait_until(lambda: os.path.exists(os.path.join(storage, name, "metrics.jsonl"))
                      and any(r.get("kind") == "step" for r in metric_rows(storage, name)))
    launch.signal(signal.SIGINT)
    assert launch.finish(timeout_s=120) == 130, launch.stderr[-4000:]
    summary = launch.summary()
    assert summary["status"] == "cancelled" and summary["epochs_completed"] == 0
    assert summary["steps_completed"] == 10, summary
    assert summary["samples_per_s"] > 0, summary  # 10 steps of 2 x 32 samples, over the time they took
    assert summary["samples_per_s"] * summary["wall_s"] >= 10 * 64
