"""The launcher's errors: bad input (exit 2) and services that do not answer (exit 1).

Both carry one line that says what is wrong and what to do about it; the
CLI prints it without a traceback (unless --verbose).
"""

from __future__ import annotations


class LauncherError(Exception):
    """An error the CLI reports as one line: ``what``, then ``; fix``."""

    exit_code = 1

    def __init__(self, what: str, fix: str | None = None) -> None:
        self.what = what
        self.fix = fix
        super().__init__(what)

    def __str__(self) -> str:
        return f"{self.what}; {self.fix}" if self.fix else self.what

    def __reduce__(self):  # Ray pickles an error a worker raised: the fix goes with it to the driver
        return type(self), (self.what, self.fix)


class UserError(LauncherError):
    """Bad input from the user (flags, YAML, data, storage URIs, cluster size, user code).

    Found before any worker starts where the driver can know it; one a worker raises (a shard
    set's file missing, a user's function handing the launcher bad input) ends the run with
    the same one line, and the user's file:line (launcher.driver.trainer.worker_user_error).
    The fix is the user's to make. Exit code 2.
    """

    exit_code = 2


class Unreachable(LauncherError):
    """A service that should answer does not: a Ray cluster, a job server, a storage
    bucket's endpoint. Not the user's input: the message names what did not answer
    and what to check (is it up, the network, the address). Exit code 1.
    """

    exit_code = 1
