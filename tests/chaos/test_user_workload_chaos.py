"""Chaos for a user workload: the guarantees of the built-in ones hold for the user's own code.

A workload written to a temporary folder outside the repository (the one of
tests/test_user_workloads.py) trains on the preemption lab's two worker nodes;
a preemption notice costs no step, and the run ends with the weights of an
uninterrupted one.
"""

from __future__ import annotations

import pytest

from launcher.lab.chaos import run_in_background
from launcher.spec import JobSpec
from test_user_workloads import SHIPPED, write

pytestmark = pytest.mark.chaos

EPOCHS, STEPS_PER_EPOCH, EVERY = 12, 19, 5  # 300 samples per rank, batches of 16
TOTAL = EPOCHS * STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("user-chaos")
    path = write(root / "code", SHIPPED)
    return f"{path}:NOTED", str(root / "runs")


def spec_for(lab, setup, name: str) -> JobSpec:
    workload, storage = setup
    # delay_ms: a few seconds of training, so the notice finds the run still going.
    return JobSpec(workload=workload, epochs=EPOCHS, checkpoint_every_steps=EVERY, seed=3, storage=storage,
                   name=name, address=lab.address, params={"delay_ms": 25}).validated()


def test_a_notice_costs_a_user_workload_no_steps(lab, setup):
    reference = run_in_background(spec_for(lab, setup, "reference")).wait()
    assert (reference.status, reference.steps_completed, reference.restarts) == ("succeeded", TOTAL, 0)
    assert reference.metrics["accuracy"] >= 0.9

    run = run_in_background(spec_for(lab, setup, "notice"))
    run.wait_for_checkpoint(lambda m: m.global_step >= EVERY)
    lab.preempt(0)
    s = run.wait()
    assert s.status == "succeeded" and s.steps_completed == TOTAL, s
    assert (s.restarts, s.preemptions, s.preemption_notices, s.steps_lost) == (1, 1, 1, 0), s
    assert s.weights_sha256 == reference.weights_sha256
