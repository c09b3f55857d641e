"""--strategy ft in the preemption lab: a lost node costs the other replicas no restart.

Three replicas of a small training function (half a CPU each) on the lab's two worker nodes;
one node is lost mid-epoch without a notice. Its replica(s) leave the quorum;
the others train on in the same processes at the smaller quorum; Ray Train replaces the lost
replica(s) alone once the node is gone, in the replacement node the autoscaler brings, and
each is healed from a peer and trains. Every sample of every epoch is trained by exactly one
committed step, whatever the quorum was.

The same with GCE's notice (the replica leaves the quorum after its step, and the driver asks
for the replacement node at the notice) is `launcher bench preemption --strategies ft`'s run,
checked to the sample on this package's lab (a lab of its own took the test ~10 s more).
"""

from __future__ import annotations

import os
import sys

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


def test_bench_preemption_runs_the_ft_strategy_and_counts_it_in_samples(lab, tmp_path, capfd):
    """The smallest run of `launcher bench preemption --strategies ft`, on the package's lab (the
    benchmark's own lab has these settings: 2 one-CPU nodes, a 6 s notice, replacements at once):
    one node preempted with a notice. Its replica leaves the quorum and the replacement joins, no
    group restarts, nothing is trained twice; the table and the plot are the command's."""
    from benchmarks import preemption as bench
    from benchmarks.preemption_report import format_table, write_results

    base = JobSpec(workers=2, epochs=1000, checkpoint_every_steps=5, preemption_check_steps=1)
    result = bench.run(["ft"], workers=2, min_workers=1, every_s=8, preemptions=1, boot_s=0, stockout_s=0,
                       notice_s=lab.notice_s, with_notice=True, epochs=1000, base=base, lab=lab,
                       note=lambda text: print(text, file=sys.stderr, flush=True))
    r = result["strategies"][0]
    said = capfd.readouterr().err
    debug = (said[-3000:], {k: r.get(k) for k in ("status", "error", "restarts", "quorum_changes", "replicas_replaced",
                                                   "nodes_removed", "samples_trained", "samples_repeated")})
    # The leaving replica told the driver of its notice, which asked for the replacement node then
    # (Ray Train's own notice path is off for replica groups).
    assert "preemption notice: Ray is draining" in said and "replacement node(s) now" in said, debug
    assert r["strategy"] == "ft" and r["ft"] and r["nodes_removed"] == 1 and r["goodput"] is None, debug
    assert r["restarts"] == 0 and r["quorum_changes"] >= 2 and r["replicas_replaced"] >= 1, debug
    assert r["samples_trained"] > 0 and r["samples_repeated"] == 0 and r["samples_skipped"] == 0, debug
    assert 0 < r["goodput_samples"] <= 1.05 and len(r["samples_timeline"]) > 3, debug
    lines = format_table(result).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("STRATEGY"))
    assert lines[header + 1].split()[0] == "ft" and "quorum change(s)" in "\n".join(lines), debug
    write_results(result, str(tmp_path / "out"))
    assert os.path.getsize(tmp_path / "out" / "preemption.png") > 10_000
