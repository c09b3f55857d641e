"""Where runs live: a storage root resolved to a pyarrow filesystem.

Everything the launcher writes outside Ray Train's own checkpoints (run logs,
summaries, exported models) goes through :class:`Storage`, so the code is the
same for a local folder and, once it is added, an object store: paths are
relative to the root and joined with "/".
"""

from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass

from launcher.errors import UserError


@dataclass
class Storage:
    """A storage root: ``uri`` as the user sees it, ``fs`` + ``root`` as pyarrow sees it."""

    uri: str
    fs: object  # pyarrow.fs.FileSystem
    root: str

    @classmethod
    def resolve(cls, uri: str) -> "Storage":
        """Resolve a normalised storage location (see spec.normalize_storage)."""
        import pyarrow.fs

        if "://" in uri:
            raise UserError(f"storage {uri!r}: only local folders are supported", "use a local folder path")
        return cls(uri=uri, fs=pyarrow.fs.LocalFileSystem(), root=uri)

    @property
    def is_local(self) -> bool:
        return "://" not in self.uri

    def path(self, *parts: str) -> str:
        """Path inside the filesystem (what pyarrow and Ray Train take)."""
        return posixpath.join(self.root, *parts)

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

        if not self.exists(*parts):
            return []
        infos = self.fs.get_file_info(pyarrow.fs.FileSelector(self.path(*parts)))
        return sorted(posixpath.basename(i.path) for i in infos if i.type == pyarrow.fs.FileType.Directory)

    # -- writing ----------------------------------------------------------------
    def makedirs(self, *parts: str) -> None:
        self.fs.create_dir(self.path(*parts), recursive=True)

    def write_text(self, text: str, *parts: str) -> None:
        """Write a whole file so that readers see the old or the new content, never half."""
        target = self.path(*parts)
        self.fs.create_dir(posixpath.dirname(target), recursive=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}" if self.is_local else target
        with self.fs.open_output_stream(tmp) as f:
            f.write(text.encode("utf-8"))
        if tmp != target:
            self.fs.move(tmp, target)

    def append_text(self, text: str, *parts: str) -> None:
        """Append to a file (objects stores have no append: read, then rewrite)."""
        if self.is_local:
            target = self.path(*parts)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "a", encoding="utf-8") as f:
                f.write(text)
            return
        self.write_text((self.read_text(*parts) or "") + text, *parts)

    def upload_dir(self, local_dir: str, *parts: str) -> None:
        """Copy a local folder's files into ``parts`` (overwriting files of the same name)."""
        import pyarrow.fs

        self.makedirs(*parts)
        pyarrow.fs.copy_files(local_dir, self.path(*parts), destination_filesystem=self.fs)

    def check_writable(self) -> None:
        """Create the root and write then delete a marker file, or raise UserError."""
        marker = f".launcher-write-test-{uuid.uuid4().hex[:8]}"
        try:
            self.makedirs()
            self.write_text("ok", marker)
            self.fs.delete_file(self.path(marker))
        except OSError as exc:
            reason = exc.strerror or str(exc).splitlines()[0]
            raise UserError(f"cannot write to storage {self.uri}: {reason}",
                            "pass --storage a folder you can write to") from None
