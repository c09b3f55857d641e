"""Each worker's peak memory, from its epoch reports to the summary and `launcher runs NAME`, and a
worker killed for memory said in one line (launcher.worker.usersession, launcher.summary,
launcher.driver.trainer.killed_for_memory). No Ray runs here: Ray's errors are built as Ray builds
them, or are their text as Ray formats it (captured from Ray 2.60)."""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
import types

import numpy as np
import pytest

from launcher.measures import format_memory, peak_memory

from launcher.summary import RunStatus, RunSummary

# Ray 2.60's memory monitor on an actor it killed (shortened: the object store's figures left out).
RAY_OOM = ("1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.5, "
           "ID: 03dfb28ece28) was 14.80GB used / 15.50GB limit (0.954839)\nOOM kill reason: Memory usage "
           "15892244736B exceeded threshold of 15891477248B (95.0% of 16642608332B limit)\nRay killed 1 worker(s) "
           "based on the killing policy\nConsidered workers: [\nSelected to kill: (Actor(c323d4753569): job ID="
           "01000000, task name=RayTrainWorker.__init__, required resources={}, pid=4242, actual memory used=9.10GB, "
           "worker ID=bbe8062c0977)\n]\nTop 10 memory users: PID\tMEM(GB)\tCOMMAND\n4242\t9.10\tray::RayTrainWorker"
           "\nRefer to the documentation on how to address the out of memory issue: https://docs.ray.io/...")
# Rays before 2.56 said the node's figures after the task's.
RAY_OOM_OLD = ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.9, ID: ab12) "
               "where the task (actor ID: 9f, name=RayTrainWorker.__init__, pid=77, memory used=6.50GB) was running "
               "was 7.60GB / 7.80GB (0.974359), which exceeds the memory usage threshold of 0.95.")
WORKER_INFO = ("A worker health check failed.\nWorker info: Worker(\n  actor=Actor(RayTrainWorker, c323d4753569),\n"
               "  metadata=ActorMetadata(\n    hostname='w1',\n    node_id='03dfb28ece28',\n    node_ip='10.0.0.5',\n"
               "    pid=4242,\n  ),\n)")
# A worker process that died with no error of its own (SIGKILL): ActorDiedError's exit detail.
DIED = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
        "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
        "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the "
        "worker crashed unexpectedly due to SIGSEGV or another unexpected error.")
FIX = "--strategy fsdp to shard the model, more workers, or a smaller --batch-size"
MEMORY = {"peak_rss_mb_max": 9000.0, "peak_rss_mb_ranks": [800.0, 9000.0]}


def oom_group_error(oom):
    """Ray Train's error for a group whose rank 1 Ray killed for memory, rank 0 failing after it."""
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    return WorkerGroupError("Worker 1 failed.", {
        0: RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
        1: WorkerHealthCheckFailedError(WORKER_INFO, failure=oom)})


def died(ip: str = "10.0.0.7", detail: str = DIED):
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    return ActorDiedError(ActorDiedErrorContext(error_message=detail, node_ip_address=ip, pid=4343,
                                                class_name="RayTrainWorker", actor_id=os.urandom(16)))


# -- the worker's figures ---------------------------------------------------------------------

def test_a_process_peak_memory_is_its_rss_and_gpu_memory_only_where_torch_set_up_cuda(monkeypatch):
    from launcher.worker.usage import peak_memory_mb

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    rss, gpu = peak_memory_mb()
    assert 10 < rss < 100_000 and gpu == 0.0
    assert "torch" not in sys.modules  # a TensorFlow worker does not import torch for this
    cuda = types.SimpleNamespace(is_initialized=lambda: True, max_memory_allocated=lambda: 3 * 2**30)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert peak_memory_mb()[1] == 3072.0
    cuda.is_initialized = lambda: False  # torch imported, CUDA never used
    assert peak_memory_mb()[1] == 0.0


class ThreadRanks:
    """A comm for sessions on threads of this process: a real sum over the ranks."""

    def __init__(self, world: int) -> None:
        self.world, self.parts, self.barrier = world, {}, threading.Barrier(world)

    def sum(self, rank: int, values: np.ndarray) -> np.ndarray:
        self.parts[rank] = values
        self.barrier.wait()
        total = np.sum([self.parts[r] for r in range(self.world)], axis=0)
        self.barrier.wait()
        return total


def test_the_epoch_report_has_each_ranks_peak_memory_in_its_slot(monkeypatch):
    """Two ranks end an epoch (a real sum over them): rank 0's report gives each rank's own peak
    RSS by rank and the largest, GPU memory only where a rank used any, and the input wait still."""
    from launcher.spec import JobSpec
    from launcher.worker import usersession
    from launcher.worker.usersession import UserSession

    class Ranked(UserSession):
        def __init__(self, spec, rank, ranks):
            super().__init__(spec, types.SimpleNamespace(rank=rank, world_size=ranks.world))
            self.ranks, self.sent = ranks, []

        _begin = restore = save = export_function = lambda self, *a: None
        weights_digest = lambda self: "digest"  # noqa: E731

        def sum_over_ranks(self, values):
            return self.ranks.sum(self.rank, values)

        def send(self, metrics, checkpoint=True):
            self.sent.append(metrics)

    figures = {"rank-0": (300.0, 0.0), "rank-1": (700.0, 512.0)}
    monkeypatch.setattr(usersession, "peak_memory_mb", lambda: figures[threading.current_thread().name])
    spec = JobSpec(name="m", workload="digits-mlp", epochs=1).validated()
    ranks = ThreadRanks(2)
    sessions = [Ranked(spec, r, ranks) for r in range(2)]
    for s in sessions:
        s._samples, s._data_wait, s._epoch_started = 8, 0.1 * (s.rank + 1), time.perf_counter() - 1.0
    threads = [threading.Thread(target=s._end_epoch, name=f"rank-{s.rank}") for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    report = sessions[0].sent[-1]
    assert report["peak_rss_mb_ranks"] == [300.0, 700.0] and report["peak_rss_mb_max"] == 700.0
    assert report["peak_gpu_mb_ranks"] == [0.0, 512.0] and report["peak_gpu_mb_max"] == 512.0
    assert report["samples"] == 16 and report["data_wait_s"] == pytest.approx(0.15)
    assert "peak_gpu_mb_max" not in usersession.memory_report(np.array([300.0, 700.0]), np.zeros(2))


# -- the run's peaks, shown -------------------------------------------------------------------

def test_the_runs_peaks_are_each_ranks_largest_over_its_reports():
    reports = [{"peak_rss_mb_max": 500.0, "peak_rss_mb_ranks": [400.0, 500.0]},
               {"loss": 0.5},  # a report that measured nothing (a Ray Train function's)
               {"peak_rss_mb_max": 650.0, "peak_rss_mb_ranks": [650.0, 450.0, 300.0],  # grown to 3 workers
                "peak_gpu_mb_max": 2048.0, "peak_gpu_mb_ranks": [2048.0, 1024.0, 0.0]},
               {"peak_rss_mb_max": 900.0}]  # a checkpoint's manifest: the largest only
    out = peak_memory(reports)
    assert out == {"peak_rss_mb_max": 900.0, "peak_rss_mb_ranks": [650.0, 500.0, 300.0],
                   "peak_gpu_mb_max": 2048.0, "peak_gpu_mb_ranks": [2048.0, 1024.0, 0.0]}
    assert peak_memory([out, {"peak_rss_mb_ranks": [1000.0]}])["peak_rss_mb_ranks"] == [1000.0, 500.0, 300.0]
    assert peak_memory([{"loss": 1.0}, {"peak_rss_mb_ranks": "junk", "peak_rss_mb_max": True}]) == {}


def test_the_summary_keeps_the_peaks_and_says_them_by_rank():
    s = RunSummary(name="r", status=RunStatus.FAILED, workload="w", framework="torch", backend="native",
                   workers=2, epochs=2, **peak_memory([{"peak_rss_mb_ranks": [412.4, 1430.0],
                                                        "peak_gpu_mb_ranks": [10240.0, 10200.0]}]))
    again = RunSummary.from_json(json.loads(json.dumps(s.to_json())))
    assert (again.peak_rss_mb_max, again.peak_rss_mb_ranks) == (1430.0, [412.4, 1430.0])
    assert format_memory(vars(again)) == "peak memory per rank: RSS 412 / 1,430 MB, GPU 10,240 / 10,200 MB"
    many = [100.0] * 15 + [260.0]
    assert format_memory({"peak_rss_mb_ranks": many}) == \
        "peak memory per rank: RSS max 260 MB (rank 15), mean 110 MB over 16 ranks"
    assert format_memory({"peak_rss_mb_max": 900.0}) == "peak memory per rank: RSS max 900 MB"
    assert format_memory(vars(RunSummary(name="r", status=RunStatus.SUCCEEDED, workload="w", framework="torch",
                                         backend="native", workers=2, epochs=2))) == ""
    from launcher.measures import pick_metrics

    assert pick_metrics({"loss": 0.5, **peak_memory([vars(s)])}) == {"loss": 0.5}  # not metrics of the model


def test_runs_name_shows_each_workers_peak_memory(capsys, tmp_path):
    from launcher.cli.main import main
    from test_runs import logged_run

    root = str(tmp_path)
    epoch = {"kind": "epoch", "step_in_epoch": 0, "world_size": 2, "samples": 100, "train_time_s": 1.0}
    logged_run(root, "mem", [{**epoch, "epoch": 1, "global_step": 10, "loss": 0.5, "peak_rss_mb_max": 610.0,
                              "peak_rss_mb_ranks": [600.0, 610.0]},
                             {**epoch, "epoch": 2, "global_step": 20, "loss": 0.4, "peak_rss_mb_max": 700.0,
                              "peak_rss_mb_ranks": [700.0, 650.0]}])
    logged_run(root, "none", [{**epoch, "epoch": 1, "global_step": 10, "loss": 0.5}])
    assert main(["runs", "--storage", root, "mem"]) == 0
    assert "\npeak memory per rank: RSS 700 / 650 MB\n" in capsys.readouterr().out
    assert main(["runs", "--storage", root, "mem", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["peak_rss_mb_max"], row["peak_rss_mb_ranks"]) == (700.0, [700.0, 650.0])
    assert main(["runs", "--storage", root, "none"]) == 0
    assert "peak memory" not in capsys.readouterr().out


def test_the_tracker_folds_the_epochs_peaks_and_says_a_failure_for_memory_in_one_line(tmp_path):
    from launcher.driver.progress import Progress
    from launcher.driver.tracker import Tracker
    from launcher.spec import JobSpec
    from launcher.storage import Storage
    from launcher.storage.runlog import RunLog
    from launcher.summary import Failure, Report

    spec = JobSpec(name="t", storage=str(tmp_path), workload="digits-mlp", epochs=3).validated()
    log = RunLog(Storage.resolve(str(tmp_path)), "t")
    log.begin(spec.to_dict())
    out = io.StringIO()
    tracker = Tracker(spec, log, Progress(3, stream=out))
    for e, ranks in ((1, [800.0, 8000.0]), (2, [700.0, 9000.0])):
        tracker.handle(Report(time.time(), {"kind": "epoch", "epoch": e, "global_step": 10 * e, "attempt": "a",
                                            "samples": 8, "train_time_s": 1.0, "peak_rss_mb_ranks": ranks,
                                            "peak_rss_mb_max": max(ranks)}))
    assert tracker.memory == MEMORY
    summary = tracker.summary(RunStatus.FAILED)
    assert (summary.peak_rss_mb_max, summary.peak_rss_mb_ranks) == (9000.0, [800.0, 9000.0])
    tracker.handle(Failure(time.time(), {0: "RuntimeError: Connection closed by peer",
                                         1: f"WorkerHealthCheckFailedError: {WORKER_INFO}\n{RAY_OOM}"[:2000]}))
    said = out.getvalue().splitlines()[-1]
    assert said.startswith("worker group failed: rank 1 (node 10.0.0.5) was killed by Ray's memory monitor"), said
    assert "its peak RSS 9,000 MB" in said and said.endswith(FIX)


# -- a worker killed for memory ---------------------------------------------------------------

def test_a_worker_rays_memory_monitor_killed_is_one_line_with_its_node_memory_and_the_fix():
    from ray.exceptions import OutOfMemoryError

    from launcher.driver.trainer import describe_failure, killed_for_memory

    error = oom_group_error(OutOfMemoryError(RAY_OOM))
    line = describe_failure(error, MEMORY)
    assert line == ("rank 1 (node 10.0.0.5) was killed by Ray's memory monitor: its node had 14.80 of 15.50 GB in "
                    "use, the worker 9.10 GB; its peak RSS 9,000 MB at the last epoch's end; use " + FIX)
    assert "\n" not in line and "gloo" not in line  # rank 0 failed for want of rank 1: not the cause
    # The bare exception, and its text as a Failure event holds it (rank known from the event).
    assert killed_for_memory(OutOfMemoryError("out of memory")).startswith("a worker was killed by Ray's memory")
    assert killed_for_memory({1: f"OutOfMemoryError: {RAY_OOM}"}) == (
        "rank 1 (node 10.0.0.5) was killed by Ray's memory monitor: its node had 14.80 of 15.50 GB in use, the "
        "worker 9.10 GB; use " + FIX)
    assert killed_for_memory({3: RAY_OOM_OLD}, MEMORY) == (
        "rank 3 (node 10.0.0.9) was killed by Ray's memory monitor: its node had 7.60 of 7.80 GB in use, the worker "
        "6.50 GB; the workers' largest peak RSS 9,000 MB at the last epoch's end; use " + FIX)


def test_a_worker_that_died_without_an_error_is_said_as_the_kernels_oom_killer_leaves_it():
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    from launcher.driver.trainer import describe_failure, killed_for_memory

    error = WorkerGroupError("Worker 1 failed.", {1: WorkerHealthCheckFailedError("A worker health check failed.",
                                                                                  failure=died())})
    assert describe_failure(error, MEMORY) == (
        "rank 1 (node 10.0.0.7) died with no error of its own, as when the kernel's OOM killer ends it (`dmesg` on "
        "the node tells); its peak RSS 9,000 MB at the last epoch's end; if memory ran out, use " + FIX)
    assert killed_for_memory({0: "a worker exited: exit code 137"}).startswith("rank 0 died with no error")
    # Not memory: a node that went (a lost VM), a worker stopped with ray.kill, a user's own error.
    assert killed_for_memory(died(detail="The actor died because its node has died. Node Id: ab12")) is None
    assert killed_for_memory(died(detail="The actor is dead because it was killed by `ray.kill`.")) is None
    assert killed_for_memory(WorkerGroupError("x", {0: ValueError("bad --param")})) is None
    assert describe_failure(WorkerGroupError("x", {0: ValueError("bad --param")})) == "rank 0: ValueError: bad --param"


def test_a_worker_out_of_gpu_memory_is_one_line_with_what_it_tried_to_allocate():
    from launcher.driver.trainer import killed_for_memory

    # UserSession.run_function's one line for torch's error, as a worker group's failure holds it
    text = ("RayTaskError(RuntimeError): OutOfMemoryError in train(session) at loop.py:12: CUDA out of memory. Tried "
            "to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.20 GiB is free. Of the "
            "allocated memory 76.00 GiB is allocated by PyTorch")
    line = killed_for_memory({2: text}, {"peak_gpu_mb_ranks": [0.0, 0.0, 77000.0], "peak_gpu_mb_max": 77000.0})
    assert line == ("rank 2 ran out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                    "capacity of 79.15 GiB); its peak GPU memory 77,000 MB at the last epoch's end; "
                    "use " + FIX)
