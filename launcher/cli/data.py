"""``launcher data upload``: put a data file or folder on Cloud Storage for ``--data gs://...``."""

from __future__ import annotations

import argparse

from launcher.cli.options import EXIT_OK, Parser


def add_parsers(sub) -> None:
    data = sub.add_parser("data", help="data on Cloud Storage")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", parser_class=Parser, required=True)
    up = data_sub.add_parser("upload", help="upload a data file or folder; prints the URI to pass as --data")
    up.add_argument("local", help="file or folder to upload")
    up.add_argument("uri", help="gs://BUCKET/PREFIX to upload under")


def cmd_data(args: argparse.Namespace) -> int:
    from launcher.storage.datacache import upload

    print(upload(args.local, args.uri))
    return EXIT_OK


COMMANDS = {"data": cmd_data}
