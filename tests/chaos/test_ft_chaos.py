"""--strategy ft in the preemption lab: a lost node costs the other replicas no restart.

Three replicas of a small training function (half a CPU each) on the lab's two worker nodes;
one node is lost mid-epoch without a notice. Its replica(s) leave the quorum;
the others train on in the same processes at the smaller quorum; Ray Train replaces the lost
replica(s) alone once the node is gone, in the replacement node the autoscaler brings, and
each is healed from a peer and trains. Every sample of every epoch is trained by exactly one
committed step, whatever the quorum was.

The same with GCE's notice (the replica leaves the quorum after its step, and the driver asks
for the replacement node at the notice) is `launcher bench preemption --strategies ft`'s run:
tests/test_bench_preemption.py checks it, to the sample.
"""

from __future__ import annotations

import os

import pytest

from launcher.lab.chaos import run_in_background
from launcher.spec import JobSpec
from test_ft import SEEN, assert_each_sample_once, records
from test_user_workloads import write

pytestmark = pytest.mark.chaos

EPOCHS, SAMPLES = 5, 120  # batches of 6 per replica: 7 steps an epoch at 3 replicas, 10 at 2


def test_a_lost_node_leaves_the_other_replicas_training_in_their_processes(lab, tmp_path, capfd):
    """The node deleted outright (a failure to Ray, hence --max-failures): the others' next quorum
    goes on without its replica once its heartbeat is silent, and a step whose allreduce broke is
    drawn again."""
    log = tmp_path / "seen"
    log.mkdir()
    spec = JobSpec(workload=write(tmp_path / "code", SEEN, "seen_ft.py") + ":seen", strategy="ft", workers=3,
                   cpus_per_worker=0.5, min_workers=1, epochs=EPOCHS, checkpoint_every_steps=5,
                   preemption_check_steps=1, seed=3, storage=str(tmp_path / "runs"), name="ft_lost",
                   address=lab.address, max_failures=1,
                   params={"log": str(log), "delay": 0.8, "n": SAMPLES}).validated()
    run = run_in_background(spec, note=lambda message: None)  # with its progress lines (on stderr)
    run.wait_for_checkpoint(lambda m: m.global_step >= 5)
    gone = lab.kill(0)
    s = run.wait(timeout_s=900)
    err = capfd.readouterr().err
    assert "preemption notice" not in err, err[-3000:]  # none was given
    kept = records(log)
    debug = (s, lab.events, sorted({(r["replica"], r["pid"], r["node"][-6:]) for r in kept}))
    assert s.status == "succeeded" and s.epochs_completed == EPOCHS, debug
    assert s.restarts == 0 and s.replicas_replaced >= 1, debug
    assert s.quorum_changes >= 2, debug  # the leave, and the replacement's join
    assert_each_sample_once(kept, SAMPLES, EPOCHS)

    left = {r["replica"] for r in kept if r["node"] == gone.node_id}
    assert left and len(left) < 3, debug
    pids = {replica: [] for replica in range(3)}
    for r in sorted(kept, key=lambda r: r["t"]):
        if r["pid"] not in pids[r["replica"]]:
            pids[r["replica"]].append(r["pid"])
    for replica in set(range(3)) - left:  # the survivors never restarted
        assert len(pids[replica]) == 1, debug
    for replica in left:  # the replacement joined, was healed, and trained committed steps
        assert len(pids[replica]) == 2, debug
        assert any(r["committed"] for r in kept if r["pid"] == pids[replica][1]), debug
    noticed = min(r["t"] for r in kept if r["pid"] in {pids[x][1] for x in left})
    survivors = [r for r in kept if r["replica"] not in left and r["committed"]]
    assert any(r["t"] < noticed for r in survivors) and any(r["t"] > noticed for r in survivors), debug
    assert os.path.isdir(os.path.join(spec.storage, "ft_lost", "model")), debug
