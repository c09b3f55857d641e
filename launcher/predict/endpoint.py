"""What a ``launcher serve`` replica answers, in AI Platform's format and the V2 protocol.

Endpoints:

- ``POST /predict`` (also ``POST /`` and Vertex AI's ``/v1/models/NAME:predict``)
  with ``{"instances": [...]}`` answers ``{"predictions": [{"prediction": class,
  "scores": [...]}, ...]}``;
- ``GET /healthz`` answers ``{"status": "ok", ...}`` with the model and the limits;
- ``GET /metrics`` answers Prometheus text: requests by status code, latency and
  batch-size histograms (of the replica that answers the scrape);
- any other path is a 404, a known path with the wrong method a 405, a body over
  the limit a 413 (kept no further than the limit), bad input a 400 whose ``error``
  says what was expected, never a 500.

Concurrent requests share forward passes (Ray Serve's ``@serve.batch``, up to
``max_batch`` requests per pass, see :mod:`launcher.predict.serve`). Each answered
request is one line of the access log.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

import orjson

from launcher.errors import UserError
from launcher.predict import protocols
from launcher.predict.formats.base import Batch, column, join, rows, split
from launcher.predict.model import Model, ModelRef

MAX_INSTANCES = 1024
BODY_MB = 1.5  # Vertex AI's limit on a prediction request
VERTEX_PATH = re.compile(r"^/v1/models/[^/]+:predict$")
PREDICT_PATHS = ("/", "/predict")
# Vertex AI's contract for a serving container: where it listens, its routes, where the model is.
AIP_PORT, AIP_PREDICT, AIP_HEALTH, AIP_STORAGE = ("AIP_HTTP_PORT", "AIP_PREDICT_ROUTE", "AIP_HEALTH_ROUTE",
                                                  "AIP_STORAGE_URI")
AIP_DEPLOYED = "AIP_DEPLOYED_MODEL_ID"
DRAIN = 16  # a body over the limit is read (and dropped) up to this many times the limit
# Sent by `launcher serve`'s own readiness check, which the counters and access log leave out.
PROBE_HEADER = "X-Launcher-Readiness"


@dataclass(frozen=True)
class Routes:
    """What a replica answers where, whom it answers (a token's SHA-256, never the token) and
    how big a body it reads."""

    predict: str = "/predict"
    health: str = "/healthz"
    token_sha256: str | None = None
    max_body: int = int(BODY_MB * (1 << 20))
    deployed_model_id: str = "model"
    name: str = "model"  # the model's name in the V2 protocol's paths

    def kind(self, path: str) -> str | None:
        """"predict", "health", "metrics" or None (no such path)."""
        if path in PREDICT_PATHS or path == self.predict or VERTEX_PATH.match(path):
            return "predict"
        if path in ("/healthz", self.health):
            return "health"
        return "metrics" if path == "/metrics" else None

    def authorised(self, header: str | None) -> bool:
        if self.token_sha256 is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return False
        return hmac.compare_digest(hashlib.sha256(given.strip().encode()).hexdigest(), self.token_sha256)


def read_token(path: str) -> str:
    """The SHA-256 of the bearer token in ``path`` (its first line); UserError when there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--token-file {path}: cannot read it ({type(exc).__name__})",
                        "write the token on the file's first line, e.g. openssl rand -hex 32 > token") from None
    if len(token) < 16 or any(c.isspace() for c in token):
        raise UserError(f"--token-file {path}: its first line must be a token of 16 or more characters "
                        "without spaces", "for example: openssl rand -hex 32 > token")
    return hashlib.sha256(token.encode()).hexdigest()


def _route(flag: str, value: str) -> str:
    if not value.startswith("/") or any(c.isspace() for c in value):
        raise UserError(f"{flag} {value!r}: a route is a path starting with /", "for example /predict")
    return value.rstrip("/") or "/"


def routes(env: dict[str, str], *, token_file: str | None = None, max_body_mb: float = BODY_MB,
           name: str = "") -> Routes:
    """The routes Vertex AI's variables in ``env`` name (else /predict and /healthz)."""
    if not 0 < max_body_mb <= 1024:
        raise UserError(f"--max-body-mb {max_body_mb:g}: must be more than 0 and at most 1024",
                        f"Vertex AI takes {BODY_MB:g} MB per request")
    return Routes(predict=_route(AIP_PREDICT, env[AIP_PREDICT]) if env.get(AIP_PREDICT) else "/predict",
                  health=_route(AIP_HEALTH, env[AIP_HEALTH]) if env.get(AIP_HEALTH) else "/healthz",
                  token_sha256=read_token(token_file) if token_file else None,
                  max_body=int(max_body_mb * (1 << 20)), deployed_model_id=env.get(AIP_DEPLOYED) or name or "model",
                  name=name or "model")


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, the sum and the count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.max = 0.0

    def observe(self, value: float) -> None:
        i = 0
        while i < len(self.bounds) and value > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.total += value
        self.max = max(self.max, value)

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            running += count
            le = "+Inf" if bound == math.inf else f"{bound:g}"
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
        return out + [f"{name}_sum{{{labels}}} {self.total:.6g}", f"{name}_count{{{labels}}} {running}"]


class Endpoint:
    """The deployment's class (made a Ray Serve deployment by :func:`deployment`)."""

    def __init__(self, ref: ModelRef, routes: Routes = None, max_instances: int = MAX_INSTANCES,
                 access_log: str | None = None) -> None:
        self.model = Model(ref)
        self.routes = routes or Routes()
        self.max_instances = max_instances
        self.max_body = self.routes.max_body
        self.about = {**self.model.about(), "max_instances": max_instances, "max_body_bytes": self.max_body}
        shape = self.about.get("input_shape")
        self.hint = f" (this model takes {'x'.join(map(str, shape))} numbers per instance)" if shape else ""
        self.replica = _replica_id()
        self.codes: dict[int, int] = {}
        self.latency = Histogram((0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.batch_requests = Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.batch_instances = Histogram((1, 8, 64, 256, 1024, 4096, 16384))
        self._log = open(access_log, "a", encoding="utf-8", buffering=1) if access_log else None  # noqa: SIM115
        self._listener_reusable = False

    async def __call__(self, request) -> Any:
        started = time.perf_counter()
        if not self._listener_reusable:
            self._listener_reusable = True
            server = request.scope.get("server")
            if server:
                reusable_listener(server[1])
        response, instances = await self.answer(request)
        seconds = time.perf_counter() - started
        if request.headers.get(PROBE_HEADER):
            return response  # `launcher serve` asking whether it is up: not a client's request
        self.codes[response.status_code] = self.codes.get(response.status_code, 0) + 1
        self.latency.observe(seconds)
        if self._log is not None:
            client = request.client.host if request.client else "-"
            self._log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {client} {request.method} {request.url.path} "
                            f"{response.status_code} {instances} {1000 * seconds:.1f}ms\n")
        return response

    async def answer(self, request) -> tuple[Any, int]:
        """(the response, how many instances it predicted)."""
        from starlette.responses import PlainTextResponse

        path = request.url.path.rstrip("/") or "/"
        kind = self.routes.kind(path)
        v2 = None if kind else protocols.route(path)
        if kind is None and v2 is None:
            return _error(f"no such path: {path} (POST {{\"instances\": [...]}} to {self.routes.predict}, or the "
                          f"V2 protocol's /v2/models/{self.routes.name}/infer; GET {self.routes.health}, /metrics)",
                          404), 0
        what = v2[0] if v2 else kind
        method = "POST" if what in ("predict", "infer") else "GET"
        if request.method != method:
            return _error(f"{request.method} {path}: use {method}", 405, {"Allow": method}), 0
        if v2 and v2[1] is not None and v2[1] != self.routes.name:
            return _error(f"no model {v2[1]} here: this server serves {self.routes.name}", 404), 0
        authorised = self.routes.authorised(request.headers.get("authorization"))
        if what == "health":
            return _json({"status": "ok", **(self.about if authorised else {})}), 0
        if what in ("live", "ready", "model_ready"):  # V2's probes, open like the health route
            return _json({"live": True} if what == "live" else {"ready": True}), 0
        if not authorised:
            return _error("a bearer token is needed: send Authorization: Bearer TOKEN (the server's --token-file)",
                          401, {"WWW-Authenticate": "Bearer"}), 0
        if what == "metrics":
            return PlainTextResponse(self.metrics(), media_type="text/plain; version=0.0.4"), 0
        if what == "server":
            return _json({"name": "launcher", "extensions": ["binary_tensor_data"]}), 0
        if what == "model":
            return _json(protocols.metadata(self.routes.name, self.about)), 0
        body = await self._body(request)
        if body is None:
            return _error(f"the request body is over {self.max_body} bytes; send fewer instances per request "
                          "(or start the server with a larger --max-body-mb)", 413), 0
        if what == "infer":
            return await self.infer(body, request.headers.get(protocols.HEADER_LENGTH))
        try:
            payload = orjson.loads(body)
        except (ValueError, UnicodeDecodeError):
            return _error("the request body is not JSON: send {\"instances\": [...]}"), 0
        if self.model.hook is not None:
            problem, instances = self.request(payload)
            if problem:
                return _error(problem), 0
            return await self.hooked(instances, payload.get("parameters") or {})
        problem, batch = self.check(payload)
        if problem:
            return _error(problem), 0
        out = await self.batched(batch)
        answer = {"predictions": self.model.answers(out), "deployedModelId": self.routes.deployed_model_id}
        return _json(answer), rows(batch)

    async def hooked(self, instances: list, parameters: dict[str, Any]) -> tuple[Any, int]:
        """A request through the run's predict hook (each request on its own: the hook decides
        how it calls the model), in a thread so the replica reads the next requests meanwhile."""
        try:
            predictions = await asyncio.to_thread(self.model.predict, instances, parameters)
        except (ValueError, TypeError) as exc:
            return _error(str(exc)), 0
        except Exception as exc:  # noqa: BLE001 - the user's hook failed: the server's fault, said so
            return _error(f"the model's predict hook failed: {type(exc).__name__}: {exc}", 500), 0
        return _json({"predictions": predictions, "deployedModelId": self.routes.deployed_model_id}), \
            len(instances)

    async def infer(self, body: bytes, header_length: str | None) -> tuple[Any, int]:
        """The V2 protocol's infer: tensors in, one tensor per output column out."""
        try:
            request, tensors = protocols.parse(body, header_length)
            names = [i["name"] for i in self.about.get("inputs") or []]
            count = len(next(iter(tensors.values())))
            if not count or count > self.max_instances:
                raise ValueError(f"{count} instances in one request; send 1..{self.max_instances}")
            # A predict hook takes the request's own instances; the model, its inputs by name.
            given = protocols.instances(tensors, None if self.model.hook is not None else names)
            if self.model.hook is not None:
                predictions = await asyncio.to_thread(self.model.predict, list(given), request.get("parameters"))
                columns = {"prediction": column(predictions)}
                return _json(protocols.response(self.routes.name, request, columns)), count
            batch = self.model.inputs(given)
        except (ValueError, TypeError) as exc:
            return _error(f"{exc}{self.hint}"), 0
        out = await self.batched(batch)
        return _json(protocols.response(self.routes.name, request, self.model.columns(out))), count

    async def _body(self, request) -> bytes | None:
        """The body, or None when it is longer than the limit: kept no further than the limit;
        the rest is read and dropped, up to :data:`DRAIN` times the limit, so that a client still
        sending hears the 413 (a server that closes on unread data resets the connection, and
        the client sees only the reset: seen with direct ingress, where no proxy reads it all)."""
        declared = request.headers.get("content-length")
        over = bool(declared and declared.isdigit() and int(declared) > self.max_body)
        if over and int(declared) > DRAIN * self.max_body:
            return None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAIN * self.max_body:
                return None
            over = over or size > self.max_body
            if not over:
                chunks.append(chunk)
        return None if over else b"".join(chunks)

    def check(self, body: Any) -> tuple[str | None, Batch | None]:
        """(what is wrong, None) or (None, the model's input batch)."""
        problem, instances = self.request(body)
        if problem:
            return problem, None
        try:
            return None, self.model.inputs(instances)
        except (ValueError, TypeError) as exc:
            return f"{exc}{self.hint}", None

    def request(self, body: Any) -> tuple[str | None, list | None]:
        """(what is wrong with a Vertex AI body, None) or (None, its instances)."""
        if not isinstance(body, dict) or "instances" not in body:
            return "the body must be a JSON object with an instances list: {\"instances\": [...]}", None
        instances = body["instances"]
        if not isinstance(instances, list):
            return f"instances must be a list, got {type(instances).__name__}", None
        if not instances:
            return "instances is empty: send at least one instance", None
        if len(instances) > self.max_instances:
            return f"{len(instances)} instances in one request; at most {self.max_instances}", None
        if not isinstance(body.get("parameters", {}), dict):
            return f"parameters must be an object, got {type(body['parameters']).__name__}", None
        return None, instances

    async def batched(self, batch: Batch) -> Batch:
        return await self._batch(batch)

    async def _batch_impl(self, batches: list[Batch]) -> list[Batch]:
        sizes = [rows(b) for b in batches]
        self.batch_requests.observe(len(batches))
        self.batch_instances.observe(sum(sizes))
        # In a thread: the replica goes on reading and checking the next requests meanwhile.
        out = await asyncio.to_thread(self.model.run, join(batches))
        return split(out, sizes)

    def metrics(self) -> str:
        """Prometheus text exposition of this replica's counters."""
        labels = f'replica="{self.replica}"'
        lines = ["# HELP launcher_serve_requests_total Requests answered by this replica, by HTTP status.",
                 "# TYPE launcher_serve_requests_total counter"]
        lines += [f'launcher_serve_requests_total{{{labels},code="{code}"}} {n}' for code, n in
                  sorted(self.codes.items())]
        for name, hist, what in (("launcher_serve_request_seconds", self.latency, "Time to answer a request"),
                                 ("launcher_serve_batch_requests", self.batch_requests,
                                  "Requests merged into one forward pass"),
                                 ("launcher_serve_batch_instances", self.batch_instances,
                                  "Instances in one forward pass")):
            lines += [f"# HELP {name} {what}.", f"# TYPE {name} histogram", *hist.lines(name, labels),
                      f"# HELP {name}_largest The largest observed.", f"# TYPE {name}_largest gauge",
                      f"{name}_largest{{{labels}}} {hist.max:.6g}"]
        return "\n".join(lines) + "\n"


def reusable_listener(port: int) -> bool:
    """Set SO_REUSEADDR on this process's socket listening on ``port`` and on the connections
    it has accepted so far; whether it found the listener.

    Ray 2.60 binds a direct-ingress replica's socket without it. A connection keeps the option
    its listener had when it was accepted, and one the server closes first leaves a TIME_WAIT
    entry that keeps every new listener off the port for 60 s, SO_REUSEADDR or not, unless the
    connection had the option. The replica calls this at its first request, so the connections
    accepted before then (that request's own among them) are marked here and later ones inherit
    the mark. A server started again at once can then listen there (through Ray Serve's proxy,
    which binds with SO_REUSEADDR; see :func:`launcher.predict.serve.ingress`). Linux only
    (/proc); elsewhere the next server waits out TIME_WAIT."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    found = False
    for fd in fds:
        try:
            sock = socket.socket(fileno=int(fd))
        except (OSError, ValueError):
            continue  # not a socket
        try:
            if sock.type == socket.SOCK_STREAM and sock.getsockname()[1:2] == (port,):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                found = found or bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        except (OSError, IndexError, TypeError):
            pass
        finally:
            sock.detach()  # the descriptor stays the server's
    return found


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001 - outside a replica (a unit test)
        return "local"


def _error(message: str, status: int = 400, headers: dict[str, str] | None = None):
    return _json({"error": message}, status, headers)


def _json(content: Any, status: int = 200, headers: dict[str, str] | None = None):
    """A JSON response written by orjson (numpy arrays as they are; several times faster than
    the standard library on the long number lists predictions are)."""
    from starlette.responses import Response

    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    headers=headers, media_type="application/json")
