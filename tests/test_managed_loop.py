"""The managed torch loop opened to any model: a workload's own loss, metrics, optimizer and LR
schedule; --precision, --grad-clip and --grad-accumulation; exact resume with all of them.

examples/diabetes_regression.py (a regression workload: MSE loss, MAE and R² metrics,
AdamW, a cosine schedule) under fp16 autocast with a GradScaler and gradient clipping is
stopped with Ctrl-C right after a mid-epoch checkpoint and launched again: the resumed
run ends with the uninterrupted run's weights, so the scheduler's and the scaler's states
were saved and restored with the model and optimizer. It also keeps 2 checkpoints
(--keep-checkpoints 2) across its launches, those Ray Train never registered included.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

import workloads
from launcher import _ray
from launcher.errors import UserError
from launcher.spec import JobSpec
from launcher.storage import Storage
from launcher.storage.checkpoint import RAY_SNAPSHOT, complete_checkpoints, read_manifest, write_manifest
from test_session import finish, launch, stop_after_step_checkpoint
from test_session_state import comm  # noqa: F401 - comm: a fixture (a single-process gloo group)
from test_user_workloads import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIABETES = os.path.join(ROOT, "examples", "diabetes_regression.py") + ":DIABETES"


def test_a_workload_with_its_own_loss_is_not_a_classifier():
    diabetes = workloads.get(DIABETES)
    assert not diabetes.is_classifier and workloads.get("digits-mlp").is_classifier
    train = diabetes.load(None, "train", 0, 2, diabetes.resolve_params({}))
    x, y = train.take([0, 1, 2])
    assert x.dtype.name == "float32" and y.dtype.name == "float32"  # targets stay real numbers


@pytest.mark.parametrize("flags,message", [
    ({"precision": "fp8"}, "unknown precision 'fp8'; valid: fp32, bf16, fp16"),
    ({"grad_clip": -1.0}, "grad_clip must be > 0"),
    ({"grad_accumulation": 0}, "grad_accumulation must be >= 1"),
    ({"precision": "bf16", "framework": "tensorflow"}, "--precision applies to torch runs"),
    ({"grad_accumulation": 2, "hvd_backward_passes": 3, "backend": "horovod"}, "disagree"),
])
def test_numerics_flags_are_checked(flags, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        JobSpec(**flags).validated()


def test_numerics_flags_parse(capsys):
    spec = JobSpec(precision="bf16", grad_clip=1.0, grad_accumulation=4).validated()
    assert (spec.precision, spec.grad_clip, spec.accumulation) == ("bf16", 1.0, 4)


@pytest.mark.integration
def test_a_regression_under_fp16_and_clipping_learns_and_resumes_exactly_keeping_2_checkpoints(warm_head, tmp_path):
    """One launch sequence for the managed loop's state: the workload's cosine schedule and the
    GradScaler's scale are saved and restored with the model and optimizer (the resumed run ends
    with the uninterrupted run's weights), and interrupted relaunches with --keep-checkpoints 2 keep
    at most 2 complete checkpoints. (Two tests once, one per flag: the same three launches each.)
    On the native backend only: the managed loop is a training function on the torch session,
    whose Horovod path (a mid-epoch stop resumed to the same weights) test_session's char_lm test
    and test_backends_horovod cover."""
    storage = str(tmp_path / "runs")
    args = ["--workload", DIABETES, "--storage", storage, "--epochs", "8", "--checkpoint-every-steps", "5",
            "--backend", "native", "--precision", "fp16", "--grad-clip", "1.0", "--keep-checkpoints", "2"]
    whole = finish(launch(args + ["--name", "whole"]))
    m = whole["metrics"]
    assert whole["status"] == "succeeded" and whole["steps_completed"] == 8 * 11, whole
    assert {"loss", "mae", "r2", "train_loss"} <= set(m) and "accuracy" not in m, m
    assert m["r2"] > 0.3 and m["mae"] < 60, m  # it learned (predicting the mean scores r2 0, mae ~65)
    model = json.load(open(os.path.join(storage, "whole", "model", "model.json")))
    assert model["num_classes"] is None and model["input_shape"] == [10]
    store = Storage.resolve(storage)
    assert [m.global_step for m, _ in complete_checkpoints(store, "whole")] == [85, 88]

    run_dir = os.path.join(storage, "stopped")
    # Stopped once Ray Train registered the checkpoint (its list of the run's checkpoints is written then).
    stopped = stop_after_step_checkpoint(args + ["--name", "stopped"], tmp_path,
                                         until=lambda: os.path.exists(os.path.join(run_dir, RAY_SNAPSHOT)))
    assert stopped["status"] == "cancelled"
    import torch

    (_, newest), = complete_checkpoints(store, "stopped")
    state = torch.load(os.path.join(newest, "state.pt"), weights_only=False)
    assert state["scaler"]["scale"] > 0 and "optimizer" in state  # the GradScaler's state is in the checkpoint
    # Two checkpoints that finished being written after Ray Train stopped listening (as during a
    # Ctrl-C): Ray never registered them, and they are newer than the one it did, which its list names.
    for n in (1, 2):
        late = shutil.copytree(newest, os.path.join(run_dir, f"checkpoint_late_{n}"))
        manifest = read_manifest(late)
        manifest.created += n
        write_manifest(late, manifest)
    assert _ray.snapshot_names(open(os.path.join(run_dir, RAY_SNAPSHOT)).read(), [os.path.basename(newest)])
    proc = launch(args + ["--name", "stopped"])
    out, err = proc.communicate(timeout=420)
    assert proc.returncode == 0, err[-3000:]
    resumed = json.loads(out.strip().splitlines()[-1])
    # The launch deleted the one Ray registered (and Ray's list, which named it) before training ...
    assert "--keep-checkpoints 2: deleted 1 older checkpoint(s) of run stopped (step 5); kept steps 5, 5" in err
    assert resumed["resumed_from"] == {"epoch": 0, "step": 5}, resumed
    assert resumed["weights_sha256"] == whole["weights_sha256"]  # the schedule and the scaler resumed too
    # ... and the unregistered ones after it: 2 remain, as after the uninterrupted run, and Ray's
    # new list names only folders that exist.
    kept = complete_checkpoints(store, "stopped")
    assert [m.global_step for m, _ in kept] == [85, 88], err[-3000:]
    assert "deleted 2 older checkpoint(s) of run stopped (steps 5, 5); kept steps 85, 88" in err
    snapshot = open(os.path.join(run_dir, RAY_SNAPSHOT)).read()
    assert _ray.snapshot_names(snapshot, [os.path.basename(p) for _, p in kept]) and \
        not _ray.snapshot_names(snapshot, [os.path.basename(newest), "checkpoint_late_1", "checkpoint_late_2"])


@pytest.mark.integration
def test_gradient_accumulation_with_ddp_learns(ray_local, capsys, tmp_path):
    code, out, err = run_cli(capsys, "run", "--storage", str(tmp_path / "runs"), "--epochs", "3",
                             "--grad-accumulation", "2", "--precision", "bf16", "--json")
    s = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and s["status"] == "succeeded", err
    assert s["metrics"]["accuracy"] > 0.7, s


def test_a_loss_hook_that_returns_a_vector_fails_naming_it(comm, tmp_path):
    """A workload's torch_loss that returns a loss per sample: the managed loop stops at the first
    batch with one line naming the hook's file and line and the fix. Run on the training session
    in this process (no Ray); a worker's error becomes the run's as test_session's broken function
    and test_tf_session's misuse show."""
    from launcher.worker import BareSession
    from launcher.worker.loader import SessionError
    from launcher.worker.torch_loop import managed
    from test_user_workloads import GOOD, write

    bad = GOOD.replace("FRAMEWORKS = (\"torch\",)", """FRAMEWORKS = ("torch",)


class PerSample(Blobs):
    def torch_loss(self, outputs, labels, params):
        import torch.nn.functional as F
        return F.cross_entropy(outputs, labels, reduction="none")


PER_SAMPLE = PerSample()""")
    path = write(tmp_path / "code", bad)
    workload = workloads.get(f"{path}:PER_SAMPLE")
    spec = JobSpec(workload=f"{path}:PER_SAMPLE", workers=1, storage=str(tmp_path / "runs"),
                   preemption_check_steps=0).validated()
    session = BareSession(spec, comm, managed(workload))
    with pytest.raises(SessionError) as raised:
        session.start()
    error = str(raised.value)
    line = 1 + bad.splitlines().index("    def torch_loss(self, outputs, labels, params):")
    assert f"torch_loss of workload blobs at {path}:{line} returned a tensor of shape (16,)" in error, error
    assert "not a scalar tensor" in error and "\n" not in error, error
    assert session.pos.global_step == 0  # no step was taken with it
