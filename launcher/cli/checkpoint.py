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
import shutil
import tempfile

from launcher.cli.options import EXIT_OK, Parser
from launcher.errors import UserError
from launcher.storage import Storage
from launcher.storage.checkpoint import complete_checkpoints
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
    found = complete_checkpoints(storage, args.name)
    if not found:
        raise UserError(f"run {args.name} under {storage.uri} has no complete checkpoint",
                        "`launcher runs` lists the runs there; --storage names another root")
    if args.step is not None:
        found = [item for item in found if item[0].global_step == args.step]
        if not found:
            steps = ", ".join(str(m.global_step) for m, _ in complete_checkpoints(storage, args.name))
            raise UserError(f"run {args.name} keeps no complete checkpoint of step {args.step}",
                            f"its checkpoints are of steps {steps}")
    manifest, path = found[-1]
    if manifest.framework != "torch":
        raise UserError(f"run {args.name} trained a {manifest.framework} model; its export is under "
                        f"{storage.path(args.name, 'model')}", "this command joins PyTorch checkpoints")
    out = os.path.abspath(args.out or f"{args.name}_step{manifest.global_step}.pt")
    if os.path.exists(out):
        raise UserError(f"--out {out} exists", "give another file; an export never overwrites one")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="launcher-export-") as work:
        folder = path if storage.is_local else _download(storage, path, work)
        export_folder(folder, manifest.strategy, out)
    print(f"exported the model of run {args.name} at step {manifest.global_step} "
          f"({'joined from its shards' if manifest.strategy == 'fsdp' else 'copied'}) to {out}")
    return EXIT_OK


def export_folder(folder: str, strategy: str, out: str) -> None:
    """The model in checkpoint ``folder`` as one file at ``out``."""
    import torch

    from launcher.worker.formats import TORCH_MODEL_FILE
    from launcher.worker.session import STATE_FILE

    if strategy != "fsdp":
        shutil.copyfile(os.path.join(folder, TORCH_MODEL_FILE), out + ".tmp")
        os.replace(out + ".tmp", out)
        return
    from launcher.worker.sharded import export_file

    state = torch.load(os.path.join(folder, STATE_FILE), map_location="cpu", weights_only=False)
    export_file(folder, state["_launcher"].get("model") or "model", out)


def _download(storage: Storage, path: str, work: str) -> str:
    import pyarrow.fs

    local = os.path.join(work, "checkpoint")
    os.makedirs(local)
    pyarrow.fs.copy_files(path, local, source_filesystem=storage.fs,
                          destination_filesystem=pyarrow.fs.LocalFileSystem())
    return local


COMMANDS = {"checkpoint": cmd_checkpoint}
