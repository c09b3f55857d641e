"""Reading and writing files under a local folder or a gs:// URI (AIP_*_DIR can be either)."""

import io
import os

import torch


def _blob(uri: str):
    from google.cloud import storage  # honours STORAGE_EMULATOR_HOST

    bucket, _, name = uri[len("gs://"):].partition("/")
    return storage.Client().bucket(bucket).blob(name)


def join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def save(obj, uri: str) -> None:
    """torch.save to a file, atomically: a reader never sees half a checkpoint."""
    if uri.startswith("gs://"):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        _blob(uri).upload_from_string(buffer.getvalue())  # an object appears whole or not at all
        return
    os.makedirs(os.path.dirname(uri), exist_ok=True)
    tmp = uri + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, uri)


def load(uri: str):
    """torch.load from a file; None when there is none."""
    if uri.startswith("gs://"):
        blob = _blob(uri)
        if not blob.exists():
            return None
        return torch.load(io.BytesIO(blob.download_as_bytes()), weights_only=True)
    if not os.path.exists(uri):
        return None
    return torch.load(uri, weights_only=True)
