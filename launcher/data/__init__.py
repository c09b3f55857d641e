"""Streamed data: shard sets, their index, the node-local cache and the dataset that reads them.

A shard set is a folder (local or ``gs://BUCKET/PREFIX``) of shard files plus an
``index.json`` written last, so a set whose writing was cut off has no index and
is never read. The modules:

* :mod:`~launcher.data.index` reads, checks and writes ``index.json`` (what the set holds);
* :mod:`~launcher.data.formats` reads and writes one shard file of each kind
  (parquet, jsonl, WebDataset tar, TFRecord) and checks a copy against the index;
* :mod:`~launcher.data.inputs` reads the local data ``launcher data shard`` takes (an image
  folder, a table, an ``.npz``, JSON lines) as pieces of samples;
* :mod:`~launcher.data.writer` makes a set from those pieces (``launcher data shard``)
  or indexes existing shard files (``launcher data index``);
* :mod:`~launcher.data.cache` keeps a node's fetched shards within ``--data-cache-gb``;
* :mod:`~launcher.data.dataset` is :class:`Shards`, the set as a dataset of the training
  session, streamed in the run's global order (``from launcher.data import Shards``).

Only :mod:`launcher.storage` talks to gs://; nothing here imports a heavy library
when the package is imported.
"""

from launcher._lazy import lazy_exports  # noqa: E402

__all__, __getattr__ = lazy_exports(__name__, {
    "Shards": "launcher.data.dataset",
    "ShardIndex": "launcher.data.index",
    "ShardError": "launcher.data.index",
    "ShardCache": "launcher.data.cache",
    "limit_bytes": "launcher.data.cache",
})
