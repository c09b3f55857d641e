"""Chaos for training functions (torch and Keras), a sharded run and XGBoost: a notice costs no step.

examples/char_lm.py (a causal transformer language model written as an ordinary
PyTorch loop on the launcher's session) trains on the preemption lab's two worker
nodes; one node gets GCE's notice in the middle of an epoch. The session checkpoints
at a step both ranks agree on, the group restarts on the replacement node from that
step, and the run ends with the weights of an uninterrupted one. The same for Keras'
model.fit, for --strategy fsdp and for --framework xgboost (a round is a step); the last two
are not compared with an uninterrupted run here: their bitwise resumes are test_sharded.py's
and test_xgboost.py's. The managed loop's notice is test_preemption_chaos's; a user's workload
runs that same loop, and its shipping to a cluster and exact resume there are
test_user_workloads'.
"""

from __future__ import annotations

import pytest

from launcher.lab.chaos import run_in_background
from launcher.spec import JobSpec
from test_session import CHAR_LM, topics_file

pytestmark = pytest.mark.chaos

EPOCHS, STEPS_PER_EPOCH, EVERY = 6, 18, 4
TOTAL = EPOCHS * STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("session-chaos")
    return topics_file(root / "data"), str(root / "runs")


def spec_for(lab, setup, name: str) -> JobSpec:
    data, storage = setup
    return JobSpec(workload=CHAR_LM, data=data, epochs=EPOCHS, checkpoint_every_steps=EVERY, seed=5,
                   storage=storage, name=name, address=lab.address, preemption_check_steps=2).validated()


def test_a_notice_costs_a_training_function_no_steps(lab, setup):
    reference = run_in_background(spec_for(lab, setup, "reference")).wait()
    assert (reference.status, reference.steps_completed, reference.restarts) == ("succeeded", TOTAL, 0), reference

    run = run_in_background(spec_for(lab, setup, "notice"))
    run.wait_for_checkpoint(lambda m: m.global_step >= EVERY)
    lab.preempt(0)
    s = run.wait()
    assert s.status == "succeeded" and s.steps_completed == TOTAL, s
    assert (s.restarts, s.preemptions, s.preemption_notices, s.steps_lost) == (1, 1, 1, 0), s
    assert s.weights_sha256 == reference.weights_sha256
    assert set(s.metrics) >= {"train_loss", "val_loss", "perplexity"}


def test_a_notice_costs_keras_fit_no_steps(lab, setup):
    """The MultiWorkerMirroredStrategy tutorial's CNN in session.fit: the notice's checkpoint is
    taken at a step both workers agree on, inside model.fit, and the run resumes there."""
    from test_tf_session import KERAS_CIFAR

    _, storage = setup
    epochs, steps, every = 3, 16, 5

    def spec(name: str) -> JobSpec:
        return JobSpec(workload=KERAS_CIFAR, params={"samples": 1024}, epochs=epochs, checkpoint_every_steps=every,
                       seed=3, storage=storage, name=name, address=lab.address, preemption_check_steps=2).validated()

    reference = run_in_background(spec("keras_reference")).wait()
    assert (reference.status, reference.framework, reference.steps_completed) == \
        ("succeeded", "tensorflow", epochs * steps), reference
    run = run_in_background(spec("keras_notice"))
    run.wait_for_checkpoint(lambda m: m.global_step >= every)
    lab.preempt(0)
    s = run.wait()
    assert s.status == "succeeded" and s.steps_completed == epochs * steps, s
    assert (s.restarts, s.preemption_notices, s.steps_lost) == (1, 1, 0), s
    assert s.weights_sha256 == reference.weights_sha256
    assert {"loss", "accuracy", "val_accuracy"} <= set(s.metrics), s.metrics


def test_a_notice_costs_a_sharded_run_no_steps(lab, setup):
    """--strategy fsdp: on the notice every rank writes its shards at the agreed step; the group
    resumes from them (DCP) and trains the steps left, and the summary says how long the notice
    checkpoint took. (That an fsdp run resumed mid-epoch from its shards ends with the uninterrupted
    run's weights is test_sharded.py's, bitwise; an uninterrupted run here checked it once more.)"""
    import math

    data, storage = setup
    spec = JobSpec(workload=CHAR_LM, data=data, epochs=2, checkpoint_every_steps=EVERY, seed=5, storage=storage,
                   name="sharded_notice", address=lab.address, preemption_check_steps=2,
                   strategy="fsdp").validated()
    run = run_in_background(spec)
    run.wait_for_checkpoint(lambda m: m.global_step >= EVERY)
    lab.preempt(0)
    s = run.wait()
    assert s.status == "succeeded" and s.steps_completed == 2 * STEPS_PER_EPOCH, s
    assert (s.restarts, s.preemption_notices, s.steps_lost) == (1, 1, 0), s
    assert s.notice_checkpoint_s is not None and 0 < s.notice_checkpoint_s < 30, s.notice_checkpoint_s
    vocab = len(set(open(data, encoding="utf-8").read()))
    assert s.metrics["val_loss"] < 0.8 * math.log(vocab), s.metrics  # it learned across the restart


def test_a_notice_costs_an_xgboost_run_no_rounds(lab, setup):
    """--framework xgboost: the notice is seen between rounds; the booster of that round is
    checkpointed, the group restarts on the replacement node (a new XGBoost tracker) and trains
    the remaining rounds on top of it. (That a run resumed from a round checkpoint ends with the
    uninterrupted run's booster, bitwise, is test_xgboost.py's; an uninterrupted run here checked it
    once more.) 300 rounds: a round took ~20 ms here, so ~6 s of training are left after the
    round-10 checkpoint for the notice to reach the workers (the drain, Ray Train's 1 s poll, the
    next round: ~2 s), about what the other kinds' runs leave (in one process these settings reach
    0.97 accuracy at 300 rounds)."""
    rounds = 300
    spec = JobSpec(framework="xgboost", params={"num_boost_round": rounds, "max_depth": 4, "eta": 0.05},
                   storage=setup[1], name="xgb_notice", address=lab.address).validated()
    run = run_in_background(spec)
    run.wait_for_checkpoint(lambda m: m.global_step >= 10)
    lab.preempt(0)
    s = run.wait()
    assert s.status == "succeeded" and s.steps_completed == rounds, s
    assert (s.restarts, s.preemption_notices, s.steps_lost) == (1, 1, 0), s
    assert s.metrics["accuracy"] > 0.9, s.metrics
