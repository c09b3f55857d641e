"""The managed TensorFlow loop (a workload on the TF session): its data path, and real 2-worker runs on a
local Ray."""

from __future__ import annotations

import importlib.util
import json
import os
import types

import pytest

import workloads
from launcher.cli.main import main
from launcher.spec import JobSpec
from test_train_local import launch


def _split_data(rank: int, world: int, spec: JobSpec):
    """The managed TensorFlow loop's training data on ``rank`` of ``world`` (no Ray): the workload's
    whole training split in the run's global order, as session.dataset takes it."""
    from launcher.worker.tf_data import EpochData

    session = types.SimpleNamespace(world=world, rank=rank, seed=spec.seed,
                                    global_batch_size=spec.batch_size * world)
    return EpochData(session, workloads.get(spec.workload).load(None, "train", 0, 1, {}), None, None, True)


def _rows(batches) -> list[bytes]:
    return [r.tobytes() for x, _ in batches for r in x.numpy()]


def test_the_managed_tf_loop_gives_each_sample_to_one_rank_once_per_epoch():
    spec = JobSpec(framework="tensorflow", workers=2, epochs=1).validated()
    everything = {r.tobytes() for r in workloads.get("digits-mlp").load(None, "train", 0, 1, {}).x}
    seen = []
    for rank in range(2):
        data = _split_data(rank, 2, spec)
        batches = list(data.stream(0, 0).take(data.steps))
        assert max(len(x) for x, _ in batches) == data.per_worker_batch == spec.batch_size  # per worker
        rows = _rows(batches)
        assert len(rows) == len(set(rows)) == 1438 // 2  # its share of the epoch, each sample once
        seen.append(set(rows))
    assert not seen[0] & seen[1]  # no sample given to two workers
    assert seen[0] | seen[1] <= everything and len(seen[0] | seen[1]) == 1438


def test_the_managed_tf_loop_resumed_on_one_worker_goes_on_at_the_sample_two_workers_stopped_at():
    """Two workers stopped after 10 steps (640 samples of the epoch's global order), resumed on
    one: it trains the 798 samples left, once each; nothing of the first 640 again."""
    spec = JobSpec(framework="tensorflow", workers=2, epochs=1).validated()
    first = [row for rank in range(2) for row in _rows(_split_data(rank, 2, spec).stream(0, 0).take(10))]
    cursor = _split_data(0, 2, spec).cursor.at(0, 10)
    assert cursor == 640

    alone = _split_data(0, 1, spec)
    step = alone.cursor.resume(0, None, cursor)
    assert alone.steps - step == -(-(1438 - 640) // spec.batch_size)  # the epoch still ends at its last step
    rows = first + _rows(alone.stream(0, step).take(alone.steps - step))
    everything = {r.tobytes() for r in workloads.get("digits-mlp").load(None, "train", 0, 1, {}).x}
    assert len(rows) == len(set(rows)) == 1438 and set(rows) == everything  # nothing twice, nothing skipped


@pytest.mark.integration
def test_tf_run_learns_resumes_and_exports_a_saved_model(ray_local, capsys, storage):
    common = ["--framework", "tensorflow", "--storage", storage, "--seed", "3"]
    code, full = launch(capsys, *common, "--name", "tf_full", "--epochs", "4")
    assert code == 0, full
    assert (full["status"], full["framework"], full["backend"]) == ("succeeded", "tensorflow", "native")
    assert (full["epochs_completed"], full["steps_completed"]) == (4, 4 * 23)
    assert full["metrics"]["accuracy"] >= 0.85
    last = [json.loads(line) for line in open(os.path.join(storage, "tf_full", "metrics.jsonl"))][-1]
    assert last["model"] == full["model"]  # exported by rank 0, where TensorFlow is loaded

    import tensorflow as tf

    loaded = tf.saved_model.load(os.path.join(storage, "tf_full", "model", "saved_model"))
    test = workloads.get("digits-mlp").load(None, "test", 0, 1, {})
    logits = next(iter(loaded.signatures["serving_default"](x=tf.constant(test.x)).values())).numpy()
    assert (logits.argmax(1) == test.y).mean() >= 0.85

    code, first = launch(capsys, *common, "--name", "tf_stopped", "--epochs", "2")
    assert code == 0 and first["epochs_completed"] == 2
    code, resumed = launch(capsys, *common, "--name", "tf_stopped", "--epochs", "4")
    assert code == 0, resumed
    assert resumed["resumed_from"] == {"epoch": 2, "step": 46}
    assert (resumed["epochs_completed"], resumed["steps_completed"]) == (4, 92)
    # Same seed and workers: stopping at epoch 2 and resuming gives the uninterrupted run's result.
    for key in ("loss", "accuracy", "train_loss"):
        assert resumed["metrics"][key] == pytest.approx(full["metrics"][key], rel=1e-5), (key, resumed, full)


@pytest.mark.integration
def test_tf_checkpoint_does_not_resume_a_torch_run(ray_local, capsys, storage):
    code, _ = launch(capsys, "--storage", storage, "--name", "mixed", "--epochs", "1")
    assert code == 0
    code = main(["run", "--storage", storage, "--name", "mixed", "--framework", "tensorflow", "--epochs", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "framework torch, not tensorflow" in err and "another --name" in err


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                    reason="Horovod is not built here: run scripts/install-horovod (scripts/setup-env does)")
def test_tf_horovod_matches_the_mirrored_strategy(ray_local, capsys, storage):
    """Both average gradients over the global batch: same seed, same losses epoch by epoch."""
    from launcher.storage.runlog import read_jsonl

    losses = {}
    for backend in ("native", "horovod"):
        code, s = launch(capsys, "--framework", "tensorflow", "--backend", backend, "--storage", storage,
                         "--seed", "5", "--epochs", "2", "--name", f"tf_{backend}")
        assert code == 0, s
        assert s["backend"] == backend and s["metrics"]["accuracy"] >= 0.85
        log = read_jsonl(open(os.path.join(storage, f"tf_{backend}", "metrics.jsonl")).read())
        losses[backend] = [(m["train_loss"], m["loss"]) for m in log if m["kind"] == "epoch"]
    assert len(losses["native"]) == len(losses["horovod"]) == 2
    for a, b in zip(losses["native"], losses["horovod"]):
        assert a == pytest.approx(b, rel=1e-3)
