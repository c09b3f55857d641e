"""What a run's reports measure, folded over ranks and reports and written for a summary.

* the metrics a summary shows (:func:`pick_metrics`: the managed loop's loss and accuracy
  first, then any other number reported, never the run's own bookkeeping), and a
  program's, from its hypertune entries (:func:`program_metrics`, :func:`program_epochs`);
* each rank's peak memory (:func:`peak_memory`, :func:`format_memory`);
* where the training time went (:func:`format_shares`, the phases of
  :data:`launcher.summary.TIME_PHASES`) and how busy each worker was (:func:`summarise_usage`,
  :func:`format_usage`, from samples laid out as :data:`launcher.summary.USAGE_FIELDS`).

The fields of :class:`launcher.summary.RunSummary` that hold them are filled with these.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from launcher.summary import USAGE_FIELDS

METRIC_KEYS = ("loss", "accuracy", "train_loss")
# What a report carries about the run itself, not the model: never shown as a metric.
BOOKKEEPING = frozenset({
    "kind", "epoch", "step_in_epoch", "global_step", "world_size", "time", "attempt", "restored_from",
    "steps_per_epoch", "startup_marks", "samples", "train_time_s", "samples_per_s", "notice", "held",
    "data_wait_s", "data_wait_fraction", "data_wait_max_fraction",
    "time_data", "time_compute", "time_sync", "time_optimizer", "time_checkpoint", "time_notice",
    "busy_s_ranks", "straggler_rank", "straggler_factor", "usage", "usage_ranks",
    "peak_rss_mb_max", "peak_rss_mb_ranks", "peak_gpu_mb_max", "peak_gpu_mb_ranks",
    "weights_sha256", "model", "model_note", "timestamp", "checkpoint_dir_name", "training_iteration",
    "launch", "source", "from_checkpoint",  # what the run log adds to a report
    "trial", "checkpoint_path"})  # a program's hypertune entry's


def pick_metrics(values: dict[str, Any]) -> dict[str, float]:
    """The metrics a summary shows, from a report or a checkpoint's manifest: the managed loop's
    (loss, accuracy, train_loss) first, then any other number a training function reported."""
    known = {k: values[k] for k in METRIC_KEYS if k in values}
    others = {k: v for k, v in values.items() if k not in BOOKKEEPING and k not in known
              and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**known, **others}


def program_metrics(entries: list[dict[str, Any]]) -> dict[str, float]:
    """A program's (``--script``, ``--package``) latest value of each metric it reported through
    hypertune: one entry per tag and report, so the last entry alone may hold one metric of several."""
    out: dict[str, float] = {}
    for entry in entries:
        out.update(pick_metrics(entry))
    return out


def program_epochs(entries: list[dict[str, Any]]) -> int:
    """How many epochs a program trained, from its hypertune entries: its own ``epoch`` metric
    where it reports one, else the number of steps it reported metrics at (a trainer reports
    once per epoch, as the example package and Vertex AI's samples do). Steps reported again
    after a restart count once."""
    epochs = [e["epoch"] for e in entries if isinstance(e.get("epoch"), (int, float))]
    if epochs:
        return int(max(epochs))
    return len({e.get("global_step") if e.get("global_step") is not None else ("at", e.get("timestamp"))
                for e in entries})


# The memory a report or a summary gives, each as NAME_max (MiB, the largest of the ranks) and
# NAME_ranks (MiB, by rank): the workers' resident sets, and their GPU memory.
MEMORY = ("peak_rss_mb", "peak_gpu_mb")
MEMORY_RANKS_SHOWN = 8  # more ranks than this: the largest and the mean, not each


def peak_memory(reports: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Each rank's peak memory over ``reports`` (epoch reports, metrics rows, summaries, or what
    this returned before): per rank the largest figure any gave, and the largest of all. A
    checkpoint's manifest keeps only the largest. Keys with nothing measured are left out."""
    out: dict[str, Any] = {}
    for m in reports:
        for name in MEMORY:
            top, ranks = m.get(f"{name}_max"), m.get(f"{name}_ranks")
            if _number(top):
                out[f"{name}_max"] = max(float(top), out.get(f"{name}_max", 0.0))
            if isinstance(ranks, list) and ranks:
                have = out.get(f"{name}_ranks", [])
                new = [float(v) if _number(v) else 0.0 for v in ranks]
                out[f"{name}_ranks"] = [max(a, b) for a, b in zip(have, new)] + have[len(new):] + new[len(have):]
                out[f"{name}_max"] = max(out[f"{name}_ranks"] + [out.get(f"{name}_max", 0.0)])
    return out


def format_memory(m: Mapping[str, Any]) -> str:
    """"peak memory per rank: RSS 412 / 430 MB, GPU 1,024 / 1,020 MB" (past
    :data:`MEMORY_RANKS_SHOWN` ranks: the largest, whose, and the mean); "" when unmeasured."""
    parts = []
    for name, label in zip(MEMORY, ("RSS", "GPU")):
        top, ranks = m.get(f"{name}_max"), m.get(f"{name}_ranks") or []
        if ranks and len(ranks) <= MEMORY_RANKS_SHOWN:
            parts.append(f"{label} " + " / ".join(f"{v:,.0f}" for v in ranks) + " MB")
        elif ranks:
            worst = max(range(len(ranks)), key=ranks.__getitem__)
            parts.append(f"{label} max {ranks[worst]:,.0f} MB (rank {worst}), mean "
                         f"{sum(ranks) / len(ranks):,.0f} MB over {len(ranks)} ranks")
        elif _number(top):
            parts.append(f"{label} max {top:,.0f} MB")
    return "peak memory per rank: " + ", ".join(parts) if parts else ""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def format_shares(shares: dict[str, float], stragglers: list[dict[str, Any]]) -> str:
    """The summary's line: the phases by their share (those of 0.5 % or more), then the stragglers."""
    parts = [f"{p} {100 * v:.1f}%" for p, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v >= 0.005]
    line = ("time: " + ", ".join(parts)) if parts else ""
    for s in stragglers:
        line += (f"; straggler: rank {s['rank']} ({s['factor']:.1f}x the median busy time, "
                 f"{s['epochs']} epoch{'s' if s['epochs'] != 1 else ''})")
    return line


def summarise_usage(samples: dict[int, list[list[float]]]) -> list[dict[str, Any]]:
    """Per rank, from its samples: mean and peak CPU %, mean and peak RSS (MiB), and where a GPU
    was seen, its mean and peak utilisation and peak memory."""
    out = []
    for rank in sorted(samples):
        rows = samples[rank]
        if not rows:
            continue
        column = {f: [r[i] for r in rows] for i, f in enumerate(USAGE_FIELDS)}
        entry: dict[str, Any] = {"rank": rank, "samples": len(rows),
                                 "cpu_pct_mean": round(sum(column["cpu_pct"]) / len(rows), 1),
                                 "cpu_pct_peak": max(column["cpu_pct"]),
                                 "rss_mb_mean": round(sum(column["rss_mb"]) / len(rows), 1),
                                 "rss_mb_peak": max(column["rss_mb"])}
        if any(column["gpu_mb"]) or any(column["gpu_pct"]):
            entry.update(gpu_pct_mean=round(sum(column["gpu_pct"]) / len(rows), 1),
                         gpu_pct_peak=max(column["gpu_pct"]), gpu_mb_peak=max(column["gpu_mb"]))
        out.append(entry)
    return out


def format_usage(per_rank: list[dict[str, Any]]) -> list[str]:
    """One line per rank for a summary: CPU and memory, mean and peak (and the GPU's); past
    :data:`MEMORY_RANKS_SHOWN` ranks, one line: the ranks' mean, and the extremes with their rank."""
    if len(per_rank) > MEMORY_RANKS_SHOWN:
        def pick(key: str, low: bool = False) -> dict[str, Any]:
            return (min if low else max)(per_rank, key=lambda u: u.get(key, 0.0))

        idle, big = pick("cpu_pct_mean", low=True), pick("rss_mb_peak")
        mean = sum(u["cpu_pct_mean"] for u in per_rank) / len(per_rank)
        line = (f"usage over {len(per_rank)} ranks: CPU {mean:.0f}% mean (least busy: rank {idle['rank']}, "
                f"{idle['cpu_pct_mean']:.0f}%); RSS peak {big['rss_mb_peak']:,.0f} MB (rank {big['rank']})")
        gpus = [u for u in per_rank if "gpu_pct_mean" in u]
        if gpus:
            low = min(gpus, key=lambda u: u["gpu_pct_mean"])
            line += (f"; GPU {sum(u['gpu_pct_mean'] for u in gpus) / len(gpus):.0f}% mean (least busy: rank "
                     f"{low['rank']}, {low['gpu_pct_mean']:.0f}%)")
        return [line + " (launcher runs NAME --plot usage: each rank over time)"]
    lines = []
    for u in per_rank:
        line = (f"rank {u['rank']}: CPU {u['cpu_pct_mean']:.0f}% mean, {u['cpu_pct_peak']:.0f}% peak; "
                f"RSS {u['rss_mb_mean']:,.0f} MB mean, {u['rss_mb_peak']:,.0f} MB peak")
        if "gpu_pct_mean" in u:
            line += (f"; GPU {u['gpu_pct_mean']:.0f}% mean, {u['gpu_pct_peak']:.0f}% peak, "
                     f"{u['gpu_mb_peak']:,.0f} MB peak")
        lines.append(line + f" ({u['samples']} samples)")
    return lines
