"""Lengths measured as a packing plan reaches documents, cached on disk by chunk of record ids.

A ``first_fit`` pack without a length index (:mod:`quern.pipeline.order.first_fit`'s
``GrowingPlan``) asks for the lengths of the documents it reaches, a window at a
time. :class:`LazyLengths` answers from memory, then from its cache files (one per
chunk of :data:`CHUNK` record ids and per column: verified index files under
``lengths/``, keyed by the fingerprint of the source, the record transforms, the
column and the chunk), and measures the rest (one bulk read and one pass of the
transforms, :func:`~quern.pipeline.definition.scan.column_lengths`), writing a chunk's
files once an eighth of it is new or it is complete, and the rest when it goes away. Processes that share the cache folder share the work done; two
that measure the same documents at once write the same values. A length depends only
on the record and the transforms.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np

from ..identity.fingerprint import fingerprint_of
from ..order import indexfile
from . import scan

__all__ = ["CHUNK", "LazyLengths"]

CHUNK = 1 << 16  # record ids per cache file


class _Files:
    """The cache files of one :class:`LazyLengths`: read once per chunk, written when due and at the end.

    Holds the values array, not the :class:`LazyLengths`, so that it can flush when that object goes away.
    """

    def __init__(self, key: str, n: int, columns: int, cache_dir: str | None, values: np.ndarray) -> None:
        self.key, self.n, self.columns, self.cache_dir, self.values = key, n, columns, cache_dir, values
        self.loaded: set[int] = set()
        self.unsaved: dict[int, int] = {}  # chunk -> lengths measured since its files were last written

    def path(self, chunk: int, column: int) -> tuple[str, str]:
        key = fingerprint_of({"lazy_lengths": self.key, "chunk": chunk, "column": column})
        return indexfile.path_for(key, self.cache_dir, kind=indexfile.LENGTHS), key

    def bounds(self, chunk: int) -> tuple[int, int]:
        return chunk * CHUNK, min(self.n, (chunk + 1) * CHUNK)

    def load(self, chunk: int) -> None:
        """Take the lengths of ``chunk``'s verified files into ``values`` (once)."""
        if chunk in self.loaded:
            return
        self.loaded.add(chunk)
        lo, hi = self.bounds(chunk)
        for c in range(self.columns):
            path, key = self.path(chunk, c)
            got, _ = indexfile.load(path, hi - lo, kind=indexfile.LENGTHS, key=key)
            if got is not None:
                known = np.asarray(got) >= 0
                self.values[lo:hi, c][known] = np.asarray(got)[known]

    def measured(self, ids: np.ndarray) -> None:
        """Records ``ids`` were just measured: write each chunk whose files are due.

        A shuffled window touches many chunks, and writing every touched file at every window would
        write the whole cache again and again; a chunk's files are written once an eighth of the chunk
        is new or it is complete, and the rest by :meth:`flush`.
        """
        chunks, added = np.unique(ids // CHUNK, return_counts=True)
        for chunk, k in zip(chunks.tolist(), added.tolist()):
            self.unsaved[chunk] = self.unsaved.get(chunk, 0) + k
            lo, hi = self.bounds(chunk)
            if self.unsaved[chunk] * 8 >= hi - lo or bool((self.values[lo:hi] >= 0).all()):
                self.store(chunk)

    def store(self, chunk: int) -> None:
        self.unsaved.pop(chunk, None)
        lo, hi = self.bounds(chunk)
        for c in range(self.columns):
            path, key = self.path(chunk, c)
            try:
                indexfile.store(path, self.values[lo:hi, c], hi - lo, kind=indexfile.LENGTHS, key=key)
            except OSError:
                return  # a cache that cannot be written: the lengths stay in memory

    def flush(self) -> None:
        """Write every chunk with lengths not written yet."""
        for chunk in list(self.unsaved):
            self.store(chunk)


class LazyLengths:
    """The lengths of a pipeline's records in some columns, measured when first asked for.

    The cache files of the chunks measured are written when due and, for the rest, when this
    object goes away or the process ends.

    Attributes:
        prefix: the pipeline whose records are measured (its record transforms applied).
        keys: the columns (``None``: the record itself).
        key: the fingerprint of the source, the transforms and the columns (the cache key).
        n: the records of the source.
        values: ``(n, len(keys))``, ``-1`` where not known yet (this process's memory).
    """

    def __init__(self, prefix: Any, keys: list[str | None], key: str, n: int, cache_dir: str | os.PathLike | None):
        self.prefix, self.keys, self.key, self.n = prefix, list(keys), key, int(n)
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self._start()

    def _start(self) -> None:
        self.values = np.full((self.n, len(self.keys)), -1, dtype=np.int64)
        self._files = _Files(self.key, self.n, len(self.keys), self.cache_dir, self.values)
        weakref.finalize(self, self._files.flush)

    def __getstate__(self) -> dict[str, Any]:
        """Without the values: a process that loads it reads the cache files."""
        return {k: v for k, v in self.__dict__.items() if k not in ("values", "_files")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore :meth:`__getstate__`'s state, nothing known yet."""
        self.__dict__.update(state)
        self._start()

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """The lengths of records ``ids`` in every column, ``(len(ids), len(keys))``.

        Raises:
            ScanError: a record could not be read or measured (named).
        """
        ids = np.asarray(ids, dtype=np.int64)
        for chunk in np.unique(ids // CHUNK).tolist():
            self._files.load(chunk)
        todo = np.unique(ids[(self.values[ids] < 0).any(axis=1)])
        if todo.size:
            self.values[todo] = scan.column_lengths(self.prefix, todo, self.keys)
            self._files.measured(todo)
        return self.values[ids]
