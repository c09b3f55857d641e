"""Streamed shard sets (launcher/data: dataset, cache): the epoch order, the node cache and
its limit, missing shards and outages, and training runs that read a set from the Cloud
Storage emulator and resume across worker counts.

The fast tests read local sets (nothing to fetch) through the session's batch sampler;
the integration tests put sets on the emulator and read them through the real cache.
"""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest

from launcher.data import writer
from launcher.data.cache import ShardCache, limit_bytes
from launcher.data.dataset import Shards
from launcher.data.index import ShardError
from launcher.errors import Unreachable, UserError
from launcher.worker.loader import BatchOrder
from test_session import SEEN
from test_tf_session import SEEN_KERAS


def id_set(folder, n: int = 64, per_shard: int = 8, uri: str | None = None) -> str:
    """A jsonl shard set of ``n`` samples {"id": i, "square": i*i}, ``per_shard`` to a shard,
    written to ``uri`` (default the folder ``folder/set``)."""
    os.makedirs(folder, exist_ok=True)
    source = os.path.join(folder, "ids.jsonl")
    with open(source, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "square": i * i}) + "\n")
    return writer.shard(source, uri or os.path.join(folder, "set"), samples_per_shard=per_shard).uri


def _session(rank: int, world: int, epoch: int = 0, seed: int = 5):
    return types.SimpleNamespace(rank=rank, world=world, spec=types.SimpleNamespace(seed=seed),
                                 pos=types.SimpleNamespace(epoch=epoch))


# -- the order (no Ray) ------------------------------------------------------------------------

def test_the_epoch_order_reads_shard_after_shard_and_shuffles_within_a_window(tmp_path):
    data = Shards(id_set(tmp_path, n=100, per_shard=10), window=15)
    assert len(data) == 100 and data.window == 15
    first = data.permutation(3, 0)
    assert sorted(first.tolist()) == list(range(100))                # each sample once
    assert np.array_equal(first, data.permutation(3, 0))              # (seed, epoch) alone
    assert not np.array_equal(first, data.permutation(3, 1))
    assert not np.array_equal(first, data.permutation(4, 0))
    assert np.array_equal(data.permutation(3, 0, shuffle=False), np.arange(100))
    # Shards are read one after another (their order drawn from (seed, epoch) alone, whatever
    # the window): each window of 15 holds the samples of the same 15 places in that sequence.
    in_turn = Shards(data.uri, window=1).permutation(3, 0)
    assert [data.shard_of(int(i)) for i in in_turn[::10]] != list(range(10))  # the shards are shuffled
    assert all(len({data.shard_of(int(i)) for i in in_turn[k:k + 10]}) == 1 for k in range(0, 100, 10))
    for start in range(0, 100, 15):
        assert set(first[start:start + 15].tolist()) == set(in_turn[start:start + 15].tolist())
        assert len({data.shard_of(int(i)) for i in first[start:start + 15]}) <= 3


def test_ranks_split_each_global_batch_and_a_resize_continues_at_the_cursor(tmp_path):
    """Through the session's batch sampler: 2 ranks read 3 global batches, 1 rank the rest of
    the epoch from the cursor: every sample once, and each rank was told what it reads."""
    data = Shards(id_set(tmp_path, n=64, per_shard=8))
    planned = {}
    seen = []
    for rank in range(2):
        order = BatchOrder(_session(rank, 2), len(data), 4, train=True, shuffle=True, drop_last=False, dataset=data)
        batches = list(iter(order))
        assert len(batches) == 8
        seen += [data[i]["id"] for batch in batches[:3] for i in batch]
        planned[rank] = data._reader().last_use  # the shards this rank's plan reads
    cursor = order.cursor_at(3)
    assert cursor == 24 and len(seen) == 24
    alone = BatchOrder(_session(0, 1), len(data), 4, train=True, shuffle=True, drop_last=False, dataset=data)
    alone.resume_at(3, cursor)
    alone.start = 3
    seen += [data[i]["id"] for batch in iter(alone) for i in batch]
    assert sorted(seen) == list(range(64))  # nothing repeated, nothing skipped
    assert all(planned.values())


def test_a_local_set_is_read_where_it_is_and_a_missing_shard_is_named(tmp_path):
    uri = id_set(tmp_path, n=16, per_shard=4)
    data = Shards(uri, transform=lambda s: (s["id"], s["square"]))
    assert [data[i] for i in range(16)] == [(i, i * i) for i in range(16)]
    assert data._reader().cache.path(0) == os.path.join(uri, "shard-00000.jsonl")  # no copy
    os.remove(os.path.join(uri, "shard-00003.jsonl"))
    with pytest.raises(ShardError, match=r"shard-00003\.jsonl of .*set: the file is missing"):
        Shards(uri)[15]


def test_a_cache_limit_below_one_shard_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="holds nothing"):
        limit_bytes(0)
    assert limit_bytes(0.5) == 2**29


def test_input_wait_is_a_share_of_the_training_time_on_the_line_and_in_the_summary():
    from launcher.cli.run import format_summary
    from launcher.driver.progress import format_epoch
    from launcher.driver.tracker import Tracker
    from launcher.measures import pick_metrics
    from launcher.summary import RunSummary
    from launcher.worker.usersession import data_wait

    assert data_wait(np.array([1.0, 3.0]), 10.0) == {"data_wait_s": 2.0, "data_wait_fraction": 0.2,
                                                     "data_wait_max_fraction": 0.3}
    assert data_wait(np.array([1.0]), 0.0) == {}
    epoch = {"epoch": 1, "global_step": 8, "samples_per_s": 100.0, "train_time_s": 10.0, "loss": 0.5,
             **data_wait(np.array([0.1, 3.0]), 10.0)}
    line = format_epoch(epoch, 2, 12.0)
    assert "input wait 16% (slowest rank 30%)  elapsed" in line, line
    assert "data_wait" not in " ".join(pick_metrics(epoch))  # not a metric of the model
    assert "slowest" not in format_epoch({**epoch, **data_wait(np.array([1.0, 1.0]), 10.0)}, 2, 12.0)
    tracker = Tracker.__new__(Tracker)
    tracker.data_wait = []
    tracker._note_wait(epoch)
    tracker._note_wait({**epoch, "train_time_s": 30.0, **data_wait(np.array([0.0, 0.0]), 30.0)})
    assert tracker.wait_fractions() == (round(1.55 / 40, 4), 0.3)
    summary = RunSummary(name="r", status="succeeded", workload="w", framework="torch", backend="native",
                         workers=2, epochs=2, data_wait_fraction=0.0388, data_wait_max_fraction=0.3)
    assert "input wait 3.9% of training (slowest rank's worst epoch 30.0%)" in format_summary(summary)
    assert "input wait" not in format_summary(RunSummary(name="r", status="succeeded", workload="w",
                                                         framework="torch", backend="native", workers=2, epochs=2))


# -- a cache too small, and bad input a worker finds (issue 65 item 3) ---------------------------

def test_a_user_error_crosses_from_a_worker_with_its_fix_and_the_users_line(tmp_path):
    """What a worker raises comes back to the driver pickled (Ray does it): a UserError keeps its
    fix; raised in a training function it names the user's file:line, no RuntimeError around
    it, and the driver finds it among the ranks' failures (exit 2, launcher.driver.launch)."""
    import pickle
    import sys

    from launcher.driver.trainer import describe_failure, worker_user_error
    from launcher.worker.usersession import UserSession

    error = pickle.loads(pickle.dumps(UserError("the cache is too small", "raise --data-cache-gb")))
    assert type(error) is UserError and str(error) == "the cache is too small; raise --data-cache-gb"
    shard = pickle.loads(pickle.dumps(ShardError("shard-3", "/d/set", "the file is missing")))
    assert isinstance(shard, UserError) and shard.fix.startswith("fetch it again")

    source = tmp_path / "mine.py"
    source.write_text("from launcher.data import Shards\n\ndef train(session):\n"
                      "    Shards(session.params['shards'])[0]\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import mine
    finally:
        sys.path.remove(str(tmp_path))
    missing = id_set(tmp_path, n=8, per_shard=4)
    os.remove(os.path.join(missing, "shard-00000.jsonl"))
    stub = types.SimpleNamespace(function=types.SimpleNamespace(fn=mine.train), params={"shards": missing})
    with pytest.raises(UserError) as raised:
        UserSession.run_function(stub)
    line = str(raised.value)
    assert line.startswith(f"train(session) at {source}:4: shard-00000.jsonl of ") and "the file is missing" in line
    assert "RuntimeError" not in line and "\n" not in line, line

    failed = types.SimpleNamespace(worker_failures={1: raised.value, 0: RuntimeError("rank 1 went")})
    assert str(worker_user_error(failed)) == line
    assert worker_user_error(types.SimpleNamespace(worker_failures={0: RuntimeError("x")})) is None
    outage = types.SimpleNamespace(worker_failures={0: Unreachable("gs://b did not answer", "check the network")})
    assert describe_failure(outage) == "rank 0: gs://b did not answer; check the network"


@pytest.mark.gcs
def test_a_cache_smaller_than_a_shard_is_refused_before_any_worker_starts(gcs, bucket, tmp_path, monkeypatch,
                                                                          capsys):
    """--data-cache-gb below the largest shard of a gs:// set the run streams (named by --param or
    --data): one line, exit 2, from the driver's checks: Ray never starts (it took a worker
    31 s to say so, wrapped in a RuntimeError, exit 1)."""
    from launcher.cli.main import main
    from launcher.data.cache import check_sets, gb_above

    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))
    uri = id_set(tmp_path, n=64, per_shard=16, uri=f"gs://{bucket}/ids")
    largest = max(s.bytes for s in Shards(uri).index.shards)
    below = (largest - 1) / 2**30
    with pytest.raises(UserError, match=r"^--param shards gs://.*/ids: the data cache's limit \(.* bytes\) is "
                                        r"smaller than the largest shard of gs://.*/ids \(shard-\d+\.jsonl, "):
        check_sets({"--param shards": uri, "--param out": f"gs://{bucket}/elsewhere"}, below)
    # Room for the largest shard is not enough: any reader holds 3 at once (a window of 1 spans 2, and the next)
    three = sum(sorted((s.bytes for s in Shards(uri).index.shards), reverse=True)[:3])
    with pytest.raises(UserError, match=r"^--data gs://.*/ids: the data cache's limit \(.*\) cannot hold the 3 largest "
                                        r"shards of gs://.*/ids \(.*\), and a reader of the set holds at least 3 at "
                                        r"once .*; raise --data-cache-gb to "):
        check_sets({"--data": uri}, largest / 2**30)
    check_sets({"--param shards": uri, "--param out": f"gs://{bucket}/elsewhere", "--param n": 3}, three / 2**30)
    check_sets({"--data": uri}, float(gb_above(three)))  # the value the line suggests is enough
    with pytest.raises(UserError, match="cannot hold the 3 shards of gs://.* a window of 1 samples reads at once"):
        Shards(uri, cache_gb=(three - 1) / 2**30, window=1)[0]  # what the reader would say: the same sum
    check_sets({"--data": id_set(tmp_path / "local", n=64, per_shard=16)}, below)  # read where it is: no cache

    source = tmp_path / "streamed.py"
    source.write_text("from launcher.data import Shards\n\ndef train(session):\n"
                      "    for epoch in session.epochs():\n        Shards(session.params['shards'])[0]\n")
    code = main(["run", "--workload", f"{source}:train", "--param", f"shards={uri}", "--data-cache-gb",
                 repr(below), "--storage", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --param shards gs://"), err
    assert "raise --data-cache-gb to" in lines[0] and "Traceback" not in err, err


DAMAGED = """
import torch
import workloads
from launcher.data import Shards


@workloads.training_function(epochs=1, batch_size=4)
def train(session):
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = session.prepare(model, optimizer)
    session.register(model=model, optimizer=optimizer)
    loader = session.loader(Shards(session.params["data"], transform=lambda s: torch.tensor([float(s["id"])])))
    for epoch in session.epochs():
        for x in loader:  # the damaged shard is found here
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            session.step(loss=loss)
"""


@pytest.mark.integration
def test_a_damaged_shard_found_by_a_worker_is_one_line_with_the_users_line_and_exit_2(ray_local, tmp_path, capsys):
    """Bad input only a worker can find (a shard whose bytes differ from the index: the driver
    reads no shard) ends the launch as a bad flag does: `error: ` and one line naming the
    shard and the user's file:line, exit 2, no RuntimeError around it; the run log says failed."""
    from launcher.cli.main import main

    uri = id_set(tmp_path / "data", n=32, per_shard=8)
    for name in sorted(os.listdir(uri)):
        if name.startswith("shard-"):
            path = os.path.join(uri, name)
            with open(path, "r+b") as f:  # the same size, other bytes
                f.write(b"{" if f.read(1) != b"{" else b"[")
    source = tmp_path / "code" / "damaged.py"
    source.parent.mkdir()
    source.write_text(DAMAGED)
    line_no = 1 + DAMAGED.splitlines().index(next(t for t in DAMAGED.splitlines() if "is found here" in t))
    code = main(["run", "--workload", f"{source}:train", "--param", f"data={uri}", "--workers", "2",
                 "--storage", str(tmp_path / "runs"), "--name", "damaged"])
    out, err = capsys.readouterr()
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert code == 2, err
    assert last.startswith(f"error: train(session) at {source}:{line_no}: shard-0000"), err
    assert "its sha256 differs from the index's" in last and "fetch it again" in last, last
    assert "RuntimeError" not in err and "Traceback" not in err and out == "", err
    assert "worker group failed" not in err, err  # said once, as the launch's last line
    summary = json.loads((tmp_path / "runs" / "damaged" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == last[len("error: "):], summary


# -- streaming from the Cloud Storage emulator ---------------------------------------------------

def _cache_files(cache: ShardCache) -> int:
    return cache.used_bytes()


@pytest.mark.integration
def test_a_set_four_times_the_cache_streams_within_the_limit(warm_head, gcs, bucket, tmp_path, monkeypatch):
    """A set of 16 shards read through a cache that holds 4: every sample of two epochs in
    the epoch order, the cache's files never over the limit, used shards evicted."""
    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))
    uri = id_set(tmp_path, n=128, per_shard=8, uri=f"gs://{bucket}/ids")
    index_bytes = sum(s.bytes for s in Shards(uri).index.shards)
    limit_gb = (index_bytes / 4) / 2**30
    data = Shards(uri, cache_gb=limit_gb, window=8)
    cache = data._reader().cache
    assert cache.limit == int(index_bytes / 4) and len(data.index.shards) == 16
    peak = 0
    for epoch in range(2):
        order = data.permutation(0, epoch)
        data.upcoming(order)
        got = []
        for i in order:
            got.append(data[int(i)]["id"])
            peak = max(peak, _cache_files(cache))
            assert peak <= cache.limit, (peak, cache.limit, os.listdir(cache.dir))
        assert got == order.tolist()
    assert 0 < peak <= cache.limit
    fetched = [name for name in os.listdir(cache.dir) if name.endswith(".jsonl")]
    assert len(fetched) <= 4  # the rest were evicted once read
    data.close()
    # A cache that cannot hold the shards one window reads at once is refused before any read.
    with pytest.raises(UserError, match="cannot hold the 3 shards of gs://.* a window of 8 samples reads at once"):
        Shards(uri, cache_gb=limit_gb / 2, window=8)[0]


@pytest.mark.integration
def test_a_shard_deleted_mid_run_is_one_line_and_an_outage_is_retried_then_one_line(warm_head, gcs, bucket, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))
    _, client = gcs
    uri = id_set(tmp_path, n=64, per_shard=8, uri=f"gs://{bucket}/ids")
    data = Shards(uri, window=1)
    data.upcoming(range(64))
    assert data[0]["id"] == 0  # reading shard 0; the next 4 are fetched ahead, shard 7 is not
    client.bucket(bucket).blob("ids/shard-00007.jsonl").delete()
    read = []
    with pytest.raises(ShardError) as missing:
        for i in range(64):
            read.append(data[i]["id"])
    assert read == list(range(56))  # up to the missing shard
    line = str(missing.value)
    assert "\n" not in line and "shard-00007.jsonl of gs://" in line and "missing from the bucket" in line, line
    data.close()

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # nothing answers there
    monkeypatch.setenv("LAUNCHER_GCS_RETRY_S", "1")
    fresh = ShardCache(data.index, 2**30, root=str(tmp_path / "other-cache"))
    with pytest.raises(Unreachable) as outage:
        fresh.get(1)
    line = str(outage.value)
    assert "\n" not in line and "did not answer" in line and "retries included (LAUNCHER_GCS_RETRY_S=1 bounds" in line, line


# test_session's SEEN (your own torch loop that logs each step's sample ids), reading a shard set.
STREAMED = SEEN.replace("import workloads\n", "import workloads\nfrom launcher.data import Shards\n").replace(
    "loader = session.loader([torch.tensor([float(i)]) for i in range(64)])",
    "loader = session.loader(Shards(session.params['data'], window=4, "
    "transform=lambda s: torch.tensor([float(s['id'])])))")


@pytest.mark.integration
def test_a_streamed_run_resized_mid_epoch_reads_every_sample_once(warm_head, gcs, bucket, tmp_path, monkeypatch):
    """Your own torch loop reads a shard set on the emulator through a cache of a quarter of
    it (--data-cache-gb): stopped after 3 steps on 2 workers, resumed on 1 and stopped after 3
    more, resumed on 2; the epoch goes on at the next sample of the run's global order each
    time, and each epoch trains every sample once. The loop is test_session.py's SEEN reading
    the set instead of a list: a list takes the same loader and global order, less the set's
    permutation of its shards (that order's resumes on other worker counts are test_order.py's,
    without Ray), so this is the 2-1-2 resize of a training function's own data too."""
    from test_session import assert_each_sample_once, run_resized_twice

    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))
    uri = id_set(tmp_path / "data", n=64, per_shard=4, uri=f"gs://{bucket}/ids")
    quarter = sum(s.bytes for s in Shards(uri).index.shards) / 4 / 2**30
    phases = run_resized_twice(tmp_path, STREAMED, "streamed.py", "--param", f"data={uri}",
                               "--data-cache-gb", repr(quarter))
    assert_each_sample_once(phases, 64, 2)
    assert {r["epoch"] for r in phases[1]} == {0}  # the shrunk group's steps were mid-epoch
    # Each epoch says how much of its training time the ranks waited for their batches.
    from launcher.storage.runlog import read_jsonl

    epochs = [m for m in read_jsonl((tmp_path / "runs" / "resized" / "metrics.jsonl").read_text())
              if m.get("kind") == "epoch"]
    assert epochs and all(0 < m["data_wait_fraction"] <= m["data_wait_max_fraction"] < 1 for m in epochs), epochs
    # and each rank's peak memory (MiB): a worker's RSS, from torch's size up, far below a machine's
    assert all(len(m["peak_rss_mb_ranks"]) == m["world_size"] and
               50 < min(m["peak_rss_mb_ranks"]) <= m["peak_rss_mb_max"] < 100_000 for m in epochs), epochs
    summary = json.loads((tmp_path / "runs" / "resized" / "summary.json").read_text())
    last = [m["peak_rss_mb_max"] for m in epochs if m["launch"] == summary["launch"]]
    assert last and summary["peak_rss_mb_max"] == max(last), summary


# test_tf_session's SEEN_KERAS (session.fit logging each step's sample ids), reading a shard set.
STREAMED_KERAS = SEEN_KERAS.replace(
    "import workloads\n", "import workloads\nfrom launcher.data import Shards\n").replace(
    "    x = np.arange(64, dtype=\"float32\").reshape(-1, 1)\n    session.fit(model, x, np.zeros_like(x))",
    "    session.fit(model, Shards(session.params['data'], window=4, "
    "transform=lambda s: (np.float32([s['id']]), np.float32([0.0]))))")


@pytest.mark.integration
def test_keras_fit_on_a_streamed_shard_set_resized_2_1_2_mid_epoch_trains_every_sample_once(warm_head, gcs, bucket,
                                                                                             tmp_path, monkeypatch):
    """session.fit on a Shards set on the emulator (MultiWorkerMirroredStrategy), stopped on 2 workers,
    resumed on 1 and stopped, resumed on 2: each epoch trains every sample once, split over the ranks.
    (Keras' resize on in-memory arrays goes through the same global order's cursor; this one run
    tests both the streamed set under session.fit and the resize.)"""
    from test_session import assert_each_sample_once, run_resized_twice

    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))
    uri = id_set(tmp_path / "data", n=64, per_shard=4, uri=f"gs://{bucket}/ids")
    phases = run_resized_twice(tmp_path, STREAMED_KERAS, "streamed_keras.py", "--param", f"data={uri}")
    assert {len(r["items"]) for r in phases[0]} == {4}  # each rank a batch of 4 (the epoch's last may be less)
    assert_each_sample_once(phases, 64, 2)
