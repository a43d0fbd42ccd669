"""Random-access record sources with bulk reads.

Every source has ``name`` (used by ``Pipeline.explain``), ``__len__``,
``__getitem__`` (one record) and ``read_many(ids)`` (the records for an array
of ids, in that order, read in bulk), and ``identity()``: a description of its
data for the pipeline fingerprint that depends on the data alone (never on
folders, modification times or object addresses), so a dataset copied to
another host keeps its identity. Sources are picklable (open handles are
reopened where the source is used). File sources refuse to read a file that
changed since they opened it (:class:`SourceError` naming it).

WebDataset tar shards, TFRecord and JSON-lines files are read in place by
record offset (:class:`WebDatasetSource`, :class:`TFRecordSource`,
:class:`JsonlSource`, on :class:`IndexedSource`), each file indexed once;
:class:`RedisStreamSource` is a live stream, whose records are the entries of a
log that grows (a pipeline over it is a
:class:`~quern.pipeline.streams.live.LiveStream`).

What each identity covers, and the checks of each kind of source, are in
``docs/design/sources.md``.

Example:
    >>> import numpy as np
    >>> src = as_source({"x": np.arange(10)})
    >>> len(src), src.read_many(np.array([3, 1]))[1]["x"].item()
    (10, 1)
"""

from __future__ import annotations

from ..core.errors import SourceError
from .array_record import ArrayRecordSource
from .base import Source
from .indexed import IndexedSource
from .jsonl import JsonlSource
from .memory import ArraySource, SequenceSource, as_source
from .parquet import ParquetSource
from .redis_stream import RedisStreamSource
from .tensorstore import TensorStoreSource
from .tfrecord import TFRecordSource
from .webdataset import WebDatasetSource

__all__ = [
    "ArrayRecordSource",
    "ArraySource",
    "IndexedSource",
    "JsonlSource",
    "ParquetSource",
    "RedisStreamSource",
    "SequenceSource",
    "Source",
    "SourceError",
    "TFRecordSource",
    "TensorStoreSource",
    "WebDatasetSource",
    "as_source",
]
