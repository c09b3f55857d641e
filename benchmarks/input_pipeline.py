"""Input pipeline alone: how fast W ranks read their share of a streamed shard set, with no model.

Each of ``workers`` processes (spawned, as Ray's workers are fresh interpreters) opens the set
with its own :class:`launcher.data.Shards`, takes its rank's share of the epoch from
:class:`launcher.worker.order.GlobalOrder` as the session does, announces it
(``Shards.upcoming``, which starts the prefetch) and reads it batch by batch, optionally
sleeping ``step_ms`` per batch as a training step would. The processes share one node cache,
as a node's ranks do; for a gs:// set it is a fresh folder under ``$LAUNCHER_CACHE`` (a cold
cache, like a new node's), removed afterwards.

Per rank: samples/s, MB/s (the index's bytes of the shards it touched over its wall time),
the time to its first batch (from opening the set, index included), the share of its time
spent inside ``data[i]`` (its wait for data), its peak RSS and the cache's peak size it saw.
With ``compare_local``, a gs:// set is copied to a local folder first and measured again
there, so emulator/GCS and local files stand side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import multiprocessing
import os
import queue
import resource
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

from benchmarks import results
from launcher import UserError
from launcher.data import ShardCache, ShardIndex, limit_bytes
from launcher.storage import CACHE_ENV, Storage, cache_root, emulator_host

START_TIMEOUT_S = 120.0   # spawned readers wait this long for each other before reading
MB = 1e6
MIB = 2**20
IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp")


# -- transforms (module-level: a spawned reader unpickles them by name) -------------------------

def decode_image(sample: dict) -> Any:
    """A WebDataset sample's image member decoded by pillow to an HxWxC uint8 array (with its
    class number when the sample has one)."""
    import numpy as np
    from PIL import Image

    ext = next((e for e in IMAGE_MEMBERS if e in sample), None)
    if ext is None:
        members = ", ".join(k for k in sample if not k.startswith("__")) or "none"
        raise UserError(f"--transform decode-image: a sample has no {'/'.join(IMAGE_MEMBERS)} member "
                        f"(its members: {members})", "use --transform none")
    with Image.open(io.BytesIO(sample[ext])) as image:
        array = np.asarray(image.convert("RGB"))
    label = sample.get("cls")
    return (array, int(label)) if label is not None else array


def to_tensor(sample: dict) -> Any:
    """The numbers of a parquet or jsonl row (scalars, lists, arrays; text left out) as one flat
    float32 array: the copy and cast a model's input needs."""
    import numpy as np

    parts = []
    for value in sample.values():
        if isinstance(value, (str, bytes)) or value is None:
            continue
        array = np.asarray(value)
        if array.dtype.kind in "biuf":
            parts.append(array.astype(np.float32, copy=False).ravel())
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


# name -> (the function, the set kinds it reads; empty: any)
TRANSFORMS: dict[str, tuple[Callable[[Any], Any] | None, tuple[str, ...]]] = {
    "none": (None, ()),
    "decode-image": (decode_image, ("tar",)),
    "tensor": (to_tensor, ("parquet", "jsonl")),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What each reader does (``launcher bench input`` checks its flags' values)."""

    workers: int = 2
    batch_size: int = 32
    batches: int | None = None   # per rank; None: the rank's whole share of one epoch
    transform: str = "none"
    step_ms: float = 0.0          # sleep per batch, as a training step
    cache_gb: float | None = None
    seed: int = 0


def check(uri: str, settings: Settings):
    """The set's index (UserError: an unknown transform, no index there, or a transform that does
    not read its kind)."""
    if settings.transform not in TRANSFORMS:
        raise UserError(f"--transform {settings.transform!r} is unknown", f"valid: {', '.join(TRANSFORMS)}")
    index = ShardIndex.load(uri)
    kinds = TRANSFORMS[settings.transform][1]
    if kinds and index.kind not in kinds:
        raise UserError(f"--transform {settings.transform} reads {'/'.join(kinds)} sets; {index.uri} holds "
                        f"{index.kind} shards", "use --transform none, or one made for that kind")
    return index


# -- one rank ----------------------------------------------------------------------------------

def measure_rank(uri: str, settings: Settings, rank: int = 0, world: int = 1) -> dict:
    """Read rank ``rank`` of ``world``'s share as the session does, timed (see the module docstring).
    Runs in the calling process: the benchmark calls it in each spawned reader."""
    from launcher.data import Shards
    from launcher.worker import GlobalOrder

    start = time.perf_counter()
    data = Shards(uri, transform=TRANSFORMS[settings.transform][0], cache_gb=settings.cache_gb)
    try:
        order = GlobalOrder(len(data), settings.seed, True, settings.batch_size, permute=data.permutation)
        indices = order.rank_indices(0, 0, rank, world)
        if settings.batches is not None:
            indices = indices[:settings.batches * settings.batch_size]
        data.upcoming(indices)
        timing = _read(data, indices, settings, start)
        # Checking shards against the index (sha256): on a local set the whole cost of it, on
        # gs:// a part of each download's.
        timing["verify_s"] = round(data._local.cache.verify_s, 4) if data._local is not None else 0.0
    finally:
        data.close()
    touched = sorted({data.shard_of(int(i)) for i in indices})
    nbytes = sum(data.index.shards[n].bytes for n in touched)
    wall = timing.pop("wall_s")
    return {"rank": rank, "samples": len(indices), "wall_s": round(wall, 4), **timing,
            "wait_fraction": round(timing["wait_s"] / wall, 4) if wall else None,
            "samples_per_s": round(len(indices) / wall, 2) if wall else None,
            "mb_per_s": round(nbytes / MB / wall, 3) if wall else None,
            "bytes": nbytes, "shards": touched, "peak_rss_mib": round(_peak_rss_mib(), 1)}


def _read(data, indices, settings: Settings, start: float) -> dict:
    """The batches read in turn: time inside ``data[i]``, time to the first batch, cache peak."""
    cache = _cache_watch(data, settings.cache_gb)
    waited, first, peak, batches = 0.0, None, 0, 0
    for k in range(0, len(indices), settings.batch_size):
        t = time.perf_counter()
        for i in indices[k:k + settings.batch_size]:
            data[int(i)]
        waited += time.perf_counter() - t
        batches += 1
        if first is None:
            first = time.perf_counter() - start
        if cache is not None:
            peak = max(peak, cache.used_bytes())
        if settings.step_ms:
            time.sleep(settings.step_ms / 1000)
    return {"batches": batches, "wall_s": time.perf_counter() - start, "wait_s": round(waited, 4),
            "first_batch_s": round(first, 4) if first is not None else None,
            "cache_peak_mib": round(peak / MIB, 3) if cache is not None else None}


def _cache_watch(data, cache_gb: float | None):
    """A view of the node cache the reader fills (the same folder), to sample its size; None for
    a local set, which is read where it is."""

    if not data.index.uri.startswith("gs://"):
        return None
    return ShardCache(data.index, limit_bytes(cache_gb))


def _peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


# -- W spawned readers -------------------------------------------------------------------------

def _reader(uri: str, settings: Settings, rank: int, world: int, cache_root: str | None, barrier, out) -> None:
    """A spawned reader: imports done and cache set before the common start, then one rank measured."""
    try:
        from launcher.data import Shards  # noqa: F401  (numpy, pyarrow: not part of the timed start)
        import pyarrow.parquet  # noqa: F401
        if settings.transform == "decode-image":
            import PIL.Image  # noqa: F401
        if cache_root:
        
            os.environ[CACHE_ENV] = cache_root
        barrier.wait(START_TIMEOUT_S)
        out.put(measure_rank(uri, settings, rank, world))
    except BaseException as exc:  # reported as the rank's failure, in one line
        text = " ".join(str(exc).split()) or type(exc).__name__
        out.put({"rank": rank, "failed": f"{type(exc).__name__}: {text}"[:300]})


def measure_source(uri: str, settings: Settings) -> list[dict]:
    """``settings.workers`` spawned readers of ``uri`` at once; one result per rank, in rank order
    (``{"rank", "failed"}`` for a rank that did not finish)."""
    world = settings.workers
    ctx = multiprocessing.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(world)
    with _cold_cache(uri) as cache_root:
        procs = [ctx.Process(target=_reader, args=(uri, settings, r, world, cache_root, barrier, out),
                             name=f"bench-input-{r}", daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        try:
            got = _collect(out, procs, world)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
    return [got.get(r) or {"rank": r, "failed": f"the reader exited with code {procs[r].exitcode}"}
            for r in range(world)]


def _collect(out, procs, world: int) -> dict[int, dict]:
    got: dict[int, dict] = {}
    while len(got) < world:
        try:
            item = out.get(timeout=1.0)
        except queue.Empty:
            if any(p.is_alive() for p in procs):
                continue
            with contextlib.suppress(queue.Empty):  # a last result put just before its reader exited
                while len(got) < world:
                    item = out.get(timeout=0.5)
                    got[item["rank"]] = item
            break
        got[item["rank"]] = item
    return got


@contextlib.contextmanager
def _cold_cache(uri: str):
    """For a gs:// set: an empty cache root under $LAUNCHER_CACHE, shared by the readers and removed
    after; None for a local set (nothing is cached)."""
    if not uri.startswith("gs://"):
        yield None
        return

    os.makedirs(cache_root(), exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench-input-", dir=cache_root())
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- the sources, the table, the files ---------------------------------------------------------

def source_label(uri: str) -> str:
    """What a set is read from: local files, the Cloud Storage emulator or Cloud Storage."""

    if not uri.startswith("gs://"):
        return "local"
    return "emulator" if emulator_host() else "gcs"


def run(uri: str, settings: Settings, note: Callable[[str], None],
        compare_local: bool = False) -> tuple[list[dict], dict[str, list[dict]]]:
    """Measure the set where it is and, with ``compare_local`` and a gs:// set, a local copy of it.

    Returns:
        One summary row per source, and each source's per-rank results.
    """

    index = check(uri, settings)
    sources = [(source_label(index.uri), index.uri, None)]
    per_rank: dict[str, list[dict]] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-input-copy-") as copy:
        if compare_local and index.uri.startswith("gs://"):
            note(f"copying {index.uri} ({index.bytes / MB:,.1f} MB) to a local folder")
            t = time.perf_counter()
            Storage.resolve(index.uri).download_dir(copy)
            sources.append(("local copy", copy, round(time.perf_counter() - t, 3)))
            note(f"copied in {sources[-1][2]:.2f} s")
        elif compare_local:
            note("--compare-local: the set is local already; it is measured once")
        for label, where, copy_s in sources:
            note(f"{label}: {settings.workers} reader(s) of {where}")
            ranks = measure_source(where, settings)
            per_rank[label] = ranks
            rows.append(summarize(label, where, ranks, index, settings, copy_s))
            note(describe_row(rows[-1]))
    _add_ratio(rows)
    return rows, per_rank


def summarize(label: str, uri: str, ranks: list[dict], index, settings: Settings,
              copy_s: float | None = None) -> dict:
    """One source's row: per-worker means and the node's totals (``mb_per_s``: each shard a rank
    touched counted once, as the node's cache fetches it once, over the slowest rank's wall time)."""
    failed = [r["failed"] for r in ranks if "failed" in r]
    row: dict[str, Any] = {"source": label, "uri": uri, "workers": len(ranks), "failed": None}
    if failed:  # the same columns as a measured row (one CSV), the numbers left empty
        return {**row, **dict.fromkeys(NUMBERS), "failed": failed[0]}
    wall = max(r["wall_s"] for r in ranks)
    shards = set().union(*(r["shards"] for r in ranks))
    cache = [r["cache_peak_mib"] for r in ranks if r["cache_peak_mib"] is not None]
    return {**row, "samples": sum(r["samples"] for r in ranks), "wall_s": round(wall, 3),
            "samples_per_s": round(sum(r["samples"] for r in ranks) / wall, 1),
            "samples_per_s_per_worker": round(_mean(r["samples_per_s"] for r in ranks), 1),
            "mb_per_s": round(sum(index.shards[n].bytes for n in shards) / MB / wall, 2),
            "mb_per_s_per_worker": round(_mean(r["mb_per_s"] for r in ranks), 2),
            "first_batch_s": max(r["first_batch_s"] or 0.0 for r in ranks),
            "wait_pct": round(100 * max(r["wait_fraction"] for r in ranks), 1) if settings.step_ms else None,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
            "verify_s": round(max(r["verify_s"] for r in ranks), 3),
            "cache_peak_mib": max(cache) if cache else None, "copy_s": copy_s, "vs_local": None}


NUMBERS = ("samples", "wall_s", "samples_per_s", "samples_per_s_per_worker", "mb_per_s", "mb_per_s_per_worker",
           "first_batch_s", "wait_pct", "peak_rss_mib", "verify_s", "cache_peak_mib", "copy_s", "vs_local")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _add_ratio(rows: list[dict]) -> None:
    """Each row's samples/s against the local copy's, when there is one."""
    local = next((r for r in rows if r["source"] == "local copy" and not r["failed"]), None)
    if local is None:
        return
    for r in rows:
        if not r["failed"]:
            r["vs_local"] = round(r["samples_per_s"] / local["samples_per_s"], 3)


def describe_row(r: dict) -> str:
    if r["failed"]:
        return f"{r['source']}: FAILED: {r['failed']}"
    return (f"{r['source']}: {r['samples']:,} samples at {r['samples_per_s']:,.0f}/s, {r['mb_per_s']:,.1f} MB/s, "
            f"first batch after {r['first_batch_s']:.2f} s, {r['verify_s']:.2f} s checking shards' sha256 "
            "(a rank's threads together)")


def format_rows(rows: list[dict]) -> str:
    head = (f"{'source':<11} {'W':>2} {'samples':>8} {'samples/s':>10} {'/worker':>8} {'MB/s':>8} {'/worker':>8} "
            f"{'first s':>8} {'wait %':>7} {'check s':>7} {'RSS MiB':>8} {'cache MiB':>9} {'vs local':>8}")
    lines = [head]
    for r in rows:
        if r["failed"]:
            lines.append(f"{r['source']:<11} {r['workers']:>2} failed: {r['failed']}")
            continue
        lines.append(f"{r['source']:<11} {r['workers']:>2} {r['samples']:>8,} {r['samples_per_s']:>10,.0f} "
                     f"{r['samples_per_s_per_worker']:>8,.0f} {r['mb_per_s']:>8,.1f} {r['mb_per_s_per_worker']:>8,.1f} "
                     f"{r['first_batch_s']:>8.2f} {_opt(r['wait_pct'], '.1f'):>7} {r['verify_s']:>7.2f} "
                     f"{r['peak_rss_mib']:>8,.0f} "
                     f"{_opt(r['cache_peak_mib'], ',.1f'):>9} {_opt(r['vs_local'], '.2f'):>8}")
    return "\n".join(lines)


def _opt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def write_results(rows: list[dict], per_rank: dict[str, list[dict]], info: dict, settings: Settings,
                  out_dir: str) -> list[str]:
    """input.json (rows, every rank's numbers, settings, machine), input.csv and input.png."""
    fig, ax = results.new_figure(ncols=1, figsize=(7, 4))
    ok = [r for r in rows if not r["failed"]]
    ax.bar(range(len(ok)), [r["samples_per_s"] for r in ok], label="all workers")
    ax.plot(range(len(ok)), [r["samples_per_s_per_worker"] for r in ok], "k_", markersize=30, label="per worker")
    ax.set_xticks(range(len(ok)), [r["source"] for r in ok])
    ax.set(ylabel="samples/s", title=f"{settings.workers} reader(s), batch {settings.batch_size}, transform "
           f"{settings.transform}" + (f", {settings.step_ms:g} ms step" if settings.step_ms else ""))
    ax.legend()
    payload = {"machine": info, "settings": dataclasses.asdict(settings), "ranks": per_rank, "definitions": {
        "samples_per_s": "samples of all ranks over the slowest rank's wall time (from opening the set)",
        "mb_per_s": "index bytes of the shards the ranks touched, each once, over the slowest rank's wall time",
        "mb_per_s_per_worker": "index bytes of the shards a rank touched over its wall time (mean of the ranks)",
        "first_batch_s": "from opening the set (index.json read) to a rank's first batch; the slowest rank",
        "wait_pct": "time inside data[i] over wall time, the rank that waited most (with step_ms only)",
        "peak_rss_mib": "the largest reader's peak resident memory (getrusage)",
        "verify_s": "seconds spent checking shards' size and sha256 against the index, summed over a rank's "
                    "threads (read-ahead threads run beside the reads), the rank that spent most; once per shard "
                    "and process, so a longer run pays it only in its first pass over the set",
        "cache_peak_mib": "the node cache's largest size seen between batches (gs:// sets only)",
        "vs_local": "samples/s against the local copy's"}}
    return results.write(out_dir, "input", rows, payload, fig)
