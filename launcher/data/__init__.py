"""Streamed data: shard sets, their index, the node-local cache and the dataset that reads them.

A shard set is a folder (local or ``gs://BUCKET/PREFIX``) of shard files plus an
``index.json`` written last, so a set whose writing was cut off has no index and
is never read. The modules:

* :mod:`~launcher.data.index` reads, checks and writes ``index.json`` (what the set holds);
* :mod:`~launcher.data.formats` reads and writes one shard file of each kind
  (parquet, jsonl, WebDataset tar, TFRecord) and checks a copy against the index;
* :mod:`~launcher.data.writer` makes a set from local data (``launcher data shard``)
  or indexes existing shard files (``launcher data index``).

Only :mod:`launcher.storage` talks to gs://; nothing here imports a heavy library
when the package is imported.
"""
