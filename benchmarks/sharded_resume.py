"""A sharded run stopped on 4 workers and resumed on 2, 3 and 4: the loss trajectory each
resumed run trains, against the uninterrupted run's.

examples/gpt.py (small) trains with ``--strategy fsdp`` for 2 epochs on 4 workers, once
whole (the reference), once stopped with Ctrl-C right after its first step checkpoint. The
stopped run's folder is copied three times and each copy resumed on another worker count,
with the global batch kept at 12 samples (3 per worker on 4, 4 on 3, 6 on 2): the same
samples in the same global batches as the reference, so the losses may differ by float
rounding only (the sums over ranks add up in another order). On 4 workers the resumed run
must end with the reference's weights, bit for bit.

Each run is a ``launcher run`` subprocess; the stop uses the launcher's own fault point
(``launcher.faultpoint``: rank 0 pauses after its step checkpoint until the Ctrl-C).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

from launcher.storage import RunRecord, Storage

# launcher/faultpoint.py's variables (a test hook, not the public API): pause rank 0 at a named point.
ENV, MARK_ENV = "LAUNCHER_FAULT_PAUSE", "LAUNCHER_FAULT_MARK"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt.py") + ":train"
GLOBAL_BATCH, STOPPED_ON, RESUMED_ON = 12, 4, (2, 3, 4)
PARAMS = {"d_model": 64, "layers": 2, "heads": 2, "context": 32, "max_chars": 12000, "eval_batches": 0}
EVERY = 6  # steps between step checkpoints: the stop comes after the first


def _args(workers: int, storage: str, name: str) -> list[str]:
    params = [x for k, v in PARAMS.items() for x in ("--param", f"{k}={v}")]
    return [sys.executable, "-m", "launcher", "run", "--workload", GPT, *params, "--strategy", "fsdp",
            "--epochs", "2", "--checkpoint-every-steps", str(EVERY), "--workers", str(workers),
            "--batch-size", str(GLOBAL_BATCH // workers), "--cpus-per-worker", "0.5", "--storage", storage,
            "--name", name, "--json"]


def _summary(proc: subprocess.Popen, timeout: float = 900) -> dict:
    out, err = proc.communicate(timeout=timeout)
    lines = [line for line in out.strip().splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"a run printed no summary (exit {proc.returncode}): {err.strip()[-400:]}")
    return json.loads(lines[-1])


def _epochs(storage: str, name: str) -> list[dict]:
    last: dict[int, dict] = {}
    for r in RunRecord(Storage.resolve(storage), name).metrics():
        if r.get("kind") == "epoch":
            last[int(r["epoch"])] = r  # a launch's report of an epoch; the resumed launch's comes last
    return [last[e] for e in sorted(last)]


def run(note: Callable[[str], None]) -> dict:
    """The reference, the stopped run and its three resumes; the trajectories and their gaps."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with tempfile.TemporaryDirectory(prefix="launcher-sharded-resume-") as tmp:
        storage = os.path.join(tmp, "runs")
        note(f"reference: {STOPPED_ON} workers, uninterrupted")
        reference = _summary(subprocess.Popen(_args(STOPPED_ON, storage, "reference"), cwd=ROOT, env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        note(f"stopped: {STOPPED_ON} workers, Ctrl-C after the step checkpoint of step {EVERY}")
        mark = os.path.join(tmp, "step-checkpoint")
        proc = subprocess.Popen(_args(STOPPED_ON, storage, "stopped"), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**env, ENV: "step-checkpoint:300", MARK_ENV: mark})
        deadline = time.time() + 600
        while not os.path.exists(mark):
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"the run to stop ended first: {proc.communicate()[1].strip()[-400:]}")
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stopped = _summary(proc)
        resumed = {}
        for n in RESUMED_ON:
            name = f"resumed_on_{n}"
            shutil.copytree(os.path.join(storage, "stopped"), os.path.join(storage, name),
                            ignore=shutil.ignore_patterns("checkpoint_manager_snapshot.json"))
            note(f"resumed on {n} workers (batch {GLOBAL_BATCH // n} each)")
            resumed[n] = _summary(subprocess.Popen(_args(n, storage, name), cwd=ROOT, env=env,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        base = _epochs(storage, "reference")
        out = {"reference": {"summary": _short(reference), "epochs": _losses(base)},
               "stopped": _short(stopped), "resumed": {}}
        for n, s in resumed.items():
            epochs = _epochs(storage, f"resumed_on_{n}")
            out["resumed"][n] = {"summary": _short(s), "epochs": _losses(epochs),
                                 "max_rel_gap": _gap(base, epochs),
                                 "same_weights": s.get("weights_sha256") == reference.get("weights_sha256")}
        return out


def _short(s: dict) -> dict:
    return {k: s.get(k) for k in ("status", "steps_completed", "resumed_from", "final_workers", "weights_sha256")}


def _losses(epochs: list[dict]) -> list[dict]:
    return [{"epoch": int(e["epoch"]), "train_loss": e.get("train_loss"), "val_loss": e.get("val_loss")}
            for e in epochs]


def _gap(base: list[dict], got: list[dict]) -> float | None:
    """The largest relative difference of an epoch's train or validation loss from the reference's."""
    if len(base) != len(got):
        return None
    gaps = [abs(g[k] - b[k]) / abs(b[k]) for b, g in zip(base, got) for k in ("train_loss", "val_loss")
            if b.get(k) is not None and g.get(k) is not None and b[k]]
    return max(gaps) if gaps else None


def format_result(result: dict) -> str:
    """The trajectories side by side, and what each resume shows."""
    lines = [f"# resume of a sharded run stopped on {STOPPED_ON} workers after its step checkpoint of step "
             f"{EVERY} (global batch {GLOBAL_BATCH})",
             "| run | epoch | train_loss | val_loss |", "|---|---|---|---|"]
    for e in result["reference"]["epochs"]:
        lines.append(f"| reference ({STOPPED_ON}) | {e['epoch']} | {e['train_loss']:.7f} | {e['val_loss']:.7f} |")
    for n, r in result["resumed"].items():
        for e in r["epochs"]:
            lines.append(f"| resumed on {n} | {e['epoch']} | {e['train_loss']:.7f} | {e['val_loss']:.7f} |")
    lines.append("")
    for n, r in result["resumed"].items():
        s = r["summary"]
        gap = "n/a" if r["max_rel_gap"] is None else f"{r['max_rel_gap']:.2e}"
        lines.append(f"# resumed on {n}: {s['status']}, from {s['resumed_from']}, {s['steps_completed']} steps; "
                     f"largest relative loss gap {gap}; final weights "
                     f"{'identical' if r['same_weights'] else 'differ'} (sha256)")
    return "\n".join(lines)
