"""Ctrl-C and SIGTERM at each moment of a launch, one run carried through them all.

The same run is launched again and again; each launch is stopped by a signal at
a different moment: while Ray starts, while the workers start, while training
(where a second launch of the run is refused first), while the first checkpoint
is handed over for upload, while the final model is exported. After each, the
launch must exit 130 within seconds, print its summary (and write summary.json
once the run's log has begun), release the run and leave no process behind; the
next launch resumes from the newest complete checkpoint. One launch's driver is
SIGKILLed while training instead: nothing of it may be left running, and the
next launch takes its lock over. The last launch runs to the end: the steps add up to one
uninterrupted run's, and the model is exported. One of its workers is SIGKILLed on the way
(it may restart once, --max-failures 1): Ray Train restarts the group from the latest
checkpoint, and the launch's own local Ray runs only the processes such a run needs. (That was
a test of its own in test_train_local.py, a cold launch of the same run: it rides on this last
launch, which is one anyway.) Moments inside the workers are reached through
launcher.faultpoint (LAUNCHER_FAULT_PAUSE), so the signal lands there every time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from harness import ROOT, Launch

from launcher.faultpoint import ENV, MARK_ENV
from launcher.storage import Storage, complete_checkpoints
from launcher.storage.runlog import read_jsonl

pytestmark = pytest.mark.integration

EPOCHS = 30  # launches until the last two ask for this many: none gets that far
STEPS_PER_EPOCH = 23  # digits-mlp, 2 workers, the default batch


def newest_epoch(storage: str, name: str) -> int:
    done = complete_checkpoints(Storage.resolve(storage), name)
    return done[-1][0].epoch if done else 0


def stopped(launch: Launch, storage: str, name: str, *, logged: bool = True) -> dict:
    """Checks every stopped launch must pass; returns its summary."""
    code = launch.finish(timeout_s=120)
    took = launch.finish_s = time.time() - launch.signalled_at
    assert code == 130, launch.stderr[-4000:]
    assert took < 45, f"{took:.0f}s from the signal to the exit"
    assert "SIGTERM received" not in launch.stderr  # Ray's C++ handler never has the last word
    summary = launch.summary()
    assert summary["status"] == "cancelled", summary
    run_dir = os.path.join(storage, name)
    if logged:
        assert json.load(open(os.path.join(run_dir, "summary.json")))["status"] == "cancelled"
    assert not os.path.exists(os.path.join(run_dir, "launch.lock"))  # the run is free again
    left = launch.left()
    assert not left, [(p.pid, p.name()) for p in left]
    # What the summary says was done is what storage holds, complete.
    assert summary["epochs_completed"] == newest_epoch(storage, name), summary
    return summary


def pause_at(point: str, marks) -> dict[str, str]:
    """The environment that holds a launch at ``point`` and marks the moment in ``marks/point``."""
    return {ENV: f"{point}:120", MARK_ENV: str(marks / point)}


def test_a_signal_at_each_moment_stops_the_launch_and_the_run_loses_nothing(storage, tmp_path):
    # SIGINT and SIGTERM take turns over the moments (SIGTERM is a scheduler's or `launcher stop`'s).
    name = "moments"
    def args_to(epochs: int) -> tuple[str, ...]:
        return "--storage", storage, "--name", name, "--epochs", str(epochs)

    args = args_to(EPOCHS)
    first_signal, other = signal.SIGINT, signal.SIGTERM
    marks = tmp_path / "marks"
    marks.mkdir()
    took = {}

    # 1. While Ray starts: nothing begun, nothing written. (SIGTERM here takes its own path: Ray's
    #    start-up installs a handler of its own; Ctrl-C there: test_driver_faults.py.)
    launch = Launch(*args)
    launch.wait_for("starting a local Ray instance")
    time.sleep(0.5)  # inside ray.init
    launch.signal(other)
    s = stopped(launch, storage, name, logged=False)
    assert s["epochs_completed"] == 0 and "epoch 1/" not in launch.stderr
    assert not os.path.exists(os.path.join(storage, name, "launches.jsonl"))
    took["Ray start"] = launch.finish_s

    # 2. While the workers start (every worker paused before joining its process group).
    launch = Launch(*args, env=pause_at("workers-start", marks))
    launch.wait_until(lambda: os.path.exists(marks / "workers-start"))
    launch.signal(first_signal)
    s = stopped(launch, storage, name)
    assert s["epochs_completed"] == 0
    took["workers start"] = launch.finish_s

    # 3. While training, after epoch 2; first, a second launch of the run is refused meanwhile.
    launch = Launch(*args)
    launch.wait_for(f"epoch 2/{EPOCHS}")
    second = subprocess.run([sys.executable, "-m", "launcher", "run", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"run {name} is being trained by another launch (pid {launch.proc.pid} on" in lines[0]
    launch.signal(other)
    s = stopped(launch, storage, name)
    trained = s["epochs_completed"]
    assert 2 <= trained < EPOCHS, s
    took["training"] = launch.finish_s

    # 3b. The driver SIGKILLed while training: no summary can be written, but the reaper stops its
    #     local Ray, and its lock is taken over by the next launch (same host, its pid is gone).
    launch = Launch(*args)
    launch.wait_for(f"epoch {trained + 2}/{EPOCHS}")
    launch.note_family()
    assert len(launch.seen) >= 4, launch.seen  # Ray's GCS, raylet, agents, the workers
    launch.signal(signal.SIGKILL)
    assert launch.finish(timeout_s=30) == -signal.SIGKILL
    left = launch.left(grace_s=30)
    assert not left, [(p.pid, p.name()) for p in left]
    took["SIGKILL, all gone"] = time.time() - launch.signalled_at
    assert os.path.exists(os.path.join(storage, name, "launch.lock"))
    trained = newest_epoch(storage, name)
    assert trained >= s["epochs_completed"] + 2

    # 4. While rank 0 hands its first checkpoint of the launch over: that epoch is not kept.
    launch = Launch(*args, env=pause_at("checkpoint", marks))
    launch.wait_until(lambda: os.path.exists(marks / "checkpoint"))
    launch.signal(first_signal)
    s = stopped(launch, storage, name)
    assert s["resumed_from"]["epoch"] == trained and s["epochs_completed"] == trained, s
    took["checkpoint upload"] = launch.finish_s

    # 5. While rank 0 exports the final model (the run now asks for one more epoch): the final
    #    checkpoint is not kept either.
    final = trained + 1
    launch = Launch(*args_to(final), env=pause_at("export", marks))
    launch.wait_until(lambda: os.path.exists(marks / "export"))
    launch.signal(other)
    s = stopped(launch, storage, name)
    assert s["resumed_from"]["epoch"] == trained and s["epochs_completed"] == trained, s
    assert s.get("model") is None and not os.path.exists(os.path.join(storage, name, "model"))
    took["export"] = launch.finish_s

    # The last launch finishes the run, asking for 30 epochs more; it may restart once. Epochs take
    # a fraction of a second here: 30 of them leave the workers alive for several seconds after its
    # second epoch is printed, when one of them is SIGKILLed.
    last = final + 29
    launch = Launch(*args_to(last), "--max-failures", "1", "--profile-startup")
    launch.wait_for(f"epoch {final + 1}/{last}")
    # The launch's own local Ray has no node anyone could drain and no autoscaler: Ray Train's
    # preemption watcher and autoscaling coordinator are left out there; the launcher's progress
    # board is not (this run can restart). Only this launch's processes: another test's run may be
    # training beside it (pytest -n 2).
    children = psutil.Process(launch.proc.pid).children(recursive=True)
    titles = [" ".join(p.cmdline()) for p in children]
    victims = [p.pid for p, t in zip(children, titles) if t.startswith("ray::RayTrainWorker")]
    assert victims, f"no Ray Train worker process found: {titles}"
    assert any(t.startswith("ray::ProgressBoard") for t in titles), titles
    assert sum(t.startswith("ray::RayTrainWorker") for t in titles) == 2, titles
    assert not [t for t in titles if "PreemptionWatcher" in t or "AutoscalingCoordinator" in t], titles
    # ... nor Ray's log monitor, API server and autoscaler monitor (nobody reads them without
    # --verbose), while the raylet and the GCS run on.
    assert not [t for t in titles if any(d in t for d in ("log_monitor.py", "dashboard/dashboard.py",
                                                          "autoscaler/_private/monitor.py"))], titles
    assert any("raylet/raylet" in t for t in titles) and any("gcs_server" in t for t in titles), titles
    os.kill(victims[-1], signal.SIGKILL)
    assert launch.finish() == 0, launch.stderr[-4000:]
    done = launch.summary()
    assert done["restarts"] == 1 and "restarted from the latest checkpoint" in launch.stderr, done
    assert len(done["recovery_s"]) == 1 and 0 < done["recovery_s"][0] < 120, done  # failure -> first step after
    # The steps add up to one uninterrupted run's.
    assert f"resumed after step {trained * STEPS_PER_EPOCH}, in epoch {final}/{last}" in launch.stderr
    assert "start-up profile:" in launch.stderr and "time to first step (from process start)" in launch.stderr
    assert done["startup"]["time_to_first_step_s"] > done["startup"]["phases"]["Ray start or connect"]
    assert done["status"] == "succeeded" and done["resumed_from"]["epoch"] == trained, done
    assert done["epochs_completed"] == last and done["steps_completed"] == last * STEPS_PER_EPOCH, done
    assert done["model"] and os.path.exists(os.path.join(storage, name, "model", "model.json"))
    launches = read_jsonl(open(os.path.join(storage, name, "launches.jsonl")).read())
    assert len([r for r in launches if r.get("event") == "start"]) == 6, launches  # Ray start logged nothing
    print("signal to exit:", ", ".join(f"{k} {v:.1f}s" for k, v in took.items()))
