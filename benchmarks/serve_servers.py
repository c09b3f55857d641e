"""The servers ``launcher bench serve`` sets beside ``launcher serve``, on the same model.

- ``ray-serve``: a bare Ray Serve deployment as Ray's documentation writes one: a
  ``@serve.deployment`` class whose ``@serve.batch`` method runs the model on the
  requests' instances, its ``__call__`` reading the JSON body and returning a dict,
  reached through Ray Serve's proxy (the anchor a user would pick instead);
- ``ray-serve-direct``: the same deployment with Ray Serve's throughput-optimised
  settings (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: direct ingress, the replica on the
  port; set by the benchmark in this process's environment before Ray starts);
- ``starlette``: one Starlette app under uvicorn in one process, calling the model in
  its handler: no Ray, no batching, no other process (what one Python HTTP server does).

Each answers ``POST /predict`` with ``{"instances": [...]}`` as ``{"predictions":
[...]}`` (the model's own answers, as ``launcher serve`` gives them). Run as::

    python -m benchmarks.serve_servers KIND MODEL_DIR PORT [MAX_BATCH WAIT_MS]

it prints a line with "serving" once it answers, and stops on SIGTERM.
"""

from __future__ import annotations

import signal
import socket
import sys

import numpy as np
import orjson
import uvicorn

from launcher.predict import Model, locate

KINDS = ("ray-serve", "ray-serve-direct", "starlette")


def _answer(model: Model, instances) -> list:
    return model.answers(model.run(model.inputs(np.asarray(instances))))


def ray_serve_app(model_dir: str, max_batch: int, wait_ms: float):
    """The bare deployment, bound to ``model_dir``."""
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(max_ongoing_requests=max(1000, 2 * max_batch))
    class BareModel:
        def __init__(self, model_dir: str) -> None:
            self.model = Model(locate(model_dir))

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=wait_ms / 1000)
        async def predict(self, requests: list[list]) -> list[list]:
            sizes = [len(r) for r in requests]
            answers = _answer(self.model, [row for r in requests for row in r])
            starts = np.cumsum([0, *sizes])
            return [answers[a:b] for a, b in zip(starts[:-1], starts[1:])]

        async def __call__(self, request: Request) -> dict:
            body = await request.json()
            return {"predictions": await self.predict(body["instances"])}

    return BareModel.bind(model_dir)


def starlette_app(model_dir: str):
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    model = Model(locate(model_dir))

    async def predict(request):
        instances = orjson.loads(await request.body())["instances"]
        return Response(orjson.dumps({"predictions": _answer(model, instances)}), media_type="application/json")

    return Starlette(routes=[Route("/predict", predict, methods=["POST"])])


def main(argv: list[str]) -> int:
    kind, model_dir, port = argv[0], argv[1], int(argv[2])
    max_batch, wait_ms = (int(argv[3]), float(argv[4])) if len(argv) > 4 else (64, 5.0)
    if kind == "starlette":
        config = uvicorn.Config(starlette_app(model_dir), host="127.0.0.1", port=port, log_level="warning",
                                access_log=False)
        server = uvicorn.Server(config)
        print(f"serving {model_dir} at http://127.0.0.1:{port} (starlette, one process)", flush=True)
        server.run()  # uvicorn stops on SIGTERM itself
        return 0
    import ray
    from ray import serve

    with socket.socket() as s:  # the proxy: on the port, or (direct ingress) out of the way
        s.bind(("127.0.0.1", 0))
        spare = s.getsockname()[1]
    ray.init(address="local", include_dashboard=False, log_to_driver=False)  # never a running cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": spare if kind == "ray-serve-direct" else port})
        serve.run(ray_serve_app(model_dir, max_batch, wait_ms), name="bare", route_prefix="/")
        print(f"serving {model_dir} at http://127.0.0.1:{port} ({kind})", flush=True)
        while True:
            signal.pause()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
