"""Each rank's output, kept with the run: what ``launcher logs NAME`` shows.

A worker's ``print``s, warnings and tracebacks go where they always go (Ray's worker log
files, which reach the terminal with ``--verbose``) and also to the run's storage:
``<run>/logs/launch<L>/<start>-<id>-rank<R>.log``, one file per rank and worker group (a
restarted group writes new files, so nothing is overwritten). On local storage the file is
written as the output comes, so ``launcher logs --follow`` sees it live; on gs:// (objects
have no append) a local copy is uploaded whole at each report and when the worker ends.

Only Python's ``sys.stdout`` and ``sys.stderr`` are copied: output that C++ code writes to
the file descriptors themselves (NCCL's, gloo's) stays in Ray's logs.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import TextIO

from launcher.storage import Storage
from launcher.storage.runlog import LOGS, log_folder, rank_log_name

STORE_EVERY_S = 10.0  # gs://: the least time between two uploads of a rank's log
_current: "RankLog | None" = None


class _Tee:
    """A text stream that writes to the stream it replaces and to the rank's log file."""

    def __init__(self, stream: TextIO, sink: "RankLog") -> None:
        self.stream, self.sink = stream, sink

    def write(self, text: str) -> int:
        self.sink.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):  # fileno, isatty, encoding ... of the stream it replaces
        return getattr(self.stream, name)


class RankLog:
    """This rank's copy of its output (see the module docstring)."""

    def __init__(self, storage_uri: str, name: str, launch: int | None, rank: int) -> None:
        self.storage = Storage.resolve(storage_uri)
        self.parts = (name, LOGS, log_folder(launch), rank_log_name(time.time(), uuid.uuid4().hex, rank))
        if self.storage.is_local:
            self.path = self.storage.path(*self.parts)
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        else:
            fd, self.path = tempfile.mkstemp(prefix=f"launcher-rank{rank}-", suffix=".log")
            os.close(fd)
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # line-buffered: seen as written
        self._lock = threading.Lock()
        self._stored = 0.0
        self._saved: tuple[TextIO, TextIO] | None = None
        self.write(f"=== rank {rank}, worker group started {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} "
                   f"UTC on {socket.gethostname()} (pid {os.getpid()}) ===\n")

    def write(self, text: str) -> None:
        with self._lock:
            if not self._file.closed:
                try:
                    self._file.write(text)
                except OSError:
                    pass  # a full disk: the output still reaches Ray's logs

    def start(self) -> "RankLog":
        global _current
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self), _Tee(sys.stderr, self)
        _current = self
        return self

    def failed(self) -> None:
        """The worker is failing: its traceback goes into the log (Ray prints it to its own)."""
        self.write(traceback.format_exc())

    def store(self, force: bool = False) -> None:
        """gs://: upload the log as it stands (at most every STORE_EVERY_S unless ``force``)."""
        if self.storage.is_local or (not force and time.monotonic() - self._stored < STORE_EVERY_S):
            return
        self._stored = time.monotonic()
        try:
            with self._lock:
                self._file.flush()
                with open(self.path, "rb") as f:
                    data = f.read()
            self.storage.write_bytes(data, *self.parts)
        except Exception:  # noqa: BLE001 - a log is a record: training never fails over it
            pass

    def close(self) -> None:
        global _current
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
            self._saved = None
        self.store(force=True)
        with self._lock:
            self._file.close()
        if not self.storage.is_local:
            try:
                os.remove(self.path)
            except OSError:
                pass
        if _current is self:
            _current = None


def store_now() -> None:
    """At a report: upload this worker's log (gs://), if it keeps one."""
    if _current is not None:
        _current.store()
