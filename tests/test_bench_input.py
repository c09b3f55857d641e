"""`launcher bench input` (benchmarks/input_pipeline.py): one rank measured in this process on a
tiny local set, the transforms, the CLI's one-line refusals, and one run of the CLI with two
spawned readers against the Cloud Storage emulator and a local copy."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from benchmarks import input_pipeline
from launcher.cli.main import main
from launcher.data import writer
from launcher.errors import UserError


def array_set(folder, uri: str | None = None, n: int = 48, per_shard: int = 8) -> str:
    """A parquet set of ``n`` samples {x: a (3, 4, 4) float32 array, y: int}, ``per_shard`` to a shard."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "arrays.npz"
    rng = np.random.default_rng(0)
    np.savez(source, x=rng.random((n, 3, 4, 4), dtype=np.float32), y=np.arange(n))
    return writer.shard(str(source), uri or str(folder / "set"), samples_per_shard=per_shard).uri


def test_one_rank_reads_the_batches_asked_for(tmp_path):
    uri = array_set(tmp_path)
    settings = input_pipeline.Settings(workers=1, batch_size=4, batches=5, transform="tensor", step_ms=1)
    r = input_pipeline.measure_rank(uri, settings)
    assert r["samples"] == 20 and r["batches"] == 5
    assert r["samples_per_s"] > 0 and r["mb_per_s"] > 0 and r["peak_rss_mib"] > 0
    assert 0 < r["first_batch_s"] <= r["wall_s"] and 0 < r["wait_fraction"] < 1
    assert r["bytes"] > 0 and r["shards"] and r["cache_peak_mib"] is None  # a local set: nothing cached
    whole = input_pipeline.measure_rank(uri, input_pipeline.Settings(workers=1, batch_size=5))
    assert whole["samples"] == 48 and whole["batches"] == 10 and len(whole["shards"]) == 6  # one epoch

    row = input_pipeline.summarize("local", uri, [r], input_pipeline.check(uri, settings), settings)
    assert row["samples"] == 20 and row["samples_per_s"] > 0 and row["wait_pct"] is not None
    table = input_pipeline.format_rows([row])
    assert "samples/s" in table.splitlines()[0] and "local" in table.splitlines()[1]


def test_transforms_decode_images_and_turn_rows_into_float32():
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (5, 3), (10, 20, 30)).save(png, format="PNG")
    array, label = input_pipeline.decode_image({"__key__": "a", "png": png.getvalue(), "cls": b"7"})
    assert array.shape == (3, 5, 3) and array.dtype == np.uint8 and label == 7
    with pytest.raises(UserError, match="no jpg/jpeg/png/webp member"):
        input_pipeline.decode_image({"__key__": "a", "txt": b"hi"})
    tensor = input_pipeline.to_tensor({"x": np.ones((2, 2), np.float64), "y": 3, "name": "skip", "v": [1, 2]})
    assert tensor.dtype == np.float32 and tensor.tolist() == [1, 1, 1, 1, 3, 1, 2]


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    uri = array_set(tmp_path)
    for argv, expected in [([str(tmp_path / "nothing")], "has no index.json"),
                           ([uri, "--workers", "0"], "--workers must be at least 1"),
                           ([uri, "--transform", "resize"], "valid: none, decode-image, tensor"),
                           ([uri, "--transform", "decode-image"], "--transform decode-image reads tar sets"),
                           ([uri, "--batch-size", "0"], "--batch-size must be at least 1")]:
        assert main(["bench", "input", *argv, "--out", str(tmp_path / "out")]) == 2, argv
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
@pytest.mark.gcs
def test_cli_reads_the_emulator_and_a_local_copy_with_two_readers(bucket, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))
    uri = array_set(tmp_path, uri=f"gs://{bucket}/set")
    out = tmp_path / "out"
    code = main(["bench", "input", uri, "--workers", "2", "--batch-size", "4", "--compare-local",
                 "--step-ms", "5", "--transform", "tensor", "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr[-3000:]
    assert "vs local" in stdout and "load average" in stdout
    result = json.load(open(out / "input.json"))
    rows = {r["source"]: r for r in result["summary"]}
    assert set(rows) == {"emulator", "local copy"}
    for r in rows.values():
        assert r["failed"] is None and r["samples"] == 48 and r["workers"] == 2, r
        assert r["samples_per_s"] > 0 and r["mb_per_s"] > 0 and r["wait_pct"] is not None
    assert rows["emulator"]["cache_peak_mib"] > 0 and rows["local copy"]["cache_peak_mib"] is None
    assert rows["local copy"]["vs_local"] == 1.0 and rows["local copy"]["copy_s"] > 0
    assert [len(ranks) for ranks in result["ranks"].values()] == [2, 2]
    assert {row["source"] for row in csv.DictReader(open(out / "input.csv"))} == {"emulator", "local copy"}
    assert (out / "input.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "cache").glob("bench-input-*"))  # the cold cache is removed
