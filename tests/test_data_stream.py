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
    from launcher.summary import RunSummary, pick_metrics
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


# -- streaming from the Cloud Storage emulator ---------------------------------------------------

def _cache_files(cache: ShardCache) -> int:
    return cache.used_bytes()


@pytest.mark.integration
def test_a_set_four_times_the_cache_streams_within_the_limit(gcs, bucket, tmp_path, monkeypatch):
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
def test_a_shard_deleted_mid_run_is_one_line_and_an_outage_is_retried_then_one_line(gcs, bucket, tmp_path,
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
def test_a_streamed_run_resized_mid_epoch_reads_every_sample_once(gcs, bucket, tmp_path, monkeypatch):
    """Your own torch loop reads a shard set on the emulator through a cache of a quarter of
    it (--data-cache-gb): stopped on 2 workers, resumed on 1 and stopped, resumed on 2; each
    epoch trains every sample once."""
    from test_session import assert_each_sample_once, run_resized_twice

    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))
    uri = id_set(tmp_path / "data", n=64, per_shard=4, uri=f"gs://{bucket}/ids")
    quarter = sum(s.bytes for s in Shards(uri).index.shards) / 4 / 2**30
    phases = run_resized_twice(tmp_path, STREAMED, "streamed.py", "--param", f"data={uri}",
                               "--data-cache-gb", repr(quarter))
    assert_each_sample_once(phases, 64, 2)
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
def test_keras_fit_streams_a_shard_set_and_trains_every_sample_once_per_epoch(gcs, bucket, tmp_path,
                                                                            monkeypatch):
    """session.fit on a Shards set on the emulator, 2 workers (MultiWorkerMirroredStrategy): each
    epoch every sample once, split over the ranks."""
    from test_session import finish, launch
    from test_user_workloads import write

    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))
    uri = id_set(tmp_path / "data", n=64, per_shard=4, uri=f"gs://{bucket}/ids")
    path = write(tmp_path / "code", STREAMED_KERAS, "streamed_keras.py")
    log = tmp_path / "seen"
    log.mkdir()
    summary = finish(launch(["--workload", f"{path}:seen", "--workers", "2", "--storage", str(tmp_path / "runs"),
                             "--param", f"log={log}", "--param", f"data={uri}", "--name", "keras_streamed"]))
    assert summary["status"] == "succeeded" and summary["steps_completed"] == 2 * 8, summary
    records = [json.loads(line) for f in sorted(log.iterdir()) for line in f.read_text().splitlines()]
    assert {len(r["items"]) for r in records} == {4}
    for epoch in (0, 1):
        items = [i for r in records if r["epoch"] == epoch for i in r["items"]]
        assert sorted(items) == list(range(64)), (epoch, sorted(items))
