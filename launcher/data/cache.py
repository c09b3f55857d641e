"""A node's cache of shards: fetched ahead of use, verified, within a size limit, shared by its ranks.

A shard set on ``gs://`` is never copied whole: each shard a rank is about to read is
downloaded into ``$LAUNCHER_CACHE/shards/<set>/`` (to a temporary name, checked against the
index's size and sha256, then renamed), and shards are removed again to stay within the
limit (``--data-cache-gb``). The ranks of a node share one folder and one ledger
(``.ledger.json``, changed under a file lock): a rank *pins* the shards it reads now and
unpins each once its part of the epoch has passed it, and marks those it fetched ahead;
only a shard no live process pins is evicted: first those nobody fetched ahead (least
recently used first), then, when a rank needs room for a shard it reads now, those fetched
ahead (the furthest ahead first). Space for a download is
reserved before it starts, so the folder's files never add up to more than the limit,
downloads under way included. A local shard set is read where it is: nothing to cache,
but each of its shards is checked against the index's size and sha256 once per process
before its first read (by the read-ahead threads where they run ahead), so a shard
damaged on disk is one line naming it, not a sample that silently differs. A launch
checks a ``gs://`` set that its ``--data`` or a ``--param`` names against the limit before
any worker starts (:func:`check_sets`), as every reader would on each node.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import threading
import time
from typing import Callable, Iterator

from launcher.data.formats import verify
from launcher.data.index import ShardError, ShardIndex, normalise, read_index_text
from launcher.errors import UserError
from launcher.settings import DATA_CACHE_GB
from launcher.storage import Storage, datacache
from launcher.storage.runs import pid_alive

LEDGER = ".ledger.json"
WAIT_S = 0.2
POLL_S = 0.005  # how often a rank looks for a shard another rank is downloading
ROOM_WAIT_S = 120.0  # a read waiting this long for room in the cache: the limit is too small


def limit_bytes(cache_gb: float | None = None) -> int:
    """The cache's size limit: ``cache_gb``, else ``$LAUNCHER_DATA_CACHE_GB`` (the run's
    ``--data-cache-gb``), else 16 GiB."""
    if cache_gb is None:
        cache_gb = float(DATA_CACHE_GB.get())
    if not cache_gb > 0:
        raise UserError(f"a data cache of {cache_gb:g} GB holds nothing", "give --data-cache-gb a size above 0")
    return int(cache_gb * 2**30)


def size_text(n: float) -> str:
    """``n`` bytes in the unit that reads best: "98 KiB", "3.5 MiB", "16 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.3g} {unit}"
    return f"{n:,.0f} bytes"


def gb_above(n: float) -> str:
    """A --data-cache-gb just above ``n`` bytes, rounded up to two figures, as a plain decimal."""
    gb = n / 2**30
    if gb <= 0:
        return "0"
    places = max(0, 1 - math.floor(math.log10(gb)))
    return f"{math.ceil(gb * 10**places) / 10**places:.{places}f}"


def too_small(uri: str, index: ShardIndex, limit: int) -> UserError | None:
    """The one line for a cache whose ``limit`` cannot hold the largest shard of the set at
    ``uri`` (None when it can, or when the set is local: read where it is, never cached)."""
    if not index.shards or not uri.startswith("gs://"):
        return None
    largest = max(index.shards, key=lambda s: s.bytes)
    if largest.bytes <= limit:
        return None
    return UserError(f"the data cache's limit ({size_text(limit)}) is smaller than the largest shard of {uri} "
                     f"({largest.name}, {size_text(largest.bytes)})",
                     f"raise --data-cache-gb to {gb_above(largest.bytes)} or more, or write the set with smaller "
                     "shards (launcher data shard --shard-mb)")


def shards_held(window: int, index: ShardIndex) -> int:
    """How many shards a reader of ``index`` (:class:`launcher.data.Shards`) holds in the cache at
    once with a shuffle window of ``window`` samples: those a window spans (one more than it
    fills, as it may straddle a boundary), and the next, needed before they are done."""
    fewest = min((s.samples for s in index.shards), default=1)
    return math.ceil(window / max(1, fewest)) + 2


def check_sets(named: dict[str, str], cache_gb: float | None) -> None:
    """Before any worker starts: each of ``named`` (what names it, e.g. ``--param shards``, ->
    its value) that is a shard set on gs:// fits the cache's limit (``--data-cache-gb``) as every
    reader needs it to, whatever its window: its largest shard (:class:`ShardCache`'s own check
    on every node), and the largest shards a window of one sample holds at once (the least any
    ``Shards(..., window=N)`` holds; a larger window is checked by the reader).

    A value that holds no ``index.json`` is not a set and is left alone (a parameter may be any
    gs:// path); reading it costs one Cloud Storage request.

    Raises:
        UserError: a shard larger than the limit (what names the set, the sizes, the fix).
        Unreachable: Cloud Storage (or its emulator) did not answer.
    """
    limit = limit_bytes(cache_gb)
    for what, value in named.items():
        if not (isinstance(value, str) and value.startswith("gs://")):
            continue
        try:
            uri = normalise(value)
        except UserError:
            continue  # not a location at all: whatever reads it says so
        text = read_index_text(Storage.resolve(uri))
        if text is None:
            continue
        index = ShardIndex.from_json(text, uri)
        problem = too_small(uri, index, limit)
        if problem is not None:
            raise UserError(f"{what} {value}: {problem.what}", problem.fix)
        held = sorted((s.bytes for s in index.shards), reverse=True)[:shards_held(1, index)]
        if sum(held) > limit:
            raise UserError(f"{what} {value}: the data cache's limit ({size_text(limit)}) cannot hold the "
                            f"{len(held)} largest shards of {uri} ({size_text(sum(held))}), and a reader of the set "
                            f"holds at least {len(held)} at once (those its shuffle window spans, and the next)",
                            f"raise --data-cache-gb to {gb_above(sum(held))} or more, or write the set with smaller "
                            "shards (launcher data shard --shard-mb)")


class ShardCache:
    """The shards of one set on this node (see the module docstring)."""

    def __init__(self, index: ShardIndex, limit: int, root: str | None = None,
                 note: Callable[[str], None] | None = None) -> None:
        self.index, self.limit, self.note = index, limit, note
        self.local = not index.uri.startswith("gs://")
        digest = hashlib.sha1(index.uri.encode()).hexdigest()[:16]
        self.dir = os.path.join(root or os.path.join(datacache.cache_root(), "shards"), digest)
        self.pid = os.getpid()
        self.sizes = {s.name: s.bytes for s in index.shards}
        problem = too_small(index.uri, index, limit)
        if problem is not None:
            raise problem
        if not self.local:
            os.makedirs(self.dir, exist_ok=True)
        self.checked: set[int] = set()  # local shards verified by this process
        self.verify_s = 0.0             # seconds this process spent checking sizes and sha256s
        self._verify_lock = threading.Lock()

    # -- where a shard is -------------------------------------------------------------------
    def path(self, n: int) -> str:
        name = self.index.shards[n].name
        if self.local:
            return os.path.join(self.index.uri, name)
        return os.path.join(self.dir, name.replace("/", "%2F"))

    def get(self, n: int) -> str:
        """The local path of shard ``n``, fetched (and pinned by this process) if it is not here."""
        self.fetch(n)
        return self.path(n)

    def _check_local(self, n: int) -> None:
        """A local shard is there and matches the index (checked once per process)."""
        if n in self.checked:
            return
        info, path = self.index.shards[n], self.path(n)
        if not os.path.isfile(path):
            raise ShardError(info.name, self.index.uri, "the file is missing",
                             "put it back, or write the set again with `launcher data shard`")
        self._verify(path, info)
        self.checked.add(n)

    def _verify(self, path: str, info) -> None:
        start = time.perf_counter()
        try:
            verify(path, info, self.index.uri)
        finally:
            with self._verify_lock:
                self.verify_s += time.perf_counter() - start

    # -- the ledger ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _ledger(self) -> Iterator[dict]:
        """The ledger under the node's lock; written back when the block ends. ``pins``: shards a
        process reads now; ``ahead``: shards a process fetched ahead of use (given up first when
        that process needs room); ``reserved``: downloads under way."""
        with datacache.node_lock(os.path.join(self.dir, ".lock")):
            try:
                with open(os.path.join(self.dir, LEDGER), encoding="utf-8") as f:
                    ledger = json.load(f)
            except (OSError, ValueError):
                ledger = {}
            for table in ("pins", "ahead", "reserved"):
                ledger.setdefault(table, {})
                for name in list(ledger[table]):  # what processes gone left behind
                    live = [pid for pid in _pids(ledger[table][name]) if pid_alive(pid)]
                    if live:
                        ledger[table][name] = live
                        continue
                    del ledger[table][name]
                    if table == "reserved":
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(self._part(name))
            yield ledger
            tmp = os.path.join(self.dir, f"{LEDGER}.{self.pid}")
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(ledger, f)
            os.replace(tmp, os.path.join(self.dir, LEDGER))

    def _part(self, name: str) -> str:
        return os.path.join(self.dir, name.replace("/", "%2F") + ".part")

    def _mark(self, ledger: dict, table: str, name: str) -> None:
        pids = ledger[table].setdefault(name, [])
        if self.pid not in pids:
            pids.append(self.pid)

    def _unmark(self, ledger: dict, table: str, name: str) -> None:
        pids = [p for p in ledger[table].get(name, []) if p != self.pid]
        if pids:
            ledger[table][name] = pids
        else:
            ledger[table].pop(name, None)

    def unpin(self, shards: list[int]) -> None:
        """This process is done with ``shards`` (for now): they may be evicted."""
        if self.local or not shards:
            return
        with self._ledger() as ledger:
            for n in shards:
                name = self.index.shards[n].name
                self._unmark(ledger, "pins", name)
                self._unmark(ledger, "ahead", name)

    def used_bytes(self) -> int:
        """Bytes of the cache's shard files, the partial ones included."""
        return sum(size for _, _, size in self._files(parts=True))

    def _files(self, parts: bool = False) -> list[tuple[float, str, int]]:
        """(mtime, name, size) of the cache's shard files (``parts``: the partial ones too); a file
        another process removes meanwhile is left out."""
        found = []
        with os.scandir(self.dir) as entries:
            for e in entries:
                if e.name.startswith(".") or (e.name.endswith(".part") and not parts):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    found.append((st.st_mtime, e.name, st.st_size))
        return found

    # -- fetching -----------------------------------------------------------------------------
    def present(self, n: int) -> bool:
        """Whether shard ``n`` is here whole. One ``stat``: asked without the lock (while waiting for
        another rank's download), the file can be evicted between two looks."""
        try:
            st = os.stat(self.path(n))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == self.index.shards[n].bytes

    def fetch(self, n: int, wait: bool = True) -> bool:
        """Make shard ``n`` present: downloaded by this process, or waited for while another one
        downloads it. ``wait``: it is read now (pinned; waits for room, giving up this process's
        shards fetched ahead first). Without: fetched ahead of use, if there is room now
        (False otherwise: a later prefetch tries again). A local shard is only checked."""
        if self.local:
            self._check_local(n)
            return True
        info = self.index.shards[n]
        table = "pins" if wait else "ahead"
        waited_since = time.monotonic()
        while True:
            with self._ledger() as ledger:
                if self.present(n):
                    self._mark(ledger, table, info.name)
                    if wait:
                        self._unmark(ledger, "ahead", info.name)
                    os.utime(self.path(n))  # recently used
                    return True
                if info.name not in ledger["reserved"]:
                    if self._make_room(ledger, info.bytes, give_up_ahead=wait):
                        ledger["reserved"][info.name] = [self.pid]
                        self._mark(ledger, table, info.name)
                        break
                    if not wait:
                        return False
                    if time.monotonic() - waited_since > ROOM_WAIT_S:
                        raise UserError(
                            f"the data cache's limit ({self.limit / 2**30:.3g} GiB) is smaller than the shards of "
                            f"{self.index.uri} that the ranks of this node read at once (waited "
                            f"{ROOM_WAIT_S:g} s for room)",
                            "raise --data-cache-gb, or shuffle in a smaller window (Shards(..., window=N))")
            # Another rank downloads it (watch for the file, without the lock), or room is still
            # pinned by others (ask again in a while).
            until = time.monotonic() + WAIT_S
            while time.monotonic() < until and not self.present(n):
                time.sleep(POLL_S)
        try:
            self._download(n)
        finally:
            with self._ledger() as ledger:
                ledger["reserved"].pop(info.name, None)
        return True

    def _make_room(self, ledger: dict, need: int, give_up_ahead: bool) -> bool:
        """Evict shards no process reads now, until ``need`` more bytes fit under the limit
        (downloads under way counted): first those nobody fetched ahead, least recently used
        first, then (``give_up_ahead``: for a shard read now) those fetched ahead, the furthest
        ahead (most recent) first, this process's before the others'. Fetched ahead, a shard
        holds room no read waits on, so two ranks' prefetches cannot starve each other's reads.
        False when ``need`` cannot fit yet."""
        reserved = sum(self.sizes.get(name, 0) for name in ledger["reserved"])
        present = self._files()
        used = reserved + sum(size for _, _, size in present)
        if used + need <= self.limit:
            return True
        reading = {name.replace("/", "%2F") for name in ledger["pins"]}
        ahead = {name.replace("/", "%2F"): pids for name, pids in ledger["ahead"].items()}
        unused = [f for f in sorted(present) if f[1] not in reading and f[1] not in ahead]
        # Fetched ahead but not read yet: the most recent is the furthest ahead (ranks read the
        # shards in the same order), so it goes first; this process's own before the others'.
        given_up = sorted((f for f in present if give_up_ahead and f[1] not in reading and f[1] in ahead),
                          key=lambda f: (ahead[f[1]] != [self.pid], -f[0]))
        for _, name, size in unused + given_up:
            if used + need <= self.limit:
                break
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.dir, name))
            used -= size
            for table in ("ahead", "pins"):
                ledger[table].pop(name.replace("%2F", "/"), None)
        return used + need <= self.limit

    def _download(self, n: int) -> None:
        info = self.index.shards[n]
        uri = self.index.shard_uri(n)
        part = self._part(info.name)
        if self.note:
            self.note(f"fetching {info.name} ({info.bytes:,} bytes)")
        try:
            datacache.download_object(uri, part)
            self._verify(part, info)
            os.replace(part, self.path(n))
        except FileNotFoundError:
            raise ShardError(info.name, self.index.uri, "the object is missing from the bucket",
                             "put it back, or write the set again with `launcher data shard`") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(part)


def _pids(value) -> list[int]:
    return [int(p) for p in (value if isinstance(value, list) else [value])]
