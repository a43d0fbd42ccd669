"""Random-access record sources with bulk reads.

Every source has ``name`` (used by ``Pipeline.explain``), ``__len__``,
``__getitem__`` (one record) and ``read_many(ids)`` (a sequence of the records
for an array of ids, in that order, read in bulk: grouped by file or row group,
one read call per group; a list, or rows already stacked as ``CollatedRows``).

``identity()`` describes the data for the pipeline fingerprint; it depends on
the data alone (never on paths' directories, modification times or object
addresses), so a dataset copied to another host keeps its identity:

- files (ArrayRecord, Parquet): each file's name, size and record count, and a
  content hash of the whole file when it is at most 1 MiB, else of its first
  64 KiB, its last 128 KiB and 16 blocks of 4 KiB (one centred in each
  sixteenth of the file): at most 1 MiB read per file. Any change of a file's
  name, size or record count, any byte changed in a file of at most 1 MiB, and
  in bigger files any change touching a sampled range, changes the identity. A
  same-size change confined to the unsampled bytes of a file over 1 MiB does
  not. Data with a manifest of checksums (written by a later ``quern prepare``)
  will be checked exactly. A ParquetSource read with ``unify_schemas=True``
  adds ``"unify_schemas": True``.
- TensorStore arrays: the spec, shape, dtype and chunk layout of each array,
  and a digest of the chunks (along the record axis) holding the first, the
  last and a few keyed rows.
- in-memory arrays: a hash of all their contents.
- other ``__len__``/``__getitem__`` objects: their type, length and a digest of
  the first, the last and a few keyed records, unless the object describes
  itself with an ``identity()`` or ``fingerprint()`` method.

Keyed rows and records are chosen from the record count alone (see
:func:`quern.pipeline.sources.base.sample_ids`), so the same data always samples the same ones.

Sources are picklable: open file handles belong to one process (per thread, or
lent to one thread at a time from a pool), are never pickled, and are reopened
lazily where the source is used.

Files must not change under a source (an open reader of a truncated or
rewritten file returns empty or wrong records without an error): ArrayRecord
and Parquet sources take each file's size, modification time, inode and device
when they open, compare them after every read from the file (one ``stat``),
and raise :class:`SourceError` naming the file when they differ. Parquet files
must agree on their schema (see :class:`ParquetSource`).
"""

from __future__ import annotations

from ..errors import SourceError
from .array_record import ArrayRecordSource
from .base import Source
from .memory import ArraySource, SequenceSource, as_source
from .parquet import ParquetSource
from .tensorstore import TensorStoreSource

__all__ = [
    "ArrayRecordSource",
    "ArraySource",
    "ParquetSource",
    "SequenceSource",
    "Source",
    "SourceError",
    "TensorStoreSource",
    "as_source",
]
