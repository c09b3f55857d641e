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


def test_start_up_phases_are_medians_per_launcher():
    samples = [{"variant": "launcher-cold", "repeat": i, "wall_s": 10.0 + i,
                "phases": {"first training step": 0.5, "Ray start or connect": ray_s}}  # sorted, as in the JSON
               for i, ray_s in enumerate([4.0, 6.0, 5.0])]
    samples.append({"variant": "launcher-warm", "repeat": 0, "wall_s": 6.0, "phases": {"Ray start or connect": 0.4}})
    samples.append({"variant": "torchrun", "repeat": 0, "wall_s": 5.0, "phases": None})
    medians = overhead.phase_medians(samples)
    assert medians == {"launcher-cold": {"Ray start or connect": 5.0, "first training step": 0.5},
                       "launcher-warm": {"Ray start or connect": 0.4}}
    assert list(medians["launcher-cold"]) == ["Ray start or connect", "first training step"]  # as they happen
    table = overhead.format_phases(medians).splitlines()
    assert table[2].split()[-2:] == ["5.00", "0.40"] and table[3].split()[-2:] == ["0.50", "-"]


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

    cmd = overhead._command("torchrun", 2, "", 0)
    assert cmd[-2:] == ["--epochs", "1"]
    res = subprocess.run(cmd[:-1] + ["2"], cwd=overhead.ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    out = overhead.last_json(res.stdout)
    assert out["accuracy"] > 0.7 and out["samples_per_s"] > 0 and out["first_step_s"] > 0, (out, res.stderr[-2000:])


def test_a_failed_bare_run_says_why_not_torchruns_banner():
    """torchrun ends a failure with a row of "=" signs; the reason kept is the worker's error."""
    from benchmarks import raywork

    cmd = raywork.bare_command("torchrun", "gloo", 1, "benchmarks.no_such_module:worker", {})
    with pytest.raises(RuntimeError) as caught:
        raywork.run_bare(cmd, 1)
    assert "No module named 'benchmarks.no_such_module'" in str(caught.value)


def test_hvd_tf_ratio_reads_the_total_from_horovods_own_example_and_the_projects_script():
    from benchmarks import hvd_tf_ratio

    horovod_example = ("Model: ResNet50\nBatch size: 4\nNumber of CPUs: 2\nRunning warmup...\nRunning benchmark...\n"
                       "Iter #0: 1.4 img/sec per CPU\nIter #1: 1.5 img/sec per CPU\n"
                       "Img/sec per CPU: 1.5 +-0.1\nTotal img/sec on 2 CPU(s): 2.9 +-0.2\n")
    assert hvd_tf_ratio.total_images_per_second(horovod_example) == 2.9
    ours = "[rank 0] Img/sec per worker: 2.61 +-0.05\n[rank 0] Total img/sec on 2 worker(s): 5.22 +-0.10\n"
    assert hvd_tf_ratio.total_images_per_second(ours) == 5.22
    assert hvd_tf_ratio.total_images_per_second("Iter #0: 1.4 img/sec per CPU\n") is None
    command = hvd_tf_ratio._command("launcher", "/x/bench.py", 2, [], "/runs", 0, ["--no-cuda"])
    assert command[command.index("--script") + 1] == "/x/bench.py" and command[-2:] == ["--", "--no-cuda"]


def test_ray_tax_groups_processes_and_takes_shares_over_the_steady_window():
    from benchmarks import ray_tax

    assert ray_tax.group_of("ray::RayTrainWorker.run_train_fn", False) == "workers"
    assert ray_tax.group_of("/venv/lib/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", False) == "raylet"
    agent = "python -u /venv/lib/ray/dashboard/agent.py --node-ip-address=1"
    assert ray_tax.group_of(agent, False) == "dashboard agent"
    assert ray_tax.group_of("ray::DashboardAgent", False) == "dashboard agent"  # its title once started
    api = "python /venv/lib/ray/dashboard/dashboard.py --host=127.0.0.1 --port=8265"
    assert ray_tax.group_of(api, False) == "api server"
    assert ray_tax.group_of("ray::TrainController.run", False) == "controller"
    worker = "python default_worker.py --node-ip-address=127.0.0.1 --raylet-name=/tmp/ray/session/sockets/raylet"
    assert ray_tax.group_of(worker, False) == "other"  # not yet named by its actor, and not the raylet
    assert ray_tax.group_of("python -m launcher run", True) == "launcher driver"
    # a worker at 90 % of a core and a raylet at 5 %, sampled each second for 40 s; the first
    # 10 s after the worker appears (start-up) and the last 2 s are left out
    rows = [{"t": float(t), "pid": 1, "group": "workers", "cpu_s": 0.9 * t} for t in range(3, 44)]
    rows += [{"t": float(t), "pid": 2, "group": "raylet", "cpu_s": 0.05 * t + (5.0 if t > 41 else 0.0)}
             for t in range(0, 44)]
    got, window = ray_tax.shares(rows, skip=10.0)
    assert window == 28.0
    assert got["workers"] == pytest.approx(90.0) and got["raylet"] == pytest.approx(5.0)
