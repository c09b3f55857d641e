"""Each file of a run's log damaged in turn: `launcher runs` still lists every run, and
the run resumes from its newest complete checkpoint with nothing lost.

One real run is carried through the damages, one epoch per launch: a torn last
line in launches.jsonl and metrics.jsonl (a writer killed mid-line), garbage in
summary.json, in Ray Train's checkpoint_manager_snapshot.json and in a lock file
left half-written, and last a damaged run.json, which the launch refuses in one
line naming the file and saying how to recover; following that advice resumes
the run.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from launcher.cli.main import main
from launcher.storage.runlog import read_jsonl

pytestmark = pytest.mark.integration

GARBAGE = '{"status": "succ'


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


def test_each_damaged_run_log_file_is_survived_and_the_run_resumes(ray_local, capsys, storage):
    args = ["--storage", storage, "--name", "logged"]
    code, first, _ = launch(capsys, *args, "--epochs", "1")
    assert code == 0, first
    run_dir = os.path.join(storage, "logged")
    shutil.copytree(run_dir, os.path.join(storage, "other"))  # a neighbour `runs` must keep listing
    # Each launch meets the damage of one writer: the append-only logs, the files rewritten
    # whole, Ray Train's snapshot. `runs` is asked after each single file's damage.
    damages = [
        [("launches.jsonl", tear), ("metrics.jsonl", tear)],
        [("summary.json", garble), ("launch.lock", garble)],  # a lock cut off while written: its writer died
        [("checkpoint_manager_snapshot.json", garble)],  # Ray Train's own record of the checkpoints
    ]
    epochs = 1
    for group in damages:
        for name, damage in group:
            damage(os.path.join(run_dir, name))
            runs = listed(capsys, storage)
            assert {"logged", "other"} <= set(runs) and runs["logged"]["status"] != "unreadable", (name, runs)
        code, s, err = launch(capsys, *args, "--epochs", str(epochs + 1))
        assert code == 0 and s["status"] == "succeeded", (group, err[-3000:])
        assert s["resumed_from"]["epoch"] == epochs and s["epochs_completed"] == epochs + 1, (group, s)
        epochs += 1
    assert [f for f in os.listdir(run_dir) if f.startswith("checkpoint_manager_snapshot.json.damaged-")]

    # Each torn line was passed over and the next record began on a line of its own.
    lines = open(os.path.join(run_dir, "launches.jsonl")).read().splitlines()
    assert [line for line in lines if line.startswith('{"event": "sta{')] == []
    starts = [r for r in read_jsonl("\n".join(lines)) if r.get("event") == "start"]
    assert len(starts) == 1 + len(damages)
    assert json.load(open(os.path.join(run_dir, "summary.json")))["status"] == "succeeded"  # rewritten whole

    # run.json is never rewritten: a damaged one is named, with the way out.
    garble(os.path.join(run_dir, "run.json"))
    runs = listed(capsys, storage)
    assert runs["logged"]["status"] == "unreadable" and runs["other"]["status"] == "succeeded", runs
    code, _, err = launch(capsys, *args, "--epochs", str(epochs + 1))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "run.json is damaged" in lines[0], err
    assert "delete that file" in lines[0]
    os.remove(os.path.join(run_dir, "run.json"))  # as the line says: the checkpoints are kept
    code, s, err = launch(capsys, *args, "--epochs", str(epochs + 1))
    assert code == 0 and s["resumed_from"]["epoch"] == epochs and s["epochs_completed"] == epochs + 1, err[-3000:]
