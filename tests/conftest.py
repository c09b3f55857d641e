"""Shared fixtures: one local Ray instance for the whole session, data file writers."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
# Tests never pick up a warm local Ray that a developer started with `launcher up`.
# TensorFlow runs with the legacy tf.keras (tf-keras), selected before it is first imported.
os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ["LAUNCHER_STATE_DIR"] = os.path.join(ROOT, ".pytest_cache", "launcher-state")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray with 2 CPUs, shared by every integration test (start-up is slow), set up as
    a launch's own local Ray is: no idle workers started ahead, and without the daemons nobody
    reads (during a whole suite the log monitor alone took 2.6 % of a core: 27 s in 17 minutes)."""
    import ray

    from launcher.driver import session

    with session.environ(session.LOCAL_RAY_ENV):
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    session._stop_daemons(*session.IDLE_DAEMONS)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def _warm_head_state(tmp_path_factory):
    """The folder of a warm local Ray head (`launcher up`) started once for the session."""
    import socket

    from launcher.driver import localhead

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = str(tmp_path_factory.mktemp("warm-head"))
    with pytest.MonkeyPatch.context() as mp:  # only while it starts: a test asks for it by the fixture
        mp.setenv(localhead.STATE_ENV, state)
        # No ready processes (launcher.worker.pool): tests change settings often, so most of a
        # pool went unused, and the head's start waited for its imports. Side by side
        # (2026-11-28, three warm-head tests, the head's start included): 172 s with a 60 s
        # pool, 155 s without. The pool itself is tested by test_pool.py and
        # test_tour.py's warm-head test.
        localhead.up(port=port, pool_s=0)
    try:
        yield state
    finally:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(localhead.STATE_ENV, state)
            localhead.down()


@pytest.fixture()
def warm_head(_warm_head_state, monkeypatch):
    """The session's warm head for this test's launches: each `launcher run` process connects to
    it instead of starting and stopping a Ray of its own. Side by side on a quiet machine
    (2026-11-28, load 1.2-2.3): test_char_lm_stopped_mid_epoch (3 launches; now
    test_char_lm_resumed_mid_epoch, 2) took 81 s on it, 108 s with LAUNCHER_TEST_COLD=1 (each
    launch its own Ray; set it to compare). It also runs
    the run's settings through the runtime environment, as a user's warm head does. Not for
    tests of Ray's own start, of a launch's local Ray, or of what a launch leaves behind."""
    from launcher.driver import localhead

    if os.environ.get("LAUNCHER_TEST_COLD"):  # A/B: each launch starts its own Ray
        return None
    monkeypatch.setenv(localhead.STATE_ENV, _warm_head_state)
    return localhead.running_head()


@pytest.fixture()
def storage(tmp_path):
    return str(tmp_path / "runs")


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """fake-gcs-server on a free loopback port for the whole session."""
    from launcher.lab.gcs_emulator import Emulator

    emulator = Emulator(str(tmp_path_factory.mktemp("gcs"))).start()
    yield emulator
    emulator.stop()


@pytest.fixture()
def gcs(gcs_emulator, monkeypatch):
    """STORAGE_EMULATOR_HOST set for this test; returns (emulator, client)."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    from launcher.storage import gcs as launcher_gcs

    return gcs_emulator, launcher_gcs.client()


@pytest.fixture()
def bucket(gcs, request):
    """A fresh bucket named after the test."""
    import re

    _, client = gcs
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:50] + "-b"
    return client.create_bucket(name).name


# Fixtures that start a Ray instance, a Ray head process or a multi-node cluster: a test that
# uses one (directly or through another fixture) must say so with a marker, so that the fast
# tier (-m "not integration and not chaos") never starts Ray.
RAY_FIXTURES = {"ray_local", "head", "lab", "warm_head", "_warm_head_state", "two_nodes", "warm_tour",
                "labelled_cluster", "two_epochs"}


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items
                if RAY_FIXTURES & set(getattr(item, "fixturenames", ()))
                and not any(item.get_closest_marker(m) for m in ("integration", "chaos"))]
    if unmarked:
        raise pytest.UsageError("these tests start Ray but are not marked integration or chaos: "
                                + ", ".join(unmarked))
