"""`launcher bench preemption`'s accounting in samples, its table and plot, and its projection to many GPUs."""

from __future__ import annotations

import csv
import json
import os

import pytest

from benchmarks import preemption_project as model
from benchmarks.preemption_report import format_table, lost_per_preemption, timeline, write_results
from launcher.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_timeline_counts_samples_once_and_the_restarts_repeats():
    # 2 workers, batch 32: 64 samples a step (32 alone). Group a trained steps 0-60 and was resumed
    # from step 50 by b (1 worker; 10 steps = 640 samples again), which went on to 80; c (2 workers)
    # resumed at 80 and trained to 100.
    attempts = [{"attempt": "a", "start_step": 0, "first_time": 0.0},
                {"attempt": "b", "start_step": 50, "first_time": 40.0},
                {"attempt": "c", "start_step": 80, "first_time": 75.0}]
    records = [{"attempt": "a", "global_step": 30, "time": 15.0, "world_size": 2, "kind": "step"},
               {"attempt": "a", "global_step": 60, "time": 30.0, "world_size": 2, "kind": "step"},
               {"attempt": "b", "global_step": 80, "time": 70.0, "world_size": 1, "kind": "step"},
               {"attempt": "c", "global_step": 100, "time": 85.0, "world_size": 2, "kind": "epoch"},
               {"attempt": "c", "time": 86.0, "kind": "note"}]  # no step: not counted
    t = timeline(records, attempts, workers=2, batch_size=32)
    assert t["samples_trained"] == 60 * 64 + 30 * 32 + 20 * 64 and t["samples_repeated"] == 10 * 32
    assert t["samples_skipped"] == 0 and t["reduced_s"] == 30.0
    once = 60 * 64 + 20 * 32 + 20 * 64
    # b's and c's first steps are points of their own: the restarts' gaps stay flat
    assert t["points"] == [(0.0, 0.0), (15.0, 30 * 64), (30.0, 60 * 64), (40.0, 60 * 64), (70.0, 60 * 64 + 20 * 32),
                           (75.0, 60 * 64 + 20 * 32), (85.0, once)]
    pace = (80 * 64) / 40.0  # a's 30 s and c's 10 s at full size
    assert t["full_pace"] == pytest.approx(pace) and t["goodput_samples"] == pytest.approx(once / 85 / pace, abs=1e-4)
    # A group that started past the last step reported: the old group (2 workers) trained the steps
    # between (b started from its checkpoint at 15), and its report of them never came.
    gap = timeline([{"attempt": "a", "global_step": 10, "time": 5.0, "world_size": 2},
                    {"attempt": "b", "global_step": 30, "time": 20.0, "world_size": 1}],
                   [{"attempt": "a", "start_step": 0, "first_time": 0.0},
                    {"attempt": "b", "start_step": 15, "first_time": 10.0}], workers=2, batch_size=1)
    assert gap["samples_skipped"] == 0 and gap["samples_repeated"] == 0
    assert gap["samples_unreported"] == 5 * 2 and gap["samples_trained"] == 10 * 2 + 5 * 2 + 15 * 1
    assert gap["points"] == [(0.0, 0.0), (5.0, 20.0), (10.0, 30.0), (20.0, 45.0)]
    assert timeline([], [], 2, 32)["goodput_samples"] is None


def test_a_quorum_change_splits_one_attempts_steps_by_the_size_they_trained_at():
    """--strategy ft is one attempt throughout: the quorum records say when its size changed."""
    attempts = [{"attempt": "x", "start_step": 0, "first_time": 0.0}]
    records = [{"attempt": "x", "global_step": 20, "time": 10.0, "world_size": 3, "kind": "step"},
               {"attempt": "x", "global_step": 25, "time": 12.5, "participants": 2, "before": 3, "kind": "quorum"},
               {"attempt": "x", "global_step": 45, "time": 27.5, "world_size": 2, "kind": "step"},
               {"attempt": "x", "global_step": 50, "time": 31.0, "participants": 3, "before": 2, "kind": "quorum"},
               {"attempt": "x", "global_step": 70, "time": 41.0, "world_size": 3, "kind": "step"}]
    t = timeline(records, attempts, workers=3, batch_size=10)
    assert t["samples_trained"] == 25 * 30 + 25 * 20 + 20 * 30 and t["samples_repeated"] == 0
    assert t["reduced_s"] == 18.5 and t["full_pace"] == pytest.approx(45 * 30 / 22.5)


def _row(strategy: str, **more) -> dict:
    attempts = [{"attempt": "a", "start_step": 0, "first_time": 100.0, "last_step": 60, "last_time": 130.0}]
    return {"strategy": strategy, "workers": 4, "min_workers": 3, "every_s": 60.0, "boot_s": 90.0, "period_s": None,
            "notice_s": 30.0, "status": "cancelled", "steps": 60, "nodes_removed": 2, "restarts": 2, "steps_lost": 0,
            "time_lost_s": 20.0, "recovery_s": [7.0, 9.0], "goodput": 0.8, "reduced_s": 12.0, "wall_s": 60.0,
            "attempts": attempts, "breakdown_s": {"held before the deadline": 1.5}, "samples_trained": 4000,
            "samples_repeated": 640, "samples_skipped": 0, "goodput_samples": 0.85, "full_pace": 128.0,
            "samples_timeline": [(0.0, 0.0), (10.0, 1280.0), (25.0, 1280.0), (30.0, 1920.0)],
            "removals": [112.0], "t0": 100.0, "lab_events": [], **more}


def test_table_per_strategy_with_ft_beside_the_restarting_ones(tmp_path):
    ft = _row("ft", ft=True, restarts=0, quorum_changes=4, quorum_change_s=[0.2, 0.3, 0.1, 0.2], replicas_replaced=2,
              time_lost_s=0.0, recovery_s=[], samples_repeated=0, goodput_samples=0.97, breakdown_s={})
    result = {"settings": {"workers": 4}, "strategies": [_row("elastic"), ft]}
    assert lost_per_preemption(result["strategies"][0]) == 10.0 and lost_per_preemption(ft) == 0.4
    text = format_table(result)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["STRATEGY", "GOODPUT", "(SAMPLES)", "REPEATED"], text
    assert lines[1].split() == ["elastic", "85.0%", "640", "0", "0", "2", "2", "10.00s", "12s"], text
    assert lines[2].split() == ["ft", "97.0%", "0", "0", "0", "2", "0", "0.40s", "12s"], text
    assert "4 quorum change(s)" in text and "0.40s per preemption, the quorum changes" in text, text
    paths = write_results(result, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["preemption.csv", "preemption.json", "preemption.png"]
    with open(tmp_path / "preemption.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["strategy"] for r in rows] == ["elastic", "ft"] and rows[1]["quorum_changes"] == "4"
    assert rows[0]["recovery_mean_s"] == "8.0" and rows[1]["lost_per_preemption_s"] == "0.4"
    written = json.loads((tmp_path / "preemption.json").read_text())
    assert written["strategies"][1]["samples_timeline"][-1] == [30.0, 1920.0]
    assert os.path.getsize(tmp_path / "preemption.png") > 10_000


def test_table_for_a_program_says_what_it_cannot_count(tmp_path):
    """A --script or --package keeps its steps to itself: its goodput is the reference run's wall time
    over the run's, and the sample columns say '-' rather than a made-up 0."""
    r = {**_row("wait"), "steps": None, "steps_lost": None, "samples_trained": None, "samples_repeated": None,
         "samples_skipped": None, "goodput_samples": None, "samples_timeline": [], "reduced_s": 0.0}
    text = format_table({"settings": {"reference_wall_s": 40.0}, "strategies": [r]})
    assert text.splitlines()[1].split()[:5] == ["wait", "80.0%", "-", "-", "-"], text
    assert "the uninterrupted run's wall time / this one's" in text and "steps lost" not in text
    assert len(write_results({"settings": {}, "strategies": [r]}, str(tmp_path))) == 3


def test_projection_costs_by_hand():
    inputs = model.Inputs(rates_per_node_h=(0.01,), gpus_per_node=8, notice_s=30, boot_s=90, held_s=5,
                          restart_fixed_s=7, nccl_init_s=160, nccl_init_ranks=1024, store_s=100, store_ranks=102400,
                          reload_s=60, quorum_change_s=0.2, quorum_overhead=0.01)
    # 512 GPUs: NCCL 80 s, store 0.5 s -> a restart 147.5 s; 64 replica groups: a quorum change 0.2 + 10 s.
    assert model.restart_s(512, inputs) == pytest.approx(147.5)
    assert model.quorum_change(512, inputs) == pytest.approx(10.2)
    assert model.cost_s("wait", 512, inputs) == pytest.approx(5 + 90 + 147.5)
    assert model.cost_s("elastic", 512, inputs) == pytest.approx(5 + 2 * 147.5 + 90 / 64)
    assert model.cost_s("elastic-early", 512, inputs) == pytest.approx(5 + 2 * 147.5 + 60 / 64)
    assert model.cost_s("ft", 512, inputs) == pytest.approx(2 * 10.2 + 90 / 64)
    # 64 nodes x 0.01 = 0.64 preemptions an hour
    assert model.goodput("wait", 512, 0.01, inputs) == pytest.approx(1 - 0.64 * 242.5 / 3600)
    assert model.goodput("ft", 512, 0.01, inputs) == pytest.approx((1 - 0.64 * (20.4 + 90 / 64) / 3600) * 0.99)
    assert model.goodput("wait", 512, 100.0, inputs) == 0.0  # never below nothing
    with pytest.raises(ValueError):
        model.cost_s("restart", 64, inputs)


def test_projection_restarts_cost_more_with_the_group_and_ft_less():
    rows = model.project_rows(model.Inputs(quorum_overhead=0.0))
    at = {(r["strategy"], r["gpus"], r["rate_per_node_h"]): r for r in rows}
    for strategy in model.STRATEGIES:
        series = [at[strategy, n, 0.007]["goodput"] for n in model.GPUS]
        assert series == sorted(series, reverse=True), (strategy, series)
    for n in model.GPUS:
        assert at["ft", n, 0.007]["goodput"] > at["elastic", n, 0.007]["goodput"] > 0.9
    assert at["wait", 1024, 0.007]["restart_s"] > at["wait", 64, 0.007]["restart_s"]


def test_projection_takes_the_measured_figures_from_a_bench_result(tmp_path):
    result = {"settings": {"boot_s": 30.0, "notice_s": 6.0}, "strategies": [
        {"strategy": "elastic", "full_pace": 1000.0, "breakdown_s": {
            "held before the deadline": 4.0, "removed -> train function starts": 3.0,
            "worker set-up (data, model, restore)": 2.0, "-> first step": 1.0}},
        {"strategy": "ft", "ft": True, "full_pace": 950.0, "quorum_change_s": [0.2, 0.4]}]}
    path = tmp_path / "preemption.json"
    path.write_text(json.dumps(result))
    got = model.from_bench(str(path))
    assert (got.boot_s, got.notice_s, got.held_s, got.restart_fixed_s) == (30.0, 6.0, 4.0, 6.0)
    assert got.quorum_change_s == pytest.approx(0.3) and got.quorum_overhead == pytest.approx(0.05)
    said = "\n".join(model.assumptions(got))
    assert f"held_s = 4.0: measured in {path}" in said and "reload_s = 60.0: assumed" in said, said
    (tmp_path / "other.json").write_text("[]")
    with pytest.raises(ValueError, match="holds no strategies"):
        model.from_bench(str(tmp_path / "other.json"))


def test_bench_preemption_project_writes_the_table_and_plot(capsys, tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "preemption", "--project", "--boot-s", "60", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "a model, not a measurement" in text and "boot_s = 60.0" in text and "nccl_init_s = 150.0" in text, text
    header = next(line for line in text.splitlines() if line.strip().startswith("64"))
    assert header.split() == ["64", "128", "256", "512", "1024"], text
    rows = json.loads((out / "preemption-project.json").read_text())
    assert {r["strategy"] for r in rows["summary"]} == set(model.STRATEGIES) and rows["assumptions"]
    assert os.path.getsize(out / "preemption-project.png") > 10_000
    assert main(["bench", "preemption", "--project", "--strategies", "elastic,ft", "--out", str(out)]) == 0
    capsys.readouterr()
    rows = json.loads((out / "preemption-project.json").read_text())
    assert {r["strategy"] for r in rows["summary"]} == {"elastic", "ft"}
    assert main(["bench", "preemption", "--project", str(tmp_path / "missing.json"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--project" in err and "missing.json" in err and len(err.strip().splitlines()) == 1, err
