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
import sys

from launcher.errors import LauncherError, Unreachable, UserError
from launcher.settings import GCS_RETRY_S
from launcher.storage.uri import GcsPath, parse_gs_uri

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
__all__ = ["GcsPath", "parse_gs_uri", "EMULATOR_ENV", "emulator_host", "worker_env", "filesystem", "client",
           "retry_policy", "explain"]


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

    retry = _dt.timedelta(seconds=float(GCS_RETRY_S.get()))
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


def _retry_notice():
    """An on_error callback: the first retry of an operation says what does not answer and for
    how long it is tried, so a storage outage is not minutes of silence."""
    said = []

    def say(exc: Exception) -> None:
        if said:
            return
        said.append(exc)

        where = (f"the Cloud Storage emulator at {emulator_host()} ({EMULATOR_ENV})" if emulator_host()
                 else "Cloud Storage")
        print(f"launcher: {where} did not answer ({type(exc).__name__}); retrying for up to "
              f"{float(GCS_RETRY_S.get()):g}s ({GCS_RETRY_S} sets it)", file=sys.stderr, flush=True)

    return say


def retry_policy():
    """Retries for 429, 5xx and dropped connections, with exponential backoff; the first
    retry is said on stderr."""
    from google.api_core.retry import Retry
    from google.cloud.storage.retry import DEFAULT_RETRY

    return Retry(predicate=DEFAULT_RETRY._predicate, initial=DEFAULT_RETRY._initial,
                 maximum=DEFAULT_RETRY._maximum, multiplier=DEFAULT_RETRY._multiplier,
                 timeout=float(GCS_RETRY_S.get()), on_error=_retry_notice())


def _shortened(text: str, limit: int = 200) -> str:
    """At most ``limit`` characters, cut at a word boundary."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def explain(exc: Exception, uri: str, action: str, waited_s: float | None = None) -> LauncherError:
    """Turn a google-cloud-storage error into one actionable line: bad input (a bucket that
    does not exist, no permission) is a UserError; a service that does not answer is Unreachable.
    ``waited_s``: how long the call went on (its retries included), when the caller timed it: the
    line then says that, not the retry setting (a try that hangs can outlast the setting)."""
    from google.api_core import exceptions as gexc

    if isinstance(exc, gexc.NotFound):
        return UserError(f"cannot {action} {uri}: the bucket does not exist",
                         "create it (gcloud storage buckets create gs://BUCKET --location REGION) or fix the name")
    if isinstance(exc, (gexc.Forbidden, gexc.Unauthorized)):
        return UserError(f"cannot {action} {uri}: permission denied",
                         "grant your account roles/storage.objectAdmin on the bucket, or use another bucket")
    first = _shortened((str(exc).splitlines() or [""])[0])
    if isinstance(exc, (gexc.ServerError, gexc.TooManyRequests, gexc.RetryError, OSError)) or \
            "connection" in type(exc).__name__.lower():
        why = outage_cause(exc, waited_s)
        if emulator_host():
            return Unreachable(f"cannot {action} {uri}: the Cloud Storage emulator at {emulator_host()} "
                               f"({EMULATOR_ENV}) did not answer ({why})",
                               f"start the emulator, or unset {EMULATOR_ENV} to use Cloud Storage itself")
        return Unreachable(f"cannot {action} {uri}: Cloud Storage did not answer ({why})",
                           "check the network and https://status.cloud.google.com, then run the command again")
    return UserError(f"cannot {action} {uri}: {type(exc).__name__}: {first}")


def outage_cause(exc: Exception, waited_s: float | None = None) -> str:
    """What happened, in a few words, for a service that did not answer (not the library's text)."""
    limit = float(GCS_RETRY_S.get())
    if waited_s is None:
        retried = f"; retried for {limit:g}s ({GCS_RETRY_S} sets it)"
    else:
        retried = f"; tried for {waited_s:.0f} s, retries included ({GCS_RETRY_S}={limit:g} bounds the retries)"
    exc = getattr(exc, "cause", None) or exc  # a RetryError: what the last try met
    text = str(exc).lower()
    if "refused" in text or "could not connect" in text:
        return "connection refused" + retried
    if "timed out" in text or "timeout" in text:
        return "no reply, the connection stayed silent" + retried
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return f"HTTP {code}" + retried
    return type(exc).__name__ + retried

