"""Every ``LAUNCHER_*`` environment variable, declared once: its name, its default, what it does.

Each is a :class:`Var`: a ``str`` (the variable's name, usable wherever a name goes:
``os.environ[USAGE_S]``, ``{RUN_NAME: name}``) that also carries its default and its
description, and reads itself with :meth:`Var.get`. :data:`TABLE` lists them in order;
the docs' reference page is generated from it, and ``tests/test_settings.py`` fails on a
``LAUNCHER_`` string anywhere else in ``launcher/`` and on a variable used anywhere in the
repository but missing here (``workloads/``, which never imports the launcher, ``scripts/``
and the test suite name theirs themselves).
"""

from __future__ import annotations

import os

PREFIX = "LAUNCHER_"
TABLE: list["Var"] = []


class Var(str):
    """An environment variable: its name, its default (as it would be written; None: unset),
    what it does, and who sets it: the ``user``; the launcher, for a ``program``'s ranks or
    for itself (``internal``); ``scripts/``'s user; the ``tests``."""

    default: str | None
    help: str
    who: str

    def __new__(cls, name: str, default: str | None, help: str, who: str = "user") -> "Var":
        var = super().__new__(cls, name)
        var.default, var.help, var.who = default, help, who
        TABLE.append(var)
        return var

    def __reduce__(self):  # pickled (a key of an environment sent to Ray's workers) as the bare name
        return str, (str(self),)

    def get(self) -> str | None:
        """The variable's value; its default when it is unset or empty."""
        return os.environ.get(self) or self.default


# -- what a user sets -------------------------------------------------------------------------
CACHE = Var("LAUNCHER_CACHE", "~/.cache/launcher",
            "each node's cache of gs:// data, streamed shards and shipped program folders, and which "
            "Horovod builds passed their import check")
DATA_CACHE_GB = Var("LAUNCHER_DATA_CACHE_GB", "16",
                    "the most GB of streamed shards a node keeps (a run's `--data-cache-gb` sets it on its workers)")
ENV_CACHE = Var("LAUNCHER_ENV_CACHE", "~/.cache/launcher/envs",
                "where each node keeps the environments a program's declared dependencies are installed into")
CODE_LIMIT_MB = Var("LAUNCHER_CODE_LIMIT_MB", "100", "the largest program or workload folder shipped to the nodes")
GCS_RETRY_S = Var("LAUNCHER_GCS_RETRY_S", "120", "how long Cloud Storage's transient errors are retried")
JOB_TIMEOUT_S = Var("LAUNCHER_JOB_TIMEOUT_S", "60", "how long each answer of a cluster's Ray job server may take")
STATE_DIR = Var("LAUNCHER_STATE_DIR", "~/.cache/launcher",
                "where the warm local Ray head and the prediction servers keep their state and logs")
USAGE_S = Var("LAUNCHER_USAGE_S", "5", "seconds between a worker's CPU, memory and GPU samples; 0 turns them off")
STEP_HOOKS = Var("LAUNCHER_STEP_HOOKS", "1",
                 "0: no gradient and optimizer hooks (a step's sync and optimizer time count as compute)")
PG_CLEANER = Var("LAUNCHER_PG_CLEANER", None, "1 keeps Ray Train's placement group cleaner (left out otherwise)")
REHEARSAL_KEEP = Var("LAUNCHER_REHEARSAL_KEEP", None, "set: `launcher cluster rehearse` keeps its folder (to read its logs)")
COMPUTE_ENDPOINT = Var("LAUNCHER_COMPUTE_ENDPOINT", None,
                       "the Compute Engine API's address (a stand-in's, as the rehearsal sets on its head)")

# -- what a program's ranks are given ---------------------------------------------------------
RUN_NAME = Var("LAUNCHER_RUN_NAME", None, "the run's `--name`", "program")
ATTEMPT = Var("LAUNCHER_ATTEMPT", None, "the worker group's id: a new one after each restart", "program")
PREEMPTION_DEADLINE_S = Var("LAUNCHER_PREEMPTION_DEADLINE_S", "30",
                            "seconds a program has after its SIGTERM on a preemption notice", "program")
PREEMPTION_FILE = Var("LAUNCHER_PREEMPTION_FILE", None, "a file that appears just before that SIGTERM, with "
                      '`{"deadline_unix_s", "seconds_left"}`', "program")

# -- what the launcher sets for itself --------------------------------------------------------
RAY_TRAIN_SET = Var("LAUNCHER_RAY_TRAIN_SET", None,
                    "the Ray Train settings the launcher set, so a process it starts can tell them from a user's",
                    "internal")
PRELOAD = Var("LAUNCHER_PRELOAD", None, "the framework a warm-head run's ready processes import ahead, in "
              "their job's runtime environment (launcher.worker.pool)", "internal")
WORKLOAD_CODE = Var("LAUNCHER_WORKLOAD_CODE", None, "1 where a user workload's folder was shipped with the job: "
                    "workers load that copy (read by workloads/user.py)", "internal")
LOCAL_RAY = Var("LAUNCHER_LOCAL_RAY", None, "1 on every process of a local Ray the launcher started (a launch's "
                "own, `launcher up`'s head): a run begun inside one (a tuning trial) knows that no node of it is "
                "preempted and no autoscaler answers", "internal")
LAB_ID = Var("LAUNCHER_LAB_ID", None, "on every process of a lab's cluster, so the lab stops only its own", "internal")

# -- what scripts/ reads ---------------------------------------------------------------------
EXTRAS = Var("LAUNCHER_EXTRAS", None, "the extras scripts/setup-env and scripts/run install (comma-separated, or all)",
             "scripts")
VENV = Var("LAUNCHER_VENV", ".venv", "the virtual environment scripts/ make and use", "scripts")
WITH_HOROVOD = Var("LAUNCHER_WITH_HOROVOD", "0", "1: scripts/setup-env builds Horovod too (scripts/test's default)",
                   "scripts")
SKIP_HOROVOD = Var("LAUNCHER_SKIP_HOROVOD", "0", "1: no Horovod build, whatever `LAUNCHER_WITH_HOROVOD` says", "scripts")

# -- what the tests and benchmarks set -----------------------------------------------------------------------
FAULT_PAUSE = Var("LAUNCHER_FAULT_PAUSE", None,
                  "`POINT[:SECONDS]`: the process reaching that point of launcher/faultpoint.py waits there", "tests")
FAULT_MARK = Var("LAUNCHER_FAULT_MARK", None, "a file each fault point reached is written to", "tests")
BENCH_BARE = Var("LAUNCHER_BENCH_BARE", None, "set by benchmarks/bare.py: a workload runs without Ray", "tests")
TEST_PROJECT = Var("LAUNCHER_TEST_PROJECT", None, "a Google Cloud project the cloud tests (`-m cloud`) may use", "tests")
TEST_COLD = Var("LAUNCHER_TEST_COLD", None, "set: each test launch starts its own Ray (no warm head)", "tests")
