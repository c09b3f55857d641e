"""``launcher serve``: a run's model behind HTTP, on Ray Serve, in AI Platform's format.

``POST /`` (or ``/predict``, or ``/v1/models/NAME:predict``) with
``{"instances": [...]}`` answers ``{"predictions": [{"prediction": class,
"scores": [...]}, ...]}``; ``GET /healthz`` answers ``{"status": "ok", ...}``.
Bad input is a 400 whose ``error`` says what was expected: a body that is not
JSON, no ``instances`` list, an empty one, more than ``max_instances``, an
instance of the wrong shape or type. Requests are batched (Ray Serve's
``@serve.batch``) so concurrent clients share forward passes.

On this machine ``launcher serve`` starts a local Ray, serves on 127.0.0.1
until Ctrl-C, SIGTERM or ``launcher serve --stop``; ``--public`` listens on
every interface (no authentication: anyone who reaches the port can use it).
With ``--address`` the application is deployed on that cluster, stays there
after the command returns, and ``--stop --address ...`` deletes it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import numpy as np

from launcher.errors import UserError
from launcher.predict.model import Model, ModelRef, predictions

APP = "launcher-model"
MAX_INSTANCES = 1024
MAX_BATCH = 64      # instances' requests merged into one forward pass, at most
BATCH_WAIT_S = 0.005


class Endpoint:
    """The deployment's class (made a Ray Serve deployment by :func:`deployment`)."""

    def __init__(self, ref: ModelRef, max_instances: int = MAX_INSTANCES) -> None:
        self.model = Model(ref)
        self.max_instances = max_instances
        self.about = {"workload": ref.info.get("workload"), "framework": ref.framework,
                      "input_shape": list(ref.input_shape), "classes": ref.num_classes, "model": ref.uri}

    async def __call__(self, request) -> Any:
        from starlette.responses import JSONResponse

        path = request.url.path.rstrip("/")
        if request.method == "GET" and path.endswith("/healthz"):
            return JSONResponse({"status": "ok", **self.about})
        if request.method != "POST":
            return JSONResponse({"error": "POST {\"instances\": [...]} to predict; GET /healthz to check"},
                                status_code=405)
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            return _bad("the request body is not JSON: send {\"instances\": [...]}")
        problem, x = self.check(body)
        if problem:
            return _bad(problem)
        scores = await self.batched(x)
        return JSONResponse({"predictions": predictions(scores)})

    def check(self, body: Any) -> tuple[str | None, np.ndarray | None]:
        """(what is wrong, None) or (None, the model's input batch)."""
        shape = "x".join(map(str, self.about["input_shape"]))
        if not isinstance(body, dict) or "instances" not in body:
            return "the body must be a JSON object with an instances list: {\"instances\": [...]}", None
        instances = body["instances"]
        if not isinstance(instances, list):
            return f"instances must be a list, got {type(instances).__name__}", None
        if not instances:
            return "instances is empty: send at least one instance", None
        if len(instances) > self.max_instances:
            return f"{len(instances)} instances in one request; at most {self.max_instances}", None
        try:
            x = self.model.inputs(_array(instances))
        except (ValueError, TypeError) as exc:
            return f"{exc} (this model takes {shape} numbers per instance)", None
        if not np.all(np.isfinite(x)):
            return "instances hold NaN or infinity", None
        return None, x

    async def batched(self, x: np.ndarray) -> np.ndarray:
        return await self._batch(x)

    async def _batch_impl(self, batches: list[np.ndarray]) -> list[np.ndarray]:
        sizes = [len(b) for b in batches]
        scores = self.model.run(np.concatenate(batches))
        return list(np.split(scores, np.cumsum(sizes)[:-1]))


def _array(instances: list) -> np.ndarray:
    """The instances as one array; ragged lists become an object array (refused as such)."""
    try:
        return np.asarray(instances)
    except ValueError:
        return np.asarray(instances, dtype=object)


def _bad(message: str):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=400)


def deployment(replicas: int):
    """The Ray Serve deployment of :class:`Endpoint`, its requests batched."""
    from ray import serve

    class ModelEndpoint(Endpoint):
        @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=BATCH_WAIT_S)
        async def _batch(self, batches: list[np.ndarray]) -> list[np.ndarray]:
            return await self._batch_impl(batches)

    return serve.deployment(ModelEndpoint, name="model", num_replicas=replicas,
                            ray_actor_options={"num_cpus": 0.5}, graceful_shutdown_timeout_s=2)


def state_file() -> str:
    from launcher.driver.localhead import STATE_ENV

    root = os.environ.get(STATE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "launcher")
    return os.path.join(root, "serve.json")


def serve(ref: ModelRef, *, port: int = 8000, public: bool = False, replicas: int = 1,
          address: str | None = None, verbose: bool = False, ready=None) -> int:
    """Serve ``ref``: on this machine until interrupted (then returns 0), or deployed on the
    cluster at ``address`` (returns 0 at once). ``ready(url)`` is called once it answers."""
    from launcher.driver import session

    host = "0.0.0.0" if public else "127.0.0.1"
    _check_port(host, port, address)
    with session.connect(address, workers=replicas, cpus_per_worker=0.5, verbose=verbose):
        from ray import serve as ray_serve

        if not verbose:
            import logging

            logging.getLogger("ray.serve").setLevel(logging.WARNING)
        ray_serve.start(http_options={"host": host, "port": port})
        ray_serve.run(deployment(replicas).bind(ref), name=APP, route_prefix="/")
        url = f"http://{'127.0.0.1' if not public else host}:{port}"
        joined = bool(address or os.environ.get("RAY_ADDRESS"))
        try:
            if not joined:
                _write_state({"pid": os.getpid(), "url": url, "model": ref.uri, "since": time.time()})
            if ready is not None:
                ready(url)
            if joined:  # the application stays on the cluster
                return 0
            signal.pause()  # Ctrl-C (and SIGTERM, turned into it) ends it
        except KeyboardInterrupt:
            pass
        finally:
            if not joined:
                _remove_state()
        # The local Ray goes down as the session closes, and the server with it: no need to
        # wait for Serve's graceful shutdown, which takes tens of seconds on a busy machine.
    return 0  # stopping a server is how it ends


def stop(address: str | None = None, timeout_s: float = 60.0) -> str:
    """Stop the model server: the one this machine runs, or the application on ``address``."""
    if address:
        from launcher.driver import session

        with session.connect(address, workers=0, cpus_per_worker=1):
            from ray import serve as ray_serve

            ray_serve.delete(APP)
        return f"deleted the {APP} application on {address}"
    try:
        with open(state_file(), encoding="utf-8") as f:
            state = json.load(f)
        pid = int(state["pid"])
    except (OSError, ValueError, KeyError):
        raise UserError("no model server is running on this machine (`launcher serve` writes "
                        f"{state_file()})", "on a cluster, add --address") from None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        _remove_state()
        return f"the model server (pid {pid}) had already stopped"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not _running(pid):
            return f"stopped the model server at {state.get('url')} (pid {pid})"
        time.sleep(0.2)
    raise UserError(f"the model server (pid {pid}) did not stop within {timeout_s:.0f}s", f"kill {pid}")


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive; a process that has exited but whose parent has not reaped it
    yet (a zombie) is not."""
    from launcher.storage.runs import pid_alive

    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _check_port(host: str, port: int, address: str | None) -> None:
    import socket

    if address or os.environ.get("RAY_ADDRESS"):
        return
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is not a port number", "use 1..65535, e.g. 8000")
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})",
                            "another server has it: pick another --port, or `launcher serve --stop`") from None


def _write_state(state: dict[str, Any]) -> None:
    path = state_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(state, f)


def _remove_state() -> None:
    try:
        os.remove(state_file())
    except OSError:
        pass
