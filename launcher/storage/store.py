"""Where runs live: a storage root (local folder or gs://bucket/prefix) as a pyarrow filesystem.

Everything the launcher writes outside Ray Train's own checkpoints (run logs,
summaries, exported models) goes through :class:`Storage`, so the code is the
same for a local folder and a Cloud Storage bucket: paths are relative to the
root and joined with "/". Ray Train gets the same filesystem and root.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass

from launcher.storage import gcs
from launcher.errors import UserError

# As Ray Train copies checkpoints: small chunks make each GCS upload many requests.
COPY_CHUNK = 64 * 1024 * 1024


@dataclass
class Storage:
    """A storage root: ``uri`` as the user sees it, ``fs`` + ``root`` as pyarrow sees it."""

    uri: str
    fs: object  # pyarrow.fs.FileSystem
    root: str
    bucket: gcs.GcsPath | None = None

    @classmethod
    def resolve(cls, uri: str) -> "Storage":
        """Resolve a normalised storage location (see spec.normalize_storage)."""
        import pyarrow.fs

        if uri.startswith("gs://"):
            where = gcs.parse_gs_uri(uri)
            return cls(uri=where.uri, fs=gcs.filesystem(), root=where.fs_path, bucket=where)
        if "://" in uri:
            raise UserError(f"storage {uri!r}: unsupported scheme", "use a local folder or gs://BUCKET/PREFIX")
        return cls(uri=uri, fs=pyarrow.fs.LocalFileSystem(), root=uri)

    @property
    def is_local(self) -> bool:
        return self.bucket is None

    def path(self, *parts: str) -> str:
        """Path inside the filesystem (what pyarrow and Ray Train take)."""
        return posixpath.join(self.root, *parts)

    def to_uri(self, fs_path: str) -> str:
        """A filesystem path (as Ray Train reports it) as the user writes it."""
        return fs_path if self.is_local else f"gs://{fs_path}"

    def uri_of(self, *parts: str) -> str:
        """Path as the user writes it (a local path or a URI)."""
        return posixpath.join(self.uri, *parts)

    # -- reading ----------------------------------------------------------------
    def exists(self, *parts: str) -> bool:
        import pyarrow.fs

        return self.fs.get_file_info(self.path(*parts)).type != pyarrow.fs.FileType.NotFound

    def read_text(self, *parts: str) -> str | None:
        """The file's text, or None when it does not exist."""
        if not self.exists(*parts):
            return None
        with self.fs.open_input_stream(self.path(*parts)) as f:
            return f.read().decode("utf-8")

    def list_dirs(self, *parts: str) -> list[str]:
        """Names of the folders directly inside ``parts`` (empty when it does not exist)."""
        import pyarrow.fs

        if self.bucket is not None:
            return self._gcs_list_dirs(*parts)
        if not self.exists(*parts):
            return []
        infos = self.fs.get_file_info(pyarrow.fs.FileSelector(self.path(*parts)))
        return sorted(posixpath.basename(i.path) for i in infos if i.type == pyarrow.fs.FileType.Directory)

    def list_files(self, *parts: str) -> list[str]:
        """Names of the files directly inside ``parts`` (empty when there is none)."""
        import pyarrow.fs

        selector = pyarrow.fs.FileSelector(self.path(*parts), allow_not_found=True)
        return sorted(posixpath.basename(i.path) for i in self.fs.get_file_info(selector)
                      if i.type == pyarrow.fs.FileType.File)

    def _gcs_list_dirs(self, *parts: str) -> list[str]:
        # pyarrow does not list GCS "folders" that exist only as object-name
        # prefixes; the JSON API's delimiter listing does.
        prefix = "/".join(p for p in (self.bucket.prefix, *parts) if p) + "/"
        prefix = prefix.lstrip("/")
        blobs = gcs.client().list_blobs(self.bucket.bucket, prefix=prefix, delimiter="/",
                                        retry=gcs.retry_policy())
        for _ in blobs:  # the prefixes are filled in as the pages are read
            pass
        return sorted(p[len(prefix):].rstrip("/") for p in blobs.prefixes)

    # -- writing ----------------------------------------------------------------
    def makedirs(self, *parts: str) -> None:
        self.fs.create_dir(self.path(*parts), recursive=True)

    def write_text(self, text: str, *parts: str) -> None:
        """Write a whole file so that readers see the old or the new content, never half."""
        self.write_bytes(text.encode("utf-8"), *parts)

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """:meth:`write_text` for bytes (a plot, say)."""
        target = self.path(*parts)
        self.fs.create_dir(posixpath.dirname(target), recursive=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}" if self.is_local else target
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        if tmp != target:
            self.fs.move(tmp, target)

    def append_text(self, text: str, *parts: str) -> None:
        """Append to a file (objects stores have no append: read, then rewrite). A last line
        left torn by a writer that was cut off is ended first, so ``text`` starts a line."""
        if self.is_local:
            target = self.path(*parts)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "a+b") as f:
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        text = "\n" + text
                f.write(text.encode("utf-8"))
            return
        existing = self.read_text(*parts) or ""
        if existing and not existing.endswith("\n"):
            existing += "\n"
        self.write_text(existing + text, *parts)

    def create_exclusive(self, text: str, *parts: str) -> bool:
        """Create a file only if it does not exist, atomically; False when it exists."""
        target = self.path(*parts)
        if self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            return True
        from google.api_core import exceptions as gexc

        name = "/".join(p for p in (self.bucket.prefix, *parts) if p)
        blob = gcs.client().bucket(self.bucket.bucket).blob(name)
        try:
            blob.upload_from_string(text.encode("utf-8"), if_generation_match=0, retry=gcs.retry_policy())
        except gexc.PreconditionFailed:
            return False
        except Exception as exc:
            raise gcs.explain(exc, self.uri_of(*parts), "write") from None
        return True

    def remove_file(self, *parts: str) -> None:
        """Delete a file; nothing when it is already gone."""
        try:
            self.fs.delete_file(self.path(*parts))
        except FileNotFoundError:
            pass

    def upload_dir(self, local_dir: str, *parts: str) -> None:
        """Copy a local folder's files into ``parts`` (overwriting files of the same name)."""
        import pyarrow.fs

        self.makedirs(*parts)
        pyarrow.fs.copy_files(local_dir, self.path(*parts), destination_filesystem=self.fs, chunk_size=COPY_CHUNK)

    def download_dir(self, local_dir: str, *parts: str) -> None:
        """Copy the files in ``parts`` into a local folder."""
        import pyarrow.fs

        pyarrow.fs.copy_files(self.path(*parts), local_dir, source_filesystem=self.fs, chunk_size=COPY_CHUNK)

    def remove_dir(self, *parts: str) -> None:
        """Delete a folder and everything in it."""
        try:
            self.fs.delete_dir(self.path(*parts))
        except FileNotFoundError:
            # On GCS a folder can exist only as a name prefix: the objects are
            # gone, and the folder-marker object pyarrow also deletes never existed.
            if self.exists(*parts) and self.is_local:
                raise
        except OSError:
            # pyarrow's GCS filesystem says "No such directory" (a plain OSError) for a
            # prefix whose objects have all gone: nothing is left to delete.
            if self.is_local or self.exists(*parts):
                raise

    def check_writable(self) -> str:
        """Create the root and write then delete a marker; returns where the storage is.

        Raises:
            UserError: no such bucket, permission denied, or a path that cannot be written.
        """
        if self.bucket is not None:
            return self._gcs_check_writable()
        marker = f".launcher-write-test-{uuid.uuid4().hex[:8]}"
        try:
            self.makedirs()
            self.write_text("ok", marker)
            self.fs.delete_file(self.path(marker))
        except OSError as exc:
            reason = exc.strerror or str(exc).splitlines()[0]
            raise UserError(f"cannot write to storage {self.uri}: {reason}",
                            "pass --storage a folder you can write to") from None
        return f"local folder {self.uri}"

    def _gcs_check_writable(self) -> str:
        client = gcs.client()
        try:
            bucket = client.get_bucket(self.bucket.bucket, retry=gcs.retry_policy())
        except Exception as exc:
            raise gcs.explain(exc, self.uri, "use") from None
        name = "/".join(p for p in (self.bucket.prefix, f".launcher-write-test-{uuid.uuid4().hex[:8]}") if p)
        try:
            blob = bucket.blob(name)
            blob.upload_from_string(b"ok", retry=gcs.retry_policy())
            blob.delete(retry=gcs.retry_policy())
        except Exception as exc:
            raise gcs.explain(exc, self.uri, "write to") from None
        return f"{self.uri} (bucket location {bucket.location})"
