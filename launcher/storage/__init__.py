"""Where runs and data live: storage URIs, Cloud Storage, the data cache, checkpoints, run logs.

:class:`Storage` is a storage root (a local folder or ``gs://bucket/prefix``)
seen through one pyarrow filesystem. The modules beside it:

* :mod:`~launcher.storage.uri` parses and normalises storage and data URIs (pure);
* :mod:`~launcher.storage.gcs` makes the google-cloud-storage and pyarrow clients,
  emulator-aware, and turns their errors into one line;
* :mod:`~launcher.storage.datacache` verifies and caches ``gs://`` data per node;
* :mod:`~launcher.storage.checkpoint` is the checkpoint manifest (what is complete);
* :mod:`~launcher.storage.runlog` writes a run's log; :mod:`~launcher.storage.runs` reads them back.
"""

from launcher.storage.store import Storage

__all__ = ["Storage"]
