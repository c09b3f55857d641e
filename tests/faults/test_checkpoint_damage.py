"""Each file of a checkpoint, then each file of the run's log, damaged in turn: the
damaged checkpoint is never used, `launcher runs` still lists every run, and the run
resumes from its newest complete checkpoint with no step lost beyond it.

One real 2-worker run writes checkpoints every 10 steps (rank 0's model and its
other registered state, the optimizer, in state.pt; each rank's RNG state; rank 0's
manifest last). Every file of the newest checkpoint is then truncated, deleted, and
for the manifest also garbled, one at a time: the storage listing and the driver's
pre-flight (what a launch resumes from) must both pass over that checkpoint.

The same run then carries the run log's damages: a torn last line in launches.jsonl
and metrics.jsonl (a writer killed mid-line), garbage in summary.json and in a lock
file left half-written, and (for the last launch) in Ray Train's
checkpoint_manager_snapshot.json; `launcher runs` is asked after each single file's
damage. One relaunch meets the log's damages together with a checkpoint cut off in
another rank's file: it resumes from the previous checkpoint and trains on to the exact
step count of an undisturbed run. Last, a damaged run.json, which the launch refuses in
one line naming the file and saying how to recover; following that advice resumes the
run (and its launch sets the damaged snapshot aside).

(These were two tests, each launching the same run: one launch sequence now carries both,
three training launches instead of seven.)
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from launcher.cli.main import main
from launcher.driver.launch import preflight
from launcher.driver.progress import Progress
from launcher.spec import JobSpec
from launcher.storage import Storage, complete_checkpoints
from launcher.storage.checkpoint import MANIFEST
from launcher.storage.runlog import read_jsonl

pytestmark = pytest.mark.integration

STEPS_PER_EPOCH = 23  # digits-mlp, 2 workers, the default batch
GARBAGE = '{"status": "succ'
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's own record of the checkpoints


def launch(capsys, *argv: str) -> tuple[int, dict, str]:
    code = main(["run", "--json", *argv])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return code, (json.loads(lines[-1]) if lines else {}), err


def listed(capsys, storage: str) -> dict[str, dict]:
    assert main(["runs", "--storage", storage, "--json"]) == 0
    return {r["name"]: r for r in json.loads(capsys.readouterr().out)}


def tear(path: str) -> None:
    with open(path, "a") as f:
        f.write('{"event": "sta')  # no newline: the writer died mid-line


def garble(path: str) -> None:
    with open(path, "w") as f:
        f.write(GARBAGE)


def damages(path: str, name: str):
    """(what, damage function) for one file of a checkpoint."""
    def truncate():
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)

    def delete():
        os.remove(path)

    def garble_manifest():
        with open(path, "w") as f:
            f.write('{"epoch": 1, "files"')

    out = [("truncated", truncate), ("deleted", delete)]
    return out + [("garbled", garble_manifest)] if name == MANIFEST else out


def test_each_damaged_checkpoint_or_run_log_file_is_passed_over_and_the_run_resumes(ray_local, capsys, storage):
    common = ["--storage", storage, "--name", "cut", "--checkpoint-every-steps", "10", "--keep-checkpoints", "20"]
    code, first, err = launch(capsys, *common, "--epochs", "1")
    assert code == 0, err[-3000:]
    store = Storage.resolve(storage)
    kept = complete_checkpoints(store, "cut")
    assert [m.global_step for m, _ in kept] == [10, 20, 23]
    manifest, newest = kept[-1]
    names = sorted(manifest.files) + [MANIFEST]
    assert {"model.pt", "state.pt", "rng_rank0.pt", "rng_rank1.pt"} <= set(names), names  # every rank's

    # -- each file of the newest checkpoint, in turn -------------------------------------------------
    spec = JobSpec(storage=storage, name="cut", epochs=2, checkpoint_every_steps=10, keep_checkpoints=20)
    tried = []
    for name in names:
        path = os.path.join(newest, name)
        with open(path, "rb") as f:
            original = f.read()
        for what, damage in damages(path, name):
            damage()
            listed_steps = [m.global_step for m, _ in complete_checkpoints(store, "cut")]
            assert listed_steps == [10, 20], (name, what, listed_steps)
            _, _, found = preflight(spec, Progress(spec.epochs, enabled=False))
            assert found[-1][0].global_step == 20, (name, what)  # the launch would resume there
            with open(path, "wb") as f:
                f.write(original)
            tried.append(f"{name} {what}")
        assert [m.global_step for m, _ in complete_checkpoints(store, "cut")] == [10, 20, 23]  # put back whole
    assert len(tried) == 2 * len(names) + 1

    # -- each file of the run's log, in turn; `runs` asked after each ----------------------------------
    run_dir = os.path.join(storage, "cut")
    shutil.copytree(run_dir, os.path.join(storage, "other"))  # a neighbour `runs` must keep listing
    # The append-only logs, the files rewritten whole (a lock cut off while written: its writer died).
    for name, damage in [("launches.jsonl", tear), ("metrics.jsonl", tear), ("summary.json", garble),
                         ("launch.lock", garble)]:
        damage(os.path.join(run_dir, name))
        runs = listed(capsys, storage)
        assert {"cut", "other"} <= set(runs) and runs["cut"]["status"] != "unreadable", (name, runs)

    # A real relaunch over all of them and over a checkpoint cut off in another rank's file.
    rng = os.path.join(newest, "rng_rank1.pt")
    with open(rng, "r+b") as f:
        f.truncate(os.path.getsize(rng) // 2)
    code, resumed, err = launch(capsys, *common, "--epochs", "2")
    assert code == 0 and resumed["status"] == "succeeded", (resumed, err[-3000:])
    assert resumed["resumed_from"]["step"] == 20  # the newest complete one
    assert resumed["steps_completed"] == 2 * STEPS_PER_EPOCH and resumed["epochs_completed"] == 2, resumed

    # Each torn line was passed over and the next record began on a line of its own.
    lines = open(os.path.join(run_dir, "launches.jsonl")).read().splitlines()
    assert [line for line in lines if line.startswith('{"event": "sta{')] == []
    starts = [r for r in read_jsonl("\n".join(lines)) if r.get("event") == "start"]
    assert len(starts) == 2
    assert json.load(open(os.path.join(run_dir, "summary.json")))["status"] == "succeeded"  # rewritten whole

    # Ray Train's own record of the checkpoints, damaged: listed still; the next launch sets it aside.
    garble(os.path.join(run_dir, SNAPSHOT))
    runs = listed(capsys, storage)
    assert {"cut", "other"} <= set(runs) and runs["cut"]["status"] != "unreadable", (SNAPSHOT, runs)

    # run.json is never rewritten: a damaged one is named, with the way out.
    garble(os.path.join(run_dir, "run.json"))
    runs = listed(capsys, storage)
    assert runs["cut"]["status"] == "unreadable" and runs["other"]["status"] == "succeeded", runs
    code, _, err = launch(capsys, *common, "--epochs", "3")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "run.json is damaged" in lines[0], err
    assert "delete that file" in lines[0]
    os.remove(os.path.join(run_dir, "run.json"))  # as the line says: the checkpoints are kept
    code, s, err = launch(capsys, *common, "--epochs", "3")
    assert code == 0 and s["resumed_from"]["epoch"] == 2 and s["epochs_completed"] == 3, err[-3000:]
    assert [f for f in os.listdir(run_dir) if f.startswith(f"{SNAPSHOT}.damaged-")], os.listdir(run_dir)
