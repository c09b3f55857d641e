"""Checkpoint save and restore throughput, the figure that decides whether a
preemption notice (30 s on GCE) leaves time to save.

The state is what the launcher's checkpoints hold for ResNet-50 training:
the model's weights plus SGD's momentum buffers (one per parameter), written
the way the training loop writes them (``torch.save`` into a folder with a
manifest, then copied to storage) and read back the way a resume reads them
(copy to a local folder, verify the manifest, ``torch.load``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

from benchmarks import results
from launcher.storage import Manifest, emulator_host, read_manifest, write_manifest

SAVE_TARGET_S = 10.0  # a third of GCE's 30 s preemption notice


@dataclass
class Sample:
    destination: str
    emulator: bool  # a gs:// destination served by a local emulator, not Cloud Storage
    bytes: int
    save_s: float
    restore_s: float


def training_state(model_name: str = "resnet50"):
    """A model and an optimizer whose state is populated, as after a training step."""
    import torch

    from workloads.torch_models import resnet18, resnet50

    torch.manual_seed(0)
    model = (resnet50 if model_name == "resnet50" else resnet18)(1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = model(torch.randn(2, 3, 32, 32)).sum()
    loss.backward()
    optimizer.step()
    return model, optimizer


def _save(model, optimizer, folder: str) -> None:
    import torch

    torch.save(model.state_dict(), os.path.join(folder, "model.pt"))
    torch.save(optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))
    write_manifest(folder, Manifest(epoch=0, step_in_epoch=1, global_step=1, world_size=1, framework="torch",
                                    backend="native", workload="resnet50-synthetic", batch_size=32, seed=0))


def measure_once(storage, model, optimizer, index: int) -> Sample:
    """Save to and restore from ``storage`` once; timings include serialisation."""
    import torch

    name = f"checkpoint_bench_{os.getpid()}_{index}"
    with tempfile.TemporaryDirectory(prefix="bench-save-") as d:
        start = time.perf_counter()
        _save(model, optimizer, d)
        storage.upload_dir(d, ".bench", name)
        save_s = time.perf_counter() - start
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    with tempfile.TemporaryDirectory(prefix="bench-restore-") as d:
        start = time.perf_counter()
        storage.download_dir(d, ".bench", name)
        read_manifest(d)
        model.load_state_dict(torch.load(os.path.join(d, "model.pt")))
        optimizer.load_state_dict(torch.load(os.path.join(d, "optimizer.pt")))
        restore_s = time.perf_counter() - start
    storage.remove_dir(".bench", name)

    return Sample(storage.uri, not storage.is_local and emulator_host() is not None, size, save_s, restore_s)


def run(storages: list, repeats: int, model_name: str, note: Callable[[str], None]) -> list[Sample]:
    model, optimizer = training_state(model_name)
    samples = []
    for storage in storages:
        for i in range(repeats):
            s = measure_once(storage, model, optimizer, i)
            note(f"{storage.uri}: {i + 1}/{repeats}  {s.bytes / 1e6:.1f} MB  save {s.save_s:.2f}s  "
                 f"restore {s.restore_s:.2f}s")
            samples.append(s)
    return samples


def summarize(samples: list[Sample]) -> list[dict]:
    rows = []
    for dest in dict.fromkeys(s.destination for s in samples):
        mine = [s for s in samples if s.destination == dest]
        mb = mine[0].bytes / 1e6
        save = [s.save_s for s in mine]
        restore = [s.restore_s for s in mine]
        rows.append({
            "destination": dest, "emulator": mine[0].emulator, "mb": round(mb, 1), "repeats": len(mine),
            "save_s_median": statistics.median(save), "save_s_max": max(save),
            "restore_s_median": statistics.median(restore), "restore_s_max": max(restore),
            "save_mb_s": mb / statistics.median(save), "restore_mb_s": mb / statistics.median(restore),
            "save_within_target": max(save) <= SAVE_TARGET_S,
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    head = f"{'destination':<40} {'MB':>7} {'save s (med/max)':>17} {'MB/s':>8} {'restore s':>17} {'MB/s':>8}  <=10s"
    lines = [head]
    for r in rows:
        lines.append(f"{r['destination']:<40} {r['mb']:>7.1f} {r['save_s_median']:>8.2f}/{r['save_s_max']:<8.2f}"
                     f" {r['save_mb_s']:>8.0f} {r['restore_s_median']:>8.2f}/{r['restore_s_max']:<8.2f}"
                     f" {r['restore_mb_s']:>8.0f}  {'yes' if r['save_within_target'] else 'NO'}")
    return "\n".join(lines)


def _label(row: dict) -> str:
    if "://" not in row["destination"]:
        return "local disk"
    return "Cloud Storage" + (" (emulator)" if row["emulator"] else "")


def write_results(rows: list[dict], samples: list[Sample], out_dir: str) -> list[str]:
    """checkpoint.json, checkpoint.csv and a bar chart (PNG) of save and restore MB/s."""
    fig, ax = results.new_figure()
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["save_mb_s"] for r in rows], 0.4, label="save")
    ax.bar([x + 0.2 for x in xs], [r["restore_mb_s"] for r in rows], 0.4, label="restore")
    ax.axhline(rows[0]["mb"] / SAVE_TARGET_S, color="red", linestyle="--",
               label=f"save in {SAVE_TARGET_S:.0f} s ({rows[0]['mb']:.0f} MB)")
    ax.set_xticks(list(xs), [_label(r) for r in rows])
    ax.set_ylabel("MB/s (median)")
    ax.set_title(f"Checkpoint throughput, {rows[0]['mb']:.0f} MB training state")
    ax.legend()
    return results.write(out_dir, "checkpoint", rows,
                         {"samples": [asdict(s) for s in samples], "save_target_s": SAVE_TARGET_S}, fig)
