"""The warm head's pool: worker processes that are ready before a run asks for them.

On a warm head (``launcher up``) every run's Ray Train actors (its controller, the controller's
synchronisation actor, one actor per worker) would each start as a new Python process and
import Ray Train, the framework and the launcher's worker code: most of a warm start
(docs/results/overhead.md). Ray hands an actor an idle process of its node when their runtime
environments are the same, and its raylet starts such processes on request, kept for a while
(its ``PrestartWorkers`` call). So:

- a run on the warm head adds :func:`job_env` to its job's runtime environment: Ray runs
  :func:`preload` in each new process of the job, which imports what the run's framework trains
  with, before any actor arrives;
- when the run's workers are done (whatever the outcome: a run stopped or failed is often
  launched again at once), its driver calls :func:`refill`: it asks the raylet for as many
  processes as the run had actors, in the runtime environment Ray Train gives them (the job's,
  with Ray Train's settings: :func:`actor_env`), kept for the head's pool time (``launcher up
  --pool-minutes``). The next run of the framework starts its actors in them, ready. The job's
  runtime environment holds only the framework and the hook: a run's settings travel in its
  config (launcher.driver.session.Connection.env), so the next run's other settings still find
  the pool; a user workload's folder, shipped in the runtime environment, does not.

Idle processes hold memory (a torch worker about 0.4 GB) until the pool time ends; a refill
adds only what its environment's pool lacks, which it sees through /proc: Linux only, no pool
elsewhere.
"""

from __future__ import annotations

import importlib
import json
import os
import time

from launcher import _ray, frameworks, settings

# The run's framework, for :func:`preload` (a variable of the job's runtime environment).
FRAMEWORK_ENV = settings.PRELOAD
# Ray's name for a setup hook given as a module path: "module.function".
HOOK = "launcher.worker.pool.preload"
# Actors of a run besides its workers: Ray Train's controller and its synchronisation actor
# (the launcher drops the placement-group cleaner: launcher.backends.raytrain).
RAY_TRAIN_ACTORS = 2
# Ray Train's own modules that its controller and worker actors import first.
RAY_TRAIN_MODULES = ("RayTrainWorker", "TrainController")


def job_env(framework: str) -> dict:
    """What a warm-head run adds to its job's runtime environment."""
    return {"worker_process_setup_hook": HOOK, "env_vars": {FRAMEWORK_ENV: framework}}


def preload() -> None:
    """Ray's setup hook in each new process of a warm-head job: in a process started for the
    pool, import Ray Train's actor modules and the framework's worker modules. A process Ray
    starts on demand for one of the job's actors (no pool process matched) imports only what its
    actor needs, as it would without the pool: Ray names its job in ``RAY_JOB_ID``, where a
    pool process, started for no job, has the nil id (all ``f``). Never raises: a module that
    fails to import here fails, and says why, where the run imports it."""
    if os.environ.get("RAY_JOB_ID", "").strip("f"):
        return
    modules = ["ray", *(_ray.PRIVATE[name][0].partition(":")[0] for name in RAY_TRAIN_MODULES)]
    try:
        modules += frameworks.get(os.environ.get(FRAMEWORK_ENV, "")).worker_modules()
    except Exception:  # noqa: BLE001 - no framework named (or none we know): Ray Train's only
        pass
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - see the docstring
            pass


def actor_env(job_env: str, train_env: dict[str, str]) -> str:
    """The runtime environment Ray Train gives the controller and the workers of a run, serialised
    as Ray serialises it: the job's (``job_env``, as Ray holds it) with Ray Train's settings
    (``train_env``, :func:`train_env_vars`) added, as compact JSON with sorted keys. An idle process
    serves only an actor whose text is the same."""
    env = json.loads(job_env or "{}")
    env["env_vars"] = {**env.get("env_vars", {}), **train_env}
    return json.dumps(env, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def train_env_vars() -> dict[str, str]:
    """What Ray Train adds to the runtime environment of a run's actors, from this process's
    environment (after launcher.driver.trainer.apply_ray_train_env)."""
    added = dict(_ray.resolve("train_env_vars")())
    added.setdefault(_ray.resolve("WARN_BLOCKING_ENV"), _ray.resolve("WARN_BLOCKING_DEFAULT"))
    return added


def refill(size: int, keep_alive_s: int, raylet: int | None) -> int:
    """From the driver of a warm-head run whose workers are done: have ``size`` idle processes
    in its actors' runtime environment kept for ``keep_alive_s`` (``raylet``: the head's, whose
    idle processes count); returns how many were asked for."""
    if not os.path.isdir("/proc"):  # it could not see what it already has: no pool (Linux only)
        return 0
    import ray

    env = actor_env(ray.get_runtime_context().get_runtime_env_string(), train_env_vars())
    need = size - len(idle_matching(json.loads(env)["env_vars"], raylet=str(raylet) if raylet else None))
    if need > 0:
        _ray.prestart_workers(env, need, keep_alive_s)
    return max(need, 0)


def wait_ready(raylet: int, size: int, timeout_s: float, proc: str = "/proc") -> int:
    """Wait until ``raylet`` has ``size`` pool processes of a torch or other framework run that
    are done importing (their CPU time stands still for half a second), or ``timeout_s`` has
    passed; returns how many are ready. ``launcher up`` waits so, so that the first run finds
    them ready rather than still importing beside it on the same cores."""
    deadline = time.time() + timeout_s
    while True:
        pids = idle_matching({FRAMEWORK_ENV: os.environ.get(FRAMEWORK_ENV, "torch")}, proc, str(raylet))
        before = {pid: _cpu_ticks(pid, proc) for pid in pids}
        time.sleep(0.5)
        ready = [pid for pid in pids if before[pid] is not None and _cpu_ticks(pid, proc) == before[pid]]
        if len(ready) >= size or time.time() > deadline:
            return len(ready)


def _cpu_ticks(pid: int, proc: str) -> int | None:
    try:
        with open(os.path.join(proc, str(pid), "stat"), encoding="ascii", errors="replace") as f:
            fields = f.read().rpartition(")")[2].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def idle_matching(env_vars: dict[str, str], proc: str = "/proc", raylet: str | None = None) -> list[int]:
    """Pids of a raylet's idle worker processes (``raylet``: its pid; any raylet's where it is
    not known) whose environment holds ``env_vars`` (those of a runtime environment: a process
    started for it has them). Linux only (:func:`refill` asks for none elsewhere)."""
    found = []
    for pid in (p for p in _listdir(proc) if p.isdigit()):
        try:
            with open(os.path.join(proc, pid, "cmdline"), "rb") as f:
                if not f.read().startswith(b"ray::IDLE"):
                    continue
            with open(os.path.join(proc, pid, "environ"), "rb") as f:
                pairs = dict(item.split("=", 1) for item in f.read().decode(errors="replace").split("\0")
                             if "=" in item)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if raylet in (None, pairs.get("RAY_RAYLET_PID")) and all(pairs.get(k) == v for k, v in env_vars.items()):
            found.append(int(pid))
    return found


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
