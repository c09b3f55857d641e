"""The preemption watcher against a fake metadata server on loopback (no Ray), and the pure
accounting of lost work."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from launcher.preemption import drain
from launcher.preemption import watcher as preemption
from launcher.cli.main import main
from launcher.lab.metadata import FakeMetadataServer
from launcher.lab.gcs_emulator import free_port
from launcher.storage.runs import format_lost, format_restarts


@pytest.fixture()
def metadata():
    server = FakeMetadataServer().start()
    yield server
    server.stop()


def test_poll_answers_at_once_then_long_polls_until_the_value_changes(metadata):
    first = preemption.poll_preempted(metadata.host, None)
    assert first.value == "FALSE" and first.etag
    threading.Timer(0.5, metadata.preempt).start()
    started = time.monotonic()
    second = preemption.poll_preempted(metadata.host, first.etag, timeout_s=20)
    assert second.value == "TRUE" and second.etag != first.etag
    assert time.monotonic() - started >= 0.4  # it waited for the change


def test_watcher_acts_once_on_true_with_a_deadline_inside_the_notice(metadata):
    deadlines, lines = [], []
    watcher = preemption.Watcher(metadata.host, lambda d: deadlines.append(d) or "drained (test)", lines.append,
                                 notice_s=30, margin_s=5)
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(watcher.run()))
    thread.start()
    time.sleep(0.5)
    noticed = time.time()
    metadata.preempt()
    thread.join(10)
    assert outcome == ["drained"] and len(deadlines) == 1
    assert noticed + 24 <= deadlines[0] <= noticed + 26
    assert any("instance/preempted = FALSE" in line for line in lines)
    assert any("instance/preempted = TRUE" in line for line in lines) and lines[-1] == "drained (test)"


def test_watcher_retries_with_backoff_until_the_server_answers():
    port = free_port()
    lines, outcome = [], []
    stop = threading.Event()
    watcher = preemption.Watcher(f"127.0.0.1:{port}", lambda d: "drained", lines.append, stop=stop)
    thread = threading.Thread(target=lambda: outcome.append(watcher.run()))
    thread.start()
    try:
        deadline = time.time() + 10
        while not any("unreachable" in line for line in lines) and time.time() < deadline:
            time.sleep(0.05)
        assert any("retrying in 1s" in line for line in lines), lines
        server = FakeMetadataServer(port).start()
        server.preempt()
        thread.join(15)
        server.stop()
    finally:
        stop.set()
    assert outcome == ["drained"], lines


class _NotGoogle(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"FALSE")

    def log_message(self, *args):
        pass


def test_not_on_gce_exits_cleanly():
    lines = []
    assert drain.watch("127.0.0.1:1", host="metadata.invalid", log=lines.append) == "not-on-gce"
    assert "does not resolve" in lines[-1]
    server = HTTPServer(("127.0.0.1", 0), _NotGoogle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        outcome = drain.watch("127.0.0.1:1", host=f"127.0.0.1:{server.server_address[1]}", log=lines.append)
    finally:
        server.shutdown()
    assert outcome == "not-on-gce" and "without the Metadata-Flavor: Google header" in lines[-1]


def test_watch_command_off_gce_and_bad_margin(capsys, monkeypatch):
    monkeypatch.setenv("GCE_METADATA_HOST", "metadata.invalid")
    assert main(["preemption", "watch", "--address", "127.0.0.1:1"]) == 0
    assert "not on Compute Engine" in capsys.readouterr().err
    assert main(["preemption", "watch", "--deadline-margin-s", "40"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --deadline-margin-s must be >= 0 and below the 30s notice")


def test_fake_metadata_server_requires_the_flavor_header(metadata):
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://{metadata.host}{preemption.PREEMPTED_PATH}", timeout=5)
    assert info.value.code == 403


def test_drain_deadline_stays_inside_the_notice():
    assert preemption.drain_deadline_s(100.0) == 125.0
    assert preemption.drain_deadline_s(100.0, notice_s=6, margin_s=2) == 104.0
    assert preemption.drain_deadline_s(100.0, notice_s=3, margin_s=5) == 100.0  # never in the past


def test_lost_work_per_restart():
    from launcher.driver.tracker import lost_work
    from launcher.summary import Attempt

    attempts = [
        Attempt(start_step=0, first_time=0.0, last_step=30, last_time=10.0),   # held after its notice at 30
        Attempt(start_step=30, first_time=20.0, last_step=57, last_time=30.0),  # killed at 57
        Attempt(start_step=50, first_time=45.0, last_step=100, last_time=60.0),
    ]
    lost = lost_work(attempts, {30: 9.5, 50: 28.0})
    assert lost == [{"resumed_from_step": 30, "steps_lost": 0, "time_lost_s": 10.5},
                    {"resumed_from_step": 50, "steps_lost": 7, "time_lost_s": 17.0}]
    assert lost_work(attempts[:1], {}) == []
    # A checkpoint the controller never reported (taken before a resize, or the survivors' own) at
    # the step the group stopped: lost from when rank 0 got there, not from the attempt's start.
    assert lost_work(attempts[:2], {})[0]["time_lost_s"] == 10.0
    assert lost_work(attempts[1:], {})[0]["time_lost_s"] == 25.0  # unknown and mid-attempt: the most


def test_runs_columns():
    from launcher.storage.runs import RunRow
    from launcher.summary import RunStatus

    r = RunRow(name="r", status=RunStatus.SUCCEEDED, restarts=2, preemptions=1, steps_lost=7, time_lost_s=27.5,
               interruptions=[{"time_lost_s": 10.5}, {"time_lost_s": 17.0}])
    assert format_restarts(r) == "2 (1 preempted)"
    assert format_lost(r) == "7 steps, 28s [10s/17s]"  # round half to even: 27.5 -> 28, 10.5 -> 10
    quiet = RunRow(name="q", status=RunStatus.SUCCEEDED)
    assert (format_restarts(quiet), format_lost(quiet)) == ("0", "-")


def test_bench_goodput_and_recovery():
    from benchmarks.preemption import breakdown, goodput, period, recoveries

    straight = [{"start_step": 0, "first_time": 0.0, "last_step": 100, "last_time": 50.0}]
    assert goodput(straight) == 1.0
    # 60 steps in 30 s, 20 s lost (10 redone steps = 5 s, plus 15 s waiting), then 50 steps in 25 s
    interrupted = [{"start_step": 0, "first_time": 0.0, "last_step": 60, "last_time": 30.0},
                   {"start_step": 50, "first_time": 45.0, "last_step": 100, "last_time": 70.0}]
    assert goodput(interrupted) == pytest.approx((25.0 + 25.0) / 70.0)
    assert recoveries(interrupted, [40.0]) == [5.0]
    assert period([100.0, 160.5, 221.0]) == 60.5 and period([100.0]) is None
    # held 30 -> 33 (deadline), removed at 33.5, train function at 38, ready at 40, first step at 45
    interrupted[1]["marks"] = {"worker_start": 38.0, "worker_ready": 40.0}
    events = [{"event": "preemption notice", "time": 10.0}, {"event": "node draining", "time": 10.2, "deadline": 33.0},
              {"event": "node removed", "time": 33.5}, {"event": "node added", "time": 35.0}]
    assert breakdown(interrupted, events) == {
        "held before the deadline": 3.0, "deadline -> node removed": 0.5, "removed -> train function starts": 4.5,
        "worker set-up (data, model, restore)": 2.0, "-> first step": 5.0}


def test_controller_states_become_restart_events_with_their_cause():
    """Ray Train's own state objects through the forwarder and the event file: an elastic group
    resized under a running run counts as a restart (it resumes from the last checkpoint like one),
    and a group merely scheduled, or resized before it ran, does not."""
    from ray.train.v2.api.exceptions import ControllerError
    from ray.train.v2._internal.execution.controller import state
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision

    from launcher.driver.events import EventChannel
    from launcher.summary import Restart

    channel = EventChannel(board=False)
    try:
        forward = channel.states.after_controller_state_update
        size = {n: ResizeDecision(num_workers=n, resources_per_worker={"CPU": 1}) for n in (1, 2)}
        forward(state.InitializingState(), state.SchedulingState(size[2]))
        forward(state.SchedulingState(size[2]), state.RunningState())
        forward(state.RunningState(), state.RunningState())
        assert channel.take() == []
        forward(state.RunningState(), state.ResizingState(size[1]))  # a node gone: 2 -> 1
        forward(state.ResizingState(size[1]), state.SchedulingState(size[1]))
        forward(state.SchedulingState(size[1]), state.RunningState())
        forward(state.RunningState(), state.RestartingState(training_failed_error=ControllerError(OSError("gone"))))
        events = channel.take()
    finally:
        channel.close()
    assert [type(e) for e in events] == [Restart, Restart]
    assert [e.cause for e in events] == ["resize", "failure"]
    assert events[0].what() == "a resize (the cluster's free resources changed: 2 -> 1 workers)"
    assert events[1].what() == "a failure" and "gone" in events[1].error


def test_a_summary_reads_back_as_it_was_written_and_statuses_are_members():
    from launcher.summary import Attempt, Interruption, RunStatus, RunSummary

    summary = RunSummary(name="r", status=RunStatus.SUCCEEDED, workload="digits-mlp", framework="torch",
                         backend="native", workers=2, epochs=3, restarts=1,
                         interruptions=[Interruption(cause="preemption", steps_lost=0, time_lost_s=1.5)],
                         attempts=[Attempt(start_step=0, first_time=1.0, last_step=9, last_time=2.0)])
    assert RunSummary.from_json(json.loads(json.dumps(summary.to_json()))) == summary
    newer = {**summary.to_json(), "status": "some-future-state", "a_key_from_a_newer_launcher": 1}
    assert RunSummary.from_json(newer).status == RunStatus.UNKNOWN
    assert RunStatus.parse("unreadable") is RunStatus.UNREADABLE and RunStatus.parse(None) is RunStatus.UNKNOWN
    with pytest.raises(ValueError):
        RunSummary.from_json(["not", "a", "summary"])


def test_bench_preemption_refuses_an_elastic_strategy_for_a_program(capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    code = main(["bench", "preemption", "--script", str(script), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "only 'wait' applies" in err and "--strategies wait" in err, err
    assert not (tmp_path / "out").exists()


def test_demo_takes_what_run_takes(tmp_path):
    """`preemption demo` builds its run from `launcher run`'s flags (its own defaults where none is
    given) and runs a --package as well as a workload."""
    from launcher.cli.main import build_parser
    from launcher.cli.preemption import demo_spec

    parser = build_parser()
    args = parser.parse_args(["preemption", "demo", "--storage", str(tmp_path), "--lr", "0.05"])
    spec, program = demo_spec(args)
    assert program is None and (spec.epochs, spec.checkpoint_every_steps, spec.lr) == (16, 10, 0.05)
    assert spec.name.startswith("preemption_demo_") and spec.max_failures == 0
    package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "trainer_package")
    args = parser.parse_args(["preemption", "demo", "--storage", str(tmp_path), "--package", package,
                              "--module", "trainer.task", "--workers", "3", "--without-notice", "--", "--epochs", "2"])
    spec, program = demo_spec(args)
    assert program is not None and program.kind == "module" and args.program_args == ["--epochs", "2"]
    assert spec.workers == 3 and spec.max_failures == 1


def test_node_keys_tell_a_fake_clusters_nodes_apart():
    from launcher.worker.salvage import node_key

    fake = [f"{'f' * 50}{i:06d}" for i in range(1, 5)]  # the lab's nodes: f...f000001, f...f000002, ...
    keys = [node_key(n) for n in fake]
    assert len(set(keys)) == 4 and all(0 <= k < 2 ** 53 for k in keys)  # a float64 carries each exactly
    assert node_key(fake[0]) == node_key(fake[0])


def test_an_elastic_group_is_never_sized_on_a_draining_node():
    from launcher.backends.elastic import usable

    reserved = {"a": {"CPU": 1.0}, "b": {"CPU": 1.0}, "c": {"CPU": 1.0}}
    assert usable(reserved, {"b": 1795629000000}) == {"a": {"CPU": 1.0}, "c": {"CPU": 1.0}}
    assert usable(reserved, {}) == reserved
    # The replacement is up already (an early request): it stands in for the draining node, once.
    nodes = [{"NodeID": "head", "Alive": True, "Resources": {"CPU": 0.0, "memory": 1e9}}]
    nodes += [{"NodeID": n, "Alive": alive, "Resources": {"CPU": 1.0}}
              for n, alive in (("a", True), ("b", True), ("c", True), ("gone", False), ("new", True), ("new2", True))]
    assert usable(reserved, {"b": 1795629000000}, nodes) == {"a": {"CPU": 1.0}, "c": {"CPU": 1.0},
                                                               "new": {"CPU": 1.0}}


def test_the_board_hands_a_grow_request_to_rank_0_and_its_answer_back():
    """The handshake between ElasticNow (the controller) and rank 0, on the board's own class."""
    from launcher.driver.events import ProgressBoard

    board = ProgressBoard.__ray_metadata__.modified_class()
    assert board.ask_checkpoint(4) is False  # nobody trains: no one would answer
    board.step("a1", 0, 12, time.time())
    assert board.checkpoint_wanted() == 0 and board.ask_checkpoint(4) is True
    assert board.checkpoint_wanted() == 4 and board.checkpoint_held() is None
    board.checkpoint_taken(30)
    assert board.checkpoint_wanted() == 0  # held: rank 0 is not asked again
    assert board.checkpoint_held() == 30 and board.checkpoint_held() is None  # answered once
    board.ask_checkpoint(4)
    assert board.checkpoint_held(give_up=True) is None and board.checkpoint_wanted() == 0  # withdrawn
