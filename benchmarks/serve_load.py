"""Model-server load: ``launcher serve`` beside the servers a user could write instead.

``launcher bench serve --run NAME`` starts, one after another in one sitting, on the
same model and a free loopback port, each server of ``--servers``
(:mod:`benchmarks.serve_servers`): ``launcher`` (``launcher serve``, as a user runs it),
``ray-serve`` (a bare Ray Serve deployment as Ray's docs write one, through its proxy),
``ray-serve-direct`` (the same with Ray Serve's throughput-optimised direct ingress) and
``starlette`` (one uvicorn process calling the model, no Ray). For each number of
instances per request (1 and 64) and each concurrency level (1, 8, 32, 128) it keeps
that many HTTP/1.1 keep-alive connections busy for a few seconds, each sending its next
request as soon as the last is answered. Per server and level: requests/s, instances/s,
latency p50/p95/p99, the errors (any answer but a 200 holding one prediction per
instance) and the ratio to the best bare Ray Serve server at that level.

The limit all are compared with: the same model's forward pass called directly in
this process on the batches a server can form at that level (instances per request
times ``min(concurrency, max_batch)`` rows), with no HTTP, JSON or Ray in between.

Then the restart check of ``launcher serve``: stop it with ``launcher serve --stop``
while clients are connected, start it again on the same port, and time how long the
port stays refused (0 when the new server binds at once) and how long until the new
server answers.

The clients are one asyncio loop in this process on the same machine as the
server: on 2 cores they take part of the CPU the server would have.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import launcher
from benchmarks import results
from launcher.predict import serve as launcher_serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVELS = (1, 8, 32, 128)
SIZES = (1, 64)
BARE = ("ray-serve", "ray-serve-direct")  # what the ratio is to: the best of them at each level


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_bytes(instances: list[list[float]], path: str = "/predict", protocol: str = "vertex") -> bytes:
    """One HTTP request: Vertex AI's JSON body, or the V2 protocol's JSON header followed by
    the instances as raw float32 (its binary tensor extension)."""
    extra = ""
    if protocol == "v2":
        import numpy as np

        rows = np.asarray(instances, dtype="<f4")
        head = json.dumps({"inputs": [{"name": "x", "shape": list(rows.shape), "datatype": "FP32",
                                       "parameters": {"binary_data_size": rows.nbytes}}]}).encode()
        body = head + rows.tobytes()
        extra = f"Inference-Header-Content-Length: {len(head)}\r\n"
    else:
        body = json.dumps({"instances": instances}).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body


def answered(body: bytes, expected: int, protocol: str = "vertex") -> bool:
    """Whether a 200's body holds one prediction per instance."""
    if protocol == "v2":
        return body.count(b'"name":"prediction","shape":[' + str(expected).encode() + b"]") == 1
    if b'"prediction"' in body:  # a classifier's answers: counted without parsing them
        return body.count(b'"prediction"') == expected
    try:
        return len(json.loads(body)["predictions"]) == expected
    except (ValueError, KeyError, TypeError):
        return False


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection")
    status = int(status_line.split()[1])
    length, chunked = None, False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value.strip())
        elif name == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    if chunked:
        parts = []
        while True:
            size = int((await reader.readline()).strip().split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            parts.append(await reader.readexactly(size))
            await reader.readline()
        return status, b"".join(parts)
    return status, await reader.readexactly(length or 0)


async def _client(port: int, request: bytes, expected: int, until: float, warm_until: float,
                  latencies: list[float], errors: dict[str, int], protocol: str = "vertex") -> None:
    reader = writer = None
    while time.perf_counter() < until:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = time.perf_counter()
            writer.write(request)
            status, body = await _read_response(reader)
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            if writer is not None:
                writer.close()
            reader = writer = None
            await asyncio.sleep(0.05)
            continue
        done = time.perf_counter()
        if started < warm_until:
            continue
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + 1
        elif not answered(body, expected, protocol):
            errors["wrong count"] = errors.get("wrong count", 0) + 1
        else:
            latencies.append(done - started)
    if writer is not None:
        writer.close()


def drive(port: int, request: bytes, expected: int, concurrency: int, seconds: float,
          warmup_s: float = 1.0, protocol: str = "vertex") -> dict[str, Any]:
    """Keep ``concurrency`` keep-alive connections busy for ``warmup_s + seconds``; the
    figures count the requests sent after the warm-up."""
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def main() -> None:
        now = time.perf_counter()
        await asyncio.gather(*(_client(port, request, expected, now + warmup_s + seconds, now + warmup_s,
                                       latencies, errors, protocol) for _ in range(concurrency)))

    asyncio.run(main())
    ordered = sorted(latencies)

    def pct(p: float) -> float | None:
        return round(1000 * ordered[min(len(ordered) - 1, int(p * len(ordered)))], 2) if ordered else None

    return {"requests": len(ordered), "requests_per_s": round(len(ordered) / seconds, 1),
            "instances_per_s": round(len(ordered) * expected / seconds, 1),
            "p50_ms": pct(0.50), "p95_ms": pct(0.95), "p99_ms": pct(0.99),
            "errors": sum(errors.values()), "error_kinds": errors}


def forward_limit(model_dir: str, rows: int, instance, seconds: float = 1.0) -> float:
    """Instances/s of the model's forward pass called directly on batches of ``rows``."""
    import numpy as np

    from launcher.predict import Model, locate

    model = _MODELS.get(model_dir)
    if model is None:
        model = _MODELS[model_dir] = Model(locate(model_dir))
    x = model.inputs(np.asarray([instance] * rows))
    model.run(x)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        model.run(x)
        done += rows
    return done / (time.perf_counter() - started)


_MODELS: dict[str, Any] = {}


class Server:
    """A server of ``kind`` (one of :data:`SERVERS`) in its own process on ``port``."""

    def __init__(self, model_dir: str, port: int, flags: list[str], env: dict[str, str],
                 kind: str = "launcher", max_batch: int = 64, batch_wait_ms: float = 5.0) -> None:
        self.port, self.env, self.kind = port, env, kind
        self.log = open(os.path.join(env["LAUNCHER_STATE_DIR"], f"{kind}-{port}.log"), "a")  # noqa: SIM115
        if kind == "launcher":
            argv = ["-m", "launcher", "serve", "--model", model_dir, "--port", str(port), *flags]
        else:
            argv = ["-m", "benchmarks.serve_servers", kind, model_dir, str(port), str(max_batch), str(batch_wait_ms)]
            if kind == "ray-serve-direct":  # read by Ray as it starts, in the server's process
                env = {**env, **launcher_serve.direct_environ(port)}
        self.proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=ROOT)

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Until its "serving" line, then until the port takes connections."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if "serving" in line:
                    while time.time() < deadline and self.proc.poll() is None:
                        try:
                            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                            return
                        except OSError:
                            time.sleep(0.1)
                if not line and self.proc.poll() is not None:
                    break
        raise RuntimeError(f"{self.kind} did not start (exit {self.proc.poll()}); see {self.log.name}")

    def stop(self) -> float:
        """``launcher serve --stop --port`` (the others: SIGTERM); returns how long it took."""
        started = time.perf_counter()
        if self.kind == "launcher":
            subprocess.run([sys.executable, "-m", "launcher", "serve", "--stop", "--port", str(self.port)],
                           env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=180, check=True)
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()
        return time.perf_counter() - started


def port_refused_s(port: int, timeout_s: float = 120) -> float:
    """How long binding ``port`` fails (as `launcher serve`'s own check binds it)."""
    started = time.perf_counter()
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return time.perf_counter() - started
            except OSError:
                if time.perf_counter() - started > timeout_s:
                    return float("inf")
        time.sleep(0.05)


def run(model_dir: str, levels: list[int], sizes: list[int], seconds: float, restarts: int, flags: list[str],
        max_batch: int, note: Callable[[str], None], state_dir: str, protocol: str = "vertex",
        servers: tuple[str, ...] = ("launcher",), batch_wait_ms: float = 5.0,
        rounds: int = 1) -> tuple[list[dict], list[dict]]:
    """(one row per server, size and level, one row per restart of ``launcher serve``);
    ``protocol``: vertex (JSON) or v2 (binary tensors, ``launcher`` only). With ``rounds`` > 1
    the servers take turns, in the opposite order each round (so neither always runs first on
    a machine that warms up or slows down), and each row holds the medians over the rounds
    (:func:`medians`); ``launcher serve``'s restarts are measured in the first round only."""
    import numpy as np

    from launcher.predict import locate

    ref = locate(model_dir)
    instance = np.random.default_rng(0).uniform(0, 1, instance_shape(ref)).round(4).tolist()
    env = {**os.environ, "LAUNCHER_STATE_DIR": state_dir, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    rows, restart_rows, limits = [], [], {}
    turns = [(r, kind) for r in range(rounds) for kind in (servers if r % 2 == 0 else servers[::-1])]
    for r, kind in turns:
        port = free_port()
        if rounds > 1:
            note(f"round {r + 1}/{rounds}")
        path = f"/v2/models/{ref.run or 'model'}/infer" if protocol == "v2" and kind == "launcher" else "/predict"
        note(f"starting {kind} on 127.0.0.1:{port} ...")
        server = Server(model_dir, port, flags, env, kind, max_batch, batch_wait_ms)
        try:
            server.wait_ready()
            for size in sizes:
                request = request_bytes([instance] * size, path, protocol if kind == "launcher" else "vertex")
                for level in levels:
                    note(f"{kind}: {size} instance(s)/request, {level} concurrent client(s), {seconds:g}s ...")
                    out = drive(port, request, size, level, seconds,
                                protocol=protocol if kind == "launcher" else "vertex")
                    key = (size, min(level, max_batch))
                    if key not in limits:
                        limits[key] = forward_limit(model_dir, size * key[1], instance)
                    rows.append({"server": kind, "instances_per_request": size, "concurrency": level, "round": r + 1,
                                 **out,
                                 "limit_instances_per_s": round(limits[key], 1),
                                 "of_limit": round(out["instances_per_s"] / limits[key], 3) if limits[key] else None})
            if kind == "launcher" and r == 0:
                server, restart_rows = _restarts(server, model_dir, port, flags, env, instance, restarts, note)
        finally:
            if server.proc.poll() is None:
                try:
                    server.stop()
                except Exception:  # noqa: BLE001 - the figures are kept; kill what is left
                    server.proc.kill()
    return with_ratios(medians(rows, servers)), restart_rows


MEDIAN_FIELDS = ("requests_per_s", "instances_per_s", "p50_ms", "p95_ms", "p99_ms", "of_limit")


def medians(rows: list[dict], servers: tuple[str, ...]) -> list[dict]:
    """One row per server, size and level (in ``servers``' order): the median of each rate and
    latency over the rounds, errors and requests summed, each round's instances/s kept in
    ``instances_per_s_rounds``."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["server"], r["instances_per_request"], r["concurrency"]), []).append(r)
    out = []
    for key in sorted(groups, key=lambda k: (servers.index(k[0]), k[1], k[2])):
        taken = groups[key]
        row = {k: v for k, v in taken[0].items() if k != "round"}
        for field in MEDIAN_FIELDS:
            values = [t[field] for t in taken if t.get(field) is not None]
            row[field] = round(statistics.median(values), 3) if values else None
        row.update(requests=sum(t["requests"] for t in taken), errors=sum(t["errors"] for t in taken),
                   rounds=len(taken), instances_per_s_rounds=[t["instances_per_s"] for t in taken])
        row["error_kinds"] = dict(sum((collections.Counter(t.get("error_kinds", {})) for t in taken),
                                      collections.Counter()))
        out.append(row)
    return out


def _restarts(server: Server, model_dir: str, port: int, flags: list[str], env: dict[str, str], instance,
              restarts: int, note: Callable[[str], None]) -> tuple[Server, list[dict]]:
    """Stop ``launcher serve`` under load and start it again, ``restarts`` times: (the server
    now running, a row per restart)."""
    out = []
    for i in range(restarts):
        note(f"restart {i + 1}/{restarts}: stopping under load (32 keep-alive clients), starting again ...")
        load = threading.Thread(target=drive, args=(port, request_bytes([instance]), 1, 32, 6.0, 0.0), daemon=True)
        load.start()
        time.sleep(3.0)
        stop_s = server.stop()
        refused = port_refused_s(port)
        started = time.perf_counter()
        server = Server(model_dir, port, flags, env)
        server.wait_ready()
        out.append({"restart": i + 1, "stop_s": round(stop_s, 2), "port_refused_s": round(refused, 3),
                    "new_server_ready_s": round(time.perf_counter() - started, 2)})
        load.join()
    return server, out


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with ``of_ray_serve``: its instances/s over the best bare Ray Serve server's at
    the same size and level (None without one)."""
    best: dict[tuple[int, int], float] = {}
    for r in rows:
        if r["server"] in BARE:
            key = (r["instances_per_request"], r["concurrency"])
            best[key] = max(best.get(key, 0.0), r["instances_per_s"])
    for r in rows:
        anchor = best.get((r["instances_per_request"], r["concurrency"]))
        r["of_ray_serve"] = round(r["instances_per_s"] / anchor, 3) if anchor else None
    return rows


def instance_shape(ref) -> list[int]:
    """The shape of one instance of ``ref``'s model: a workload's input shape, or a tabular
    model's row of features."""
    from launcher.predict import Model

    shape = ref.info.get("input_shape")
    if shape is None:
        model = _MODELS.get(ref.uri) or Model(ref)
        about = model.about()
        shape = [about["features"]] if about.get("features") else None
    if not shape:
        raise launcher.UserError(f"{ref.uri}: bench serve sends instances of numbers and cannot tell this {ref.format} "
                        "model's shape", "bench a workload's run, or a scikit-learn or XGBoost model")
    return [int(d) for d in shape]


def format_rows(rows: list[dict], restarts: list[dict]) -> str:
    lines = [f"{'server':<16} {'inst/req':>8} {'clients':>7} {'req/s':>8} {'inst/s':>9} {'p50 ms':>7} "
             f"{'p99 ms':>7} {'errors':>6} {'of Ray Serve':>12} {'of limit':>8}"]
    for r in rows:
        ratio = f"{r['of_ray_serve']:>12.2f}" if r.get("of_ray_serve") is not None else f"{'-':>12}"
        lines.append(f"{r['server']:<16} {r['instances_per_request']:>8} {r['concurrency']:>7} "
                     f"{r['requests_per_s']:>8.1f} {r['instances_per_s']:>9.1f} {_ms(r['p50_ms'])} "
                     f"{_ms(r['p99_ms'])} {r['errors']:>6} {ratio} {r['of_limit'] or 0:>8.2f}")
    if rows and rows[0].get("rounds", 1) > 1:
        lines.append(f"(each figure: the median of {rows[0]['rounds']} rounds, the servers taking turns)")
    for r in restarts:
        lines.append(f"restart {r['restart']}: stop took {r['stop_s']:.2f}s, port refused for "
                     f"{r['port_refused_s']:.3f}s, new server answering after {r['new_server_ready_s']:.1f}s")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return f"{value:>7.1f}" if value is not None else f"{'-':>7}"


def write_results(rows: list[dict], restarts: list[dict], info: dict, settings: dict, out_dir: str) -> list[str]:
    """serve.json, serve.csv and serve.png (instances/s and p99 latency against concurrency,
    one line per server and size of request)."""
    sizes = list(dict.fromkeys(r["instances_per_request"] for r in rows))
    import numpy as np

    fig, axes = results.new_figure(nrows=2, ncols=max(1, len(sizes)), figsize=(5.5 * max(1, len(sizes)), 7))
    axes = np.asarray(axes).reshape(2, -1)
    for col, size in enumerate(sizes):
        top, bottom = axes[0, col], axes[1, col]
        for kind in dict.fromkeys(r["server"] for r in rows):
            level = [r for r in rows if r["instances_per_request"] == size and r["server"] == kind]
            xs = [r["concurrency"] for r in level]
            top.plot(xs, [r["instances_per_s"] for r in level], marker="o", label=kind)
            bottom.plot(xs, [r["p99_ms"] or 0 for r in level], marker="o", label=kind)
        limit = [r for r in rows if r["instances_per_request"] == size and r["server"] == rows[0]["server"]]
        top.plot([r["concurrency"] for r in limit], [r["limit_instances_per_s"] for r in limit], linestyle="--",
                 color="grey", label="the forward pass alone")
        top.set_title(f"{size} instance(s) per request")
        top.set_ylabel("instances/s")
        top.set_yscale("log")
        bottom.set_ylabel("p99 latency (ms)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent keep-alive clients")
            ax.legend(fontsize=8)
    return results.write(out_dir, "serve", rows, {"restarts": restarts, "machine": info, "settings": settings},
                         fig)
