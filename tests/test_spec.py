"""Unit tests for launcher.spec: validation and defaults."""

from __future__ import annotations

import datetime as dt

import pytest

from launcher.errors import UserError
from launcher.spec import JobSpec, check_name, default_name
from launcher.spec import load_spec_file


def test_defaults_resolve_from_workload():
    spec = JobSpec().validated(now=dt.datetime(2026, 1, 2, 3, 4, 5))
    assert (spec.workload, spec.framework, spec.backend, spec.workers) == ("digits-mlp", "torch", "native", 2)
    assert (spec.epochs, spec.batch_size, spec.lr) == (10, 32, 0.002)
    assert spec.name == "digits_mlp_torch_native_20260102_030405"
    assert spec.storage.endswith("/runs") and spec.storage.startswith("/")


def test_default_name_follows_job_id_rule():
    name = default_name("resnet50-synthetic", "torch", "native", dt.datetime(2026, 11, 21, 8, 0, 0))
    assert name == "resnet50_synthetic_torch_native_20261121_080000"
    check_name(name)


@pytest.mark.parametrize("bad", ["1run", "_run", "run-1", "run 1", "a" * 129, "", "r\u00e9sum\u00e9"])
def test_invalid_names_rejected(bad):
    with pytest.raises(UserError, match="invalid run name"):
        check_name(bad)


def test_longest_valid_name():
    check_name("a" * 128)


@pytest.mark.parametrize("field,value,match", [
    ("workload", "digit-mlp", r"unknown workload 'digit-mlp' \(did you mean digits-mlp\?\); valid: digits-mlp, "),
    ("framework", "jax", "unknown framework 'jax'; valid: torch"),
    ("backend", "mpi", "unknown backend 'mpi'.*valid: native"),
    ("workers", 0, "workers must be >= 1, got 0"),
    ("batch_size", 0, "batch_size must be >= 1, got 0"),
    ("epochs", -1, "epochs must be >= 1"),
    ("lr", 0.0, "lr must be > 0"),
    ("cpus_per_worker", 0.0, "cpus_per_worker must be > 0"),
    ("keep_checkpoints", 0, "keep_checkpoints must be >= 1"),
    ("name", "9lives", "invalid run name"),
])
def test_bad_fields_name_the_field(field, value, match):
    with pytest.raises(UserError, match=match):
        JobSpec.from_mapping({field: value}).validated()


def test_workload_params_checked():
    spec = JobSpec(workload="resnet18-synthetic", params={"image_size": "64"}).validated()
    assert spec.params == {"image_size": 64, "num_samples": 256, "test_samples": 64, "num_classes": 1000}
    with pytest.raises(UserError, match="has no parameter 'imagesize'"):
        JobSpec(workload="resnet18-synthetic", params={"imagesize": "64"}).validated()
    with pytest.raises(UserError, match="image_size"):
        JobSpec(workload="resnet18-synthetic", params={"image_size": "8"}).validated()


def test_unknown_key_suggests_closest():
    with pytest.raises(UserError, match="unknown key 'num_wokers'; did you mean workers") as err:
        JobSpec.from_mapping({"num_wokers": 2})
    with pytest.raises(UserError, match="unknown key 'zzz'; valid keys: workload, framework, backend"):
        JobSpec.from_mapping({"zzz": 2})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["2", 2.5, True, None])
def test_types_are_checked(value):
    with pytest.raises(UserError, match="workers"):
        JobSpec.from_mapping({"workers": value})


def test_int_accepted_for_float_field():
    assert JobSpec.from_mapping({"lr": 1}).lr == 1.0


def test_yaml_file_and_flag_override(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("workload: digits-mlp\nworkers: 3\nepochs: 4\nparams: {}\n")
    spec = load_spec_file(str(path))
    assert (spec.workers, spec.epochs) == (3, 4)
    merged = spec.merged({"workers": 1, "epochs": None}).validated()
    assert (merged.workers, merged.epochs) == (1, 4)


def test_yaml_unknown_key_and_syntax_errors(tmp_path):
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("workload: digits-mlp\nbatchsize: 4\n")
    with pytest.raises(UserError, match=r"a.yaml: unknown key 'batchsize'; did you mean batch_size\?"):
        load_spec_file(str(bad_key))
    bad_syntax = tmp_path / "b.yaml"
    bad_syntax.write_text("workers: [1, 2\n")
    with pytest.raises(UserError, match="b.yaml: .* at line"):
        load_spec_file(str(bad_syntax))
    not_mapping = tmp_path / "c.yaml"
    not_mapping.write_text("- workers\n")
    with pytest.raises(UserError, match="expected a mapping"):
        load_spec_file(str(not_mapping))
    with pytest.raises(UserError, match="does not exist"):
        load_spec_file(str(tmp_path / "missing.yaml"))


def test_storage_uri_schemes_rejected_clearly():
    with pytest.raises(UserError, match="s3:// scheme is not supported"):
        JobSpec(storage="s3://bucket/x").validated()


@pytest.mark.parametrize("min_workers", [0, 5])
def test_min_workers_must_be_between_one_and_workers(min_workers):
    with pytest.raises(UserError, match=r"--min-workers .* is outside 1\.\.4"):
        JobSpec(workers=4, min_workers=min_workers).validated()
    assert JobSpec(workers=4, min_workers=2).validated().min_workers == 2


def test_machine_types_from_flags_and_yaml(tmp_path):
    from launcher import flags
    from launcher.cli.main import build_parser
    from launcher.cli.options import spec_from_args

    path = tmp_path / "job.yaml"
    path.write_text("machine_type: n1-standard-8+NVIDIA_TESLA_T4\nprimary_machine_type: n1-standard-4\n")
    spec = load_spec_file(str(path)).validated()
    # Spelled one way once validated: the GPU count and the lower-case accelerator name filled in.
    assert (spec.machine_type, spec.primary_machine_type) == ("n1-standard-8+nvidia-tesla-t4x1", "n1-standard-4")
    args = build_parser().parse_args(["run", "--config", str(path), "--machine-type", "g2-standard-8"])
    flagged = spec_from_args(args)
    assert (flagged.machine_type, flagged.primary_machine_type) == ("g2-standard-8+nvidia-l4x1", "n1-standard-4")
    # `launcher submit` rebuilds them on the cluster as flags.
    argv = flags.to_argv(flagged)
    assert argv[argv.index("--machine-type") + 1] == "g2-standard-8+nvidia-l4x1"
    assert argv[argv.index("--primary-machine-type") + 1] == "n1-standard-4"
    assert JobSpec().validated().machine_type is None  # default: any node
    with pytest.raises(UserError, match=r"^--primary-machine-type n1-standard-4\+nvidia-l4: nvidia-l4 attaches to "):
        JobSpec(primary_machine_type="n1-standard-4+nvidia-l4").validated()
