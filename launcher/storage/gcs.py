"""Google Cloud Storage access: URIs, clients and errors, emulator-aware.

Credentials come from Application Default Credentials, as with every Google
client library. When ``STORAGE_EMULATOR_HOST`` is set (tests, local trials),
both the google-cloud-storage client and pyarrow's GcsFileSystem talk to that
emulator over plain HTTP without credentials. Nothing here prints or stores a
credential or token.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from dataclasses import dataclass

from launcher.errors import UserError

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
RETRY_ENV = "LAUNCHER_GCS_RETRY_S"  # how long transient errors are retried (default 120 s)
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


def emulator_host() -> str | None:
    host = os.environ.get(EMULATOR_ENV)
    return host.rstrip("/") if host else None


def worker_env() -> dict[str, str]:
    """Environment a worker needs to reach the same storage (never credentials)."""
    host = emulator_host()
    return {EMULATOR_ENV: host} if host else {}


def filesystem():
    """A pyarrow GcsFileSystem: the emulator's when STORAGE_EMULATOR_HOST is set, else ADC."""
    import pyarrow.fs

    retry = _dt.timedelta(seconds=float(os.environ.get(RETRY_ENV, "120")))
    host = emulator_host()
    if host:
        scheme, _, endpoint = host.rpartition("://")
        return pyarrow.fs.GcsFileSystem(anonymous=True, scheme=scheme or "http", endpoint_override=endpoint,
                                        retry_time_limit=retry)
    return pyarrow.fs.GcsFileSystem(retry_time_limit=retry)


def client():
    """A google-cloud-storage client (emulator or Application Default Credentials)."""
    from google.cloud import storage

    if emulator_host():
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT", "emulator"),
                              credentials=AnonymousCredentials())
    try:
        return storage.Client()
    except Exception as exc:  # google.auth.exceptions.DefaultCredentialsError and friends
        raise UserError(f"no Google Cloud credentials: {type(exc).__name__}",
                        "run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS") from None


def retry_policy():
    """Retries for 429, 5xx and dropped connections, with exponential backoff."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_timeout(float(os.environ.get(RETRY_ENV, "120")))


def explain(exc: Exception, uri: str, action: str) -> UserError:
    """Turn a google-cloud-storage error into one actionable line."""
    from google.api_core import exceptions as gexc

    if isinstance(exc, gexc.NotFound):
        return UserError(f"cannot {action} {uri}: the bucket does not exist",
                         "create it (gcloud storage buckets create gs://BUCKET --location REGION) or fix the name")
    if isinstance(exc, (gexc.Forbidden, gexc.Unauthorized)):
        return UserError(f"cannot {action} {uri}: permission denied",
                         "grant your account roles/storage.objectAdmin on the bucket, or use another bucket")
    return UserError(f"cannot {action} {uri}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
