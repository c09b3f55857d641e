"""Unit tests for launcher.storage.checkpoint: manifests and telling complete checkpoints from cut-off ones."""

from __future__ import annotations

import os

import pytest

from launcher.storage.checkpoint import (IncompleteCheckpoint, Manifest, complete_checkpoints, read_manifest,
                                 write_manifest)
from launcher.storage import Storage


def make_checkpoint(folder: str, step: int, payload: bytes = b"weights" * 100) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.pt"), "wb") as f:
        f.write(payload)
    write_manifest(folder, Manifest(epoch=step // 10, step_in_epoch=step % 10, global_step=step, world_size=2,
                                    framework="torch", backend="native", workload="digits-mlp",
                                    batch_size=32, seed=0, metrics={"loss": 0.5}))
    return folder


def test_manifest_round_trip(tmp_path):
    folder = make_checkpoint(str(tmp_path / "c"), 23)
    m = read_manifest(folder)
    assert (m.epoch, m.step_in_epoch, m.global_step, m.world_size) == (2, 3, 23, 2)
    assert m.files == {"model.pt": 700} and m.metrics == {"loss": 0.5}
    assert m.position == {"epoch": 2, "step": 23}


def test_truncated_or_missing_files_detected(tmp_path):
    folder = make_checkpoint(str(tmp_path / "c"), 5)
    with open(os.path.join(folder, "model.pt"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(IncompleteCheckpoint, match="model.pt has 100 bytes, manifest says 700"):
        read_manifest(folder)
    os.remove(os.path.join(folder, "model.pt"))
    with pytest.raises(IncompleteCheckpoint, match="model.pt is missing"):
        read_manifest(folder)
    os.remove(os.path.join(folder, "manifest.json"))
    with pytest.raises(IncompleteCheckpoint, match="has no manifest.json"):
        read_manifest(folder)


def test_complete_checkpoints_skips_partial_ones(tmp_path):
    root = tmp_path / "runs"
    run = root / "r"
    make_checkpoint(str(run / "checkpoint_a"), 10)
    make_checkpoint(str(run / "checkpoint_b"), 30)
    newest = make_checkpoint(str(run / "checkpoint_c"), 40)
    with open(os.path.join(newest, "model.pt"), "r+b") as f:
        f.truncate(3)  # cut off mid-upload
    (run / "checkpoint_d").mkdir()  # no manifest yet
    (run / "checkpoint_e").mkdir()
    (run / "checkpoint_e" / "manifest.json").write_text("{not json")
    found = complete_checkpoints(Storage.resolve(str(root)), "r")
    assert [m.global_step for m, _ in found] == [10, 30]
    assert found[-1][1].endswith("checkpoint_b")


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_append_after_a_torn_last_line_starts_a_new_line(tmp_path, where, request):
    from launcher.storage.runlog import read_jsonl

    if where == "gcs":
        bucket = request.getfixturevalue("bucket")
        storage = Storage.resolve(f"gs://{bucket}/runs")
    else:
        storage = Storage.resolve(str(tmp_path / "runs"))
    storage.write_text('{"event": "start", "launch": 1}\n{"event": "end", "lau', "r", "launches.jsonl")
    storage.append_text('{"event": "start", "launch": 2}\n', "r", "launches.jsonl")
    assert read_jsonl(storage.read_text("r", "launches.jsonl")) == [{"event": "start", "launch": 1},
                                                                  {"event": "start", "launch": 2}]
