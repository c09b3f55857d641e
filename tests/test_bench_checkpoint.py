"""`launcher bench checkpoint`: it measures, prints a table and writes JSON, CSV and a plot."""

from __future__ import annotations

import csv
import json
import os

from launcher.cli.main import main


def test_checkpoint_benchmark_local_and_emulator(capsys, tmp_path):
    out = tmp_path / "results"
    code = main(["bench", "checkpoint", "--model", "resnet18", "--repeats", "1", "--emulator",
                 "--storage", str(tmp_path / "disk"), "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0
    assert "save s (med/max)" in stdout and "gs://launcher-bench/checkpoints" in stdout
    result = json.load(open(out / "checkpoint.json"))
    rows = {r["destination"]: r for r in result["summary"]}
    assert set(rows) == {str(tmp_path / "disk"), "gs://launcher-bench/checkpoints"}
    assert rows["gs://launcher-bench/checkpoints"]["emulator"] is True
    for r in rows.values():
        # ResNet-18 weights + SGD momentum: 2 x 11.7 M float32 values (~93.5 MB) plus headers
        assert 93 < r["mb"] < 95
        assert r["save_s_median"] > 0 and r["restore_mb_s"] > 0
    assert len(list(csv.DictReader(open(out / "checkpoint.csv")))) == 2
    assert (out / "checkpoint.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path / "disk" / ".bench") == []  # benchmark checkpoints cleaned up
