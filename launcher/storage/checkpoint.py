"""The checkpoint manifest: what a checkpoint folder holds and where training stands.

A checkpoint is a folder of framework-native files plus ``manifest.json``,
written last by rank 0. The manifest lists the files it vouches for with their
sizes, every rank's files included, so a reader can tell a complete checkpoint
from one cut off while it was being written and never resume from the latter.
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from launcher import _ray

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class IncompleteCheckpoint(Exception):
    """A checkpoint folder whose manifest is missing, unreadable or does not match its files;
    ``manifest``: the manifest when it could be read (its step names the checkpoint), else None."""

    def __init__(self, what: str, manifest: "Manifest | None" = None) -> None:
        super().__init__(what)
        self.manifest = manifest


@dataclass
class Manifest:
    """Where training stood when the checkpoint was taken.

    ``epoch`` counts completed epochs; ``step_in_epoch`` counts the steps done
    in the epoch under way (0 at an epoch boundary); ``global_step`` counts
    optimizer steps since the run began; ``cursor``, mid-epoch, the samples of the
    epoch used so far in the run's global order (:mod:`launcher.worker.order`), which a
    run on another worker count continues from (None: no global order, or an older
    checkpoint).
    """

    epoch: int
    step_in_epoch: int
    global_step: int
    world_size: int
    framework: str
    backend: str
    workload: str
    batch_size: int
    seed: int
    metrics: dict[str, Any] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)  # name -> size in bytes
    created: float = field(default_factory=time.time)
    format: int = FORMAT_VERSION
    cursor: int | None = None
    strategy: str = "ddp"   # fsdp: the model and optimizers are sharded (DCP files, one set per rank)

    @property
    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.global_step}


def resume_point(position: dict[str, int], epochs: int | None) -> str:
    """Where a run resumes, in the progress line's words: epochs counted from 1, the one under
    way (``position`` as :attr:`Manifest.position` gives it: completed epochs, global step)."""
    done, step = int(position["epoch"]), int(position["step"])
    if epochs and done >= epochs:
        return f"after step {step}: all {epochs} epochs are done"
    return f"after step {step}, in epoch {done + 1}/{epochs}" if epochs else f"after step {step}, in epoch {done + 1}"


def write_manifest(directory: str, manifest: Manifest, others: dict[str, int] | None = None) -> None:
    """Record the sizes of the files already in ``directory``, and of ``others`` (files other
    ranks put into the same checkpoint), and write the manifest."""
    files = dict(others or {})
    files.update({name: os.path.getsize(os.path.join(directory, name))
                  for name in os.listdir(directory) if name != MANIFEST})
    manifest.files = dict(sorted(files.items()))
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(manifest), f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(directory, MANIFEST))


def parse_manifest(text: str) -> Manifest:
    try:
        raw = json.loads(text)
        if raw.get("format") != FORMAT_VERSION:
            raise IncompleteCheckpoint(f"manifest format {raw.get('format')!r}, expected {FORMAT_VERSION}")
        return Manifest(**raw)
    except (ValueError, TypeError, AttributeError) as exc:
        raise IncompleteCheckpoint(f"unreadable manifest: {exc}") from None


def read_manifest(directory: str) -> Manifest:
    """Read and verify a local checkpoint folder (see :func:`verify`)."""
    import pyarrow.fs

    return verify(pyarrow.fs.LocalFileSystem(), os.path.abspath(directory))


def verify(fs, path: str) -> Manifest:
    """Read the manifest of the checkpoint at ``path`` on pyarrow filesystem ``fs``
    and check every file it lists is there with the listed size.

    Raises:
        IncompleteCheckpoint: when it is not a complete checkpoint.
    """
    import pyarrow.fs

    try:
        with fs.open_input_stream(f"{path}/{MANIFEST}") as f:
            data = f.read()
    except OSError:
        raise IncompleteCheckpoint(f"{path} has no {MANIFEST}") from None
    try:
        manifest = parse_manifest(data.decode("utf-8", errors="replace"))
    except IncompleteCheckpoint as exc:  # said with the folder it is about
        raise IncompleteCheckpoint(f"{path}: {exc}") from None
    names = list(manifest.files)
    for name, info in zip(names, fs.get_file_info([f"{path}/{n}" for n in names])):
        want = manifest.files[name]
        if info.type != pyarrow.fs.FileType.File:
            raise IncompleteCheckpoint(f"{path}: {name} is missing", manifest)
        if info.size != want:
            raise IncompleteCheckpoint(f"{path}: {name} has {info.size} bytes, manifest says {want}", manifest)
    return manifest


def complete_checkpoints(storage, run: str) -> list[tuple[Manifest, str]]:
    """The run's complete checkpoints as (manifest, path in storage), oldest first.

    Folders without a readable manifest, or whose files do not match it,
    are left out: they were cut off while being written.
    """
    found = []
    for folder in storage.list_dirs(run):
        if not folder.startswith("checkpoint_"):
            continue
        path = storage.path(run, folder)
        try:
            found.append((verify(storage.fs, path), path))
        except IncompleteCheckpoint:
            continue
    return sorted(found, key=lambda item: (item[0].global_step, item[0].created))


def incomplete_checkpoints(storage, run: str) -> list[IncompleteCheckpoint]:
    """The run's checkpoint folders that :func:`complete_checkpoints` leaves out, by folder name,
    each as the error saying what is wrong with it (a shard file missing, say), to name it to a
    user who asked for one of them."""
    found = []
    for folder in storage.list_dirs(run):
        if folder.startswith("checkpoint_"):
            try:
                verify(storage.fs, storage.path(run, folder))
            except IncompleteCheckpoint as exc:
                found.append(exc)
    return found


def newest_complete(options: list[tuple[object, str]]) -> tuple[object, str, Manifest] | None:
    """Among (filesystem, path) options, the complete checkpoint with the most steps.

    Ray Train offers the newest checkpoint it registered; the driver offers
    the newest complete ones it found in storage (a checkpoint can finish
    uploading after Ray stopped listening, e.g. during Ctrl-C). Taking the
    newest complete one loses the least work and never uses a partial one.
    """
    best = None
    for fs, path in options:
        try:
            manifest = verify(fs, path)
        except IncompleteCheckpoint:
            continue
        if best is None or manifest.global_step > best[2].global_step:
            best = (fs, path, manifest)
    return best


RAY_SNAPSHOT = _ray.CHECKPOINT_SNAPSHOT  # Ray Train's own list of a run's checkpoints


def prune(storage, run: str, keep: int,
          found: list[tuple[Manifest, str]] | None = None) -> tuple[list[tuple[Manifest, str]], str | None]:
    """Keep the ``keep`` newest complete checkpoints of ``run`` and delete the older complete ones.

    ``found``: the run's complete checkpoints as :func:`complete_checkpoints` listed them (listed
    now when None). Returns the complete checkpoints left, oldest first, and a line saying what
    was deleted (None when nothing was).

    Every launch's checkpoints count, not only those Ray Train registered in this one: a
    checkpoint that finished being written after Ray stopped listening (during Ctrl-C, say) is
    never registered, and Ray never deletes it. Newest means the most steps, then the latest
    manifest; the newest is always kept. A folder without a manifest that matches its files is
    never touched: it may be being written, or be a damaged one kept for inspection. Call it
    holding the run's lock with no worker running, so nothing else writes to the run meanwhile.

    When Ray Train's list of the run's checkpoints (:data:`RAY_SNAPSHOT`) names a folder to be
    deleted, the list is removed first (see :func:`launcher._ray.snapshot_names`). Storage that
    refuses a deletion stops the pruning, said in the line; it never fails the launch.
    """
    if found is None:
        found = complete_checkpoints(storage, run)
    old = found[:-max(1, keep)]
    if not old:
        return found, None
    deleted: list[tuple[Manifest, str]] = []
    failure = None
    try:
        snapshot = storage.read_text(run, RAY_SNAPSHOT)
        if snapshot is not None and _ray.snapshot_names(snapshot, [posixpath.basename(p) for _, p in old]):
            storage.remove_file(run, RAY_SNAPSHOT)
        for manifest, path in old:
            storage.remove_dir(run, posixpath.basename(path))
            deleted.append((manifest, path))
    except OSError as exc:
        failure = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    said = []
    if deleted:
        said.append(f"deleted {len(deleted)} older checkpoint(s) of run {run} ({_steps(deleted)})")
    if failure:
        stay = old[len(deleted):]
        said.append(f"could not delete {len(stay)} older checkpoint(s) of run {run} ({_steps(stay)}): {failure}")
    said.append(f"kept {_steps(found[len(old):])}")
    return found[len(deleted):], f"--keep-checkpoints {keep}: " + "; ".join(said)


def _steps(checkpoints: list[tuple[Manifest, str]]) -> str:
    steps = [str(m.global_step) for m, _ in checkpoints]
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(steps)


def set_aside_damaged_snapshot(storage, run: str) -> str | None:
    """Move Ray Train's checkpoint list of ``run`` aside when it is not readable JSON;
    returns a line saying so (None when the file is fine or absent).

    Ray Train reads that file when a run of the same name starts, and a damaged one
    fails its controller before any worker starts. The launcher resumes from the
    checkpoints their manifests vouch for, so the list is not needed: the damaged
    file is kept under another name and Ray Train starts a fresh list.
    """
    text = storage.read_text(run, RAY_SNAPSHOT)
    if text is None:
        return None
    try:
        if isinstance(json.loads(text), dict):
            return None
    except ValueError:
        pass
    aside = f"{RAY_SNAPSHOT}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    storage.write_text(text, run, aside)
    storage.remove_file(run, RAY_SNAPSHOT)
    return (f"Ray Train's {RAY_SNAPSHOT} in run {run} was damaged: kept as {aside}; the run resumes "
            "from the checkpoints their manifests vouch for")
