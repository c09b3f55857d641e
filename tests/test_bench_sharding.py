"""`launcher bench sharding`: fsdp against ddp on examples/gpt.py. The arithmetic (rows, goals,
table) and the flags are checked without Ray or a subprocess; one small run of the command
must write its table, JSON, CSV and plot with rows for both strategies."""

from __future__ import annotations

import csv
import json
import math

import pytest

from benchmarks import sharding
from launcher.cli.main import main


def measurement(strategy, workers, variant="launcher", repeat=0, **figures):
    return {"kind": "throughput", "strategy": strategy, "workers": workers, "variant": variant, "repeat": repeat,
            **figures}


def stall(strategy, workers, upload, stall_ms):
    return {"kind": "stall", "strategy": strategy, "workers": workers, "variant": "launcher", "upload": upload,
            "stall_ms": stall_ms, "step_ms": 100.0}


MEASURED = [
    measurement("ddp", 1, samples_per_s=100.0, state_mb=40.0, peak_rss_mb=600.0),
    measurement("ddp", 1, "torchrun", samples_per_s=101.0, state_mb=40.0),
    measurement("ddp", 2, samples_per_s=180.0, state_mb=40.4, peak_rss_mb=610.0),
    measurement("fsdp", 2, samples_per_s=150.0, state_mb=21.0, peak_rss_mb=580.0),
    measurement("fsdp", 2, "torchrun", samples_per_s=160.0, state_mb=21.0),
    measurement("fsdp", 4, samples_per_s=250.0, state_mb=10.5),
    measurement("fsdp", 4, "torchrun", failed="SIGABRT"),
    stall("fsdp", 2, "sync", 400.0), stall("fsdp", 2, "async", 20.0),
    stall("ddp", 2, "sync", 300.0), stall("ddp", 2, "async", 90.0),
]


def test_rows_pair_each_run_with_its_twin_and_compare_fsdp_with_ddp_at_the_same_size():
    rows = {(r["strategy"], r["workers"]): r for r in sharding.summarize(MEASURED)}
    assert rows[("ddp", 1)]["vs_torchrun"] == pytest.approx(100 / 101, abs=1e-3)
    assert rows[("ddp", 1)]["state_vs_ddp_share"] is None
    two = rows[("fsdp", 2)]
    assert two["state_vs_ddp_share"] == pytest.approx(21.0 / (40.4 / 2), abs=1e-3)  # ddp's at 2 workers
    assert two["vs_torchrun"] == pytest.approx(150 / 160, abs=1e-3) and two["peak_rss_mb"] == 580.0
    assert (two["stall_sync_ms"], two["stall_async_ms"], two["stall_ratio"]) == (400.0, 20.0, 0.05)
    four = rows[("fsdp", 4)]  # no ddp row at 4 workers: ddp's state at any size; the failed twin: no ratio
    assert four["state_vs_ddp_share"] == pytest.approx(10.5 / (40.0 / 4), abs=1e-3)
    assert four["vs_torchrun"] is None and four["torchrun_samples_per_s"] is None
    assert rows[("ddp", 2)]["stall_ratio"] == 0.3


def test_goals_say_which_figures_met_them_and_which_were_not_measured():
    checked = sharding.goals(sharding.summarize(MEASURED))
    verdicts = {(g["goal"].split()[1], g["strategy"], g["workers"]): g["met"] for g in checked}
    assert verdicts[("state", "fsdp", 2)] is True and verdicts[("state", "fsdp", 4)] is True
    assert verdicts[("launcher/torchrun", "fsdp", 2)] is False   # 0.9375 < 0.97
    assert verdicts[("launcher/torchrun", "fsdp", 4)] is None    # its twin failed
    assert verdicts[("stall", "fsdp", 2)] is True and verdicts[("stall", "ddp", 2)] is False
    text = sharding.format_goals(checked)
    assert "fsdp launcher/torchrun >= 0.97: fsdp N=2 0.938 MISSED; fsdp N=4 not measured" in text
    assert "async stall <= 0.2 x sync: ddp N=2 0.300 MISSED; fsdp N=2 0.050 met" in text
    table = sharding.format_rows(sharding.summarize(MEASURED))
    assert "launcher/torchrun" in table and "1.040" in table and len(table.splitlines()) == 5


def test_goals_without_any_figure_are_not_measured_rather_than_missing():
    checked = sharding.goals(sharding.summarize([measurement("ddp", 1, samples_per_s=1.0, state_mb=1.0)]))
    assert [g["met"] for g in checked] == [None, None, None]
    assert "not measured" in sharding.format_goals(checked)


def test_results_are_written_as_json_csv_and_png(tmp_path):
    rows = sharding.summarize(MEASURED)
    info = {"cpu_model": "test CPU", "cpu_cores": 2, "date_utc": "today"}
    paths = sharding.write_results(rows, sharding.goals(rows), MEASURED, info, sharding.Settings(), str(tmp_path))
    assert [p.rsplit(".", 1)[1] for p in paths] == ["json", "csv", "png"]
    saved = json.load(open(paths[0]))
    assert len(saved["summary"]) == 4 and saved["settings"]["workers"] == [1, 2, 4] and saved["goals"]
    assert [r["strategy"] for r in csv.DictReader(open(paths[1]))] == ["ddp", "ddp", "fsdp", "fsdp"]
    assert open(paths[2], "rb").read(4) == b"\x89PNG"


@pytest.mark.parametrize("steps,batch,workers,context,expected", [
    (12, 8, 1, 64, 12), (12, 8, 4, 64, 12), (3, 4, 2, 128, 3), (9, 1, 4, 32, 9),
    (2, 2, 2, 16, 5), (1, 1, 4, 32, 9),  # steps x batch < 9: the held-out tenth needs more text
])
def test_the_text_gives_the_steps_asked_and_a_held_out_window_per_worker(steps, batch, workers, context, expected):
    chars = sharding.max_chars(steps, batch, workers, context)
    cut = int(chars * 0.9)  # as examples/gpt.py splits it, in char_lm.Windows of `context`
    train, held_out = (cut - 1) // context, (chars - cut - 1) // context
    assert math.ceil(train / (batch * workers)) == expected and held_out >= workers


def test_each_run_gets_the_size_the_steps_and_the_strategy():
    args = sharding.Settings(d_model=64, layers=2, batch_size=4, steps=3).args("fsdp", 2)
    assert args[:2] == ["--workload", sharding.GPT] and args[-4:] == ["--batch-size", "4", "--strategy", "fsdp"]
    assert "d_model=64" in args and "layers=2" in args and "eval_batches=1" in args


@pytest.mark.parametrize("flags,needle", [
    (["--strategies", "ddp,zero3"], "--strategies: unknown zero3"),
    (["--workers-list", "1,two"], "--workers-list '1,two' is not a comma-separated list of integers"),
    (["--workers-list", "0,2"], "--workers-list '0,2': every value must be at least 1"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--d-model", "30", "--heads", "4"], "--d-model 30 is not a multiple of --heads 4"),
    (["--stall", "fsdp,ddpp"], "--stall: unknown ddpp"),
    (["--steps", "3", "--every", "3"], "--steps 3 leaves no step checkpoint at --every 3"),
    (["--stall-workers", "0"], "--stall-workers must be at least 1"),
])
def test_a_bad_flag_is_one_line_and_exit_2(capsys, flags, needle):
    code = main(["bench", "sharding", *flags, "--out", "/nonexistent/never-written"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.integration
def test_bench_sharding_writes_rows_for_both_strategies(warm_head, capsys, tmp_path):
    code = main(["bench", "sharding", "--workers-list", "2", "--steps", "5", "--batch-size", "2", "--d-model", "32",
                 "--layers", "1", "--heads", "2", "--context", "16", "--stall", "none",
                 "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    rows = json.load(open(tmp_path / "sharding.json"))["summary"]
    assert {(r["strategy"], r["workers"]) for r in rows} == {("ddp", 2), ("fsdp", 2)}
    assert all(r["samples_per_s"] > 0 and r["state_mb"] > 0 for r in rows), rows
    fsdp2 = next(r for r in rows if (r["strategy"], r["workers"]) == ("fsdp", 2))
    assert fsdp2["state_vs_ddp_share"] < 1.15, fsdp2  # (the stall runs: tests/test_sharded.py's async save)
    assert "# goals" in out and "load average" in out
    assert all(r["vs_torchrun"] > 0 for r in rows), rows  # each beside its torchrun twin
    assert len(list(csv.DictReader(open(tmp_path / "sharding.csv")))) == 2
    assert open(tmp_path / "sharding.png", "rb").read(4) == b"\x89PNG"
