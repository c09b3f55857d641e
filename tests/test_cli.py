"""CLI tests that need no Ray: bad input is one clear line and a non-zero exit, before any worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from datafiles import write_mnist_idx
from launcher.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("argv,needles", [
    (["--workload", "mnist"], ["unknown workload 'mnist'", "valid: digits-mlp, mnist-mlp, mnist-cnn"]),
    (["--framework", "jax"], ["unknown framework 'jax'", "valid: torch"]),
    (["--backend", "hvd"], ["unknown backend 'hvd'", "valid: native"]),
    (["--workers", "0"], ["workers must be >= 1, got 0", "--workers"]),
    (["--batch-size", "0"], ["batch_size must be >= 1", "--batch-size"]),
    (["--name", "my-run"], ["invalid run name 'my-run'", "letters, digits and underscores"]),
    (["--workers", "two"], ["invalid int value: 'two'"]),
    (["--param", "image_size"], ["is not KEY=VALUE"]),
    (["--storage", "gs:/bucket"], ["looks like a URI but is malformed"]),
    (["--storage", "s3://bucket/x"], ["s3:// scheme is not supported"]),
    (["--preemption-check-steps", "-1"], ["preemption_check_steps must be >= 0", "--preemption-check-steps"]),
])
def test_bad_flags(capsys, tmp_path, argv, needles):
    code, out, err = run_cli(capsys, "run", "--storage", str(tmp_path), *argv)
    assert_one_line_error(code, err, *needles)
    assert out == ""
    assert not os.path.exists(tmp_path / "runs")


def test_verbose_adds_traceback(capsys):
    code, _, err = run_cli(capsys, "run", "--workers", "0", "--verbose")
    assert code == 2 and "Traceback" in err and "workers must be >= 1" in err


def test_yaml_unknown_key(capsys, tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("workload: digits-mlp\nnum_wokers: 2\n")
    code, _, err = run_cli(capsys, "run", "--config", str(cfg))
    assert_one_line_error(code, err, "unknown key 'num_wokers'", "did you mean workers?")


def test_missing_and_malformed_data(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", "--workload", "mnist-cnn", "--storage", str(tmp_path / "s"))
    assert_one_line_error(code, err, "needs --data", "IDX files")
    code, _, err = run_cli(capsys, "run", "--workload", "mnist-cnn", "--data", str(tmp_path / "none"),
                           "--storage", str(tmp_path / "s"))
    assert_one_line_error(code, err, "does not exist")
    folder = write_mnist_idx(str(tmp_path / "mnist"), n_train=20, n_test=10)
    with open(os.path.join(folder, "t10k-images-idx3-ubyte"), "r+b") as f:
        f.truncate(1000)
    code, _, err = run_cli(capsys, "run", "--workload", "mnist-cnn", "--data", folder,
                           "--storage", str(tmp_path / "s"))
    assert_one_line_error(code, err, "t10k-images-idx3-ubyte holds 1000 bytes", "truncated")


def test_unwritable_storage(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, _, err = run_cli(capsys, "run", "--storage", str(blocker / "runs"))
    assert_one_line_error(code, err, "cannot write to storage", "--storage")


def test_workloads_listing(capsys):
    code, out, _ = run_cli(capsys, "workloads")
    assert code == 0
    assert "digits-mlp" in out and "cifar10-cnn" in out and "--param image_size" in out
    code, out, _ = run_cli(capsys, "workloads", "--json")
    listed = {w["name"]: w for w in json.loads(out)}
    assert listed["mnist-cnn"]["frameworks"] == ["torch", "tensorflow"]
    assert "IDX" in listed["mnist-cnn"]["data"] and listed["digits-mlp"]["data"] == "no files needed"


def test_runs_on_empty_storage(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "runs", "--storage", str(tmp_path))
    assert code == 0 and out.strip() == "no runs"


def test_module_entry_point_help_is_fast_and_light():
    # `python -m launcher --help` must not import Ray, torch or the workers' code.
    probe = ("import sys, runpy; sys.argv=['launcher','--help']\n"
             "try:\n runpy.run_module('launcher', run_name='__main__')\n"
             "except SystemExit: pass\n"
             "print('HEAVY', sorted(m for m in ('ray','torch','tensorflow') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "usage: launcher" in res.stdout
    assert "HEAVY []" in res.stdout


def test_torch_runs_never_import_tensorflow():
    # Everything a torch run loads on the driver and the workers, TensorFlow excluded.
    probe = ("import sys\n"
             "import launcher.cli.main, launcher.driver.launch, launcher.worker.entry, launcher.worker.torch_loop,"
             " launcher.worker.export, launcher.backends.native\n"
             "from launcher.spec import JobSpec\n"
             "import workloads\n"
             "spec = JobSpec(workload='mnist-cnn').validated()\n"
             "workloads.get('mnist-cnn').torch_model({})\n"
             "print('TF', 'tensorflow' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "TF False" in res.stdout, res.stderr


def test_torch_trainer_is_lean_and_torch_free_outside_the_workers():
    # The driver builds the trainer and Ray's controller unpickles its backend config:
    # neither may import torch, and no Ray Data or placement-group cleaner callbacks ride along.
    probe = ("import sys, pickle\n"
             "from ray.train import RunConfig, ScalingConfig\n"
             "from launcher import backends\n"
             "from launcher.spec import JobSpec\n"
             "from launcher.worker.entry import train_loop_per_worker\n"
             "spec = JobSpec(storage='/tmp').validated()\n"
             "t = backends.get('native').trainer(spec, train_loop_per_worker, {}, ScalingConfig(num_workers=2),"
             " RunConfig(storage_path='/tmp'))\n"
             "names = [type(c).__name__ for c in t._create_default_callbacks()]\n"
             "print('CALLBACKS', names)\n"
             "print('BLOB', pickle.dumps(t.backend_config).hex())\n"
             "print('TORCH', 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if " " in line)
    assert lines.get("TORCH") == "False", res.stderr
    assert "BackendSetupCallback" in lines["CALLBACKS"]
    assert "DatasetsCallback" not in lines["CALLBACKS"] and "PlacementGroupCleaner" not in lines["CALLBACKS"]
    # A fresh process standing in for the controller: the config loads, torch stays out.
    load = ("import sys, pickle\n"
            f"cfg = pickle.loads(bytes.fromhex('{lines['BLOB']}'))\n"
            "print(cfg.backend, cfg.backend_cls.__name__, 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", load], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.stdout.split() == ["gloo", "_ProcessGroupBackend", "False"], res.stderr


def test_an_address_where_nothing_answers_is_one_line_within_seconds(capsys, tmp_path):
    # Ray itself retries for minutes; the launcher checks the port first (an outage: exit 1).
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        started = time.time()
        # A fresh process: in this one a test may have started a local Ray, which a run would use.
        done = subprocess.run([sys.executable, "-m", "launcher", "run", "--address", address,
                               "--storage", str(tmp_path / "runs")], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 1 and lines[-1].startswith(f"error: nothing answers at {address}"), done.stderr
        assert "is the cluster up?" in lines[-1] and time.time() - started < 30


def test_a_damaged_run_log_is_listed_and_named_on_resume(capsys, tmp_path):
    for name, text in (("good", json.dumps({"name": "good", "workload": "digits-mlp", "framework": "torch"})),
                       ("bad", '{"x')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(text)
    code, out, _ = run_cli(capsys, "runs", "--storage", str(tmp_path), "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0 and rows["bad"]["status"] == "unreadable" and rows["good"]["workload"] == "digits-mlp"
    assert "bad" in run_cli(capsys, "runs", "--storage", str(tmp_path))[1]  # the table lists it too
    code, _, err = run_cli(capsys, "run", "--storage", str(tmp_path), "--name", "bad")
    assert_one_line_error(code, err, "bad/run.json is damaged (not JSON", "delete that file")


def test_runs_in_a_folder_that_does_not_exist_says_so(capsys, tmp_path):
    code, out, err = run_cli(capsys, "runs", "--storage", str(tmp_path / "typo"))
    assert_one_line_error(code, err, "no such folder", "typo")


def test_runs_name_shows_the_checkpoints_kept(capsys, tmp_path):
    from test_checkpoint import make_checkpoint

    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "run.json").write_text(json.dumps({"name": "kept", "workload": "digits-mlp",
                                                            "framework": "torch"}))
    make_checkpoint(str(tmp_path / "kept" / "checkpoint_b"), 23)
    make_checkpoint(str(tmp_path / "kept" / "checkpoint_a"), 15)
    (tmp_path / "kept" / "checkpoint_c").mkdir()  # incomplete: not listed
    code, out, _ = run_cli(capsys, "runs", "kept", "--storage", str(tmp_path))
    lines = out.splitlines()
    assert code == 0 and lines[1].startswith("kept ") and lines[2] == "checkpoints kept: 2", out
    assert lines[3:] == [f"  epoch 1, step 15: {tmp_path / 'kept' / 'checkpoint_a'}",
                         f"  epoch 2, step 23: {tmp_path / 'kept' / 'checkpoint_b'}"]
    code, out, _ = run_cli(capsys, "runs", "kept", "--storage", str(tmp_path), "--json")
    assert code == 0 and [c["step"] for c in json.loads(out)["checkpoints"]] == [15, 23]
    code, _, err = run_cli(capsys, "runs", "kpet", "--storage", str(tmp_path))
    assert_one_line_error(code, err, f"no run kpet under {tmp_path}")


@pytest.mark.parametrize("text,needles", [
    ("workers: 2\nepochs: 1\nworkers: 4\n", ["key 'workers' is given twice at line 3"]),
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", ["is not a text file"]),
])
def test_config_files_that_are_wrong(capsys, tmp_path, text, needles):
    path = tmp_path / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, _, err = run_cli(capsys, "run", "--config", str(path), "--storage", str(tmp_path / "runs"))
    assert_one_line_error(code, err, *needles)


@pytest.mark.parametrize("argv,needles", [
    (["--lr", "inf"], ["lr must be a finite number, got inf", "--lr"]),
    (["--cpus-per-worker", "nan"], ["cpus_per_worker must be a finite number"]),
    (["--data", "/tmp"], ["workload digits-mlp reads no data files", "drop --data"]),
])
def test_values_found_wrong_before_any_worker(capsys, tmp_path, argv, needles):
    code, out, err = run_cli(capsys, "run", "--storage", str(tmp_path / "runs"), *argv)
    assert_one_line_error(code, err, *needles)


@pytest.mark.parametrize("argv,needles", [
    (["--workers", "1000000"], ["1000000 workers x 1 CPUs is 1e+06 CPUs; this machine has", "lower --workers"]),
    (["--cpus-per-worker", "64"], ["--cpus-per-worker 64: this machine has", "or run on a cluster"]),
])
def test_a_local_run_larger_than_the_machine_is_refused_before_ray_starts(capsys, tmp_path, argv, needles):
    import time

    started = time.time()
    code, _, err = run_cli(capsys, "run", "--storage", str(tmp_path / "runs"), *argv)
    assert time.time() - started < 20
    assert_one_line_error(code, err, *needles)


def test_a_cifar_file_that_is_not_a_tar_is_one_line(capsys, tmp_path):
    bad = tmp_path / "cifar-10-python.tar.gz"
    bad.write_bytes(b"this is not a tar file\nat all\n")
    code, _, err = run_cli(capsys, "run", "--workload", "cifar10-cnn", "--data", str(bad),
                           "--storage", str(tmp_path / "runs"))
    assert_one_line_error(code, err, "cannot read", "as a tar archive")


def test_fewer_training_samples_than_workers_is_refused(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", "--workload", "resnet18-synthetic", "--param", "num_samples=1",
                           "--workers", "2", "--storage", str(tmp_path / "runs"))
    assert_one_line_error(code, err, "has 1 training sample(s) for 2 workers", "use fewer --workers")


def test_the_summary_says_a_one_off_set_up_apart_from_the_wall_time():
    from launcher.cli.run import format_summary
    from launcher.summary import RunStatus, RunSummary

    s = RunSummary(name="h", status=RunStatus.SUCCEEDED, workload="digits-mlp", framework="torch",
                   backend="horovod", workers=2, epochs=1, epochs_completed=1, samples_per_s=2635.0,
                   wall_s=29.4, setup_s=561.0)
    assert "  2,635 samples/s, wall 29.4s (+ 561.0s of one-off set-up: see --profile-startup)" in format_summary(s)
    s.setup_s = 0.0
    assert "  2,635 samples/s, wall 29.4s\n" in format_summary(s)


def test_the_header_summary_and_json_say_the_strategy():
    """A sharded run says so wherever its backend is said: the header, the summary, --json."""
    from launcher.cli.run import format_summary
    from launcher.driver.launch import starting_line
    from launcher.spec import JobSpec
    from launcher.summary import RunStatus, RunSummary

    spec = JobSpec(workload="examples/gpt.py:train", strategy="fsdp", workers=2, name="gpt")
    assert starting_line(spec) == "starting 2 torch/native workers (strategy fsdp) for examples/gpt.py:train, run gpt"
    assert "torch/native workers (strategy ddp)" in starting_line(JobSpec())
    s = RunSummary(name="gpt", status=RunStatus.SUCCEEDED, workload="examples/gpt.py:train", framework="torch",
                   backend="native", strategy="fsdp", workers=2, epochs=1, model="runs/gpt/model")
    assert "  examples/gpt.py:train / torch / native, strategy fsdp, 2 workers\n" in format_summary(s)
    assert s.to_json()["strategy"] == "fsdp" and RunSummary.from_json(s.to_json()).strategy == "fsdp"
    assert "strategy" not in format_summary(RunSummary.from_json({"name": "old", "status": "succeeded"}))


def test_a_model_exported_as_weights_only_is_said_in_the_summary_with_how_to_predict():
    from launcher.cli.run import format_summary
    from launcher.measures import pick_metrics
    from launcher.summary import RunStatus, RunSummary
    from launcher.worker.export import weights_only_note

    note = weights_only_note("its forward takes Tensor, str, and predict and serve send it tensors of a batch")
    s = RunSummary(name="r", status=RunStatus.SUCCEEDED, workload="loop.py:train", framework="torch",
                   backend="native", strategy="ddp", workers=2, epochs=1, model="runs/r/model", model_note=note)
    lines = format_summary(s).splitlines()
    at = lines.index("  model:      runs/r/model")
    assert lines[at + 1].strip() == note and len(lines) == at + 2, lines
    assert "no program launcher predict and serve can run" in note and "model.load_state_dict" in note
    assert pick_metrics({"model_note": note, "loss": 0.5}) == {"loss": 0.5}
    s.model_note = None
    assert format_summary(s).splitlines()[-1] == "  model:      runs/r/model"
