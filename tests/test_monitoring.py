"""Where a run's time goes (launcher.worker.timing): the step-time breakdown and the straggler.

The fast tests time a real torch model's backward pass and optimizer step through the hooks,
check the sums, shares and words the driver shows, and train an input-bound run (a slow
dataset) on the training session in this process (no Ray), whose reports name the input. The
integration test trains, on a local Ray, a run that checkpoints every step, whose rank 1 is
slowed down in its second epoch only: the progress lines and the summary name the
checkpoints, and the straggler in the second epoch, not in the first.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

import workloads
from launcher.driver.progress import format_epoch
from launcher.measures import format_shares
from launcher.spec import JobSpec
from launcher.worker.timing import PHASES, SHARE_KEYS, StepClock, breakdown, combine, describe, own_row
from test_session_state import comm  # noqa: F401 - comm: a fixture (a single-process gloo group)
from test_user_workloads import elsewhere, run_cli, write  # noqa: F401 - elsewhere: a fixture


def _model_and_optimizer():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_clock_tells_waiting_for_gradients_from_the_update():
    """Between the last gradient and the optimizer's update the rank waits (DDP's allreduce, here
    a sleep): that is sync; the update itself is optimizer; a step without an update adds neither."""
    import torch

    model, optimizer = _model_and_optimizer()
    clock = StepClock()
    clock.watch_gradients(model)
    clock.watch_optimizer(optimizer)
    for _ in range(3):
        model(torch.randn(16, 4)).pow(2).mean().backward()
        time.sleep(0.05)
        optimizer.step()
        optimizer.zero_grad()
        clock.step_done()
    assert 0.15 <= clock.seconds["sync"] < 0.6, clock.seconds
    assert 0 < clock.seconds["optimizer"] < 0.05, clock.seconds
    before = clock.state()
    model(torch.randn(16, 4)).pow(2).mean().backward()  # accumulating: no update, nothing added
    clock.step_done()
    assert clock.state() == before
    clock.reset({"sync": 1.5})
    assert clock.state() == {"sync": 1.5, "optimizer": 0.0, "checkpoint": 0.0, "notice": 0.0}
    clock.close()
    optimizer.step()
    assert clock.state()["optimizer"] == 0.0  # the hooks are gone


def test_horovods_optimizer_counts_its_synchronize_as_sync():
    """Horovod's DistributedOptimizer waits for the allreduce inside step() (synchronize); the
    clock counts that wait as sync, and the update once (torch runs the step hooks twice there)."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    model, optimizer = _model_and_optimizer()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    real = optimizer.synchronize

    def slow_synchronize():
        time.sleep(0.05)
        return real()

    optimizer.synchronize = slow_synchronize
    clock = StepClock()
    clock.watch_gradients(model)
    clock.watch_optimizer(optimizer)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        optimizer.step()
        clock.step_done()
    assert 0.1 <= clock.seconds["sync"] < 0.5, clock.seconds
    assert clock.seconds["optimizer"] < 0.05, clock.seconds


def test_the_breakdown_gives_shares_per_phase_and_names_the_straggler():
    clock = StepClock()
    clock.seconds.update(sync=1.0, optimizer=0.5, checkpoint=2.0, notice=0.5)
    row = own_row(1.0, clock, 10.0)
    assert row == [1.0, 5.0, 1.0, 0.5, 2.0, 0.5, 10.0]  # data, compute (the rest), ..., seconds
    other = [1.0, 1.0, 5.0, 0.5, 2.0, 0.5, 10.0]   # rank 1 waited for rank 0 (sync)
    out = breakdown(np.array([row, other]).T)
    assert out["time_compute"] == pytest.approx(0.3) and out["time_sync"] == pytest.approx(0.3)
    assert out["time_checkpoint"] == pytest.approx(0.2)
    assert sum(out[k] for k in SHARE_KEYS) == pytest.approx(1.0)
    assert out["busy_s_ranks"] == [6.5, 2.5]
    assert out["straggler_rank"] == 0 and out["straggler_factor"] == pytest.approx(6.5 / 4.5, abs=0.01)
    even = breakdown(np.array([row, row]).T)
    assert "straggler_rank" not in even                       # nobody slower than the others
    assert "straggler_rank" not in breakdown(np.array([row]).T)  # one rank: no one to compare with
    assert breakdown(np.zeros((len(PHASES) + 1, 2))) == {}       # no training time: nothing to say
    # four ranks, one 1.3x the median: named; 1.1x: not
    four = np.array([row] * 4).T.copy()
    four[1, 2] = 5.0 * 1.3 + 1.0 + 0.5 - 1.0 - 0.5  # rank 2's compute so that its busy time is 1.3x
    assert breakdown(four)["straggler_rank"] == 2
    four[1, 2] = 5.0 + 0.65
    assert "straggler_rank" not in breakdown(four)


def test_the_progress_line_and_the_summary_name_the_largest_share():
    report = {"epoch": 2, "global_step": 40, "samples_per_s": 900.0, "time_data": 0.42, "time_compute": 0.38,
              "time_sync": 0.1, "time_optimizer": 0.05, "time_checkpoint": 0.05, "time_notice": 0.0,
              "train_time_s": 3.0, "data_wait_fraction": 0.42, "data_wait_max_fraction": 0.45}
    line = format_epoch(report, 3, 12.0)
    assert "42% waiting for data" in line and "straggler" not in line and "input wait" not in line, line
    slow = {**report, "time_data": 0.1, "time_sync": 0.42, "straggler_rank": 1, "straggler_factor": 1.61}
    assert describe(slow) == "42% synchronising gradients  straggler rank 1 (1.6x the median)"
    shares, stragglers = combine([report, {**slow, "train_time_s": 1.0}, {"epoch": 1, "kind": "epoch"}])
    assert shares["data"] == pytest.approx((0.42 * 3 + 0.1) / 4) and stragglers == [
        {"rank": 1, "epochs": 1, "factor": 1.61}]
    text = format_shares(shares, stragglers)
    assert text.startswith("time: compute 38.0%, data 34.0%, sync 18.0%"), text
    assert "straggler: rank 1 (1.6x the median busy time, 1 epoch)" in text and "notice" not in text, text
    assert combine([{"epoch": 1}]) == ({}, [])


# -- a run slow for its input (in this process), and for its checkpoints and a straggler (local Ray) --

SLOW = '''
import time

import torch


class Items(torch.utils.data.Dataset):
    def __init__(self, delay):
        self.delay = delay
        g = torch.Generator().manual_seed(0)
        self.items = [(torch.randn(8, generator=g), torch.randn(1, generator=g)) for _ in range(128)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.items[i]


def train(session):
    """A linear model; --param delay=S: each item takes S to read; --param slow=S: rank 1 takes S
    more per step, from the epoch --param slow_from=E on (0-based; from the first by default)."""
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = session.prepare(model, optimizer)
    session.register(model=model, optimizer=optimizer)
    loader = session.loader(Items(float(session.params.get("delay", 0.0))), batch_size=8)
    for epoch in session.epochs():
        for x, y in loader:
            if session.rank == 1 and epoch >= int(session.params.get("slow_from", 0)):
                time.sleep(float(session.params.get("slow", 0.0)))
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            session.step(train_loss=loss)
'''


def test_an_input_bound_run_is_told_it_waits_for_data(comm, elsewhere, tmp_path):
    """Each item takes 4 ms to read (16 batches of 8 an epoch): the session's loader counts the
    wait as the data phase, the largest share of each epoch, and the progress line and the
    summary made of the epoch reports say so. Trained on the session less Ray (BareSession, one
    rank); that these words reach the user from a launch's ranks: the integration test below."""
    from launcher.worker import BareSession
    from launcher.worker.timing import largest_share

    path = write(elsewhere, SLOW)
    spec = JobSpec(workers=1, storage=str(tmp_path / "runs"), workload=f"{path}:train", epochs=2,
                   preemption_check_steps=0, params={"delay": 0.004}).validated()
    session = BareSession(spec, comm, workloads.get(f"{path}:train"))
    session.start()
    reports = [r for r in session.reports if r.get("kind") == "epoch"]
    assert len(reports) == 2, session.reports
    for report in reports:  # 128 items of 4 ms: 0.51 s of waiting at least (without the sleep: ~0.01 s)
        assert report["data_wait_s"] >= 128 * 0.004 and report["time_data"] > 0.8, report
        assert largest_share(report)[0] == "data", report
        line = format_epoch(report, 2, 1.0)
        assert "% waiting for data" in line and "straggler" not in line, line
    shares, stragglers = combine(reports)
    assert format_shares(shares, stragglers).startswith("time: data "), shares


@pytest.mark.integration
def test_a_slow_run_is_told_why(ray_local, capsys, elsewhere, tmp_path, monkeypatch):
    """A checkpoint every step: the checkpoints and the wait for them are the largest shares of
    both epochs (rank 0 writes; whether rank 1's wait for it lands in the hand-over or in the next
    step's allreduce depends on how far ahead it runs, and the line gives the ranks' mean share:
    in one run of the whole suite, 52 % checkpointing then 48 % synchronising). Rank 1 takes 30 ms
    more per step in the second epoch only (half the ranks compute, half wait: the rank is what
    tells): named the straggler of that epoch, not of the first. The input-bound case:
    test_an_input_bound_run_is_told_it_waits_for_data (no launch)."""
    monkeypatch.setenv("LAUNCHER_USAGE_S", "0.5")
    path = write(elsewhere, SLOW)
    code, out, err = run_cli(capsys, "run", "--workload", f"{path}:train", "--workers", "2", "--epochs", "2",
                             "--storage", str(tmp_path / "runs"), "--name", "slow", "--checkpoint-every-steps", "1",
                             "--param", "slow=0.03", "--param", "slow_from=1")
    assert code == 0, err
    first = [line for line in err.splitlines() if line.startswith("epoch 1/2")]
    second = [line for line in err.splitlines() if line.startswith("epoch 2/2")]
    assert first and second, err
    top = r"\d+% (checkpointing|synchronising gradients)"
    assert re.search(top, first[0]) and "straggler rank 1" not in first[0], err
    assert re.search(top, second[0]) and "straggler rank 1" in second[0], err
    # the summary: the phase first among the shares, and rank 1 named the straggler of one epoch
    time_line = next(line for line in out.splitlines() if line.strip().startswith("time: "))
    assert re.match(r"time: (checkpoint|sync) ", time_line.strip()) and "checkpoint " in time_line, out
    assert re.search(r"straggler: rank 1 \([0-9.]+x the median busy time, 1 epoch\)", time_line), out
    # each worker's CPU and memory, sampled every 0.5 s: in the run log and summed up per rank
    from launcher.storage.runlog import read_jsonl

    samples = read_jsonl((tmp_path / "runs" / "slow" / "usage.jsonl").read_text())
    for rank in (0, 1):
        mine = [u for u in samples if u["rank"] == rank]
        assert len(mine) >= 3 and all(50 < u["rss_mb"] < 100_000 and 0 <= u["cpu_pct"] <= 400 for u in mine), mine
        assert sum(u["cpu_pct"] for u in mine) > 0, mine  # it trained: some CPU was used
    assert "rank 1: CPU " in out and "RSS " in out, out
    code, shown, _ = run_cli(capsys, "runs", "slow", "--storage", str(tmp_path / "runs"))
    assert code == 0 and "usage per worker" in shown and "rank 1: CPU" in shown and "time: " in shown, shown


# -- launcher runs --compare / --plot, on run logs written by the run log's own writer (no Ray) ----

def _logged_run(root, name: str, lr: float, losses: list[float], usage: bool = False) -> None:
    from launcher.storage import Storage
    from launcher.storage.runlog import RunLog

    log = RunLog(Storage.resolve(str(root)), name)
    log.begin({"workload": "digits-mlp", "framework": "torch", "lr": lr, "epochs": len(losses), "name": name,
               "storage": str(root), "batch_size": 32})
    for i, loss in enumerate(losses):
        log.record({"kind": "epoch", "epoch": i + 1, "global_step": 10 * (i + 1), "loss": loss, "accuracy": 1 - loss,
                    "train_time_s": 2.0, "time_data": 0.5 - 0.1 * i, "time_compute": 0.4 + 0.1 * i, "time_sync": 0.1,
                    "time_optimizer": 0.0, "time_checkpoint": 0.0, "time_notice": 0.0,
                    **({"straggler_rank": 1, "straggler_factor": 1.4} if i == 0 else {})})
    if usage:
        log.record_usage({r: [[1000.0 + t, 90.0 - r, 400.0 + t, 0.0, 0.0] for t in range(4)] for r in (0, 1)})
    log.finish({"name": name, "status": "succeeded", "workload": "digits-mlp", "framework": "torch",
                "backend": "native", "workers": 2, "epochs": len(losses), "wall_s": 9.0,
                "time_shares": {"data": 0.4, "compute": 0.5, "sync": 0.1}, "stragglers": []})


def test_runs_compare_puts_differing_params_and_final_metrics_side_by_side(tmp_path, capsys, monkeypatch):
    _logged_run(tmp_path, "slow_lr", 0.01, [0.9, 0.6, 0.5])
    _logged_run(tmp_path, "fast_lr", 0.1, [0.7, 0.3])
    png = tmp_path / "cmp.png"
    code, out, err = run_cli(capsys, "runs", "--storage", str(tmp_path), "--compare", "slow_lr", "fast_lr",
                             "--out", str(png))
    assert code == 0, err
    table = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:] if line.strip() and " " in line}
    assert table["lr"] == ["0.01", "0.1"] and table["epochs"] == ["3", "2"], out
    assert table["loss"] == ["0.5000", "0.3000"] and "batch_size" not in table and "name" not in table, out
    assert f"wrote {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # Without --out the plot goes to the current folder, and the line says where (issue 65 item 7)
    monkeypatch.chdir(tmp_path / "slow_lr")
    code, out, err = run_cli(capsys, "runs", "--storage", str(tmp_path), "--compare", "slow_lr", "fast_lr")
    assert code == 0 and out.splitlines()[-1] == f"wrote {tmp_path / 'slow_lr' / 'compare-loss.png'}", out
    code, _, err = run_cli(capsys, "runs", "--storage", str(tmp_path), "--compare", "slow_lr")
    assert code == 2 and "--compare needs two runs or more" in err
    code, _, err = run_cli(capsys, "runs", "--storage", str(tmp_path), "--compare", "slow_lr", "nope")
    assert code == 2 and "no run nope" in err


def test_runs_plot_draws_a_metric_the_time_breakdown_and_the_workers_usage(tmp_path, capsys):
    _logged_run(tmp_path, "r", 0.01, [0.9, 0.6, 0.5], usage=True)
    for what in ("accuracy", "time", "usage"):
        png = tmp_path / f"{what}.png"
        code, out, err = run_cli(capsys, "runs", "r", "--storage", str(tmp_path), "--plot", what, "--out", str(png))
        assert code == 0 and out.strip() == f"wrote {png}", err
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000
    code, _, err = run_cli(capsys, "runs", "r", "--storage", str(tmp_path), "--plot", "perplexity")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "no run here reported perplexity" in lines[0], err
    assert "accuracy, loss" in lines[0] and "'time' or 'usage'" in lines[0], err
    _logged_run(tmp_path, "quiet", 0.01, [0.9])
    code, _, err = run_cli(capsys, "runs", "quiet", "--storage", str(tmp_path), "--plot", "usage")
    assert code == 2 and "no usage samples" in err
    code, out, _ = run_cli(capsys, "runs", "r", "--storage", str(tmp_path))
    assert "time: compute 50.0%, data 40.0%, sync 10.0% (the last launch)" in out, out
    assert "rank 1: CPU 89% mean, 89% peak; RSS 402 MB mean, 403 MB peak (4 samples)" in out, out


def test_the_cost_benchmark_times_steps_with_the_clock_and_without():
    from benchmarks.monitoring_cost import in_process, ratios

    rows = in_process("digits", 2, 5)
    assert [r["pair"] for r in rows] == [1, 2]
    assert all(r["on_steps_per_s"] > 10 and r["off_steps_per_s"] > 10 and 0.2 < r["ratio"] < 5 for r in rows), rows
    assert ratios([(90.0, 100.0), (5.0, 0.0)])[0] == 0.9


# -- launcher logs --------------------------------------------------------------------------------

def test_logs_show_each_ranks_output_prefixed_and_filtered(tmp_path, capsys):
    import io

    from launcher.cli.runviews import show_logs
    from launcher.storage import Storage
    from launcher.worker.ranklog import RankLog

    _logged_run(tmp_path, "r", 0.01, [0.5])
    for rank in (0, 1):
        log = RankLog(str(tmp_path), "r", 1, rank).start()
        print(f"hello from rank {rank}")
        if rank == 1:
            try:
                1 / 0
            except ZeroDivisionError:
                log.failed()
        log.close()
    storage = Storage.resolve(str(tmp_path))
    out = io.StringIO()
    show_logs(storage, "r", out=out)
    text = out.getvalue()
    assert "[rank 0] hello from rank 0" in text and "[rank 1] hello from rank 1" in text, text
    assert "[rank 1] ZeroDivisionError: division by zero" in text and "=== rank 0, worker group started" in text
    out = io.StringIO()
    show_logs(storage, "r", rank=1, out=out)
    assert "rank 0" not in out.getvalue() and "ZeroDivisionError" in out.getvalue()
    capsys.readouterr()
    for argv, needle in ((["--rank", "5"], "has output of rank(s) 0, 1"), (["--launch", "3"], "launch(es) 1"),
                         ([], None)):
        code, out_text, err = run_cli(capsys, "logs", "r", "--storage", str(tmp_path), *argv)
        assert (code, needle is None or needle in err) == (0 if needle is None else 2, True), err
    code, _, err = run_cli(capsys, "logs", "nope", "--storage", str(tmp_path))
    assert code == 2 and "no run nope" in err
    _logged_run(tmp_path, "old", 0.01, [0.5])
    code, _, err = run_cli(capsys, "logs", "old", "--storage", str(tmp_path))
    assert code == 2 and "has no worker output" in err


FAILS = '''
import torch


def train(session):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = session.prepare(model, optimizer)
    session.register(model=model, optimizer=optimizer)
    loader = session.loader([torch.ones(2)] * 32, batch_size=4)
    print(f"rank {session.rank} starts", flush=True)
    for epoch in session.epochs():
        for i, x in enumerate(loader):
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            session.step(train_loss=loss)
            if session.rank == 1 and i == 2:
                print("rank 1 is about to divide", flush=True)
                1 / 0
'''


@pytest.mark.integration
def test_launcher_logs_shows_the_traceback_of_the_rank_that_failed(ray_local, capsys, elsewhere, tmp_path):
    path = write(elsewhere, FAILS)
    runs = str(tmp_path / "runs")
    code, _, err = run_cli(capsys, "run", "--workload", f"{path}:train", "--workers", "2", "--epochs", "1",
                           "--max-failures", "0", "--storage", runs, "--name", "fails")
    assert code == 1, err
    code, out, err = run_cli(capsys, "logs", "fails", "--storage", runs, "--rank", "1")
    assert code == 0, err
    assert "[rank 1] rank 1 starts" in out and "[rank 1] rank 1 is about to divide" in out, out
    assert "[rank 1] ZeroDivisionError: division by zero" in out and "[rank 0]" not in out, out
    assert "1 / 0" in out, out  # the user's line, in the traceback
    code, out, _ = run_cli(capsys, "logs", "fails", "--storage", runs)
    assert "[rank 0] rank 0 starts" in out and "[rank 1] rank 1 starts" in out, out


def test_usage_is_summed_up_per_rank_and_condensed_for_many_ranks():
    from launcher.measures import format_usage, summarise_usage

    per_rank = summarise_usage({r: [[0.0, 50.0 + r, 100.0 * (r + 1), 0.0, 0.0], [5.0, 70.0 + r, 150.0, 0.0, 0.0]]
                                for r in range(2)})
    assert per_rank[1] == {"rank": 1, "samples": 2, "cpu_pct_mean": 61.0, "cpu_pct_peak": 71.0,
                           "rss_mb_mean": 175.0, "rss_mb_peak": 200.0}
    assert format_usage(per_rank)[0] == "rank 0: CPU 60% mean, 70% peak; RSS 125 MB mean, 150 MB peak (2 samples)"
    many = summarise_usage({r: [[0.0, 90.0 - (r == 7) * 60, 100.0 + r, 40.0, 500.0]] for r in range(16)})
    lines = format_usage(many)
    assert len(lines) == 1 and lines[0].startswith("usage over 16 ranks: CPU 86% mean (least busy: rank 7, 30%)"), lines
    assert "RSS peak 115 MB (rank 15); GPU 40% mean" in lines[0], lines

