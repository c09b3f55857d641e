"""The model servers this machine runs: one entry (port, run, PID) per ``launcher serve`` under
the state folder, so several can run at once (``--list``, ``--stop --port/--run/--all``);
``--stop --address`` deletes the application on a cluster instead."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Any

from launcher.driver import session
from launcher.errors import UserError
from launcher.settings import STATE_DIR
from launcher.storage.runs import pid_alive

APP = "launcher-model"


def servers_dir() -> str:
    return os.path.join(os.path.expanduser(STATE_DIR.get()), "servers")


def _entry_path(port: int) -> str:
    return os.path.join(servers_dir(), f"{port}.json")


def servers() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the servers running on this machine, the entries of those that are gone, now removed),
    each sorted by port."""
    live, dead = [], []
    try:
        names = sorted(os.listdir(servers_dir()))
    except OSError:
        names = []
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(servers_dir(), name)
        try:
            with open(path, encoding="utf-8") as f:
                entry = json.load(f)
            pid = int(entry["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            _remove(path)
            continue
        if _running(pid):
            live.append(entry)
        else:
            _remove(path)
            dead.append(entry)
    return sorted(live, key=lambda e: e["port"]), sorted(dead, key=lambda e: e["port"])


def listing() -> str:
    """``launcher serve --list``: one line per running server."""
    live, dead = servers()
    lines = [f"removed the entry of the server at {e['url']} (pid {e['pid']}): it had stopped" for e in dead]
    if not live:
        return "\n".join(lines + ["no model server is running on this machine"])
    lines.append(f"{'PORT':>5}  {'PID':>7}  {'UP':>8}  {'RUN':<20} MODEL")
    for e in live:
        up = time.time() - float(e.get("since", time.time()))
        lines.append(f"{e['port']:>5}  {e['pid']:>7}  {_duration(up):>8}  {e.get('run') or '-':<20} {e['model']}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def stop(address: str | None = None, *, port: int | None = None, run: str | None = None, every: bool = False,
         timeout_s: float = 60.0) -> str:
    """Stop model servers: this machine's (the only one, or those ``port``/``run`` name, or
    ``every`` one), or the application on ``address``."""
    if address:
        with session.connect(address, workers=0, cpus_per_worker=1):
            from ray import serve as ray_serve

            ray_serve.delete(APP)
        return f"deleted the {APP} application on {address}"
    live, dead = servers()
    lines = [f"removed the entry of the server at {e['url']} (pid {e['pid']}): it had already stopped"
             for e in dead if (port is None or e["port"] == port) and (run is None or e.get("run") == run)]
    chosen = [e for e in live if (port is None or e["port"] == port) and (run is None or e.get("run") == run)]
    if not chosen:
        if lines:
            return "\n".join(lines)
        what = " ".join(filter(None, (f"on port {port}" if port else "", f"for run {run}" if run else "")))
        running = ", ".join(str(e["port"]) for e in live)
        raise UserError(f"no model server {what + ' ' if what else ''}is running on this machine"
                        + (f" (running: port {running})" if running else ""),
                        "`launcher serve --list` shows them; on a cluster, add --address")
    if len(chosen) > 1 and not every and port is None:
        ports = ", ".join(str(e["port"]) for e in chosen)
        raise UserError(f"{len(chosen)} model servers are running (ports {ports})",
                        "say which with --port or --run, or stop them all with --all")
    for e in chosen:
        try:
            os.kill(int(e["pid"]), signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + timeout_s
    for e in chosen:
        pid = int(e["pid"])
        while _running(pid) and time.time() < deadline:
            time.sleep(0.1)
        if _running(pid):
            raise UserError(f"the model server at {e['url']} (pid {pid}) did not stop within {timeout_s:.0f}s",
                            f"kill {pid}")
        _remove(_entry_path(e["port"]))
        lines.append(f"stopped the model server at {e['url']} (pid {pid})")
    return "\n".join(lines)


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive; a process that has exited but whose parent has not reaped it
    yet (a zombie) is not."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _check_port(host: str, port: int) -> None:
    """Refuse a port another process listens on, before Ray starts. The test socket sets
    SO_REUSEADDR as the server itself (uvicorn) does, so connections of a server that just
    stopped, still in TIME_WAIT, do not keep a new one off its port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})",
                            "another server has it: pick another --port, or `launcher serve --list` and "
                            "`launcher serve --stop --port PORT`") from None


def _write_entry(entry: dict[str, Any]) -> None:
    path = _entry_path(entry["port"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(entry, f)
    os.replace(tmp, path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
