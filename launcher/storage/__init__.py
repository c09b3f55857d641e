"""Where runs and data live: storage URIs, Cloud Storage, the data cache, checkpoints, run logs.

:class:`Storage` is a storage root (a local folder or ``gs://bucket/prefix``)
seen through one pyarrow filesystem. The modules beside it:

* :mod:`~launcher.storage.uri` parses and normalises storage and data URIs (pure);
* :mod:`~launcher.storage.gcs` makes the google-cloud-storage and pyarrow clients,
  emulator-aware, and turns their errors into one line;
* :mod:`~launcher.storage.datacache` verifies and caches ``gs://`` data per node;
* :mod:`~launcher.storage.checkpoint` is the checkpoint manifest (what is complete);
* :mod:`~launcher.storage.runlog` names a run folder's records, writes them (``RunLog``) and
  reads them back (``RunRecord``); :mod:`~launcher.storage.runs` lists runs from them.
"""

from launcher._lazy import lazy_exports
from launcher.storage.store import Storage

_lazy, __getattr__ = lazy_exports(__name__, {
    "Manifest": "launcher.storage.checkpoint",
    "complete_checkpoints": "launcher.storage.checkpoint",
    "read_manifest": "launcher.storage.checkpoint",
    "write_manifest": "launcher.storage.checkpoint",
    "emulator_host": "launcher.storage.gcs",
    "cache_root": "launcher.storage.datacache",
    "CACHE_ENV": "launcher.storage.datacache",
    "normalize_storage": "launcher.storage.uri",
    "RunRecord": "launcher.storage.runlog",
})
__all__ = ["Storage", *_lazy]
