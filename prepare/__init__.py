"""``quern prepare``: small files, JSON lines, Parquet, ArrayRecord, tar or TFRecord in; shards, manifest, metadata out.

The output is ArrayRecord shards with a manifest and a metadata index. Run once before training: many small files become a few shards of about 128 MB
(IOPS down by orders of magnitude), and per-record metadata (lengths after the
map, scalar fields) is computed once, so filters, packing, bucketing and
balanced host slices never read a record to learn its length::

    quern prepare docs/ --output prepared/ --map mytok:encode --workers 8
    src = quern.sources.ArrayRecordSource("prepared/")   # shards, manifest, metadata

The output is deterministic (byte-identical for any worker count, local or Ray,
and any output folder), restartable (a killed run, run again, keeps its finished
shards) and atomic (nothing has its final name before it is complete). See
:func:`prepare`, ``docs/design/prepare.md`` for the record order, restarts and
processes, and :mod:`quern.pipeline.sources.prepared` for the folder.
"""

from ..pipeline.core.errors import PrepareError
from ..pipeline.sources.prepared import open_manifest, verify
from .run import parse_size, prepare

__all__ = ["PrepareError", "open_manifest", "parse_size", "prepare", "verify"]
