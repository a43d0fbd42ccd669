"""TensorStore arrays (zarr, zarr3, ...): the first axis is the record axis."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.errors import SourceError
from ..identity.hashing import digest
from .base import (
    Source,
    ThreadLocalHandles,
    check_ids,
    sample_ids,
)


def _tensorstore_spec(spec: Any) -> Any:
    """A path to a zarr/zarr3 array directory becomes a TensorStore spec; specs pass through."""
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if os.path.exists(os.path.join(path, "zarr.json")):
            driver = "zarr3"
        elif os.path.exists(os.path.join(path, ".zarray")):
            driver = "zarr"
        else:
            raise FileNotFoundError(
                f"TensorStoreSource: {path!r} is not a zarr (.zarray) or zarr3 (zarr.json) array directory"
            )
        return {"driver": driver, "kvstore": {"driver": "file", "path": path}}
    return spec


class TensorStoreSource(Source):
    """TensorStore arrays; the first axis is the record axis.

    One array gives each row as an array; a dict of arrays gives a dict of
    rows. ``read_many`` issues one read per array for the sorted unique rows
    needed (one slice when they are contiguous).

    Args:
        spec: a TensorStore spec or the path of a zarr/zarr3 array folder, or a
            dict of name -> spec or path (all of one first dimension).
        name: the source's name (default ``"tensorstore"``, or the names joined by ``+``).

    Raises:
        FileNotFoundError: a path is not a zarr or zarr3 array folder.
        SourceError: an array cannot be opened.
        ValueError: an array is a scalar, or the arrays differ in first dimension.
    """

    def __init__(self, spec: Any, name: str | None = None):
        self._single = not isinstance(spec, Mapping) or "driver" in spec
        specs = {"": spec} if self._single else dict(spec)
        self.specs = {k: _tensorstore_spec(v) for k, v in specs.items()}
        self._handles = ThreadLocalHandles()
        lengths = {k: int(self._store(k).shape[0]) for k in self.specs}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"TensorStoreSource: arrays differ in first dimension: {lengths}")
        self._len = next(iter(lengths.values()))
        self.name = name or ("tensorstore" if self._single else "+".join(self.specs))

    def _store(self, key: str) -> Any:
        handles = self._handles.get()
        st = handles.get(key)
        if st is None:
            import tensorstore as ts

            try:
                st = ts.open(self.specs[key], open=True, read=True).result()
            except Exception as e:
                raise SourceError(f"TensorStoreSource: cannot open {self.specs[key]!r}: {e}") from e
            if st.rank < 1:
                raise ValueError(f"TensorStoreSource: {self.specs[key]!r} is a scalar; need a record axis")
            st = st[ts.d[0].translate_to[0]]  # record i is row i of the domain, whatever its origin
            handles[key] = st
        return st

    def __len__(self) -> int:
        return self._len

    def read_many(self, ids: np.ndarray) -> list:
        """The rows ``ids``, in that order.

        Args:
            ids: record ids in ``[0, len(self))``.

        Returns:
            A list of arrays (one array), or of dicts of arrays (a dict of arrays).

        Raises:
            IndexError: an id is out of range.
            SourceError: a read failed.
        """
        ids = check_ids(ids, len(self), f"TensorStoreSource {self.name!r}")
        if not ids.size:
            return []
        uniq, inverse = np.unique(ids, return_inverse=True)
        cols = {}
        for key in self.specs:
            st = self._store(key)
            try:
                lo, hi = int(uniq[0]), int(uniq[-1]) + 1
                if hi - lo == uniq.size:  # contiguous: one slice read
                    block = st[lo:hi].read().result()
                else:
                    block = st[uniq].read().result()
            except Exception as e:
                raise SourceError(f"TensorStoreSource: reading rows of {self.specs[key]!r} failed: {e}") from e
            cols[key] = block[inverse]
        if self._single:
            return list(cols[""])
        names = list(cols)
        return [{k: cols[k][i] for k in names} for i in range(len(ids))]

    SAMPLE_BAND_BYTES = 8 << 20

    def identity(self) -> dict:
        """A description of the data for the pipeline fingerprint.

        Returns:
            The type, name, length, the specs (with each ``path`` cut to its last
            component, so that an array copied to another folder keeps its identity)
            and, per array (``arrays[key]``, key ``""`` for a single array), its
            shape, dtype, chunk layout and a content sample (see :meth:`_array_identity`).

        Raises:
            SourceError: the sample rows cannot be read.
        """
        return {
            **super().identity(),
            "specs": {k: _json_safe(_relocatable(v)) for k, v in self.specs.items()},
            "arrays": {k: self._array_identity(k) for k in self.specs},
        }

    def _array_identity(self, key: str) -> dict:
        """``{"shape", "dtype", "chunk_layout", "sample"}`` of array ``key``.

        ``sample`` is the digest of the bands of rows that share a read chunk
        along the record axis with the rows :func:`sample_ids` picks (first,
        last and five keyed ones; reading a row fetches those chunks anyway), or
        of the picked row alone where its band exceeds ``SAMPLE_BAND_BYTES``.
        Rewriting values of the same shape and dtype changes it when a sampled
        band changes; a change confined to other chunks is not seen.
        """
        st = self._store(key)
        layout = st.chunk_layout
        n = int(st.shape[0])
        chunk, origin = layout.read_chunk.shape, layout.grid_origin
        rows_per_chunk = int(chunk[0]) if chunk is not None and chunk[0] else 1
        origin0 = int(origin[0]) if origin is not None and origin[0] is not None else 0
        row_bytes = st.dtype.numpy_dtype.itemsize * int(np.prod(st.shape[1:], dtype=np.int64))
        if rows_per_chunk * row_bytes > self.SAMPLE_BAND_BYTES:
            rows_per_chunk, origin0 = 1, 0
        bands = sorted(
            {
                (max(0, lo), min(n, lo + rows_per_chunk))
                for lo in (i - (i - origin0) % rows_per_chunk for i in sample_ids(n))
            }
        )
        try:
            reads = [st[lo:hi].read() for lo, hi in bands]
            rows = [r.result() for r in reads]
        except Exception as e:
            raise SourceError(f"TensorStoreSource: reading sample rows of {self.specs[key]!r} failed: {e}") from e
        return {
            "shape": [int(d) for d in st.shape],
            "dtype": st.dtype.name,
            "chunk_layout": _json_safe(layout.to_json()),
            "sample": digest(list(zip(bands, rows)), f"TensorStoreSource {self.name!r} sample"),
        }


def _relocatable(spec: Any) -> Any:
    """``spec`` with every ``"path"`` string cut to its last component (folders dropped)."""
    if isinstance(spec, Mapping):
        return {
            k: os.path.basename(v.rstrip("/")) if k == "path" and isinstance(v, str) else _relocatable(v)
            for k, v in spec.items()
        }
    if isinstance(spec, (list, tuple)):
        return [_relocatable(v) for v in spec]
    return spec


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return repr(obj)
