"""The overhead benchmark: its arithmetic and output files, and that its torchrun baseline runs
(the timed runs themselves are measured by hand, not in CI)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import overhead


def test_summary_ratios_and_files(tmp_path):
    walls = {"launcher-cold": [30.0, 34.0, 31.0], "launcher-warm": [20.0, 22.0, 21.0], "torchrun": [7.0, 8.0, 6.0]}
    samples = [{"variant": v, "repeat": i, "wall_s": w, "first_step_s": (w - 5 if v != "torchrun" else None),
                "accuracy": 0.56} for v, ws in walls.items() for i, w in enumerate(ws)]
    rows = {r["variant"]: r for r in overhead.summarize(samples)}
    assert rows["launcher-cold"]["wall_s_median"] == 31.0
    assert rows["launcher-cold"]["vs_torchrun"] == pytest.approx(31.0 / 7.0)
    assert rows["launcher-warm"]["vs_torchrun"] == pytest.approx(3.0)
    assert (rows["launcher-warm"]["wall_s_min"], rows["launcher-warm"]["wall_s_max"]) == (20.0, 22.0)
    assert rows["launcher-warm"]["first_step_s_median"] == 16.0 and rows["torchrun"]["first_step_s_median"] is None
    table = overhead.format_rows(list(rows.values()))
    assert "launcher-warm" in table and "3.00" in table
    paths = overhead.write_results(list(rows.values()), samples, str(tmp_path))
    assert json.load(open(paths[0]))["samples"] == samples
    assert open(paths[2], "rb").read(4) == b"\x89PNG"


def test_result_line_with_and_without_horovodrun_prefix():
    assert overhead.last_json('noise\n{"a": 1}\n') == {"a": 1}
    assert overhead.last_json('[0]<stdout>:{"samples_per_s": 5.0, "threads": 1}\n') == {"samples_per_s": 5.0, "threads": 1}
    with pytest.raises(RuntimeError):
        overhead.last_json("no result")


def test_failed_runs_are_counted_not_summarised():
    samples = [{"variant": "torchrun", "repeat": 0, "wall_s": 7.0, "first_step_s": 3.0, "samples_per_s": 100.0},
               {"variant": "launcher-cold", "repeat": 0, "wall_s": 30.0, "first_step_s": 25.0, "samples_per_s": 80.0},
               {"variant": "launcher-cold", "repeat": 1, "wall_s": 99.0, "failed": "worker group failed"}]
    rows = {r["variant"]: r for r in overhead.summarize(samples)}
    assert rows["launcher-cold"]["runs"] == 1 and rows["launcher-cold"]["failed_runs"] == 1
    assert rows["launcher-cold"]["wall_s_max"] == 30.0
    assert rows["launcher-cold"]["throughput_vs_torchrun"] == pytest.approx(0.8)
    assert "1+1F" in overhead.format_rows(list(rows.values()))


def test_every_torchrun_failed_still_gives_a_table(tmp_path):
    samples = [{"variant": "torchrun", "repeat": 0, "wall_s": 7.0, "failed": "exit status 1"},
               {"variant": "launcher-warm", "repeat": 0, "wall_s": 12.0, "first_step_s": 9.0, "samples_per_s": 80.0}]
    rows = overhead.summarize(samples)
    assert [r["variant"] for r in rows] == ["launcher-warm"] and rows[0]["vs_torchrun"] is None
    assert "launcher-warm" in overhead.format_rows(rows)
    assert overhead.write_results(rows, samples, str(tmp_path))


def test_torchrun_baseline_trains_under_torchrun():
    """The benchmark's baseline really runs: our training loop, 2 processes, torchrun's rendezvous."""
    import subprocess
    import sys

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    res = subprocess.run([torchrun, "--nproc-per-node=2", os.path.join(overhead.ROOT, "benchmarks", "torchrun_digits.py"),
                          "--epochs", "2"], cwd=overhead.ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    out = overhead.last_json(res.stdout)
    assert out["accuracy"] > 0.7 and out["samples_per_s"] > 0 and out["first_step_s"] > 0
