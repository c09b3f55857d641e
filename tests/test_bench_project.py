"""The projection model's arithmetic, its input formats and `launcher bench project`'s output files."""

from __future__ import annotations

import csv
import json
import math

import pytest

from benchmarks import project
from launcher.cli.main import main

MB = 1e6


def test_one_gpu_is_fully_efficient():
    w = project.Workload("m", 100 * MB, 0.1)
    assert project.efficiency(1, w, 25, project.Model()) == 1.0


def test_infinite_bandwidth_and_no_latency_is_fully_efficient():
    w = project.Workload("m", 500 * MB, 0.1)
    model = project.Model(latency_s=0.0, intra_node_gbps=math.inf)
    assert project.efficiency(1024, w, math.inf, model) == 1.0


def test_hand_computed_case():
    # 16 GPUs over 8-GPU nodes: the ring crosses nodes, so the 10 Gbit/s network is the link.
    # G = 150 MB in 64 MiB buffers -> 3 buffers; transfer = 2*15/16 * 150e6 / 1.25e9 = 0.225 s;
    # latency = 3 * 2*15 * 100 us = 0.009 s; comm = 0.234 s. Hidden: 0.5 * 2/3 * 0.3 = 0.1 s.
    # step = 0.3 + 0.134 = 0.434 s; E = 0.3 / 0.434.
    w = project.Workload("m", 150 * MB, 0.3)
    model = project.Model(latency_s=100e-6, fusion_bytes=64 * 1024 * 1024)
    t, comm = project.step_time(16, w, 10, model)
    assert comm == pytest.approx(0.234)
    assert t == pytest.approx(0.434)
    assert project.efficiency(16, w, 10, model) == pytest.approx(0.3 / 0.434)


def test_communication_fully_hidden_by_overlap():
    w = project.Workload("m", 1 * MB, 1.0)  # tiny gradients, long compute
    assert project.efficiency(64, w, 100, project.Model()) == 1.0


def test_efficiency_falls_with_gpus_and_rises_with_bandwidth():
    w = project.Workload("vgg", 550 * MB, 0.3)
    m = project.Model()
    effs = [project.efficiency(n, w, 25, m) for n in (16, 64, 512)]
    assert effs[0] >= effs[1] >= effs[2]
    assert project.efficiency(512, w, 200, m) > project.efficiency(512, w, 25, m)


def test_fusion_buffers_pay_latency_each():
    m = project.Model(fusion_bytes=10 * MB, latency_s=1e-3)
    one = project.comm_time(4, 10 * MB, math.inf, m)
    three = project.comm_time(4, 30 * MB, math.inf, m)
    assert one == pytest.approx(2 * 3 * 1e-3) and three == pytest.approx(3 * one)


def test_inputs_from_scaling_json_and_figures_file(tmp_path):
    scaling = tmp_path / "scaling.json"
    scaling.write_text(json.dumps({"settings": {"workload": "resnet50-synthetic"}, "machine": {"date_utc": "d"},
                                   "measurements": [
                                       {"framework": "torch", "backend": "native", "workers": 2,
                                        "gradient_bytes": 1e8, "local_step_s": 0.9},
                                       {"framework": "torch", "backend": "native", "workers": 1,
                                        "gradient_bytes": 1e8, "local_step_s": 0.8}]}))
    [w] = project.from_scaling_results(str(scaling))
    assert (w.gradient_bytes, w.step_time_s) == (1e8, 0.8)  # the 1-worker figure
    figures = tmp_path / "figures.yaml"
    figures.write_text("- {model: a, params: 25000000, step_time_s: 0.2}\n- {model: b, gradient_mb: 10, step_time_s: 1}\n")
    a, b = project.from_figures_file(str(figures))
    assert a.gradient_bytes == 1e8 and b.gradient_bytes == 1e7
    with pytest.raises(ValueError, match="step_time_s"):
        project.figure({"model": "x", "params": 1}, "here")


def test_cli_writes_table_json_csv_png(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "project", "--model", "resnet101:178:0.45", "--model", "vgg16:553:0.45",
                 "--network-gbps", "25,100", "--gpus", "8,64,512", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "resnet101" in text and "512" in text
    data = json.load(open(out / "project.json"))
    assert len(data["summary"]) == 2 * 2 * 3 and data["model"]["fusion_bytes"] == 128 * 1024 * 1024
    rows = list(csv.DictReader(open(out / "project.csv")))
    assert {r["gpus"] for r in rows} == {"8", "64", "512"}
    assert all(0 < float(r["efficiency"]) <= 1 for r in rows)
    assert open(out / "project.png", "rb").read(4) == b"\x89PNG"


def test_cli_rejects_bad_model_flag(capsys):
    assert main(["bench", "project", "--model", "resnet101:lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NAME:GRADIENT_MB:STEP_S" in err[0]
    assert main(["bench", "project"]) == 2
    assert "nothing to project" in capsys.readouterr().err
