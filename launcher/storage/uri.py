"""Storage and data locations as the user writes them: a local path or ``gs://bucket/prefix``.

Pure functions (no client, no network): parse and normalise what a flag or a
YAML key gave, or raise a :class:`~launcher.errors.UserError` saying what is
malformed and how to write it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from launcher.errors import UserError

DEFAULT_STORAGE = "./runs"
URI_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class GcsPath:
    bucket: str
    prefix: str  # no leading or trailing slash; may be empty

    @property
    def uri(self) -> str:
        return f"gs://{self.bucket}/{self.prefix}".rstrip("/")

    @property
    def fs_path(self) -> str:
        """The path pyarrow's GcsFileSystem (and Ray Train) take: bucket/prefix."""
        return f"{self.bucket}/{self.prefix}".rstrip("/")


def parse_gs_uri(uri: str, what: str = "storage") -> GcsPath:
    """Split gs://bucket/prefix, or raise UserError saying what is malformed."""
    if not uri.startswith("gs://"):
        raise UserError(f"{what} {uri!r} is not a gs:// URI", "write gs://BUCKET/PREFIX")
    rest = uri[len("gs://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UserError(f"{what} {uri!r} names no bucket", "write gs://BUCKET/PREFIX")
    if not BUCKET_RE.match(bucket):
        raise UserError(f"{what} {uri!r}: {bucket!r} is not a valid bucket name",
                        "bucket names have 3-63 lowercase letters, digits, '-', '_' or '.'")
    prefix = prefix.strip("/")
    if "//" in prefix:
        raise UserError(f"{what} {uri!r} has an empty path segment ('//')", "remove the doubled slash")
    return GcsPath(bucket, prefix)


def normalize_storage(storage: str) -> str:
    """A local storage path made absolute (Ray Train needs one); URIs are checked for a known scheme."""
    if URI_LIKE.match(storage) and "://" not in storage:
        raise UserError(f"storage {storage!r} looks like a URI but is malformed",
                        "write scheme://bucket/prefix, or ./path for a local folder")
    if storage.startswith("gs://"):
        return parse_gs_uri(storage).uri
    if "://" in storage:
        scheme = storage.split("://", 1)[0]
        raise UserError(f"storage {storage!r}: the {scheme}:// scheme is not supported",
                        "use a local folder or gs://BUCKET/PREFIX")
    if not storage:
        raise UserError("storage is empty", f"use a local folder, for example {DEFAULT_STORAGE}")
    return os.path.abspath(os.path.expanduser(storage))


def normalize_data(data: str | None) -> str | None:
    if data is None:
        return None
    if data.startswith("gs://"):
        return parse_gs_uri(data, what="--data").uri
    if URI_LIKE.match(data):
        raise UserError(f"--data {data!r}: only local paths and gs:// URIs are supported",
                        "write gs://BUCKET/PREFIX or a local path")
    return os.path.abspath(os.path.expanduser(data))
