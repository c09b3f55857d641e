"""User-facing errors: one line that says what is wrong, why, and how to fix it."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (flags, YAML, data, storage, cluster size).

    The CLI prints ``str(error)`` as a single line and exits non-zero without a
    traceback (unless --verbose).
    """

    def __init__(self, what: str, fix: str | None = None) -> None:
        self.what = what
        self.fix = fix
        super().__init__(what)

    def __str__(self) -> str:
        return f"{self.what}; {self.fix}" if self.fix else self.what
