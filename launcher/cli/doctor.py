"""``launcher doctor``: which frameworks and backends can run on this machine.

Every framework and every (backend, framework) pair gets one line: usable,
or why not and how to fix it. Imports that are slow or can crash the process
(TensorFlow, Horovod's compiled extensions) run in subprocesses, concurrently,
so the command takes about as long as the slowest single import.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from launcher import _deferred

FRAMEWORKS = ("torch", "tensorflow", "xgboost", "scikit-learn")
SETUP_HINT = "run scripts/setup-env (or pip install -e .) to install the pinned dependencies"
# How to import each framework the way the launcher does (TF: legacy tf.keras).
FRAMEWORK_PROBES = {
    "torch": ("import torch; print(torch.__version__)", {}),
    "tensorflow": ("import tensorflow as tf, tf_keras; print(tf.__version__)",
                   {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}),
    "xgboost": ("import xgboost; print(xgboost.__version__)", {}),
    # scikit-learn: not a --framework of its own; trainer packages (Vertex AI's sklearn containers) use it.
    "scikit-learn": ("import sklearn; print(sklearn.__version__)", {}),
}
TRAINING_FRAMEWORKS = ("torch", "tensorflow", "xgboost")  # those a backend trains (--framework)


@dataclass
class Check:
    """One line of the report."""

    kind: str          # "framework" or "backend"
    name: str          # framework name, or "backend/framework"
    usable: bool
    detail: str = ""   # version when usable; why not and how to fix otherwise

    def line(self) -> str:
        state = "usable" if self.usable else "NOT usable"
        return f"{self.kind:<9} {self.name:<20} {state}" + (f": {self.detail}" if self.detail else "")


@functools.lru_cache(maxsize=None)  # one answer per process, as for the backends' probes
def probe_framework(name: str) -> tuple[bool, str]:
    """(importable, version or why not), from a fresh interpreter."""
    code, env = FRAMEWORK_PROBES[name]
    try:
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return False, f"importing {name} took over 3 minutes"
    if done.returncode == 0:
        return True, f"{name} {done.stdout.strip().splitlines()[-1]}"
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    why = lines[-1][:200] if lines else f"exit status {done.returncode}"
    extra = _deferred.extra_of(name)  # TensorFlow and XGBoost come in extras of their own
    fix = f"install the launcher's {extra} extra: {_deferred.install_command(extra)}" if extra else SETUP_HINT
    return False, f"{name} does not import ({why}); {fix}"


def backend_check(backend, framework: str, framework_ok: tuple[bool, str]) -> Check:
    name = f"{backend.name}/{framework}"
    if framework not in backend.frameworks:
        return Check("backend", name, False,
                     f"the {backend.name} backend does not run {framework} in this launcher version; "
                     f"use --backend {'/'.join(backend_names_for(framework)) or '(none yet)'}")
    if not framework_ok[0]:
        return Check("backend", name, False, f"needs {framework}: {framework_ok[1]}")
    why = backend.unavailable_reason(framework)
    return Check("backend", name, why is None, why or backend.description)


def backend_names_for(framework: str) -> list[str]:
    from launcher import backends

    return [b.name for b in backends.REGISTRY if framework in b.frameworks]


def diagnose() -> list[Check]:
    """Every framework and every backend/framework pair, probed concurrently."""
    from launcher import backends

    for backend in backends.REGISTRY:  # the checks as they stand now, not as a launch last found them
        backend.forget_checks()
    with ThreadPoolExecutor(max_workers=8) as pool:
        fw_futures = {f: pool.submit(probe_framework, f) for f in FRAMEWORKS}
        # Warm the backends' own (cached) probes in parallel with the framework imports.
        warm = [pool.submit(b.unavailable_reason, f) for b in backends.REGISTRY for f in b.frameworks]
        fw = {f: fut.result() for f, fut in fw_futures.items()}
        for w in warm:
            w.result()
    checks = [Check("framework", f, ok, detail) for f, (ok, detail) in fw.items()]
    for backend in backends.REGISTRY:
        checks.extend(backend_check(backend, f, fw[f]) for f in TRAINING_FRAMEWORKS)
    return checks


def add_parsers(sub) -> None:
    doc = sub.add_parser("doctor", help="which frameworks and backends are usable here, and how to fix the rest")
    doc.add_argument("--json", action="store_true", help="print the checks as a JSON list on stdout")


def cmd_doctor(args: argparse.Namespace) -> int:
    """Exit 0 when the default (torch on the native backend) is usable, else 1."""
    checks = diagnose()
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        print("\n".join(c.line() for c in checks))
    default = next(c for c in checks if c.name == "native/torch")
    return 0 if default.usable else 1


COMMANDS = {"doctor": cmd_doctor}
