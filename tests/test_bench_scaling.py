"""`launcher bench scaling` on tiny sizes: it runs through the backends' trainers and writes
well-formed JSON, CSV and PNG (figures are not checked: this is a shared machine)."""

from __future__ import annotations

import csv
import json

import pytest

from benchmarks import scaling
from launcher.cli.main import main

TINY = ["--workload", "resnet18-synthetic", "--image-size", "32", "--batch-size", "2", "--num-classes", "10",
        "--warmup", "1", "--iters", "2", "--batches-per-iter", "1"]


def test_summary_efficiency_and_comm_share():
    measured = [
        {"framework": "torch", "backend": "native", "workers": 1, "rates": [10.0, 10.0], "sync_step_s": 0.1,
         "local_step_s": 0.1, "gradient_bytes": 4e6},
        {"framework": "torch", "backend": "native", "workers": 2, "rates": [15.0, 17.0], "sync_step_s": 0.2,
         "local_step_s": 0.15, "gradient_bytes": 4e6},
    ]
    one, two = scaling.summarize(measured)
    assert one["efficiency"] == 1.0 and one["comm_share"] == 0.0 and one["ci95"] == 0.0
    assert two["images_per_s"] == 16.0 and two["per_worker"] == 8.0
    assert two["efficiency"] == pytest.approx(16.0 / 20.0)
    assert two["comm_share"] == pytest.approx(0.25)
    assert two["ci95"] == pytest.approx(1.96 * 2 ** 0.5, abs=0.01)


def test_cli_rejects_bad_flags(capsys):
    assert main(["bench", "scaling", "--frameworks", "jax"]) == 2
    assert "valid: torch, tensorflow" in capsys.readouterr().err
    assert main(["bench", "scaling", "--workers", "0,2"]) == 2
    assert main(["bench", "scaling", "--image-size", "16"]) == 2
    assert "--image-size" in capsys.readouterr().err


@pytest.mark.integration
def test_tiny_torch_scaling_writes_results(ray_local, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "scaling", *TINY, "--frameworks", "torch", "--backends", "native,nosuch",
                 "--workers", "1,2", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "# scaling" in captured.out and "nosuch" in captured.out  # the unavailable backend is listed
    assert "unavailable" in captured.err and "[2/2]" in captured.err  # progress on stderr
    data = json.load(open(out / "scaling.json"))
    rows = {r["workers"]: r for r in data["summary"] if r["variant"] == "launcher"}
    assert set(rows) == {1, 2} and rows[1]["efficiency"] == 1.0
    assert rows[2]["images_per_s"] > 0 and 0 <= rows[2]["comm_share"] <= 1
    assert data["measurements"][0]["gradient_bytes"] > 1e6  # ResNet-18: ~11 M parameters
    assert data["machine"]["cpu_model"] and data["machine"]["threads_per_worker"] == 1
    assert [u["backend"] for u in data["unavailable"]] == ["nosuch"]
    # The same worker under torchrun, in the same run, and the launcher's ratio to it.
    bare = {r["workers"]: r for r in data["summary"] if r["variant"] == "torchrun"}
    assert set(bare) == {1, 2} and bare[1]["efficiency"] == 1.0 and bare[2]["images_per_s"] > 0
    assert rows[2]["vs_bare"] == pytest.approx(rows[2]["images_per_s"] / bare[2]["images_per_s"], rel=0.01)
    assert "launcher/bare" in captured.out and "torchrun" in captured.out
    assert len(list(csv.DictReader(open(out / "scaling.csv")))) == 4
    assert open(out / "scaling.png", "rb").read(4) == b"\x89PNG"


@pytest.mark.integration
def test_tiny_tensorflow_scaling_one_worker(ray_local):
    settings = scaling.Settings(workload="resnet18-synthetic", image_size=32, batch_size=2, num_classes=10,
                                warmup=1, iters=2, batches_per_iter=1)
    measured, skipped = scaling.run(settings, ["tensorflow"], ["native"], [1], lambda _: None)
    assert skipped == [] and len(measured) == 1
    m = measured[0]
    assert len(m["rates"]) == 2 and all(r > 0 for r in m["rates"]) and m["gradient_bytes"] > 1e6
