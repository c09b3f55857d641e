"""The warm head's pool (launcher.worker.pool): which idle processes a refill counts, what a
run's job adds, what the processes import. Fast: files, no Ray."""

from __future__ import annotations

import json
import sys

from launcher import frameworks
from launcher.worker import pool


def _process(proc, pid: int, cmdline: bytes, **environ: str) -> None:
    folder = proc / str(pid)
    folder.mkdir()
    (folder / "cmdline").write_bytes(cmdline)
    (folder / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()) + b"\0")


def test_a_refill_counts_only_this_raylets_idle_processes_of_the_same_settings(tmp_path, monkeypatch):
    proc = tmp_path / "proc"
    proc.mkdir()
    monkeypatch.setenv("RAY_RAYLET_PID", "100")
    ours = {"LAUNCHER_PRELOAD": "torch", "LAUNCHER_STATE_DIR": "/s"}
    _process(proc, 11, b"ray::IDLE\0", RAY_RAYLET_PID="100", PATH="/bin", **ours)
    _process(proc, 12, b"ray::IDLE\0", RAY_RAYLET_PID="100", **ours)
    _process(proc, 13, b"ray::RayTrainWorker.run\0", RAY_RAYLET_PID="100", **ours)  # busy
    _process(proc, 14, b"ray::IDLE\0", RAY_RAYLET_PID="200", **ours)  # another Ray's
    _process(proc, 15, b"ray::IDLE\0", RAY_RAYLET_PID="100", LAUNCHER_PRELOAD="xgboost", LAUNCHER_STATE_DIR="/s")
    _process(proc, 16, b"ray::IDLE\0", RAY_RAYLET_PID="100")  # a default worker: no settings of ours
    (proc / "self").mkdir()  # not a process folder
    (proc / "17").mkdir()  # gone before it could be read
    assert sorted(pool.idle_matching(ours, str(proc), "100")) == [11, 12]
    assert sorted(pool.idle_matching(ours, str(proc))) == [11, 12, 14]  # the raylet not known: any
    assert pool.idle_matching(ours, str(tmp_path / "nowhere")) == []


def test_the_pool_is_asked_for_in_the_runtime_environment_ray_gives_ray_trains_actors():
    """The form of the text Ray gives an actor (Ray 2.60: as an actor on the warm head printed its
    own): the job's runtime environment as the driver's context returns it, the actor's variables
    merged in, compact with sorted keys. A refill in any other text would start processes that no
    actor of the next run is given (test_tour checks it on a live head)."""
    job = ('{"env_vars": {"LAUNCHER_USAGE_S": "2", "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": '
           '"launcher.worker.pool.preload"}, "worker_process_setup_hook": "launcher.worker.pool.preload"}')
    train = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2", "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0"}
    assert pool.actor_env(job, train) == (
        '{"env_vars":{"LAUNCHER_USAGE_S":"2","RAY_TRAIN_HEALTH_CHECK_INTERVAL_S":"0.2",'
        '"RAY_WARN_BLOCKING_GET_INSIDE_ASYNC":"0","__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR":'
        '"launcher.worker.pool.preload"},"worker_process_setup_hook":"launcher.worker.pool.preload"}')
    assert pool.actor_env("", train) == '{"env_vars":' + json.dumps(train, separators=(",", ":")) + "}"


def test_a_warm_head_job_runs_the_hook_with_its_framework():
    env = pool.job_env("torch")
    assert env == {"worker_process_setup_hook": pool.HOOK, "env_vars": {pool.FRAMEWORK_ENV: "torch"}}
    module, _, function = pool.HOOK.rpartition(".")
    assert module == pool.__name__ and callable(getattr(pool, function))  # Ray imports it by this name


def test_the_hook_imports_the_frameworks_worker_modules_and_never_fails(monkeypatch):
    modules = frameworks.get("torch").worker_modules()
    assert {"torch", "launcher.worker.session", "launcher.worker.torch_loop"} <= set(modules), modules
    assert frameworks.get("tensorflow").worker_modules() == ("launcher.worker.entry",)  # configured before import
    monkeypatch.setenv("RAY_JOB_ID", "ffffffff")  # a pool process: started for no job
    monkeypatch.setenv(pool.FRAMEWORK_ENV, "no-such-framework")
    pool.preload()  # a framework it cannot name: nothing imported, nothing raised
    monkeypatch.setenv(pool.FRAMEWORK_ENV, "torch")
    pool.preload()
    assert {"torch", "launcher.worker.session", "launcher.worker.torch_loop"} <= set(sys.modules)


def test_a_process_started_for_a_jobs_actor_imports_nothing_ahead(monkeypatch):
    monkeypatch.setenv("RAY_JOB_ID", "05000000")
    monkeypatch.setenv(pool.FRAMEWORK_ENV, "xgboost")
    monkeypatch.delitem(sys.modules, "launcher.worker.xgb_loop", raising=False)
    pool.preload()
    assert "launcher.worker.xgb_loop" not in sys.modules


def test_up_waits_for_pool_processes_that_stand_still_and_finds_its_raylet(tmp_path):
    from launcher.driver import localhead

    proc = tmp_path / "proc"
    proc.mkdir()
    for pid in (21, 22):
        _process(proc, pid, b"ray::IDLE\0", RAY_RAYLET_PID="300", LAUNCHER_PRELOAD="torch")
        # utime and stime are fields 14 and 15 of /proc/PID/stat; a file that does not change is
        # a process whose CPU time stands still: done importing
        (proc / str(pid) / "stat").write_text(f"{pid} (python) S 300 1 1 0 -1 0 0 0 0 0 7 3 0 0 20 0 1 0")
    _process(proc, 300, b"/venv/ray/core/src/ray/raylet/raylet\0--node_ip_address=127.0.0.1\0")
    (proc / "300" / "stat").write_text("300 (raylet) S 299 1 1 0")
    assert pool.wait_ready(300, 2, timeout_s=5, proc=str(proc)) == 2
    assert pool.wait_ready(301, 2, timeout_s=0, proc=str(proc)) == 0  # another raylet's: none, at the deadline
    assert localhead.raylet_of(299, str(proc)) == 300 and localhead.raylet_of(298, str(proc)) is None
