"""Benchmarks of training functions: bench scaling's whole-run mode against the bare twin, and
bench stall (the training time a checkpoint costs). The arithmetic is checked on given figures;
each command also runs once, small, and must write its table, JSON and plot."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import function_scaling
from test_session import CHAR_LM, topics_file
from test_user_workloads import run_cli


def test_function_scaling_pairs_each_launcher_run_with_its_bare_twin(tmp_path):
    measured = [{"backend": "native", "variant": v, "workers": n, "repeat": i, "samples_per_s": rate}
                for n, rates in ((1, [(90.0, 100.0), (99.0, 100.0), (95.0, 95.0)]), (2, [(150.0, 160.0)]))
                for i, pair in enumerate(rates) for v, rate in zip(("launcher", "torchrun"), pair)]
    measured.append({"backend": "native", "variant": "torchrun", "workers": 2, "repeat": 1, "failed": "SIGABRT"})
    rows = {(r["variant"], r["workers"]): r for r in function_scaling.summarize(measured)}
    assert rows[("launcher", 1)]["samples_per_s"] == 95.0 and rows[("launcher", 1)]["vs_bare"] == 0.99
    assert rows[("launcher", 2)]["efficiency"] == pytest.approx(150.0 / (2 * 95.0), abs=1e-4)
    assert rows[("torchrun", 2)]["repeats"] == 1 and rows[("torchrun", 1)]["vs_bare"] is None
    assert "0.990" in function_scaling.format_rows(list(rows.values()))


@pytest.mark.integration
def test_bench_scaling_of_a_training_function_writes_its_results(warm_head, capsys, tmp_path):
    data = topics_file(tmp_path / "data")
    code, out, err = run_cli(capsys, "bench", "scaling", "--workload", CHAR_LM, "--data", data, "--workers", "1",
                             "--repeats", "1", "--param", "max_chars=6000", "--out", str(tmp_path / "out"))
    assert code == 0, err[-3000:]
    result = json.load(open(tmp_path / "out" / "function-scaling.json"))
    rows = {r["variant"]: r for r in result["summary"]}
    assert rows["launcher"]["samples_per_s"] > 0 and rows["torchrun"]["samples_per_s"] > 0, rows
    assert rows["launcher"]["vs_bare"] is not None and "launcher/bare" in out
    assert open(tmp_path / "out" / "function-scaling.png", "rb").read(4) == b"\x89PNG"


@pytest.mark.integration
@pytest.mark.gcs
def test_bench_stall_measures_each_storage_and_upload_mode_asked_for(warm_head, capsys, tmp_path):
    """Both storages (local disk and the emulator), with the asynchronous upload: the synchronous one is
    every other test's checkpoint path. An unknown name is one line before anything runs."""
    code, _, err = run_cli(capsys, "bench", "stall", "--storages", "local,s3")
    assert code == 2 and "--storages: unknown s3" in err and "valid: local, gcs" in err, err
    code, out, err = run_cli(capsys, "bench", "stall", "--mb", "4", "--steps", "12", "--every", "4",
                             "--uploads", "async", "--out", str(tmp_path / "out"))
    assert code == 0, err[-3000:]
    rows = json.load(open(tmp_path / "out" / "checkpoint-stall.json"))["summary"]
    assert [(r["storage"], r["upload"]) for r in rows] == [("local disk", "async"), ("GCS emulator", "async")]
    assert all(r["checkpoints"] == 2 and r["serialise_ms"] > 0 and r["state_mb"] == 4 for r in rows), rows
    assert "stall/save" in out and os.path.getsize(tmp_path / "out" / "checkpoint-stall.png") > 0
