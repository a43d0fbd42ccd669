"""Lengths measured as a packing plan reaches documents, cached on disk by chunk of record ids.

A ``first_fit`` pack without a length index (:mod:`quern.pipeline.order.first_fit`'s
``GrowingPlan``) asks for the lengths of the documents it reaches, a window at a
time. :class:`LazyLengths` answers from memory, then from its cache files (one per
chunk of :data:`CHUNK` record ids and per column: verified index files under
``lengths/``, keyed by the fingerprint of the source, the record transforms, the
column and the chunk), and measures the rest (one bulk read and one pass of the
transforms, :func:`~quern.pipeline.definition.scan.column_lengths`), writing the
chunks it completed. Processes that share the cache folder share the work done; two
that measure the same documents at once write the same values. A length depends only
on the record and the transforms.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..identity.fingerprint import fingerprint_of
from ..order import indexfile
from . import scan

__all__ = ["CHUNK", "LazyLengths"]

CHUNK = 1 << 16  # record ids per cache file


class LazyLengths:
    """The lengths of a pipeline's records in some columns, measured when first asked for.

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
        self.values = np.full((self.n, len(self.keys)), -1, dtype=np.int64)
        self._loaded: set[int] = set()

    def __getstate__(self) -> dict[str, Any]:
        """Without the values: a process that loads it reads the cache files."""
        return {k: v for k, v in self.__dict__.items() if k not in ("values", "_loaded")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore :meth:`__getstate__`'s state, nothing known yet."""
        self.__dict__.update(state)
        self.values = np.full((self.n, len(self.keys)), -1, dtype=np.int64)
        self._loaded = set()

    def _path(self, chunk: int, column: int) -> tuple[str, str]:
        key = fingerprint_of({"lazy_lengths": self.key, "chunk": chunk, "column": column})
        return indexfile.path_for(key, self.cache_dir, kind=indexfile.LENGTHS), key

    def _bounds(self, chunk: int) -> tuple[int, int]:
        return chunk * CHUNK, min(self.n, (chunk + 1) * CHUNK)

    def _load(self, chunk: int) -> None:
        if chunk in self._loaded:
            return
        self._loaded.add(chunk)
        lo, hi = self._bounds(chunk)
        for c in range(len(self.keys)):
            path, key = self._path(chunk, c)
            got, _ = indexfile.load(path, hi - lo, kind=indexfile.LENGTHS, key=key)
            if got is not None:
                known = np.asarray(got) >= 0
                self.values[lo:hi, c][known] = np.asarray(got)[known]

    def _store(self, chunk: int) -> None:
        lo, hi = self._bounds(chunk)
        for c in range(len(self.keys)):
            path, key = self._path(chunk, c)
            try:
                indexfile.store(path, self.values[lo:hi, c], hi - lo, kind=indexfile.LENGTHS, key=key)
            except OSError:
                return  # a cache that cannot be written: the lengths stay in memory

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """The lengths of records ``ids`` in every column, ``(len(ids), len(keys))``.

        Raises:
            ScanError: a record could not be read or measured (named).
        """
        ids = np.asarray(ids, dtype=np.int64)
        chunks = np.unique(ids // CHUNK).tolist()
        for chunk in chunks:
            self._load(chunk)
        todo = np.unique(ids[(self.values[ids] < 0).any(axis=1)])
        if todo.size:
            self.values[todo] = scan.column_lengths(self.prefix, todo, self.keys)
            for chunk in np.unique(todo // CHUNK).tolist():
                self._store(chunk)
        return self.values[ids]
