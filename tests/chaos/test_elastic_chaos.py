"""Chaos test: with --min-workers, a run whose lost node is not replaced goes on with fewer workers."""

from __future__ import annotations

import os

import pytest

from launcher.lab.chaos import PreemptionLab, run_in_background
from launcher.storage.runlog import read_jsonl
from launcher.spec import JobSpec

pytestmark = pytest.mark.chaos


def test_lost_node_not_replaced_the_run_shrinks_and_completes(tmp_path):
    root = str(tmp_path / "runs")
    with PreemptionLab(nodes=2, cpus_per_node=1, notice_s=6.0, margin_s=2.0) as lab:
        spec = JobSpec(epochs=4, checkpoint_every_steps=10, seed=3, storage=root, name="elastic",
                       address=lab.address, max_failures=3, min_workers=1).validated()
        run = run_in_background(spec)
        run.wait_for_checkpoint(lambda m: m.global_step >= 30)
        assert lab.kill(0, replace=False) is None  # one worker node left, for good
        s = run.wait(timeout_s=600)
    assert s.status == "succeeded", s
    assert (s.epochs_completed, s.workers, s.final_workers) == (4, 2, 1), s
    assert s.restarts >= 1 and s.metrics["accuracy"] >= 0.85
    epochs = [m for m in read_jsonl(open(os.path.join(root, "elastic", "metrics.jsonl")).read())
              if m["kind"] == "epoch"]
    # Reports the controller had not collected yet when the node died never reach the log (their
    # checkpoints are still kept and resumed from); on a loaded machine that was seen to be the
    # epoch-1 report. So check the order and the end rather than every epoch.
    logged = [m["epoch"] for m in epochs]
    assert logged == sorted(set(logged)) and logged[0] <= 2 and logged[-1] == 4, logged
    assert epochs[0]["world_size"] == 2 and epochs[-1]["world_size"] == 1
    # one worker has the whole training split: 1,438 samples in batches of 32
    assert epochs[-1]["steps_per_epoch"] == 45 and epochs[-1]["samples"] == 1438
