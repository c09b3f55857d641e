"""A stand-in for GCE's metadata server on loopback, for tests and local trials.

It answers ``/computeMetadata/v1/instance/preempted`` the way the real one
does: ``Metadata-Flavor: Google`` on every reply, an ``ETag`` per value, and
``wait_for_change=true&last_etag=...`` held open until the value changes (or
``timeout_sec`` passes). Requests without the ``Metadata-Flavor: Google``
header are refused with 403, as GCE does. :meth:`preempt` flips the value
to TRUE, which is what GCE does 30 seconds before it powers a Spot VM off.
"""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from launcher.preemption.watcher import PREEMPTED_PATH


class FakeMetadataServer:
    def __init__(self, port: int = 0) -> None:
        self._changed = threading.Condition()
        self._value, self._version = "FALSE", 0
        self.requests = 0
        self._closing = False
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-metadata", daemon=True)

    @property
    def host(self) -> str:
        """What to put in GCE_METADATA_HOST (or pass as --metadata-host)."""
        return f"127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "FakeMetadataServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def preempt(self) -> None:
        self._set("TRUE")

    def reset(self) -> None:
        self._set("FALSE")

    def _set(self, value: str) -> None:
        with self._changed:
            if value != self._value:
                self._value, self._version = value, self._version + 1
                self._changed.notify_all()

    def _etag(self) -> str:
        return hashlib.sha1(f"{self._version}:{self._value}".encode()).hexdigest()[:16]

    def answer(self, query: dict[str, list[str]]) -> tuple[str, str]:
        """The value and ETag to send, waiting for a change when asked to."""
        with self._changed:
            self.requests += 1
            if query.get("wait_for_change", ["false"])[0].lower() == "true":
                last, start = query.get("last_etag", [None])[0], self._version
                timeout = float(query.get("timeout_sec", ["300"])[0])
                # Without last_etag GCE waits for the next change; with it, for a different value.
                self._changed.wait_for(lambda: self._closing or (
                    self._version != start if last is None else self._etag() != last), timeout=timeout)
            return self._value, self._etag()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                url = urlparse(self.path)
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403, "Missing Metadata-Flavor: Google header", "")
                if url.path != PREEMPTED_PATH:
                    return self._send(404, "not found", "")
                value, etag = fake.answer(parse_qs(url.query))
                self._send(200, value, etag)

            def _send(self, status: int, body: str, etag: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", "application/text")
                if etag:
                    self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # quiet
                pass

        return Handler
