"""Data on Cloud Storage: upload once, download once per node, verify before use.

``--data gs://bucket/prefix`` names either one object (``.../mnist.npz``) or
every object under a prefix (a folder of IDX files). Each node keeps a copy
under ``$LAUNCHER_CACHE`` (default ``~/.cache/launcher``); the ranks on a node
take a file lock so one of them downloads while the others wait. Every file
is checked against the object's size and MD5 (or CRC32C) before it is used,
and a copy that was cut off is never taken for a good one: files are
downloaded to a temporary name and renamed only once verified.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import time
from typing import Callable, Iterator

import google_crc32c

from launcher.errors import UserError
from launcher.storage import gcs
from launcher.settings import CACHE as CACHE_ENV
from launcher.storage.store import Storage

CHUNK = 8 * 1024 * 1024


def cache_root() -> str:
    return os.path.abspath(os.path.expanduser(CACHE_ENV.get()))


def local_data(data: str | None, note: Callable[[str], None] | None = None) -> str | None:
    """The local path of ``data``: itself when local, this node's verified copy when gs://."""
    if data is None or not data.startswith("gs://"):
        return data
    return fetch(data, note)


def _digests(path: str) -> tuple[str, str]:
    """Base64 MD5 and CRC32C of a file, as Cloud Storage reports them."""
    md5, crc = hashlib.md5(), google_crc32c.Checksum()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            md5.update(chunk)
            crc.update(chunk)
    return base64.b64encode(md5.digest()).decode(), base64.b64encode(crc.digest()).decode()


def _check_copy(path: str, blob) -> str | None:
    """None when the file matches the object, else what differs."""
    if not os.path.isfile(path):
        return "missing"
    if os.path.getsize(path) != blob.size:
        return f"{os.path.getsize(path)} bytes, the object has {blob.size}"
    md5, crc = _digests(path)
    if blob.md5_hash and md5 != blob.md5_hash:
        return "MD5 differs"
    if not blob.md5_hash and blob.crc32c and crc != blob.crc32c:
        return "CRC32C differs"
    return None


@contextlib.contextmanager
def node_lock(path: str) -> Iterator[None]:
    """An exclusive lock between the processes of this machine (a file lock at ``path``)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _list(uri: str):
    where = gcs.parse_gs_uri(uri, what="--data")
    try:
        blobs = list(gcs.client().list_blobs(where.bucket, prefix=where.prefix, retry=gcs.retry_policy()))
    except Exception as exc:
        raise gcs.explain(exc, uri, "read") from None
    exact = [b for b in blobs if b.name == where.prefix]
    if exact:
        return where, exact
    folder = where.prefix + "/" if where.prefix else ""
    files = [b for b in blobs if b.name.startswith(folder) and not b.name.endswith("/")]
    if not files:
        raise UserError(f"--data {uri}: no objects there",
                        f"upload the data first: launcher data upload LOCAL_PATH {uri}")
    return where, files


def fetch(uri: str, note: Callable[[str], None] | None = None) -> str:
    """Download ``uri`` into this node's cache (once) and return the local path."""
    where, blobs = _list(uri)
    root = os.path.join(cache_root(), "gcs", where.bucket)
    lock = os.path.join(cache_root(), "locks", where.bucket, hashlib.sha1(where.prefix.encode()).hexdigest())
    with node_lock(lock):
        for blob in blobs:
            dest = os.path.join(root, blob.name)
            if os.path.isfile(dest) and _check_copy(dest, blob) is None:
                continue
            if note:
                note(f"downloading gs://{where.bucket}/{blob.name} ({blob.size:,} bytes)")
            _download(blob, dest)
    return os.path.join(root, where.prefix)


def fetch_object(uri: str, what: str, note: Callable[[str], None] | None = None) -> str:
    """Download the one object ``uri`` into this node's cache (once) and return the local path.

    ``what`` names the flag that gave it (for the messages).

    Raises:
        UserError: no such object (or no such bucket), or no permission.
        Unreachable: Cloud Storage (or its emulator) did not answer.
    """
    where = gcs.parse_gs_uri(uri, what=what)
    if not where.prefix:
        raise UserError(f"{what} {uri}: names a bucket, not an object", "name the file, e.g. gs://BUCKET/code/x.tar.gz")
    client = gcs.client()
    try:
        blob = client.bucket(where.bucket).get_blob(where.prefix, retry=gcs.retry_policy())
        bucket_exists = blob is not None or client.bucket(where.bucket).exists(retry=gcs.retry_policy())
    except Exception as exc:
        raise gcs.explain(exc, uri, "read") from None
    if blob is None:
        if not bucket_exists:
            raise UserError(f"{what} {uri}: the bucket {where.bucket} does not exist", "check the bucket's name")
        raise UserError(f"{what} {uri}: no such object",
                        f"upload it first (gcloud storage cp FILE {uri}), or fix the name")
    dest = os.path.join(cache_root(), "gcs", where.bucket, where.prefix)
    lock = os.path.join(cache_root(), "locks", where.bucket, hashlib.sha1(where.prefix.encode()).hexdigest())
    with node_lock(lock):
        if not (os.path.isfile(dest) and _check_copy(dest, blob) is None):
            if note:
                note(f"downloading {uri} ({blob.size:,} bytes)")
            _download(blob, dest)
    return dest


def download_object(uri: str, dest: str) -> None:
    """Download the object ``uri`` to the local file ``dest`` through pyarrow's Cloud Storage
    client (C++: measured 3x the google-cloud-storage client's rate from the emulator), retried
    for ``LAUNCHER_GCS_RETRY_S``. FileNotFoundError when there is no such object; an outage is
    one line (Unreachable)."""
    where = gcs.parse_gs_uri(uri, what="data")
    storage = Storage.resolve(f"gs://{where.bucket}")
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    start = time.monotonic()
    try:
        with storage.fs.open_input_stream(storage.path(where.prefix)) as src, open(dest, "wb") as out:
            while True:
                chunk = src.read(CHUNK)
                if not chunk:
                    break
                out.write(chunk)
    except FileNotFoundError:
        raise FileNotFoundError(uri) from None
    except OSError as exc:
        raise gcs.explain(exc, uri, "download", time.monotonic() - start) from None


def _download(blob, dest: str) -> None:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f"{dest}.part-{os.getpid()}"
    try:
        blob.download_to_filename(tmp, retry=gcs.retry_policy(), checksum=None)
        problem = _check_copy(tmp, blob)
        if problem:
            raise UserError(f"download of gs://{blob.bucket.name}/{blob.name} is corrupt ({problem})",
                            "run again; if it persists, upload the file again")
        os.replace(tmp, dest)
    except UserError:
        raise
    except Exception as exc:
        raise gcs.explain(exc, f"gs://{blob.bucket.name}/{blob.name}", "download") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def upload(local: str, uri: str, show_progress: bool = True) -> str:
    """Upload a file or a folder under gs://bucket/prefix; returns the URI to pass as --data.

    A file lands at prefix/<file name>; a folder's files keep their paths
    relative to the folder. Each upload is verified against its MD5.
    """
    where = gcs.parse_gs_uri(uri, what="destination")
    if not os.path.exists(local):
        raise UserError(f"{local} does not exist", "pass a data file or folder to upload")
    if os.path.isfile(local):
        files = [(local, os.path.basename(local))]
        result = f"{where.uri}/{os.path.basename(local)}"
    else:
        files = [(os.path.join(d, n), os.path.relpath(os.path.join(d, n), local))
                 for d, _, names in sorted(os.walk(local)) for n in sorted(names)]
        result = where.uri
    if not files:
        raise UserError(f"{local} holds no files", "pass a folder with the data files")
    client = gcs.client()
    try:
        bucket = client.get_bucket(where.bucket, retry=gcs.retry_policy())
    except Exception as exc:
        raise gcs.explain(exc, where.uri, "upload to") from None
    total = sum(os.path.getsize(p) for p, _ in files)
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="upload", disable=not show_progress) as bar:
        for path, rel in files:
            name = "/".join(p for p in (where.prefix, rel.replace(os.sep, "/")) if p)
            blob = bucket.blob(name)
            md5, _ = _digests(path)
            try:
                blob.upload_from_filename(path, retry=gcs.retry_policy(), checksum="md5")
                blob.reload(retry=gcs.retry_policy())
            except Exception as exc:
                raise gcs.explain(exc, f"gs://{where.bucket}/{name}", "upload to") from None
            if blob.md5_hash and blob.md5_hash != md5:
                raise UserError(f"gs://{where.bucket}/{name}: uploaded MD5 differs from the local file",
                                "run the upload again")
            bar.update(os.path.getsize(path))
    return result
