"""Random-access record sources with bulk reads.

Every source has ``name`` (used by ``Pipeline.explain``), ``__len__``,
``__getitem__`` (one record) and ``read_many(ids)`` (a sequence of the records
for an array of ids, in that order, read in bulk: grouped by file or row group,
one read call per group; a list, or rows already stacked as ``CollatedRows``).
``identity()`` describes the data (files, sizes, record counts) for the
pipeline fingerprint.

Sources are picklable: open file handles belong to one process (per thread, or
lent to one thread at a time from a pool), are never pickled, and are reopened
lazily where the source is used.
"""

from __future__ import annotations

import collections
import glob as _glob
import hashlib
import os
import threading
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .collate import CollatedRows
from .errors import SourceError

__all__ = [
    "SourceError",
    "Source",
    "ArrayRecordSource",
    "ParquetSource",
    "TensorStoreSource",
    "ArraySource",
    "SequenceSource",
    "as_source",
]


def _expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike], what: str) -> list[str]:
    """Expand a glob, a path or a list of paths/globs into a sorted-per-pattern list of files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        p = os.fspath(p)
        if any(c in p for c in "*?["):
            matches = sorted(_glob.glob(p))
            if not matches:
                raise FileNotFoundError(f"{what}: no file matches {p!r}")
            out.extend(matches)
        else:
            if not os.path.exists(p):
                raise FileNotFoundError(f"{what}: file not found: {p!r}")
            out.append(p)
    if not out:
        raise ValueError(f"{what}: no files given")
    return out


def _group_by(keys: np.ndarray) -> Iterable[tuple[int, np.ndarray]]:
    """Yield ``(key, positions)`` for each distinct key, positions in ascending order."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    bounds = np.flatnonzero(np.diff(sorted_keys)) + 1
    for chunk in np.split(order, bounds):
        if chunk.size:
            yield int(keys[chunk[0]]), chunk


def _check_ids(ids: np.ndarray | Sequence[int], n: int, name: str) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        bad = ids[(ids < 0) | (ids >= n)][0]
        raise IndexError(f"{name}: record {int(bad)} out of range [0, {n})")
    return ids


class Source:
    """Base class: subclasses set ``name`` and implement ``__len__`` and ``read_many``."""

    name: str = "source"

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def read_many(self, ids: np.ndarray) -> list:  # pragma: no cover - abstract
        raise NotImplementedError

    def __getitem__(self, i: int) -> Any:
        return self.read_many(np.asarray([i], dtype=np.int64))[0]

    def __getitems__(self, ids: Sequence[int]) -> list:
        return self.read_many(np.asarray(ids, dtype=np.int64))

    def identity(self) -> dict:
        return {"type": type(self).__name__, "name": self.name, "len": len(self)}

    def block_size(self) -> int:
        """Natural read granularity in records (row-group size); 1 for pure random access."""
        return 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, len={len(self)})"


_SAMPLE_BYTES = 8192


def _sample_hash(path: str, size: int) -> str:
    """Hash of the first ``_SAMPLE_BYTES`` of a file and of the last ones before any
    trailing zero padding: a cheap content check that sees rewritten records even
    when the size is unchanged (ArrayRecord pads files to 64 KiB blocks, and its
    index of record offsets sits at the end, before the padding; Parquet's footer
    is at the end). A change only in the middle of a same-size file with the same
    offsets is not seen."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE_BYTES))
        f.seek(max(0, size - (1 << 16)))
        h.update(f.read(1 << 16).rstrip(b"\0")[-_SAMPLE_BYTES:])
    return h.hexdigest()[:16]


def _file_identity(paths: list[str], counts: Sequence[int]) -> list[dict]:
    out = []
    for p, c in zip(paths, counts):
        size = os.path.getsize(p)
        out.append({"file": os.path.basename(p), "size": size, "records": int(c), "sample": _sample_hash(p, size)})
    return out


class _ThreadLocalHandles:
    """Per-process, per-thread cache of open handles, dropped on pickling."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._pid = os.getpid()

    def get(self) -> dict:
        if self._pid != os.getpid():  # forked: never share handles with the parent
            self._local = threading.local()
            self._pid = os.getpid()
        d = getattr(self._local, "handles", None)
        if d is None:
            d = self._local.handles = {}
        return d

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


class _HandlePool:
    """Idle open handles per key, shared by the threads of one process: a thread
    borrows a handle for one call (``take``) and gives it back (``give``), so no
    handle is used by two threads at once and handles opened once are reused by
    every thread. At most ``limit`` idle handles are kept (the least recently
    given back are dropped, which closes them). Dropped on pickling and after a
    fork."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._idle: collections.OrderedDict = collections.OrderedDict()  # key -> [handles], least recent first
        self._count = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def take(self, key: Any) -> Any:
        with self._lock:
            if self._pid != os.getpid():
                self._idle.clear()
                self._count, self._pid = 0, os.getpid()
            handles = self._idle.get(key)
            if not handles:
                return None
            self._count -= 1
            return handles.pop()

    def give(self, key: Any, handle: Any) -> None:
        with self._lock:
            if self._pid != os.getpid():
                return
            self._idle.setdefault(key, []).append(handle)
            self._idle.move_to_end(key)
            self._count += 1
            while self._count > self.limit:
                oldest, handles = next(iter(self._idle.items()))
                if handles:
                    handles.pop(0)
                    self._count -= 1
                if not handles:
                    del self._idle[oldest]

    def __getstate__(self) -> dict:
        return {"limit": self.limit}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["limit"])


# --------------------------------------------------------------------------- ArrayRecord


class ArrayRecordSource(Source):
    """ArrayRecord files (a glob, a path or a list); records are the raw ``bytes``.

    Ids are global over the files in the given order (globs sorted). Reads are
    grouped by file: one ``ArrayRecordReader.read(list)`` call per file per
    ``read_many``. Readers are opened for random access
    (``readahead_buffer_size:0``) and shared by threads through a pool (a reader
    is never used by two threads at once) that keeps at most ``max_open_files``
    idle readers open.
    """

    READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        name: str | None = None,
        max_open_files: int = 256,
    ):
        self.paths = _expand_paths(paths, "ArrayRecordSource")
        self.name = name or os.path.basename(self.paths[0]).split("-")[0].split(".")[0] or "array_record"
        self._pool = _HandlePool(max_open_files)
        counts = []
        for i in range(len(self.paths)):
            reader = self._reader(i)
            counts.append(reader.num_records())
            self._pool.give(i, reader)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    def _reader(self, file_index: int):
        """A reader of file ``file_index`` for this thread's exclusive use; give it back to ``self._pool``."""
        r = self._pool.take(file_index)
        if r is None:
            from array_record.python import array_record_module

            path = self.paths[file_index]
            r = array_record_module.ArrayRecordReader(path, self.READER_OPTIONS)
            if not r.ok():
                try:
                    r.read([0])
                    detail = "reader is not ok"
                except Exception as e:  # the reader keeps the failure status
                    detail = str(e)
                raise SourceError(f"ArrayRecordSource: cannot open {path!r}: {detail}")
        return r

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read_many(self, ids: np.ndarray) -> list:
        ids = _check_ids(ids, len(self), f"ArrayRecordSource {self.name!r}")
        out: list = [None] * len(ids)
        file_of = np.searchsorted(self.starts, ids, side="right") - 1
        for f, where in _group_by(file_of):
            local = (ids[where] - self.starts[f]).tolist()
            reader = self._reader(f)
            try:
                records = reader.read(local)
            except Exception as e:
                raise SourceError(
                    f"ArrayRecordSource: reading records {local[:8]}{'...' if len(local) > 8 else ''} "
                    f"of {self.paths[f]!r} failed: {e}"
                ) from e
            finally:
                self._pool.give(f, reader)
            for k, rec in zip(where.tolist(), records):
                out[k] = rec
        return out

    def identity(self) -> dict:
        return {**super().identity(), "files": _file_identity(self.paths, self.counts)}


# --------------------------------------------------------------------------- Parquet


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)  # cached and shared by every batch that reads this row group
    return a


def _values_to_numpy(arr) -> np.ndarray:
    """Arrow array -> NumPy in bulk; with nulls, an object array holding ``None`` for them."""
    if arr.null_count:
        return np.array(arr.to_pylist(), dtype=object)
    return arr.to_numpy(zero_copy_only=False)


def _column_to_numpy(col) -> tuple[str, Any]:
    """Convert one Arrow column of a row group to read-only NumPy arrays, in bulk.

    Returns ``("list", (offsets, values, valid))`` for list columns (row i is
    ``values[offsets[i]:offsets[i+1]]``, or ``None`` where ``valid`` is False)
    and ``("flat", array)`` otherwise. A null is ``None`` in every column type
    (in an object array); columns without nulls keep their NumPy dtype.
    """
    import pyarrow as pa

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    if pa.types.is_fixed_size_list(t) and arr.null_count == 0:
        width = t.list_size
        values = _values_to_numpy(arr.values[arr.offset * width : (arr.offset + len(arr)) * width])
        return "flat", _readonly(values.reshape((len(arr), width) + values.shape[1:]))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        if pa.types.is_fixed_size_list(t):
            width = t.list_size
            offsets = np.arange(len(arr) + 1, dtype=np.int64) * width + arr.offset * width
        else:
            offsets = arr.offsets.to_numpy()  # respects a slice offset; .values does not
        values = _values_to_numpy(arr.values[int(offsets[0]) : int(offsets[-1])])
        valid = _readonly(arr.is_valid().to_numpy(zero_copy_only=False)) if arr.null_count else None
        return "list", (_readonly(offsets - offsets[0]), _readonly(values), valid)
    return "flat", _readonly(_values_to_numpy(arr))


def _decoded_nbytes(decoded: dict) -> int:
    """Approximate memory of a decoded row group (object arrays count their pointers only)."""
    total = 0
    for _, data in decoded.values():
        for a in data if isinstance(data, tuple) else (data,):
            total += a.nbytes if isinstance(a, np.ndarray) else 0
    return total


class ParquetSource(Source):
    """Parquet files (a glob, a path or a list); records are ``{column: value}`` dicts.

    Random access by row through the row-group index: ids map to
    ``(file, row group, row)``; ``read_many`` decodes each needed row group once
    (kept in an LRU cache bounded by ``cache_bytes`` of decoded data and, if
    given, ``cache_row_groups`` row groups), converts
    it to NumPy column by column in bulk, and slices rows out. List columns
    come out as read-only 1-D arrays (views of the cached row group: copy before
    changing them in place), scalar columns as NumPy scalars, a null as ``None``
    in every column type, strings/binary as
    ``str``/``bytes``.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        columns: Sequence[str] | None = None,
        name: str | None = None,
        cache_row_groups: int | None = None,
        cache_bytes: int = 1 << 30,
    ):
        import pyarrow.parquet as pq

        self.paths = _expand_paths(paths, "ParquetSource")
        self.columns = [columns] if isinstance(columns, str) else (list(columns) if columns is not None else None)
        self.name = name or os.path.basename(self.paths[0]).split("-")[0].split(".")[0] or "parquet"
        self.cache_row_groups = None if cache_row_groups is None else int(cache_row_groups)
        self.cache_bytes = int(cache_bytes)
        rg_rows, rg_file, rg_index, file_rows = [], [], [], []
        schema = None
        for fi, path in enumerate(self.paths):
            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as e:
                raise SourceError(f"ParquetSource: cannot open {path!r}: {e}") from e
            if schema is None:
                schema = meta.schema.to_arrow_schema()
                names = set(schema.names)
                missing = [c for c in (self.columns or []) if c not in names]
                if missing:
                    raise KeyError(f"ParquetSource: columns {missing} not in {path!r}; it has {sorted(names)}")
            for g in range(meta.num_row_groups):
                rg_rows.append(meta.row_group(g).num_rows)
                rg_file.append(fi)
                rg_index.append(g)
            file_rows.append(meta.num_rows)
        self.file_rows = np.asarray(file_rows, dtype=np.int64)
        self.rg_file = np.asarray(rg_file, dtype=np.int64)
        self.rg_index = np.asarray(rg_index, dtype=np.int64)
        self.rg_starts = np.concatenate([[0], np.cumsum(np.asarray(rg_rows, dtype=np.int64))]).astype(np.int64)
        self._handles = _ThreadLocalHandles()
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict = collections.OrderedDict()  # row group -> (decoded, nbytes)
        self._cached_bytes = 0

    def __getstate__(self) -> dict:
        d = self.__dict__.copy()
        d["_lock"] = None
        d["_cache"] = None
        d["_cached_bytes"] = 0
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()
        self._cache = collections.OrderedDict()
        self._cached_bytes = 0

    def __len__(self) -> int:
        return int(self.rg_starts[-1])

    def block_size(self) -> int:
        sizes = np.diff(self.rg_starts)
        return int(np.median(sizes)) if sizes.size else 1

    def _row_group(self, g: int) -> dict:
        """Decoded row group ``g`` (global numbering) as ``{column: (kind, data)}``, cached."""
        with self._lock:
            hit = self._cache.get(g)
            if hit is not None:
                self._cache.move_to_end(g)
                return hit[0]
        import pyarrow.parquet as pq

        f, local = int(self.rg_file[g]), int(self.rg_index[g])
        path = self.paths[f]
        handles = self._handles.get()
        try:
            pf = handles.get(f)
            if pf is None:
                pf = handles[f] = pq.ParquetFile(path)
            table = pf.read_row_group(local, columns=self.columns)
            if table.num_rows != self.rg_starts[g + 1] - self.rg_starts[g]:
                raise SourceError(f"row group {local} has {table.num_rows} rows, metadata said otherwise")
            decoded = {name: _column_to_numpy(table.column(name)) for name in table.column_names}
        except Exception as e:
            raise SourceError(f"ParquetSource: reading row group {local} of {path!r} failed: {e}") from e
        with self._lock:
            if g not in self._cache:
                size = _decoded_nbytes(decoded)
                self._cache[g] = (decoded, size)
                self._cached_bytes += size
            while (len(self._cache) > 1 and self._cached_bytes > self.cache_bytes) or (
                self.cache_row_groups is not None and len(self._cache) > self.cache_row_groups
            ):
                self._cached_bytes -= self._cache.popitem(last=False)[1][1]
        return decoded

    def read_many(self, ids: np.ndarray) -> list:
        ids = _check_ids(ids, len(self), f"ParquetSource {self.name!r}")
        out: list = [None] * len(ids)
        group_of = np.searchsorted(self.rg_starts, ids, side="right") - 1
        for g, where in _group_by(group_of):
            decoded = self._row_group(g)
            rows = ids[where] - self.rg_starts[g]
            cols = {}
            for name, (kind, data) in decoded.items():
                if kind == "list":
                    offsets, values, valid = data
                    cols[name] = [values[a:b] for a, b in zip(offsets[rows].tolist(), offsets[rows + 1].tolist())]
                    if valid is not None:
                        for k in np.flatnonzero(~valid[rows]).tolist():
                            cols[name][k] = None
                else:
                    cols[name] = data[rows]
            names = list(cols)
            for k, i in enumerate(where.tolist()):
                out[i] = {name: cols[name][k] for name in names}
        return out

    def identity(self) -> dict:
        return {
            **super().identity(),
            "columns": self.columns,
            "files": _file_identity(self.paths, self.file_rows),
        }


# --------------------------------------------------------------------------- TensorStore


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

    ``TensorStoreSource(spec_or_path)`` yields each row as an array;
    ``TensorStoreSource({"name": spec_or_path, ...})`` yields a dict of rows
    (all arrays must have the same first dimension). ``read_many`` issues one
    read per array for the sorted unique rows needed.
    """

    def __init__(self, spec: Any, name: str | None = None):
        self._single = not isinstance(spec, Mapping) or "driver" in spec
        specs = {"": spec} if self._single else dict(spec)
        self.specs = {k: _tensorstore_spec(v) for k, v in specs.items()}
        self._handles = _ThreadLocalHandles()
        lengths = {k: int(self._store(k).shape[0]) for k in self.specs}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"TensorStoreSource: arrays differ in first dimension: {lengths}")
        self._len = next(iter(lengths.values()))
        self.name = name or ("tensorstore" if self._single else "+".join(self.specs))

    def _store(self, key: str):
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
        ids = _check_ids(ids, len(self), f"TensorStoreSource {self.name!r}")
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

    def identity(self) -> dict:
        return {**super().identity(), "specs": {k: _json_safe(v) for k, v in self.specs.items()}}


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return repr(obj)


# --------------------------------------------------------------------------- in memory and generic


class ArraySource(Source):
    """In-memory arrays. ``ArraySource({"x": ndarray, ...})``: record ``i`` is
    ``{"x": x[i], ...}``; ``ArraySource(ndarray)``: record ``i`` is ``x[i]``.

    ``read_many`` gathers each array once with the whole id array and returns
    the rows already stacked (a :class:`~quern.pipeline.collate.CollatedRows`), so
    collation costs no copy. The identity hashes the arrays' contents.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray] | np.ndarray, name: str = "arrays"):
        self._single = isinstance(arrays, np.ndarray)
        if self._single:
            arrays = {"": arrays}
        if not isinstance(arrays, Mapping) or not arrays:
            raise TypeError("ArraySource expects an array or a non-empty dict of name -> array")
        self.arrays = {str(k): np.asarray(v) for k, v in arrays.items()}
        lengths = {k: (v.shape[0] if v.ndim else None) for k, v in self.arrays.items()}
        if None in lengths.values() or len(set(lengths.values())) != 1:
            raise ValueError(f"ArraySource: arrays must share their first dimension, got {lengths}")
        self._len = next(iter(lengths.values()))
        self.name = name

    def __len__(self) -> int:
        return self._len

    def read_many(self, ids: np.ndarray) -> Sequence:
        ids = _check_ids(ids, len(self), f"ArraySource {self.name!r}")
        cols = {k: v[ids] for k, v in self.arrays.items()}
        return CollatedRows(cols[""] if self._single else cols, len(ids))

    def identity(self) -> dict:
        """Type, name, length and a hash of the contents (computed once: the arrays must not change)."""
        if getattr(self, "_content", None) is None:
            self._content = self._hash_content()
        return {**super().identity(), "content": self._content}

    def _hash_content(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for k in sorted(self.arrays):
            a = np.ascontiguousarray(self.arrays[k])
            h.update(f"{k}:{a.dtype.str}:{a.shape}".encode())
            if a.dtype.kind != "O":
                h.update(a.view(np.uint8).reshape(-1) if a.size else b"")
            else:
                h.update(repr(a.tolist()).encode())
        return h.hexdigest()


class SequenceSource(Source):
    """Any object with ``__len__`` and ``__getitem__`` (grain's data-source protocol).

    ``read_many`` calls the object's ``__getitems__`` when it has one, else
    ``__getitem__`` per id. Its identity is its type, ``len`` and ``repr``.
    """

    def __init__(self, obj: Any, name: str | None = None):
        if not (hasattr(obj, "__len__") and hasattr(obj, "__getitem__")):
            raise TypeError(f"a source needs __len__ and __getitem__; {type(obj).__name__} has not both")
        self.obj = obj
        self.name = name or getattr(obj, "name", None) or type(obj).__name__
        if not isinstance(self.name, str):
            self.name = type(obj).__name__

    def __len__(self) -> int:
        return len(self.obj)

    def read_many(self, ids: np.ndarray) -> list:
        ids = _check_ids(ids, len(self), f"source {self.name!r}")
        getitems = getattr(self.obj, "__getitems__", None)
        if getitems is not None:
            records = list(getitems(ids.tolist()))
            if len(records) != len(ids):
                raise SourceError(f"source {self.name!r}: __getitems__ returned {len(records)} records for {len(ids)} ids")
            return records
        return [self.obj[i] for i in ids.tolist()]

    def identity(self) -> dict:
        r = repr(self.obj)
        if " at 0x" in r:  # default object repr carries a memory address: not stable
            r = type(self.obj).__qualname__
        return {**super().identity(), "repr": r[:1000]}


def as_source(obj: Any) -> Source:
    """Wrap ``obj`` as a :class:`Source`: quern sources pass through, arrays and dicts
    of arrays become :class:`ArraySource`, other ``__len__``/``__getitem__`` objects :class:`SequenceSource`."""
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, (Mapping, np.ndarray)):
        return ArraySource(obj)
    return SequenceSource(obj)
