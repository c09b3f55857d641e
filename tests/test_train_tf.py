"""The managed TensorFlow loop (a workload on the TF session): its data path, a TensorFlow launch
refused under a torch run's name (no Ray), and real 2-worker runs on a local Ray: one of 2 epochs
(MultiWorkerMirroredStrategy, seed 5), launched once for the module, is resumed to 4 epochs against
an uninterrupted run, and is what Horovod's run of the same settings must match epoch by epoch."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import types

import pytest

import workloads
from launcher.cli.main import main
from launcher.spec import JobSpec
from test_train_local import launch

SEED = "5"


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


def _epoch_losses(storage: str, name: str) -> list[tuple[float, float]]:
    """(train_loss, loss) of each epoch in run ``name``'s log."""
    from launcher.storage.runlog import read_jsonl

    log = read_jsonl(open(os.path.join(storage, name, "metrics.jsonl")).read())
    return [(m["train_loss"], m["loss"]) for m in log if m["kind"] == "epoch"]


@pytest.fixture(scope="module")
def two_epochs(ray_local, tmp_path_factory):
    """The native run of 2 epochs (``tf_stopped``), launched once for both tests below: its
    storage, its summary, and its epochs' losses as they were before anything resumed it."""
    storage = str(tmp_path_factory.mktemp("tf-runs"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", "--json", "--framework", "tensorflow", "--storage", storage, "--seed", SEED,
                     "--name", "tf_stopped", "--epochs", "2"])
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert code == 0 and len(lines) == 1, err.getvalue()[-3000:]
    assert "a resumed run will not be exact" not in err.getvalue(), err.getvalue()  # all its state is registered
    return {"storage": storage, "summary": json.loads(lines[0]), "losses": _epoch_losses(storage, "tf_stopped")}


@pytest.mark.integration
def test_tf_run_learns_resumes_and_exports_a_saved_model(ray_local, capsys, two_epochs):
    storage = two_epochs["storage"]
    common = ["--framework", "tensorflow", "--storage", storage, "--seed", SEED]
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

    first = two_epochs["summary"]  # tf_stopped: the same settings, stopped after 2 epochs
    assert first["status"] == "succeeded" and first["epochs_completed"] == 2, first
    code, resumed = launch(capsys, *common, "--name", "tf_stopped", "--epochs", "4")
    assert code == 0, resumed
    assert resumed["resumed_from"] == {"epoch": 2, "step": 46}
    assert (resumed["epochs_completed"], resumed["steps_completed"]) == (4, 92)
    # Same seed and workers: stopping at epoch 2 and resuming gives the uninterrupted run's result.
    for key in ("loss", "accuracy", "train_loss"):
        assert resumed["metrics"][key] == pytest.approx(full["metrics"][key], rel=1e-5), (key, resumed, full)


def test_tf_checkpoint_does_not_resume_a_torch_run(capsys, storage):
    """A torch run (its run log and a checkpoint, as its launch leaves them) is not continued by a
    TensorFlow launch of the same name: refused in one line before Ray starts, naming both
    frameworks and the way out."""
    from launcher.storage import Storage
    from launcher.storage.checkpoint import Manifest, write_manifest
    from launcher.storage.runlog import RunLog

    torch_run = JobSpec(storage=storage, name="mixed", epochs=1).validated()
    assert torch_run.framework == "torch"
    RunLog(Storage.resolve(storage), "mixed").begin(torch_run.to_dict())
    folder = os.path.join(storage, "mixed", "checkpoint_000023")
    os.makedirs(folder)
    write_manifest(folder, Manifest(epoch=1, step_in_epoch=0, global_step=23, world_size=2, framework="torch",
                                    backend="native", workload="digits-mlp", batch_size=32, seed=0, metrics={}))
    code = main(["run", "--storage", storage, "--name", "mixed", "--framework", "tensorflow", "--epochs", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "framework torch, not tensorflow" in err and "another --name" in err, err
    assert len(RunLog(Storage.resolve(storage), "mixed").reader.starts()) == 1  # the refused launch left no trace


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                    reason="Horovod is not built here: run scripts/install-horovod (scripts/setup-env does)")
def test_tf_horovod_matches_the_mirrored_strategy(ray_local, capsys, storage, two_epochs):
    """Both average gradients over the global batch: same seed, same losses epoch by epoch (the
    mirrored strategy's run: the module's run of 2 epochs)."""
    native = two_epochs["summary"]
    assert native["backend"] == "native" and native["metrics"]["accuracy"] >= 0.85, native
    code, s = launch(capsys, "--framework", "tensorflow", "--backend", "horovod", "--storage", storage,
                     "--seed", SEED, "--epochs", "2", "--name", "tf_horovod")
    assert code == 0, s
    assert s["backend"] == "horovod" and s["metrics"]["accuracy"] >= 0.85
    losses = {"native": two_epochs["losses"], "horovod": _epoch_losses(storage, "tf_horovod")}
    assert len(losses["native"]) == len(losses["horovod"]) == 2
    for a, b in zip(losses["native"], losses["horovod"]):
        assert a == pytest.approx(b, rel=1e-3)
