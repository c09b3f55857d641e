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


DEFAULT_TRACKING = "./mlruns"  # `--mlflow` alone: MLflow's file store in the launching folder
TRACKING_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")


def normalize_tracking(uri: str | None) -> str | None:
    """An MLflow tracking location (``--mlflow``): a folder becomes an absolute ``file://`` URI; a
    server or database URI is checked for a scheme MLflow knows and for credentials, which belong
    in MLflow's environment variables (the URI is kept in the run's log)."""
    if uri is None:
        return None
    text = uri.strip()
    if not text:
        raise UserError("--mlflow is empty", f"give a tracking server (http://HOST:5000), a database URI "
                        f"(sqlite:///FILE.db) or a folder (default {DEFAULT_TRACKING})")
    if text == "databricks":  # MLflow's name for a Databricks workspace's tracking
        return text
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", text)
    if scheme is None or len(scheme.group(1)) == 1:  # no scheme (C:\ is a drive, not one): a folder
        return "file://" + os.path.abspath(os.path.expanduser(text))
    name = scheme.group(1).lower().split("+", 1)[0]
    if name == "gs":
        raise UserError(f"--mlflow {text}: Cloud Storage can hold MLflow's artifacts but not its tracking store",
                        "run an MLflow tracking server (its --artifacts-destination may be gs://) and give "
                        "its http:// address")
    if name not in TRACKING_SCHEMES:
        raise UserError(f"--mlflow {text}: MLflow has no tracking store for the {name}: scheme",
                        f"use one of {', '.join(s + ':' for s in TRACKING_SCHEMES)} or a folder")
    if re.match(r"^[^:]+://[^/@]*:[^/@]*@", text):
        raise UserError("--mlflow: the tracking URI holds a password, and the URI is kept in the run's log",
                        "drop it from the URI and set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                        "(or MLFLOW_TRACKING_TOKEN)" if name in ("http", "https") else
                        "give the database's password to an MLflow tracking server and pass its http:// address")
    if name == "sqlite":
        path = text[len("sqlite://"):]
        if not path.startswith("/") or path == "/":
            raise UserError(f"--mlflow {text}: an in-memory database is gone when the launch ends",
                            "name a file: sqlite:///FILE.db")
        return "sqlite:///" + os.path.abspath(os.path.expanduser(path[1:])) if not path.startswith("//") else text
    if name == "file":
        path = text[len("file:"):]
        path = path[2:] if path.startswith("//") else path
        return "file://" + os.path.abspath(os.path.expanduser(path))
    return text
