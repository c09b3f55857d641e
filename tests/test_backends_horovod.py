"""The Horovod backend: ring placement, options, and real Horovod training on Ray Train V2.

Tests that run Horovod skip with a reason when it is not built here
(scripts/install-horovod builds it; scripts/setup-env runs that).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from launcher.backends.horovod_train import Slot, plan_slots
from launcher.cli.main import main
from launcher.errors import UserError
from launcher.spec import JobSpec

needs_horovod = pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None,
    reason="Horovod is not built in this environment: run scripts/install-horovod (scripts/setup-env does)")


# -- pure ---------------------------------------------------------------------------------

def test_plan_slots_two_nodes_two_workers_each():
    slots = plan_slots(["a", "a", "b", "b"])
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (0, 0, 2, 0, 2), (1, 1, 2, 0, 2), (2, 0, 2, 1, 2), (3, 1, 2, 1, 2)]
    assert {s.size for s in slots} == {4} and [s.hostname for s in slots] == ["a", "a", "b", "b"]


def test_plan_slots_follows_real_placement_even_when_interleaved_or_uneven():
    slots = plan_slots(["a", "b", "a", "a"])
    assert [(s.local_rank, s.local_size) for s in slots] == [(0, 3), (0, 1), (1, 3), (2, 3)]
    # local rank 0 lives on both nodes; local ranks 1 and 2 only on node a
    assert [(s.cross_rank, s.cross_size) for s in slots] == [(0, 2), (1, 2), (0, 1), (0, 1)]


def test_slot_env_names_every_variable_horovod_reads():
    env = Slot("n1", 3, 4, 1, 2, 1, 2).env()
    assert env == {"HOROVOD_HOSTNAME": "n1", "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4",
                   "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
                   "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"}


def test_horovod_options_are_validated():
    assert JobSpec(backend="horovod", hvd_fp16=True, hvd_fusion_mb=8, hvd_backward_passes=2).validated()
    with pytest.raises(UserError, match="--hvd-fp16 is a Horovod option, but the backend is native"):
        JobSpec(hvd_fp16=True).validated()
    with pytest.raises(UserError, match="hvd_backward_passes must be >= 1"):
        JobSpec(backend="horovod", hvd_backward_passes=0).validated()
    with pytest.raises(UserError, match="hvd_fusion_mb must be >= 0"):
        JobSpec(backend="horovod", hvd_fusion_mb=-1.0).validated()
    with pytest.raises(UserError, match="hvd_fp16 must be true or false"):
        JobSpec.from_mapping({"backend": "horovod", "hvd_fp16": "yes"})


def test_missing_horovod_is_one_line_saying_how_to_build(monkeypatch, capsys, tmp_path):
    import functools

    from launcher.backends import horovod

    monkeypatch.setattr(horovod, "installed", lambda: False)
    monkeypatch.setattr(horovod, "probe", functools.lru_cache(lambda framework: "Horovod is not installed"))
    # an installed copy of the launcher has no install script at hand: refused in one line
    monkeypatch.setattr(horovod, "INSTALL_SCRIPT", str(tmp_path / "no-such-script"))
    code = main(["run", "--backend", "horovod", "--storage", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "backend horovod cannot run torch here: Horovod is not installed" in err[0]
    assert "scripts/install-horovod" in err[0]


def test_a_first_horovod_run_builds_it_and_a_failed_build_is_refused_in_a_line(monkeypatch, capsys, tmp_path):
    import functools

    from launcher.backends import horovod

    monkeypatch.setattr(horovod, "installed", lambda: False)
    monkeypatch.setattr(horovod, "probe", functools.lru_cache(lambda framework: "Horovod is not installed"))
    script = tmp_path / "install-horovod"  # a real build step that fails the way a missing compiler does
    script.write_text("#!/bin/sh\necho \"install-horovod: g++ not found\" >&2\necho \"$1\" > \"$(dirname \"$0\")/asked\"\n"
                      "exit 3\n")
    script.chmod(0o755)
    monkeypatch.setattr(horovod, "INSTALL_SCRIPT", str(script))
    code = main(["run", "--backend", "horovod", "--storage", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert (tmp_path / "asked").read_text().strip() == sys.executable  # built for this interpreter
    assert "Horovod 0.28.1 is not installed in this environment yet; installing it now, once" in err[0]
    assert err[1] == "building Horovod failed: install-horovod: g++ not found"
    assert "backend horovod cannot run torch here: Horovod is not installed" in err[2] and len(err) == 3


@needs_horovod
@pytest.mark.integration  # it starts the probe's interpreter
def test_a_passed_probe_is_recorded_and_a_changed_build_is_probed_again(monkeypatch, tmp_path):
    """The first probe imports Horovod's torch extension in a child interpreter and records that
    it passed; the next launch's probe finds its fingerprint and starts nothing; a different
    library path (as a rebuild or a reinstall changes the files' fingerprint) is probed again, and
    so is every framework after `launcher doctor` has dropped the record."""
    from launcher.backends import horovod

    started: list[str] = []

    def audit(event, args):
        if event == "subprocess.Popen" and started is not None:
            started.append(" ".join(map(str, args[1] or ())))

    sys.addaudithook(audit)  # hooks cannot be removed: it records only while the list is there
    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))
    try:
        horovod.probe.cache_clear()
        assert horovod.probe("torch") is None and len(started) == 1 and "horovod.torch" in started[0], started
        record = json.load(open(tmp_path / "cache" / "horovod-probe.json"))
        assert set(record) == {"torch"} and len(record["torch"]) == 64
        horovod.probe.cache_clear()  # a later launch
        assert horovod.probe("torch") is None and len(started) == 1, started
        monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
        horovod.probe.cache_clear()
        assert horovod.probe("torch") is None and len(started) == 2, started
        assert json.load(open(tmp_path / "cache" / "horovod-probe.json"))["torch"] != record["torch"]
        # `launcher doctor` (diagnose) first drops what earlier processes recorded: a new process probes
        horovod.HorovodBackend().forget_checks()
        assert not (tmp_path / "cache" / "horovod-probe.json").exists()
        horovod.probe.cache_clear()
        assert horovod.probe("torch") is None and len(started) == 3, started
    finally:
        started = None
        horovod.probe.cache_clear()


# -- real Horovod on Ray --------------------------------------------------------------------

def _allreduce_worker(config):
    import horovod.torch as hvd
    import ray.train
    import torch

    hvd.init()
    rank = hvd.rank()
    x = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    out = {"rank": rank, "size": hvd.size(), "ctx_rank": ray.train.get_context().get_world_rank(),
           "sum": hvd.allreduce(x, op=hvd.Sum).tolist(), "avg": hvd.allreduce(x, op=hvd.Average).tolist(),
           "fusion": os.environ.get("HOROVOD_FUSION_THRESHOLD")}
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


@needs_horovod
@pytest.mark.integration
def test_allreduce_sums_and_averages_over_the_ring(ray_local, tmp_path):
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from launcher.backends.horovod_train import HorovodConfig

    # The workers cannot import this test module: ship _allreduce_worker by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    DataParallelTrainer(_allreduce_worker, train_loop_config={"out": str(tmp_path)},
                        backend_config=HorovodConfig(fusion_threshold_bytes=1 << 20),
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name="allreduce", storage_path=str(tmp_path / "runs"))).fit()
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for r, res in enumerate(results):
        assert (res["rank"], res["ctx_rank"], res["size"]) == (r, r, 2)
        assert res["sum"] == [3.0, 30.0] and res["avg"] == [1.5, 15.0]
        assert res["fusion"] == str(1 << 20)


def _launch(capsys, *argv):
    code = main(["run", "--json", *argv])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1])


def _epoch_losses(storage, name):
    from launcher.storage.runlog import read_jsonl

    with open(os.path.join(storage, name, "metrics.jsonl")) as f:
        return {m["epoch"]: m["train_loss"] for m in read_jsonl(f.read()) if m["kind"] == "epoch"}


def _close(a, b, rel=1e-3):
    return abs(a - b) <= rel * abs(b)


@needs_horovod
@pytest.mark.integration
def test_horovod_matches_ddp_learns_and_resumes_across_backends(ray_local, capsys, storage):
    """Same seed, 2 workers: Horovod and DDP both average gradients, so their losses agree;
    checkpoints are one format, so a run started under one backend resumes under the other
    and continues exactly as the straight Horovod run did."""
    common = ["--storage", storage, "--seed", "3", "--workers", "2"]

    def run(backend, name, epochs):
        code, s = _launch(capsys, *common, "--backend", backend, "--name", name, "--epochs", str(epochs))
        assert code == 0 and s["status"] == "succeeded" and s["backend"] == backend, s["error"]
        return s, _epoch_losses(storage, name)

    hvd, straight = run("horovod", "hvd", 4)  # `launcher run --backend horovod` learns
    assert hvd["epochs_completed"] == 4 and hvd["metrics"]["accuracy"] >= 0.90, hvd["metrics"]
    assert sorted(straight) == [1, 2, 3, 4]
    _, ddp = run("native", "ddp_then_hvd", 2)
    for epoch in (1, 2):
        assert _close(ddp[epoch], straight[epoch]), (epoch, ddp[epoch], straight[epoch])

    s, resumed = run("horovod", "ddp_then_hvd", 4)  # native checkpoint -> horovod
    assert s["resumed_from"] == {"epoch": 2, "step": 46} and s["epochs_completed"] == 4
    for epoch in (3, 4):
        assert _close(resumed[epoch], straight[epoch]), ("native->horovod", epoch, resumed[epoch], straight[epoch])

    # The straight Horovod run's epoch-2 checkpoint, alone in a new run folder, resumed by DDP.
    import shutil

    from launcher.storage.checkpoint import complete_checkpoints
    from launcher.storage import Storage

    (at_2, path), = [(m, p) for m, p in complete_checkpoints(Storage.resolve(storage), "hvd") if m.epoch == 2]
    assert at_2.backend == "horovod"
    shutil.copytree(path, os.path.join(storage, "hvd_then_ddp", os.path.basename(path)))
    s, resumed = run("native", "hvd_then_ddp", 3)  # horovod checkpoint -> native
    assert s["resumed_from"] == {"epoch": 2, "step": 46} and s["epochs_completed"] == 3
    assert _close(resumed[3], straight[3]), ("horovod->native", resumed[3], straight[3])


@needs_horovod
@pytest.mark.integration
def test_horovod_options_train(ray_local, capsys, storage):
    """fp16 compression, a 1 MiB fusion buffer and 2 backward passes per step still learn."""
    code, s = _launch(capsys, "--storage", storage, "--backend", "horovod", "--name", "hvd_opts", "--epochs", "2",
                      "--hvd-fp16", "--hvd-fusion-mb", "1", "--hvd-backward-passes", "2")
    assert code == 0 and s["status"] == "succeeded", s
    assert s["steps_completed"] == 2 * 23
    losses = _epoch_losses(storage, "hvd_opts")
    assert losses[2] < losses[1] < 2.4  # ln(10) = 2.30: it learns from the first epoch


# Ring ranks against node placement on a 2-node cluster: tests/test_placement.py, on that module's
# cluster (one cluster started for both).
