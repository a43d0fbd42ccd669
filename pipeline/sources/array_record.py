"""ArrayRecord files: records are the raw ``bytes``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import SourceError
from .base import (
    FileStats,
    HandlePool,
    Source,
    check_ids,
    expand_paths,
    file_identity,
    group_by,
)


class ArrayRecordSource(Source):
    """ArrayRecord files (a glob, a path or a list); records are the raw ``bytes``.

    Ids are global over the files in the given order (globs sorted). Reads are
    grouped by file: one ``ArrayRecordReader.read(list)`` call per file per
    ``read_many``. Readers are opened for random access
    (``readahead_buffer_size:0``) and shared by threads through a pool (a reader
    is never used by two threads at once) that keeps at most ``max_open_files``
    idle readers open.

    The files must not change while the source is in use: an open reader of a
    file truncated or rewritten under it returns empty or stale records without
    an error. So each file's size, modification time (ns), inode and device are
    taken when the source opens, and after every read of a file (one ``stat``
    per file per ``read_many``, a few microseconds) compared with them: any
    difference raises :class:`SourceError` naming the file, and the reader is
    closed (see :class:`FileStats`).
    """

    READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        name: str | None = None,
        max_open_files: int = 256,
    ):
        self.paths = expand_paths(paths, "ArrayRecordSource")
        self.name = name or os.path.basename(self.paths[0]).split("-")[0].split(".")[0] or "array_record"
        self._pool = HandlePool(max_open_files)
        self._files = FileStats("ArrayRecordSource", self.paths)  # before a reader sees them
        counts = []
        for i in range(len(self.paths)):
            reader = self._reader(i)
            counts.append(reader.num_records())
            self._pool.give(i, reader)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    def _reader(self, file_index: int) -> Any:
        """A reader of file ``file_index`` for this thread's exclusive use; give it back to ``self._pool``."""
        r = self._pool.take(file_index)
        if r is None:
            from array_record.python import array_record_module

            path = self.paths[file_index]
            counts = getattr(self, "counts", None)  # None while __init__ counts the records
            try:
                r = array_record_module.ArrayRecordReader(path, self.READER_OPTIONS)
                if not r.ok():
                    r.read([0])  # the reader keeps the failure status: reading raises it
                    raise SourceError("reader is not ok")
            except Exception as e:
                if counts is not None:  # opened before: a change is the cause to report
                    self._files.check(file_index)
                raise SourceError(f"ArrayRecordSource: cannot open {path!r}: {e}") from e
            if counts is not None and r.num_records() != counts[file_index]:
                self._files.check(file_index)
                raise SourceError(
                    f"ArrayRecordSource: {path!r} now holds {r.num_records()} records, not the "
                    f"{int(counts[file_index])} it held when the source opened it; open a new source to read it"
                )
        return r

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read_many(self, ids: np.ndarray) -> list:
        ids = check_ids(ids, len(self), f"ArrayRecordSource {self.name!r}")
        out: list = [None] * len(ids)
        file_of = np.searchsorted(self.starts, ids, side="right") - 1
        for f, where in group_by(file_of):
            local = (ids[where] - self.starts[f]).tolist()
            reader = self._reader(f)
            try:
                records = reader.read(local)
            except Exception as e:
                self._files.check(f)  # a change is the cause to report (the reader is dropped)
                self._pool.give(f, reader)
                raise SourceError(
                    f"ArrayRecordSource: reading records {local[:8]}{'...' if len(local) > 8 else ''} "
                    f"of {self.paths[f]!r} failed: {e}"
                ) from e
            self._files.check(f)  # after the read: what it returned came from the file the source opened
            self._pool.give(f, reader)
            for k, rec in zip(where.tolist(), records):
                out[k] = rec
        return out

    def identity(self) -> dict:
        return {**super().identity(), "files": file_identity(self.paths, self.counts)}
