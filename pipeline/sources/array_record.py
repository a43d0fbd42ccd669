"""ArrayRecord files: records are the raw ``bytes``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import SourceError
from . import prepared
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

    ``paths`` may also be a folder written by ``quern prepare`` (or its
    ``manifest.json``; alone, or as the one item of a list): the source reads the shards its manifest names, in
    order, after checking that each is there with its size and record count
    (:func:`~quern.pipeline.sources.prepared.open_manifest`); a folder without a
    complete manifest is refused, naming what is missing. ``manifest`` is then the
    manifest, :attr:`metadata` its metadata index (per-record ``length`` and the
    prepared scalar fields, read and checked on first use), ``name`` the folder's
    name, and the identity holds the manifest's SHA-256 checksums of the shards
    (exact, and free) instead of sampled hashes.

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
        self.folder: str | None = None
        self.manifest: dict[str, Any] | None = None
        self._metadata: dict[str, np.ndarray] | None = None
        if isinstance(paths, (str, os.PathLike)):
            one: str | None = os.fspath(paths)
        else:
            one = os.fspath(paths[0]) if len(paths) == 1 else None
        if one is not None and os.path.basename(one) == prepared.MANIFEST and os.path.isfile(one):
            one = os.path.dirname(one) or "."
        if one is not None and os.path.isdir(one):
            self.folder = os.path.abspath(one)
            self.manifest = prepared.open_manifest(self.folder)
            self.paths = [os.path.join(self.folder, s["file"]) for s in self.manifest["shards"]]
            default = os.path.basename(self.folder) or "prepared"
        else:
            self.paths = expand_paths(paths, "ArrayRecordSource")
            default = os.path.basename(self.paths[0]).split("-")[0].split(".")[0] or "array_record"
        self.name = name or default
        self._pool = HandlePool(max_open_files)
        self._files = FileStats("ArrayRecordSource", self.paths)  # before a reader sees them
        counts = []
        for i in range(len(self.paths)):
            reader = self._reader(i)
            counts.append(reader.num_records())
            self._pool.give(i, reader)
        self.counts = np.asarray(counts, dtype=np.int64)
        if self.manifest is not None:
            for s, c in zip(self.manifest["shards"], counts):
                if c != s["records"]:
                    raise SourceError(
                        f"ArrayRecordSource: {self.folder!r}: shard {s['file']!r} holds {c} records; its manifest "
                        f"says {s['records']}"
                    )
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

    @property
    def metadata(self) -> dict[str, np.ndarray]:
        """The metadata index of a prepared folder: ``{field: read-only array}``, one
        value per record (``length`` and the prepared fields); checked against the
        manifest's checksums when first read. A ``ValueError`` for plain files."""
        if self.manifest is None or self.folder is None:
            raise ValueError(
                f"ArrayRecordSource {self.name!r} has no metadata: it reads files, not a folder written by quern prepare"
            )
        if self._metadata is None:
            self._metadata = prepared.load_metadata(self.folder, self.manifest)
        return self._metadata

    @property
    def has_metadata(self) -> bool:
        """Whether the source is a prepared folder with a metadata index."""
        return self.manifest is not None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_metadata": None}  # workers read the metadata again if they need it

    def identity(self) -> dict:
        if self.manifest is not None:  # exact: the manifest's checksums
            shards = [
                {"file": s["file"], "size": s["bytes"], "records": s["records"], "sha256": s["sha256"]}
                for s in self.manifest["shards"]
            ]
            return {**super().identity(), "files": shards}
        return {**super().identity(), "files": file_identity(self.paths, self.counts)}
