"""``launcher data``: upload data to Cloud Storage, or make a shard set to stream (``shard``, ``index``)."""

from __future__ import annotations

import argparse
import sys

from launcher.cli.options import EXIT_OK, Parser
from launcher.cli.run import sigterm_as_ctrl_c


def add_parsers(sub) -> None:
    data = sub.add_parser("data", help="data on Cloud Storage, and shard sets to stream")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", parser_class=Parser, required=True)
    up = data_sub.add_parser("upload", help="upload a data file or folder; prints the URI to pass as --data")
    up.add_argument("local", help="file or folder to upload")
    up.add_argument("uri", help="gs://BUCKET/PREFIX to upload under")

    shard = data_sub.add_parser("shard", help="write local data as a shard set (shards + index.json) to stream "
                                "from a folder or gs://")
    shard.add_argument("input", help="a folder of class folders (ROOT/CLASS/IMAGE) -> tar shards; a .csv or "
                       ".parquet table or a .npz of arrays -> parquet shards; a .jsonl file -> jsonl shards")
    shard.add_argument("output", help="local folder or gs://BUCKET/PREFIX for the set; must hold no index.json")
    shard.add_argument("--kind", help="the shards' kind when the input can be written as another "
                       "(a table as jsonl, a .jsonl as parquet); default: as listed for INPUT")
    size = shard.add_mutually_exclusive_group()
    size.add_argument("--shard-mb", type=float, metavar="MB",
                      help="cut a shard before it passes this many MiB of samples (default 64)")
    size.add_argument("--samples-per-shard", type=int, metavar="N", help="cut a shard every N samples instead")
    shard.add_argument("--keep-order", action="store_true",
                       help="write an image folder's files class by class, as listed (default: in a shuffled order, "
                       "so that every shard holds every class; tables, arrays and JSON lines keep their order)")

    index = data_sub.add_parser("index", help="write index.json for shard files already in a folder (local or "
                                "gs://), counting and hashing each")
    index.add_argument("folder", help="the folder of .tar, .parquet, .tfrecord or .jsonl shards")
    index.add_argument("--kind", help="index only the shards of this kind (parquet, jsonl, tar, tfrecord); "
                       "needed when the folder holds several; default: from the files' endings")
    index.add_argument("--overwrite", action="store_true",
                       help="replace an index.json that is already there (its fields are kept)")


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_data(args: argparse.Namespace) -> int:
    if args.data_command == "shard":
        from launcher.data import writer

        sizes = {} if args.shard_mb is None else {"shard_mb": args.shard_mb}
        with sigterm_as_ctrl_c():  # SIGTERM says what Ctrl-C says: where the unfinished set is
            made = writer.shard(args.input, args.output, kind=args.kind, samples_per_shard=args.samples_per_shard,
                                shuffle_seed=None if args.keep_order else 0, note=_progress, **sizes)
        print(f"{_summary(made)}: {made.uri} (give this to the training code)")
    elif args.data_command == "index":
        from launcher.data import writer

        made = writer.index(args.folder, kind=args.kind, overwrite=args.overwrite, note=_progress)
        print(f"indexed {_summary(made)}: {made.uri}")
    else:
        from launcher.storage.datacache import upload

        print(upload(args.local, args.uri))
    return EXIT_OK


def _summary(index) -> str:
    from launcher.data.formats import size_text

    return f"{len(index.shards)} {index.kind} shards, {index.samples:,} samples, {size_text(index.bytes)}"


COMMANDS = {"data": cmd_data}
