"""Unit tests for launcher.storage.checkpoint: manifests and telling complete checkpoints from cut-off ones."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from launcher import _ray
from launcher.storage.checkpoint import (RAY_SNAPSHOT, IncompleteCheckpoint, Manifest, complete_checkpoints, prune,
                                         read_manifest, write_manifest)
from launcher.storage import Storage


def make_checkpoint(folder: str, step: int, payload: bytes = b"weights" * 100, created: float | None = None) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.pt"), "wb") as f:
        f.write(payload)
    manifest = Manifest(epoch=step // 10, step_in_epoch=step % 10, global_step=step, world_size=2,
                        framework="torch", backend="native", workload="digits-mlp",
                        batch_size=32, seed=0, metrics={"loss": 0.5})
    if created is not None:
        manifest.created = created
    write_manifest(folder, manifest)
    return folder


def ray_snapshot(*names: str) -> str:
    """Ray Train's list of a run's checkpoints naming ``names`` (oldest first), as Ray 2.60 writes it."""
    results = [{"version": 0, "checkpoint_dir_name": n, "metrics": {"global_step": i}} for i, n in enumerate(names)]
    return json.dumps({"ray_version": "2.60.0", "checkpoint_results": results,
                       "checkpoint_report_indices": list(range(len(names))),
                       "latest_checkpoint_result": results[-1] if results else None,
                       "pending_training_results": [], "pending_validation_specs": [],
                       "current_report_index": len(names), "validated_checkpoint_dir_names": [],
                       "timed_out_validation_checkpoint_dir_names": [], "failed_validation_checkpoint_dir_names": []})


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


def pruning_setup(local_root, storage: Storage, snapshot: str) -> None:
    """Run "r": complete checkpoints at steps 5 (an earlier launch's), 10 and 15 (in Ray's list) and
    20 (finished after Ray stopped listening), a folder being written and a damaged one."""
    made = local_root / "made"
    make_checkpoint(str(made / "checkpoint_a"), 5)
    make_checkpoint(str(made / "checkpoint_b"), 10)
    make_checkpoint(str(made / "checkpoint_c"), 15)
    make_checkpoint(str(made / "checkpoint_f"), 20)
    (made / "checkpoint_d").mkdir()
    (made / "checkpoint_d" / "model.pt").write_bytes(b"half")  # being written: no manifest yet
    damaged = make_checkpoint(str(made / "checkpoint_e"), 3)
    with open(os.path.join(damaged, "model.pt"), "r+b") as f:
        f.truncate(3)  # kept for inspection
    for folder in sorted(os.listdir(made)):
        storage.upload_dir(str(made / folder), "r", folder)
    storage.write_text(snapshot, "r", RAY_SNAPSHOT)


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_prune_keeps_the_newest_complete_checkpoints_of_every_launch(tmp_path, where, request):
    storage = (Storage.resolve(f"gs://{request.getfixturevalue('bucket')}/runs") if where == "gcs"
               else Storage.resolve(str(tmp_path / "runs")))
    pruning_setup(tmp_path, storage, ray_snapshot("checkpoint_b", "checkpoint_c"))
    left, line = prune(storage, "r", 2)
    assert [(m.global_step, os.path.basename(p)) for m, p in left] == [(15, "checkpoint_c"), (20, "checkpoint_f")]
    assert complete_checkpoints(storage, "r") == left
    # The folder being written and the damaged one are left alone; the older complete ones are gone.
    assert storage.list_dirs("r") == ["checkpoint_c", "checkpoint_d", "checkpoint_e", "checkpoint_f"]
    assert line == "--keep-checkpoints 2: deleted 2 older checkpoint(s) of run r (steps 5, 10); kept steps 15, 20"
    # Ray's list named checkpoint_b: removed, so Ray Train starts a fresh one rather than fail the next launch.
    assert not storage.exists("r", RAY_SNAPSHOT)
    assert prune(storage, "r", 2) == (left, None)  # nothing more to do
    left, line = prune(storage, "r", 1)
    assert [m.global_step for m, _ in left] == [20] and line.endswith("(step 15); kept step 20")


def test_ray_list_naming_only_kept_checkpoints_stays(tmp_path):
    storage = Storage.resolve(str(tmp_path / "runs"))
    snapshot = ray_snapshot("checkpoint_c", "checkpoint_f")
    pruning_setup(tmp_path, storage, snapshot)
    left, _ = prune(storage, "r", 2)
    assert [m.global_step for m, _ in left] == [15, 20]
    assert storage.read_text("r", RAY_SNAPSHOT) == snapshot


def test_prune_never_deletes_the_newest_and_breaks_ties_by_time(tmp_path):
    storage = Storage.resolve(str(tmp_path / "runs"))
    run = tmp_path / "runs" / "r"
    make_checkpoint(str(run / "checkpoint_late"), 30, created=2000.0)
    make_checkpoint(str(run / "checkpoint_early"), 30, created=1000.0)
    make_checkpoint(str(run / "checkpoint_old"), 20, created=3000.0)
    left, line = prune(storage, "r", 0)  # never fewer than one
    assert [os.path.basename(p) for _, p in left] == ["checkpoint_late"]
    assert sorted(os.listdir(run)) == ["checkpoint_late"] and "steps 20, 30" in line


def test_a_deletion_storage_refuses_stops_pruning_and_is_said(tmp_path, monkeypatch):
    storage = Storage.resolve(str(tmp_path / "runs"))
    pruning_setup(tmp_path, storage, ray_snapshot("checkpoint_f"))
    removed = []

    def remove_dir(*parts):
        if removed:
            raise PermissionError(13, "Permission denied", storage.path(*parts))
        removed.append(parts)
        shutil.rmtree(storage.path(*parts))

    monkeypatch.setattr(storage, "remove_dir", remove_dir)
    left, line = prune(storage, "r", 2)
    assert [m.global_step for m, _ in left] == [10, 15, 20]
    assert line == ("--keep-checkpoints 2: deleted 1 older checkpoint(s) of run r (step 5); could not delete 1 older "
                    "checkpoint(s) of run r (step 10): [Errno 13] Permission denied: "
                    f"'{storage.path('r', 'checkpoint_b')}'; kept steps 15, 20")


def test_which_checkpoints_rays_list_names():
    names = ["checkpoint_a", "checkpoint_b", "checkpoint_c"]
    assert _ray.snapshot_names(ray_snapshot("checkpoint_b"), names) == ["checkpoint_b"]
    # A field of another Ray that holds paths is seen too; text that is not JSON names every folder.
    assert _ray.snapshot_names(json.dumps({"new": [{"path": "/runs/r/checkpoint_c/"}]}), names) == ["checkpoint_c"]
    assert _ray.snapshot_names(json.dumps({"x": "checkpoint_ab"}), names) == []
    assert _ray.snapshot_names("{cut", names) == names


def test_where_a_run_resumes_counts_epochs_from_one_as_the_progress_line_does():
    from launcher.storage.checkpoint import resume_point

    assert resume_point({"epoch": 0, "step": 30}, 4) == "after step 30, in epoch 1/4"   # mid-epoch, the first
    assert resume_point({"epoch": 1, "step": 50}, 4) == "after step 50, in epoch 2/4"   # at the end of the first
    assert resume_point({"epoch": 4, "step": 200}, 4) == "after step 200: all 4 epochs are done"
    assert resume_point({"epoch": 2, "step": 7}, None) == "after step 7, in epoch 3"


# -- launcher checkpoint export: bad input is one line, exit 2 ------------------------------------

def sharded_checkpoint(folder: str, step: int) -> str:
    """A --strategy fsdp checkpoint as a run writes it: DCP's shard and metadata files, the state
    file naming the model, and the manifest listing every file (one rank, a small model)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from launcher.worker.strategies import STATE_FILE
    from launcher.worker.sharded import shard_files

    dcp.save({"model": torch.nn.Linear(3, 2).state_dict()},
             storage_writer=dcp.FileSystemWriter(folder, thread_count=1), no_dist=True)
    torch.save({"_launcher": {"model": "model"}}, os.path.join(folder, STATE_FILE))
    write_manifest(folder, Manifest(epoch=1, step_in_epoch=0, global_step=step, world_size=1, framework="torch",
                                    backend="native", workload="digits-mlp", batch_size=32, seed=0,
                                    strategy="fsdp"), shard_files(folder))
    return folder


def export(capsys, root, *argv: str) -> tuple[int, str]:
    from launcher.cli.main import main

    code = main(["checkpoint", "export", *argv, "--storage", str(root)])
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return code, err


def test_an_export_under_a_file_or_of_no_such_run_is_one_line(tmp_path, capsys):
    make_checkpoint(str(tmp_path / "runs" / "r" / "checkpoint_000001"), step=5)
    (tmp_path / "afile.pt").write_bytes(b"mine")
    code, err = export(capsys, tmp_path / "runs", "r", "--out", str(tmp_path / "afile.pt" / "model.pt"))
    assert code == 2 and f"{tmp_path / 'afile.pt'} is a file, not a folder" in err, err
    assert (tmp_path / "afile.pt").read_bytes() == b"mine"
    code, err = export(capsys, tmp_path / "runs", "nosuchrun")
    assert code == 2 and f"no run nosuchrun under {tmp_path / 'runs'}" in err, err  # as `launcher runs NAME` says
    assert "checkpoint" not in err, err


def test_an_export_names_the_shard_file_a_sharded_checkpoint_lacks(tmp_path, capsys):
    folder = sharded_checkpoint(str(tmp_path / "runs" / "s" / "checkpoint_000001"), step=7)
    shard = next(n for n in os.listdir(folder) if n.endswith(".distcp"))
    os.remove(os.path.join(folder, shard))
    for step in ([], ["--step", "7"]):
        code, err = export(capsys, tmp_path / "runs", "s", "--out", str(tmp_path / "s.pt"), *step)
        assert code == 2 and f"run s has no complete checkpoint: {folder}: {shard} is missing" in err, err
    assert not (tmp_path / "s.pt").exists()
