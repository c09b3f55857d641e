"""Each file of a checkpoint cut off or deleted in turn: the checkpoint is never used,
and the run resumes from the newest complete one with no step lost beyond it.

One real 2-worker run writes checkpoints every 10 steps (rank 0's model and its
other registered state, the optimizer, in state.pt; each rank's RNG state; rank 0's
manifest last). Every file of the
newest checkpoint is then truncated, deleted, and for the manifest also garbled,
one at a time: the storage listing and the driver's pre-flight (what a launch
resumes from) must both pass over that checkpoint. A relaunch with one of them
damaged resumes from the previous checkpoint and trains on to the exact step
count of an undisturbed run.
"""

from __future__ import annotations

import json
import os

import pytest

from launcher.cli.main import main
from launcher.driver.launch import preflight
from launcher.driver.progress import Progress
from launcher.spec import JobSpec
from launcher.storage import Storage, complete_checkpoints
from launcher.storage.checkpoint import MANIFEST

pytestmark = pytest.mark.integration

STEPS_PER_EPOCH = 23  # digits-mlp, 2 workers, the default batch


def launch(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["run", "--json", *argv])
    out = capsys.readouterr().out
    return code, json.loads(out.strip().splitlines()[-1])


def damages(path: str, name: str):
    """(what, damage function) for one file of a checkpoint."""
    def truncate():
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)

    def delete():
        os.remove(path)

    def garble():
        with open(path, "w") as f:
            f.write('{"epoch": 1, "files"')

    out = [("truncated", truncate), ("deleted", delete)]
    return out + [("garbled", garble)] if name == MANIFEST else out


def test_each_damaged_file_of_a_checkpoint_is_passed_over_and_the_run_resumes(ray_local, capsys, storage):
    common = ["--storage", storage, "--name", "cut", "--checkpoint-every-steps", "10", "--keep-checkpoints", "20"]
    code, _ = launch(capsys, *common, "--epochs", "1")
    assert code == 0
    store = Storage.resolve(storage)
    kept = complete_checkpoints(store, "cut")
    assert [m.global_step for m, _ in kept] == [10, 20, 23]
    manifest, newest = kept[-1]
    names = sorted(manifest.files) + [MANIFEST]
    assert {"model.pt", "state.pt", "rng_rank0.pt", "rng_rank1.pt"} <= set(names), names  # every rank's

    spec = JobSpec(storage=storage, name="cut", epochs=2, checkpoint_every_steps=10, keep_checkpoints=20)
    tried = []
    for name in names:
        path = os.path.join(newest, name)
        with open(path, "rb") as f:
            original = f.read()
        for what, damage in damages(path, name):
            damage()
            listed = [m.global_step for m, _ in complete_checkpoints(store, "cut")]
            assert listed == [10, 20], (name, what, listed)
            _, _, found = preflight(spec, Progress(spec.epochs, enabled=False))
            assert found[-1][0].global_step == 20, (name, what)  # the launch would resume there
            with open(path, "wb") as f:
                f.write(original)
            tried.append(f"{name} {what}")
        assert [m.global_step for m, _ in complete_checkpoints(store, "cut")] == [10, 20, 23]  # put back whole
    assert len(tried) == 2 * len(names) + 1

    # A real relaunch over a checkpoint cut off in another rank's file.
    rng = os.path.join(newest, "rng_rank1.pt")
    with open(rng, "r+b") as f:
        f.truncate(os.path.getsize(rng) // 2)
    code, resumed = launch(capsys, *common, "--epochs", "2")
    assert code == 0 and resumed["status"] == "succeeded", resumed
    assert resumed["resumed_from"]["step"] == 20  # the newest complete one
    assert resumed["steps_completed"] == 2 * STEPS_PER_EPOCH
