"""`launcher bench allreduce`: size parsing, the nccl-tests arithmetic, and a tiny real run over gloo."""

from __future__ import annotations

import csv
import json

import pytest

from benchmarks import allreduce
from launcher.cli.main import main


def test_sizes_range_and_list():
    assert allreduce.parse_sizes("4KB..32KB") == [4096, 8192, 16384, 32768]
    assert allreduce.parse_sizes("4KB,1MB") == [4096, 1024 ** 2]
    assert allreduce.human(256 * 1024 ** 2) == "256MB"
    for bad in ("4XB", "1MB..4KB", "2B"):
        with pytest.raises(ValueError):
            allreduce.parse_sizes(bad)


def test_bus_bandwidth_follows_nccl_tests():
    rows = allreduce.summarize([{"backend": "gloo", "workers": 4, "bytes": 1_000_000, "time_s": 0.001, "repeats": 3},
                                {"backend": "gloo", "variant": "torchrun", "workers": 4, "bytes": 1_000_000,
                                 "time_s": 0.0008, "repeats": 3}], copy_bw=4e9)
    [r] = [r for r in rows if r["variant"] == "launcher"]
    assert r["vs_bare"] == pytest.approx(0.8)  # the launcher reaches 80 % of the bare bus bandwidth
    assert r["algbw_gb_s"] == pytest.approx(1.0)
    assert r["busbw_gb_s"] == pytest.approx(1.5)  # 2 (n-1) / n = 1.5 for n = 4
    assert r["busbw_vs_copy"] == pytest.approx(0.375)
    assert r["latency_us"] is None  # 1 MB is not a latency-sized message


def test_cli_rejects_bad_flags(capsys):
    assert main(["bench", "allreduce", "--sizes", "lots"]) == 2
    assert "--sizes" in capsys.readouterr().err
    assert main(["bench", "allreduce", "--workers", "1"]) == 2
    assert "--workers" in capsys.readouterr().err
    assert main(["bench", "allreduce", "--backends", "mpi"]) == 2
    assert "valid: gloo, horovod, nccl" in capsys.readouterr().err


@pytest.mark.integration
def test_tiny_gloo_run_writes_results(ray_local, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "allreduce", "--sizes", "4KB,64KB", "--backends", "gloo,horovod,nccl",
                 "--workers", "2", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "memory-copy bandwidth" in captured.out and "# allreduce" in captured.out
    assert "nccl: unavailable" in captured.err  # no GPU on the test machine
    data = json.load(open(out / "allreduce.json"))
    gloo = [r for r in data["summary"] if r["backend"] == "gloo" and r["variant"] == "launcher"]
    assert [r["bytes"] for r in gloo] == [4096, 65536]
    assert all(r["algbw_gb_s"] > 0 and r["busbw_gb_s"] == pytest.approx(r["algbw_gb_s"], rel=0.01) for r in gloo)
    # The same collective measured bare in the same run, and the launcher's ratio to it.
    bare = {(r["backend"], r["bytes"]): r for r in data["summary"] if r["variant"] != "launcher"}
    assert bare[("gloo", 4096)]["variant"] == "torchrun" and bare[("gloo", 65536)]["time_us"] > 0
    assert all(r["vs_bare"] == pytest.approx(bare[("gloo", r["bytes"])]["time_us"] / r["time_us"], rel=0.01)
               for r in gloo)
    assert "gloo: launcher/bare bus bandwidth" in captured.out and "against torchrun" in captured.out
    if "horovod: unavailable" not in captured.err:
        assert {("horovod", "launcher"), ("horovod", "horovodrun")} <= {(r["backend"], r["variant"])
                                                                         for r in data["summary"]}
    assert data["copy_bandwidth_gb_s"] > 0 and data["machine"]["cpu_cores"]
    assert any(u["backend"] == "nccl" for u in data["unavailable"])
    assert len(list(csv.DictReader(open(out / "allreduce.csv")))) == len(data["summary"])
    assert open(out / "allreduce.png", "rb").read(4) == b"\x89PNG"
