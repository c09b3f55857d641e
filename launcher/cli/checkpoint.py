"""``launcher checkpoint export RUN``: a run's checkpoint as one model file.

A checkpoint of ``--strategy fsdp`` holds the model in shards, one file per rank plus DCP's
metadata; this joins them into one ``torch.save`` file of whole tensors, whose keys are those
of the model's own ``state_dict`` (``model.load_state_dict(torch.load(FILE))``). A data-parallel
checkpoint holds that file already; it is copied. By default the newest complete checkpoint;
``--step`` picks another that the run keeps (``launcher runs NAME`` lists them).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from launcher import frameworks
from launcher.cli.options import EXIT_OK, Parser
from launcher.errors import UserError
from launcher.storage import Storage
from launcher.storage.checkpoint import Manifest, complete_checkpoints, incomplete_checkpoints
from launcher.storage.uri import DEFAULT_STORAGE, normalize_storage


def add_parsers(sub) -> None:
    group = sub.add_parser("checkpoint", help="a run's checkpoints: export one as a single model file")
    commands = group.add_subparsers(dest="checkpoint_command", metavar="COMMAND", parser_class=Parser,
                                    required=True)
    export = commands.add_parser("export", help="join a (sharded) checkpoint's model into one torch.save file")
    export.add_argument("name", metavar="RUN", help="the run's name")
    export.add_argument("--storage", default=DEFAULT_STORAGE, help="storage root: a folder or gs://BUCKET/PREFIX "
                        f"(default {DEFAULT_STORAGE})")
    export.add_argument("--step", type=int, default=None, help="the checkpoint of this global step (default: "
                        "the newest complete one)")
    export.add_argument("--out", default=None, help="the file to write (default: RUN_stepN.pt here); never "
                        "overwritten")


def cmd_checkpoint(args: argparse.Namespace) -> int:
    storage = Storage.resolve(normalize_storage(args.storage))
    if storage.is_local and not os.path.isdir(storage.root):
        raise UserError(f"--storage {args.storage}: no such folder ({storage.root})",
                        "give the folder your runs went to (`launcher run --storage`), ./runs by default")
    manifest, path = chosen(storage, args.name, args.step)
    if not frameworks.get(manifest.framework).joins_checkpoints:
        raise UserError(f"run {args.name} trained a {manifest.framework} model; its export is under "
                        f"{storage.path(args.name, 'model')}", "this command joins PyTorch checkpoints")
    out = out_file(args.out, f"{args.name}_step{manifest.global_step}.pt")
    with tempfile.TemporaryDirectory(prefix="launcher-export-") as work:
        folder = path if storage.is_local else _download(storage, path, work)
        how = export_folder(folder, manifest.strategy, out)
    print(f"exported the model of run {args.name} at step {manifest.global_step} ({how}) to {out}")
    return EXIT_OK


UNFINISHED = "a checkpoint with a file missing or cut short cannot be exported: put the file back, or "


def chosen(storage: Storage, name: str, step: int | None) -> tuple[Manifest, str]:
    """The run's checkpoint to export (the newest complete one, or ``step``'s) as (manifest, path).

    Raises:
        UserError: no such run; no complete checkpoint (naming what the newest one lacks, a shard
            file say); no complete checkpoint of ``step``.
    """
    found = complete_checkpoints(storage, name)
    if not found:
        broken = incomplete_checkpoints(storage, name)
        if not broken and not storage.list_files(name) and not storage.list_dirs(name):  # no folder
            from launcher.cli.runviews import no_run

            raise no_run(storage, name)
        if broken:
            raise UserError(f"run {name} has no complete checkpoint: {broken[-1]}",
                            UNFINISHED + "launch the run again to write a complete one")
        raise UserError(f"run {name} under {storage.uri} has no complete checkpoint",
                        "`launcher runs` lists the runs there; --storage names another root")
    if step is None:
        return found[-1]
    kept = [item for item in found if item[0].global_step == step]
    if kept:
        return kept[-1]
    broken = [exc for exc in incomplete_checkpoints(storage, name)
              if exc.manifest is not None and exc.manifest.global_step == step]
    if broken:
        raise UserError(f"run {name}: its checkpoint of step {step} is incomplete ({broken[-1]})",
                        UNFINISHED + "export another step (`launcher runs NAME` lists the complete ones)")
    steps = ", ".join(str(m.global_step) for m, _ in found)
    raise UserError(f"run {name} keeps no complete checkpoint of step {step}", f"its checkpoints are of steps {steps}")


def out_file(given: str | None, default: str) -> str:
    """``--out`` (or ``default``) as an absolute path whose folder exists; nothing is overwritten.

    Raises:
        UserError: the file exists, a folder on its path is a file, or the folder cannot be made.
    """
    out = os.path.abspath(given or default)
    flag = f"--out {given or out}"
    if os.path.exists(out):
        raise UserError(f"{flag} exists", "give another file; an export never overwrites one")
    above = os.path.dirname(out)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise UserError(f"{flag}: {above} is a file, not a folder", "give a path in a folder (or one that does "
                        "not exist yet, which is made)")
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag}: cannot make its folder ({exc.strerror or exc})",
                        "give a path in a folder you can write to") from None
    return out


def export_folder(folder: str, strategy: str, out: str) -> str:
    """The model in checkpoint ``folder`` as one file at ``out``, as its strategy writes it;
    returns how it was made."""
    from launcher.worker.strategies import strategy_class

    return strategy_class(strategy).export_file(folder, out)


def _download(storage: Storage, path: str, work: str) -> str:
    import pyarrow.fs

    local = os.path.join(work, "checkpoint")
    os.makedirs(local)
    pyarrow.fs.copy_files(path, local, source_filesystem=storage.fs,
                          destination_filesystem=pyarrow.fs.LocalFileSystem())
    return local


COMMANDS = {"checkpoint": cmd_checkpoint}
