"""``launcher predict`` (batch, on Ray Data) and ``launcher serve`` (HTTP, on Ray Serve)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from launcher.cli.options import EXIT_OK, add_verbose
from launcher.cli.run import sigterm_as_ctrl_c, summary_stream
from launcher.errors import UserError
from launcher.storage.uri import DEFAULT_STORAGE


def _model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a run's folder or its model folder (local or gs://)")
    parser.add_argument("--run", metavar="NAME", help="a run's name, looked up under --storage")
    parser.add_argument("--storage", default=None, help=f"where --run is (default {DEFAULT_STORAGE})")
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or a new local Ray)")


def add_parsers(sub) -> None:
    p = sub.add_parser("predict", help="batch prediction with a run's model over .npy/.npz/.csv/JSON-lines files "
                       "(Ray Data); JSON lines out")
    _model_flags(p)
    p.add_argument("--input", required=True, help="a file, a folder or a glob (local or gs://)")
    p.add_argument("--output", required=True, help="a new folder for the predictions (local or gs://)")
    p.add_argument("--workers", type=int, default=1, help="model replicas predicting in parallel (default 1)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_verbose(p)

    s = sub.add_parser("serve", help="serve a model over HTTP (Ray Serve), Vertex AI's {\"instances\": [...]} "
                       "format and its AIP_* variables (AIP_HTTP_PORT, AIP_PREDICT_ROUTE, AIP_HEALTH_ROUTE, "
                       "AIP_STORAGE_URI); Ctrl-C or --stop ends it")
    _model_flags(s)
    s.add_argument("--port", type=int, default=None, help="HTTP port (default 8000); with --stop, the server "
                   "to stop")
    s.add_argument("--replicas", type=int, default=1, help="model replicas (default 1)")
    s.add_argument("--max-batch", type=int, default=64, help="requests merged into one forward pass, at most "
                   "(default 64)")
    s.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long a forward pass waits for more "
                   "requests to join it (default 5)")
    s.add_argument("--max-queued", type=int, default=1000, help="requests a replica holds waiting for a forward "
                   "pass, at most; past them a request gets 503 with Retry-After at once (default 1000)")
    s.add_argument("--public", action="store_true", help="listen on every interface, not only 127.0.0.1: "
                   "anyone who can reach the port can use the model unless --token-file is given")
    s.add_argument("--token-file", metavar="FILE", help="answer only requests with Authorization: Bearer TOKEN, "
                   "the token on FILE's first line (health checks stay open)")
    s.add_argument("--max-body-mb", type=float, default=None, help="the largest request body read, in MB "
                   "(default 1.5, Vertex AI's limit); past it, 413")
    s.add_argument("--stop", action="store_true", help="stop this machine's model server (the only one, or the "
                   "one --port or --run names, or --all), or with --address the cluster's")
    s.add_argument("--all", action="store_true", help="with --stop: every model server on this machine")
    s.add_argument("--list", action="store_true", help="list the model servers running on this machine")
    add_verbose(s)


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise UserError(f"{flag} {value}: must be 1 or more")


def cmd_predict(args: argparse.Namespace) -> int:
    from launcher.predict.batch import predict
    from launcher.predict.model import locate

    _positive("--workers", args.workers)
    ref = locate(args.model, args.run, args.storage)
    with sigterm_as_ctrl_c():
        with summary_stream() as out:
            summary = predict(ref, args.input, args.output, workers=args.workers, address=args.address,
                              verbose=args.verbose, note=lambda text: print(text, file=sys.stderr, flush=True))
            if args.json:
                print(json.dumps(summary.to_json()), file=out, flush=True)
            else:
                print(f"predicted {summary.rows} rows from {summary.files} file(s) in {summary.seconds:.1f}s "
                      f"({summary.rows_per_s:.0f} rows/s) -> {summary.output}", file=out, flush=True)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from launcher.predict import endpoint, serve, servers

    if args.list:
        print(servers.listing())
        return EXIT_OK
    if args.stop:
        print(servers.stop(args.address, port=args.port, run=args.run, every=args.all))
        return EXIT_OK
    if args.all:
        raise UserError("--all goes with --stop", "launcher serve --stop --all")
    from launcher.predict.model import locate

    env = os.environ
    options = serve.ServeOptions(port=_port(args.port, env.get(endpoint.AIP_PORT)), public=args.public,
                                 replicas=args.replicas, max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms,
                                 max_queued=args.max_queued)
    options.check()
    model = args.model or (None if args.run else env.get(endpoint.AIP_STORAGE))
    ref = locate(model, args.run, args.storage)
    routes = endpoint.routes(env, token_file=args.token_file, name=ref.run or "model",
                            max_body_mb=endpoint.BODY_MB if args.max_body_mb is None else args.max_body_mb)

    def ready(url: str, access_log: str | None, path: str) -> None:
        where = ("it stays deployed on the cluster (launcher serve --stop --address ...)" if args.address else
                 f"access log {access_log}; Ctrl-C or `launcher serve --stop --port {options.port}` stops it")
        token = ", bearer token required" if routes.token_sha256 else ""
        print(f"serving {ref.uri} ({ref.what}, {ref.format}) at {url}: POST "
              f"{{\"instances\": [...]}} to {routes.predict}{token}, GET {routes.health}, /metrics; through {path}; "
              + where,
              flush=True)

    with sigterm_as_ctrl_c():
        return serve.serve(ref, options, routes=routes, address=args.address, verbose=args.verbose, ready=ready)


def _port(flag: int | None, variable: str | None) -> int:
    """--port, else Vertex AI's AIP_HTTP_PORT, else 8000."""
    if flag is not None:
        return flag
    if variable is None:
        return 8000
    if not variable.isdigit():
        raise UserError(f"AIP_HTTP_PORT={variable!r} is not a port number", "set it to 1..65535, or pass --port")
    return int(variable)


COMMANDS = {"predict": cmd_predict, "serve": cmd_serve}
