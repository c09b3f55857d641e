"""The model server's parts that need no Ray: input checks, metrics text, options, the
per-server state entries (the server itself is tested in test_predict.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launcher.errors import UserError
from launcher.predict import endpoint, serve, servers
from launcher.predict.formats.instances import _not_a_number


def test_the_element_that_is_not_a_number_is_named():
    assert _not_a_number([[1, 2.5], [3, -4]]) is None
    assert _not_a_number([None]) == "instances[0] is null, not a number"
    assert _not_a_number([[1, 2], [3, {"a": 1}]]) == "instances[1][1] is an object, not a number"
    assert _not_a_number([[[0, True]]]) == "instances[0][0][1] is true/false, not a number"
    assert _not_a_number([["text"]]) is None  # left to the workload's check, which says "text"


def test_histogram_text_is_cumulative_prometheus():
    h = endpoint.Histogram((1, 4, 16))
    for v in (1, 2, 3, 20, 5):
        h.observe(v)
    lines = h.lines("x", 'replica="r"')
    assert lines[:4] == ['x_bucket{replica="r",le="1"} 1', 'x_bucket{replica="r",le="4"} 3',
                         'x_bucket{replica="r",le="16"} 4', 'x_bucket{replica="r",le="+Inf"} 5']
    assert lines[4:] == ['x_sum{replica="r"} 31', 'x_count{replica="r"} 5'] and h.max == 20


def test_options_are_checked_and_size_the_replica_for_its_batches():
    assert serve.ServeOptions(max_batch=64).max_ongoing == 1000
    assert serve.ServeOptions(max_batch=64, max_queued=16).max_ongoing == 128
    for bad, message in ((dict(max_batch=0), "--max-batch 0"), (dict(replicas=0), "--replicas 0"),
                         (dict(max_queued=0), "--max-queued 0"), (dict(batch_wait_ms=-1), "--batch-wait-ms -1"),
                         (dict(port=70000), "--port 70000")):
        with pytest.raises(UserError, match=message.replace("-", r"\-")):
            serve.ServeOptions(**bad).check()


def test_entries_of_stopped_servers_are_cleaned_up_and_the_live_ones_listed(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_STATE_DIR", str(tmp_path))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        for port, pid, run in ((18001, sleeper.pid, "alive"), (18002, gone.pid, "dead")):
            servers._write_entry({"pid": pid, "port": port, "url": f"http://127.0.0.1:{port}", "model": f"/r/{run}/model",
                                "run": run, "since": 0})
        live, dead = servers.servers()
        assert [e["run"] for e in live] == ["alive"] and [e["run"] for e in dead] == ["dead"]
        assert sorted(os.listdir(servers.servers_dir())) == ["18001.json"]
        with pytest.raises(UserError, match="no model server on port 18003 is running on this machine "
                                            r"\(running: port 18001\)"):
            servers.stop(port=18003)
        assert "stopped the model server at http://127.0.0.1:18001" in servers.stop(run="alive")
        assert sleeper.wait(timeout=10) == -15 and servers.listing() == "no model server is running on this machine"
    finally:
        sleeper.kill()


def test_a_port_held_by_a_listener_is_refused_in_one_line():
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(UserError, match=f"cannot listen on 127.0.0.1:{port}"):
            servers._check_port("127.0.0.1", port)
    servers._check_port("127.0.0.1", port)  # free again at once


def test_state_entries_are_json_written_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_STATE_DIR", str(tmp_path))
    servers._write_entry({"pid": 1, "port": 9, "url": "u", "model": "m"})
    assert json.load(open(os.path.join(servers.servers_dir(), "9.json")))["model"] == "m"
    assert not [n for n in os.listdir(servers.servers_dir()) if n.endswith(".tmp")]


def test_bench_serve_requests_parse_as_the_server_reads_them():
    """bench serve's two request kinds: the server's own parsers get the instances back."""
    import numpy as np

    from benchmarks import serve_load
    from launcher.predict import protocols

    rows = [[0.5, 1.25, -2.0]] * 4
    for protocol in ("vertex", "v2"):
        raw = serve_load.request_bytes(rows, "/p", protocol)
        head, _, body = raw.partition(b"\r\n\r\n")
        headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
        assert int(headers["Content-Length"]) == len(body)
        if protocol == "v2":
            _, tensors = protocols.parse(body, headers["Inference-Header-Content-Length"])
            assert np.array_equal(tensors["x"], np.asarray(rows, np.float32))
        else:
            assert json.loads(body) == {"instances": rows}
    v2 = json.dumps({"outputs": [{"name": "prediction", "shape": [4], "datatype": "INT64", "data": [1, 2, 3, 4]}]})
    assert serve_load.answered(v2.replace(" ", "").encode(), 4, "v2")
    assert not serve_load.answered(v2.replace(" ", "").encode(), 3, "v2")
    assert serve_load.answered(b'{"predictions":[{"prediction":1},{"prediction":2}]}', 2)


def test_direct_ingress_only_where_one_replica_serves_on_a_ray_this_command_starts():
    one, three = serve.ServeOptions(port=8123), serve.ServeOptions(port=8123, replicas=3)
    alone = dict(joined=False, warm_head=False, ray_running=False, env={})
    assert serve.ingress(one, **alone)[0] == serve.DIRECT
    for options, changes, why in ((three, {}, "3 replicas share port 8123"),
                                  (one, dict(joined=True), "a cluster's nodes"),
                                  (one, dict(warm_head=True), "the warm head's Ray"),
                                  (one, dict(ray_running=True), "Ray was already started"),
                                  (one, dict(env={"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}),
                                   "RAY_SERVE_THROUGHPUT_OPTIMIZED=0 is set"),
                                  (one, dict(port_closing=True), "port 8123 still holds the closing connections")):
        path, said = serve.ingress(options, **{**alone, **changes})
        assert path == serve.PROXY and why in said, (changes, said)
    # Ray Serve hands a direct-ingress replica a port from [MIN, MAX): exactly the server's
    env = serve.direct_environ(8123)
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == \
        ("8123", "8124")
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"


def test_the_environment_is_set_for_ray_over_the_users_and_given_back(monkeypatch):
    from launcher.driver import session

    monkeypatch.setenv("LAUNCHER_TEST_A", "user")
    monkeypatch.delenv("LAUNCHER_TEST_B", raising=False)
    with session.environ({"LAUNCHER_TEST_A": "ours", "LAUNCHER_TEST_B": "ours"}, override=True):
        assert (os.environ["LAUNCHER_TEST_A"], os.environ["LAUNCHER_TEST_B"]) == ("ours", "ours")
    assert os.environ["LAUNCHER_TEST_A"] == "user" and "LAUNCHER_TEST_B" not in os.environ
    with session.environ({"LAUNCHER_TEST_A": "ours", "LAUNCHER_TEST_B": "ours"}):
        assert (os.environ["LAUNCHER_TEST_A"], os.environ["LAUNCHER_TEST_B"]) == ("user", "ours")
    assert "LAUNCHER_TEST_B" not in os.environ


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds the listener through /proc (Linux)")
@pytest.mark.parametrize("marked", ["never", "before the connection", "while it is open"])
def test_a_stopped_servers_closing_connections_leave_its_port_to_the_next_one_once_marked(marked):
    """A listener bound as Ray's direct-ingress replica binds it (no SO_REUSEADDR) leaves, after
    the server closes a connection first, a TIME_WAIT entry that keeps every listener off the
    port. Once the replica marks its sockets reusable, one with SO_REUSEADDR (the proxy's) can
    listen there at once, and ``launcher serve`` goes that way. The mark reaches a connection
    accepted before it (the replica marks at its first request, on that request's connection),
    not only those accepted after."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    if marked == "before the connection":
        assert endpoint.reusable_listener(port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    if marked == "while it is open":
        assert endpoint.reusable_listener(port)  # as the replica does on its first request
    conn.close()  # the server side closes first: its end goes to TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    assert serve._closing("127.0.0.1", port)  # no listener without SO_REUSEADDR gets it
    if marked != "never":
        servers._check_port("127.0.0.1", port)  # ... one with it does
        assert serve.ingress(serve.ServeOptions(port=port), joined=False, warm_head=False, ray_running=False,
                             env={}, port_closing=True)[0] == serve.PROXY
    else:
        with pytest.raises(UserError, match=f"cannot listen on 127.0.0.1:{port}"):
            servers._check_port("127.0.0.1", port)


def test_bench_serve_rounds_are_medians_per_server_size_and_level():
    """Three rounds of two servers: each row is the median of its three, errors summed, in the
    servers' order whatever order they ran in; the ratio is to bare Ray Serve's median."""
    from benchmarks.serve_load import format_rows, medians, with_ratios

    def row(server, rnd, rate, p99, errors=0):
        return {"server": server, "instances_per_request": 1, "concurrency": 8, "round": rnd, "requests": 100,
                "requests_per_s": rate, "instances_per_s": rate, "p50_ms": p99 / 2, "p95_ms": p99, "p99_ms": p99,
                "of_limit": 0.5, "errors": errors, "error_kinds": {"503": errors} if errors else {}}

    raw = [row("launcher", 1, 100.0, 30.0), row("ray-serve", 1, 80.0, 40.0),
           row("ray-serve", 2, 90.0, 20.0, errors=1), row("launcher", 2, 300.0, 10.0),
           row("launcher", 3, 120.0, 50.0), row("ray-serve", 3, 60.0, 60.0)]
    rows = with_ratios(medians(raw, ("launcher", "ray-serve")))
    assert [r["server"] for r in rows] == ["launcher", "ray-serve"]
    launcher, bare = rows
    assert launcher["instances_per_s"] == 120.0 and launcher["p99_ms"] == 30.0  # medians, not means or the last
    assert launcher["instances_per_s_rounds"] == [100.0, 300.0, 120.0] and launcher["rounds"] == 3
    assert bare["errors"] == 1 and bare["error_kinds"] == {"503": 1} and bare["requests"] == 300
    assert launcher["of_ray_serve"] == 1.5 and "round" not in launcher
    assert "the median of 3 rounds" in format_rows(rows, [])
