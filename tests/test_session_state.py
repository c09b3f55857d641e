"""The training session's state, in one process (no Ray): what a checkpoint holds and restores.

A real single-process gloo group stands in for the workers; the session is
:class:`launcher.worker.bare.BareSession` (the training session less Ray), so
these run in the fast tier. The loader's order is checked to resume at the exact
batch, a checkpoint to round-trip every registered state and the RNG streams, and a
checkpoint written by the managed loop before it ran on the session to restore.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import workloads  # noqa: E402
from launcher.backends import DDPComm  # noqa: E402
from launcher.spec import JobSpec  # noqa: E402
from launcher.storage.checkpoint import Manifest, write_manifest  # noqa: E402
from launcher.worker import BareSession  # noqa: E402


class CpuComm(DDPComm):
    def device(self):
        return torch.device("cpu")


@pytest.fixture(scope="module")
def comm():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield CpuComm()
    dist.destroy_process_group()


def session(comm, **spec) -> BareSession:
    values = {"workers": 1, "storage": "/tmp", "preemption_check_steps": 0, "epochs": 2, "batch_size": 4, **spec}
    return BareSession(JobSpec(**values).validated(), comm)


def test_the_loader_resumes_at_the_exact_batch(comm):
    s = session(comm)
    loader = s.loader(list(range(30)), batch_size=4)
    whole = [b.tolist() for b in loader]
    assert sorted(sum(whole, [])) == list(range(30)) and whole != [list(range(i, min(i + 4, 30)))
                                                                  for i in range(0, 30, 4)]  # shuffled
    resumed = session(comm)
    resumed._resume = (3, None)  # as a checkpoint after 3 batches of this epoch restores it
    loader = resumed.loader(list(range(30)), batch_size=4)
    assert [b.tolist() for b in loader] == whole[3:]
    assert [b.tolist() for b in loader] == whole  # the next pass starts at its beginning
    s.pos.epoch = 1
    assert [b.tolist() for b in s.loader(list(range(30)), batch_size=4, train=False)] == \
        [list(range(i, min(i + 4, 30))) for i in range(0, 30, 4)]  # evaluation: in order, whole


def build():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    return model, optimizer, scheduler


def test_a_checkpoint_round_trips_every_registered_state_and_the_rng(comm, tmp_path):
    s = session(comm)
    model, optimizer, scheduler = build()
    s.register(model=model, optimizer=optimizer, scheduler=scheduler)
    s._train_loader = s.loader(list(range(20)))
    for _ in range(3):
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    s.pos.step_in_epoch, s.pos.global_step = 3, 3
    s._train_loader.batches = 3
    s.save(str(tmp_path), {})
    after = torch.rand(4)  # what the stream gives next in the saved run

    restored = session(comm)
    restored.restore(str(tmp_path))
    # 3 batches of 4 done: the epoch's cursor in the global order is at its 12th sample.
    assert (restored.pos.step_in_epoch, restored.pos.global_step, restored._resume) == (3, 3, (3, 12))
    fresh_model, fresh_optimizer, fresh_scheduler = build()
    restored.register(model=fresh_model, optimizer=fresh_optimizer, scheduler=fresh_scheduler)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()))
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 3
    restored._begin()  # sets the saved RNG streams before the first step
    assert torch.equal(torch.rand(4), after)


def test_state_alive_but_not_registered_is_named_and_registered_state_is_not(comm):
    """What a resumed run would lose is found among the process's live objects: an optimizer
    and a scheduler nobody registered are named with the register call that keeps them; what is
    registered, a disabled GradScaler (no state) and an optimizer that a registered wrapper
    stands in for (Horovod's) are not; an optimizer the loop dropped in a reference cycle is no
    state of the run."""
    s = session(comm)
    model, optimizer, scheduler = build()
    s.register(model=model)
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    said = s.unregistered()
    assert len(said) == 2, said
    assert said[0].startswith("the LR scheduler StepLR is not registered") and \
        "session.register(scheduler=...)" in said[0], said
    assert said[1].startswith("the optimizer Adam is not registered") and \
        "session.register(optimizer=...)" in said[1], said

    s.register(optimizer=optimizer, scheduler=scheduler)
    given = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = torch.optim.SGD(model.parameters(), lr=0.1)
    s._stand_ins[id(given)] = wrapper  # as prepare() records Horovod's wrapper of the given one
    s.register(wrapped=wrapper)
    dropped = torch.optim.SGD(model.parameters(), lr=0.1)
    dropped.cycle = dropped  # only a collection frees it
    del dropped
    assert s.unregistered() == []
    del disabled, given  # alive until here: the walks above saw them


def test_a_registered_object_without_state_is_one_line(comm):
    from launcher.worker.loader import SessionError

    with pytest.raises(SessionError, match=r"session.register\(x=...\) at .*test_session_state.py:\d+: a int has no"):
        session(comm).register(x=3)


def test_a_checkpoint_of_the_managed_loop_before_the_session_restores(comm, tmp_path):
    """Written as the managed loop wrote it: model.pt, optimizer.pt, each rank's bare RNG tensor."""
    model, optimizer, _ = build()
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    torch.save(model.state_dict(), os.path.join(tmp_path, "model.pt"))
    torch.save(optimizer.state_dict(), os.path.join(tmp_path, "optimizer.pt"))
    torch.save(torch.get_rng_state(), os.path.join(tmp_path, "rng_rank0.pt"))
    after = torch.rand(3)
    write_manifest(str(tmp_path), Manifest(epoch=1, step_in_epoch=5, global_step=12, world_size=1, framework="torch",
                                           backend="native", workload="digits-mlp", batch_size=4, seed=0))
    s = session(comm)
    s.restore(str(tmp_path))
    assert (s.pos.epoch, s.pos.step_in_epoch, s.pos.global_step, s._resume) == (1, 5, 12, (5, None))
    fresh_model, fresh_optimizer, _ = build()
    s.register(model=fresh_model, optimizer=fresh_optimizer)
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1
    assert torch.equal(fresh_model.weight, model.weight)
    s._begin()
    assert torch.equal(torch.rand(3), after)


def test_the_managed_loop_reads_a_workloads_shard_a_batch_per_call():
    from launcher.worker.torch_loop import SplitDataset, as_tensors

    digits = workloads.get("digits-mlp")
    split = digits.load(None, "train", 0, 2, digits.resolve_params({}))
    dataset = SplitDataset(split)
    x, y = as_tensors(dataset.__getitems__([3, 1, 2]))
    assert x.shape == (3, 64) and y.dtype == torch.int64
    assert np.array_equal(x.numpy(), split.take(np.array([3, 1, 2]))[0])


def test_a_prefetching_loader_gives_the_same_batches_and_position(comm):
    plain, ahead = session(comm), session(comm)
    expected = [b.tolist() for b in plain.loader(list(range(30)), batch_size=4)]
    loader = ahead.loader(list(range(30)), batch_size=4, prefetch=True)
    got = []
    for batch in loader:
        got.append(batch.tolist())
        assert loader.batches == len(got)  # counted as handed over, not as read ahead
    assert got == expected and ahead._samples == 30
    # Leaving the loop early stops the reading thread; the next pass starts afresh.
    for _ in loader:
        break
    assert [b.tolist() for b in loader] == expected


def test_a_prefetching_loader_reports_a_collate_error(comm):
    from launcher.worker.loader import SessionError

    ragged = [torch.zeros(1 + i % 2) for i in range(8)]
    with pytest.raises(SessionError, match="the default collate cannot batch the items of list"):
        list(session(comm).loader(ragged, batch_size=4, prefetch=True))


def test_a_drain_deadline_leaves_room_for_an_epoch_end_before_the_next_check(comm):
    """The hold before a drain deadline counts an epoch's end (evaluation, checkpoint, report) that
    falls before the next notice check: without it, a chaos run trained on into that end and lost
    the steps after it when the node went."""
    import time

    s = session(comm)
    s.steps_per_epoch = 23
    for i in range(23):  # an epoch of quick steps
        s.pos.step_in_epoch = i + 1
        s.after_step(time.perf_counter(), epoch_ends=i == 22)
    time.sleep(0.3)  # its end
    s.pos.step_in_epoch = 1
    s.after_step(time.perf_counter())
    assert 0.3 <= s.epoch_end_s < 0.5 and s.step_s < 0.05
    deadline = int((time.time() + 1.8) * 1000)  # room for the steps (1.5 s at least), not for an end too
    s.pos.step_in_epoch = 5  # 18 steps to the epoch's end: not before the next check (every 10)
    assert not s._deadline_close(deadline, 10)
    s.pos.step_in_epoch = 20  # the end comes before the next check
    assert s._deadline_close(deadline, 10)


@pytest.mark.parametrize("name", ["no_steps", "no_model", "ragged", "raises", "loader_in_loop"])
def test_a_broken_function_fails_naming_the_users_line(comm, tmp_path, name):
    """Each misuse of the session in a user's function is one error naming the user's line
    (on a worker the run fails with it: test_session)."""
    from test_session import BROKEN, BROKEN_CASES, broken_line

    path = tmp_path / "broken.py"
    path.write_text(BROKEN)
    function = workloads.get(f"{path}:{name}")
    s = BareSession(JobSpec(workers=1, storage=str(tmp_path), workload=f"{path}:{name}", preemption_check_steps=0,
                            epochs=function.defaults.epochs, batch_size=function.defaults.batch_size).validated(),
                   comm, function)
    with pytest.raises(Exception) as raised:
        s.start()
    for needle in dict(BROKEN_CASES)[name] + [f"{path}:{broken_line(name)}"]:
        assert needle in str(raised.value), str(raised.value)
