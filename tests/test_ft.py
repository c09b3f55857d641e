"""--strategy ft: per-step fault tolerance with torchft replica groups.

The fast tests check what the spec refuses (one line, exit 2) and the cursor a quorum's steps
move: a committed step advances it by the samples the step trained, whatever the number of
replicas in its quorum, and a step whose commit failed is drawn again from the same place.
The integration test trains a training function on 2 replicas on a real local Ray (the
session's warm head) with real torchft: every sample of each epoch is trained once, and a run
stopped with Ctrl-C after a mid-epoch checkpoint and launched again ends with the uninterrupted
run's weights. The preemption of a replica's node (the survivors keep their processes, the
replacement is healed from a peer) is tests/chaos/test_ft_chaos.py's.
"""

from __future__ import annotations

import json
import os
import types

import pytest

from launcher.storage import Storage
from launcher.storage.checkpoint import complete_checkpoints
from launcher.worker.ft import leave_now
from launcher.worker.ft_order import QuorumOrder
from launcher.worker.order import GlobalOrder
from test_session import assert_same_epochs, finish, launch, stop_after_step_checkpoint
from test_user_workloads import write

# -- refusals (no Ray) --------------------------------------------------------------------------


@pytest.mark.parametrize("flags,needle", [
    (["--backend", "horovod"], "--strategy ft runs on the native torch backend, not horovod"),
    (["--framework", "tensorflow"], "TensorFlow runs are data parallel only"),
    (["--framework", "xgboost"], "--strategy does not apply to an XGBoost run"),
    (["--fsdp-offload"], "--fsdp-offload applies to --strategy fsdp"),
    (["--precision", "fp16"], "a torchft step must be committed or retried"),
    (["--grad-accumulation", "2"], "a quorum is formed per optimizer step"),
])
def test_what_ft_cannot_keep_in_step_is_refused_in_one_line(capsys, flags, needle):
    from launcher.cli.main import main

    assert main(["run", "--strategy", "ft", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_program_is_not_kept_in_step_by_ft(capsys, tmp_path):
    from launcher.cli.main import main

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["run", "--script", str(script), "--strategy", "ft"]) == 2
    assert "program prepares its own" in capsys.readouterr().err


# -- the cursor a quorum's steps move (no Ray: the quorums are given) -----------------------------

class Quorums:
    """What a replica's order asks of its strategy: the quorum of the step about to be drawn (and,
    for a replica behind, the peer's cursor it is healed to there, as FaultTolerant._load does)."""

    def __init__(self, replicas: int) -> None:
        self.replicas, self.participants, self.rank = replicas, 0, 0
        self.order: QuorumOrder | None = None
        self.heal_to: int | None = None

    def begin_step(self) -> tuple[int, int]:
        if self.heal_to is not None:
            self.order.cursor, self.order.over, self.heal_to = self.heal_to, False, None
        return self.participants, self.rank


def replica_order(n: int, batch_size: int) -> tuple[QuorumOrder, Quorums]:
    quorums = Quorums(3)
    session = types.SimpleNamespace(spec=types.SimpleNamespace(seed=3), pos=types.SimpleNamespace(epoch=0),
                                    rank=0, world=1, _samples=0)
    order = quorums.order = QuorumOrder(quorums, session, n, batch_size, True, True, False, True, None)
    return order, quorums


def test_the_cursor_moves_by_what_committed_steps_trained_whatever_the_quorum():
    """Three replica slots over one epoch of 120 samples in batches of 6 per replica: quorums of
    3, then 2 (a replica left; its step's commit failed once and is drawn again), then 3 (the
    replacement, healed from a peer: it takes the peers' cursor). Each committed step's shares
    together are the next samples of the run's order; the epoch trains every sample once."""
    n, batch = 120, 6
    orders = [replica_order(n, batch) for _ in range(3)]
    draws = [iter(order) for order, _ in orders]
    expected = GlobalOrder(n, 3, True, batch).permutation(0)
    trained: list[int] = []
    script = [((0, 1, 2), True)] * 2 + [((0, 2), False)] + [((0, 2), True)] * 3 + [((0, 1, 2), True)] * 10
    for members, committed in script:
        if orders[0][0].over:
            break
        cursor = orders[0][0].cursor
        if 1 in members and orders[1][0].cursor != cursor:  # a replica behind heals from a peer at the draw
            orders[1][1].heal_to = cursor
        shares = []
        for rank, slot in enumerate(members):
            order, quorums = orders[slot]
            quorums.participants, quorums.rank = len(members), rank
            shares.append(next(draws[slot]))
        step = sorted(i for share in shares for i in share)
        assert step == sorted(expected[cursor:cursor + batch * len(members)].tolist())  # the next samples
        assert len({len(s) for s in shares}) == 1  # every replica of the quorum trains as many
        for slot in members:
            if committed:
                orders[slot][0].commit(len(members))
            else:
                orders[slot][0].pending = 0
        if committed:
            trained += step
            assert orders[0][0].cursor == cursor + len(step)
        else:
            assert orders[0][0].cursor == cursor  # retried from the same place
    assert orders[0][0].over and orders[0][0].cursor == n
    assert sorted(trained) == list(range(n))  # nothing repeated, nothing skipped
    assert orders[0][0].session._samples == n


def test_an_epoch_ends_when_no_step_of_the_quorum_is_left():
    """Samples that cannot be split evenly over the quorum (fewer than its replicas) wait for the
    next epoch's order, as with a fixed group; len() tells the loader's last batch."""
    order, quorums = replica_order(10, 4)
    quorums.participants = 3
    share = next(iter(order))
    assert len(share) == 3 and order.pending == 9  # 9 of the 10 samples, 3 per replica
    assert len(order) == 2  # handed out 1, and not done yet
    order.commit(3)
    assert (order.cursor, order.over, len(order)) == (9, True, 1)  # the last batch was the one handed out
    order.epoch_over()
    assert (order.cursor, order.over, order.handed) == (0, False, 0)


# -- a lost peer (no Ray: torchft's managed work, its process group's work broken) ----------------

def test_an_allreduce_broken_by_a_lost_peer_leaves_the_step_uncommitted_not_the_replica_failed():
    """A peer's process killed mid-allreduce (its node removed without notice): torchft notes the
    error, so the step will not commit, but leaves the work's future unset, and its own DDP hook
    then fails an assertion inside backward(), ending the survivor too. Ours hands the bucket back."""
    import logging

    import torch
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import _ManagedWork
    from torchft.work import _DummyWork

    from launcher.worker.ft import _comm_hook

    class Broken(_DummyWork):  # gloo's work once the peer's connection closed
        def wait(self, timeout=None):
            raise RuntimeError("Connection closed by peer")

    class Manager:  # torchft's Manager, as far as its managed work and the hooks use it
        _logger = logging.getLogger("test_ft")

        def __init__(self) -> None:
            self.errors: list[Exception] = []

        def report_error(self, e: Exception) -> None:
            self.errors.append(e)

        def allreduce(self, tensor):
            return _ManagedWork(self, Broken(tensor), tensor)

    grads = torch.ones(3)
    bucket = types.SimpleNamespace(buffer=lambda: grads)
    with pytest.raises(AssertionError):
        DistributedDataParallel._comm_hook(Manager(), bucket)
    manager = Manager()
    assert _comm_hook(manager, bucket).wait() is grads
    assert [str(e) for e in manager.errors] == ["Connection closed by peer"]  # the step will not commit


def test_a_replica_with_notice_trains_on_until_its_deadline_is_two_steps_and_3_s_off():
    now = 1_000.0
    at = lambda left: int((now + left) * 1000)  # noqa: E731 - a deadline `left` seconds away, in ms
    assert not leave_now(at(25.0), now, step_s=2.0)   # 25 s left, steps of 2 s: 7 s are needed
    assert not leave_now(at(7.5), now, step_s=2.0)
    assert leave_now(at(6.9), now, step_s=2.0)
    assert not leave_now(at(3.5), now, step_s=0.01)   # fast steps: LEAVE_MIN_S is the margin
    assert leave_now(at(2.9), now, step_s=0.01)
    assert leave_now(None, now, step_s=2.0)           # no deadline known: leave at once
    assert leave_now(at(-1.0), now, step_s=2.0)


def test_ft_replicas_watch_for_notices_on_a_cluster_whatever_ray_trains_watcher_setting(monkeypatch):
    """Each ft replica reads its own node's drain state: Ray Train's watcher (off in a process that
    ran a local launch, and in the launches it starts) is not how its notices come."""
    from launcher.driver import trainer
    from launcher.spec import JobSpec

    monkeypatch.setenv(trainer.PREEMPTION_WATCHER_ENV, "0")
    ft = JobSpec(strategy="ft", workers=2).validated()
    assert trainer.notices_possible(ft, local=False) and not trainer.notices_possible(ft, local=True)
    assert not trainer.notices_possible(JobSpec(workers=2).validated(), local=False)


# -- training on a real local Ray with real torchft ---------------------------------------------

SEEN = '''
import json
import os
import time

import ray.train
import torch
import workloads


@workloads.training_function(epochs=2, batch_size=6)
def seen(session):
    """A tiny model; each replica logs the sample ids of every step it trained, and whether the step
    committed (the position moved on), with its process id and node."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = session.prepare(model, optimizer)
    session.register(model=model, optimizer=optimizer)
    loader = session.loader([torch.tensor([float(i)]) for i in range(int(session.params.get("n", 120)))])
    replica = ray.train.get_context().get_world_rank()
    node = ray.get_runtime_context().get_node_id()
    out = os.path.join(session.params["log"], f"{os.getpid()}.jsonl")
    for epoch in session.epochs():
        for x in loader:
            epoch, before = session.epoch, session.global_step
            loss = (model(x / 64) - x / 32).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            session.step(loss=loss)
            with open(out, "a") as f:
                f.write(json.dumps({"epoch": epoch, "step": session.global_step, "replica": replica, "node": node,
                                    "pid": os.getpid(), "committed": session.global_step > before,
                                    "t": time.time(), "items": x.squeeze(-1).int().tolist()}) + "\\n")
            time.sleep(float(session.params.get("delay", 0)))
'''


def records(log) -> list[dict]:
    return [json.loads(line) for f in sorted(os.listdir(log)) for line in open(os.path.join(log, f))]


def assert_each_sample_once(kept: list[dict], n: int, epochs: int) -> None:
    for epoch in range(epochs):
        items = [i for r in kept if r["epoch"] == epoch and r["committed"] for i in r["items"]]
        assert sorted(items) == list(range(n)), (epoch, sorted(items))  # nothing repeated, nothing skipped


@pytest.mark.integration
def test_ft_trains_each_sample_once_and_resumes_to_the_same_weights(warm_head, tmp_path):
    """2 replicas, a step checkpoint every 4 steps. The uninterrupted run trains every sample of each
    epoch once (each step's global batch split over the quorum); a run stopped by Ctrl-C after its
    first step checkpoint (mid-epoch) and launched again ends with the same weights and epoch losses.
    The three launches connect to the session's warm head rather than each starting a Ray of its
    own (~9 s a launch here: conftest's warm_head); the lighthouse and the replicas are the run's
    own actors either way."""
    path = write(tmp_path / "code", SEEN, "seen_ft.py")
    storage = str(tmp_path / "runs")
    args = ["--workload", f"{path}:seen", "--strategy", "ft", "--storage", storage]
    (tmp_path / "whole").mkdir()
    # The uninterrupted run keeps no step checkpoints: they change no weight.
    whole = finish(launch(args + ["--name", "whole", "--param", f"log={tmp_path / 'whole'}"]))
    args += ["--checkpoint-every-steps", "4", "--keep-checkpoints", "10"]
    assert whole["status"] == "succeeded" and whole["strategy"] == "ft", whole
    assert (whole["epochs_completed"], whole["steps_completed"], whole["final_workers"]) == (2, 20, 2), whole
    assert (whole["restarts"], whole["quorum_changes"]) == (0, 0), whole
    assert whole["weights_sha256"] and whole["model"], whole
    kept = records(tmp_path / "whole")
    assert all(r["committed"] for r in kept) and {r["replica"] for r in kept} == {0, 1}
    assert_each_sample_once(kept, 120, 2)

    (tmp_path / "stopped").mkdir()
    storage_root = Storage.resolve(storage)

    def mid_epoch_checkpoint() -> bool:
        return any(m.step_in_epoch for m, _ in complete_checkpoints(storage_root, "stopped"))

    stop_args = args + ["--name", "stopped", "--param", f"log={tmp_path / 'stopped'}"]
    stopped = stop_after_step_checkpoint(stop_args, tmp_path, until=mid_epoch_checkpoint)
    assert stopped["status"] == "cancelled" and stopped["steps_completed"] < 20, stopped
    resumed = finish(launch(stop_args))
    assert resumed["status"] == "succeeded" and resumed["resumed_from"] == {"epoch": 0, "step": 4}, resumed
    assert resumed["weights_sha256"] == whole["weights_sha256"]
    assert_same_epochs(storage, "whole", "stopped", ["loss"])
