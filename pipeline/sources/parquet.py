"""Parquet files: records are ``{column: value}`` dicts, one type per column whatever the row group."""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from ..core.deprecation import keyword_only
from ..core.errors import SourceError
from ..remote.cache import ShardCache, is_url
from .base import (
    FileStats,
    Source,
    ThreadLocalHandles,
    check_ids,
    expand_paths,
    file_identity,
    group_by,
)

_A = TypeVar("_A", bound="np.ndarray | None")


def _readonly(a: _A) -> _A:
    if a is not None:
        a.setflags(write=False)  # cached and shared by every batch that reads this row group
    return a


def _values_to_numpy(arr: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """Arrow array -> ``(values, valid)`` in bulk.

    ``values`` has the NumPy dtype the Arrow type converts to when there is no
    null (``arr.drop_null().to_numpy()``), so a value's type never depends on
    whether its row group holds a null; null slots hold a placeholder (zero, or
    ``None`` in object arrays). ``valid`` is the mask of non-null slots, or
    ``None`` when there is no null.
    """
    if not arr.null_count:
        return arr.to_numpy(zero_copy_only=False), None
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    present = arr.drop_null().to_numpy(zero_copy_only=False)
    values = (np.empty if present.dtype.kind == "O" else np.zeros)(len(arr), present.dtype)
    values[valid] = present
    return values, valid


def _column_to_numpy(col: Any) -> tuple[str, tuple]:
    """Convert one Arrow column of a row group to read-only NumPy arrays, in bulk.

    Returns ``("flat", (values, valid))`` for scalar columns and for
    fixed-size lists without nulls (row i is ``values[i]``, a NumPy scalar or a
    1-D array), and ``("list", (offsets, values, valid, value_nulls))`` for
    other list columns (row i is ``values[offsets[i]:offsets[i+1]]``;
    ``value_nulls[j]`` counts the null elements before ``values[j]``, or is
    ``None`` when there is none). ``valid`` marks the non-null rows (``None``
    when all are). Dtypes are those of :func:`_values_to_numpy`: the same for
    every row group of a column.
    """
    import pyarrow as pa

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        values, valid = _values_to_numpy(arr)
        return "flat", (_readonly(values), _readonly(valid))
    if pa.types.is_fixed_size_list(t):
        width = t.list_size
        offsets = np.arange(len(arr) + 1, dtype=np.int64) * width + arr.offset * width
    else:
        offsets = arr.offsets.to_numpy()  # respects a slice offset; .values does not
    values, value_valid = _values_to_numpy(arr.values[int(offsets[0]) : int(offsets[-1])])
    valid = arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else None
    if pa.types.is_fixed_size_list(t) and valid is None and value_valid is None:
        return "flat", (_readonly(values.reshape((len(arr), width) + values.shape[1:])), None)
    value_nulls = None if value_valid is None else np.concatenate([[0], np.cumsum(~value_valid)])
    return "list", (_readonly(offsets - offsets[0]), _readonly(values), _readonly(valid), _readonly(value_nulls))


def _with_null_elements(values: np.ndarray, nulls: np.ndarray) -> np.ndarray:
    """A read-only object array of ``values`` (NumPy scalars of their dtype) with ``None`` where ``nulls``."""
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)  # a list of NumPy scalars: assigning the array itself would make Python ints
    out[nulls] = None
    return _readonly(out)


def _decoded_nbytes(decoded: dict) -> int:
    """Approximate memory of a decoded row group (object arrays count their pointers only)."""
    total = 0
    for _, data in decoded.values():
        for a in data if isinstance(data, tuple) else (data,):
            total += a.nbytes if isinstance(a, np.ndarray) else 0
    return total


def _widen(a: Any, b: Any) -> Any:
    """The Arrow type that holds every value of types ``a`` and ``b`` exactly, or ``None``.

    Only lossless widenings: a type with itself; ``null`` with any type; integers
    of one signedness to the wider; an unsigned integer into a wider signed one;
    floats to the wider; ``string``/``large_string`` and ``binary``/``large_binary``
    to the large one; lists (variable-size, large or of one fixed size) of
    widenable elements. Never integer with float (``int64`` values would be
    rounded), number with string, or timestamps of other units or zones.
    """
    import pyarrow as pa

    t = pa.types
    if a == b:
        return a
    if t.is_null(a) or t.is_null(b):
        return b if t.is_null(a) else a
    if t.is_integer(a) and t.is_integer(b):
        if t.is_signed_integer(a) == t.is_signed_integer(b):
            return a if a.bit_width >= b.bit_width else b
        signed, unsigned = (a, b) if t.is_signed_integer(a) else (b, a)
        return signed if signed.bit_width > unsigned.bit_width else None
    if t.is_floating(a) and t.is_floating(b):
        return a if a.bit_width >= b.bit_width else b
    for small, large in ((pa.string(), pa.large_string()), (pa.binary(), pa.large_binary())):
        if {a, b} == {small, large}:
            return large
    if t.is_fixed_size_list(a) and t.is_fixed_size_list(b):
        value = _widen(a.value_type, b.value_type) if a.list_size == b.list_size else None
        return None if value is None else pa.list_(value, a.list_size)
    lists = (t.is_list, t.is_large_list)
    if any(f(a) for f in lists) and any(f(b) for f in lists):
        value = _widen(a.value_type, b.value_type)
        if value is None:
            return None
        return pa.large_list(value) if t.is_large_list(a) or t.is_large_list(b) else pa.list_(value)
    return None


def _check_schemas(
    paths: list[str], schemas: list[Any], columns: list[str] | None, unify: bool
) -> tuple[list[str], dict[str, Any], list[dict[str, Any]]]:
    """Check that Parquet files agree on the ``columns`` they are read for (all of the first file's when ``None``).

    Returns the column names (the first file's order), the type each column is
    read as, and per file the columns to cast.

    Every file must have every column (and, with ``columns=None``, no other), of
    the first file's type; with ``unify``, of a type :func:`_widen` unifies with
    the others, read as the unified type. Raises :class:`SourceError` naming the
    two files and the column that disagree. Nullability and metadata are not
    compared.
    """
    first = schemas[0]
    names = list(columns) if columns is not None else list(first.names)
    types = {c: first.field(c).type for c in names}
    origin = dict.fromkeys(names, 0)  # the file each column's current type comes from
    hint = (
        "cannot be unified (unify_schemas=True widens integers, floats, string and binary types, lists of those, "
        "and null columns; never int with float or number with string)"
        if unify
        else "pass unify_schemas=True to read compatible types as one (int32 and int64 as int64, float32 and "
        "float64 as float64)"
    )
    for fi in range(1, len(paths)):
        schema = schemas[fi]
        have = set(schema.names)
        missing = [c for c in names if c not in have]
        extra = [c for c in schema.names if c not in types] if columns is None else []
        if missing or extra:
            c = (missing or extra)[0]
            has, lacks = (paths[0], paths[fi]) if missing else (paths[fi], paths[0])
            raise SourceError(
                f"ParquetSource: files disagree on their columns: column {c!r} is in {has!r} but not in {lacks!r}"
                f" (missing in {paths[fi]!r}: {missing}, only in it: {extra}); "
                "select the common columns with columns=[...]"
            )
        for c in names:
            got = schema.field(c).type
            if got == types[c]:
                continue
            wide = _widen(types[c], got) if unify else None
            if wide is None:
                raise SourceError(
                    f"ParquetSource: files disagree on the type of column {c!r}: {paths[origin[c]]!r} has "
                    f"{types[c]}, {paths[fi]!r} has {got}; {hint}"
                )
            if wide != types[c]:
                types[c], origin[c] = wide, fi
    casts = [{c: types[c] for c in names if schema.field(c).type != types[c]} for schema in schemas]
    return names, types, casts


class ParquetSource(Source):
    """Parquet files; records are ``{column: value}`` dicts, one type per column whatever the row group.

    Ids map to ``(file, row group, row)``; ``read_many`` decodes each needed
    row group once (kept in an LRU cache), converts it to NumPy column by
    column in bulk, and slices rows out.

    Scalar columns give NumPy scalars of the column's dtype (``np.int64``,
    ``np.datetime64`` for timestamps and dates, ...), strings and binary
    ``str``/``bytes``, list columns read-only 1-D arrays of the element dtype
    (views of the cached row group: copy before changing them in place). A null
    is ``None`` in every column type; a list holding a null element is a
    read-only object array of NumPy scalars and ``None``.

    All files must have one schema over the columns read (the order may
    differ; records follow the first file's); ``unify_schemas=True`` reads
    compatible types as their common type (int32 and int64 as int64, float32
    and float64 as float64, string as large_string, a null column as the
    other files' type; only lossless widenings). Page checksums are verified
    when the files have them. The details are in ``docs/design/sources.md``.

    Args:
        paths: a glob, a path or a list of them, or a list of URLs (fetched whole
            into ``cache`` when the source opens).
        columns: the columns read (default: all the first file's).
        name: the source's name (default: from the first file's name).
        cache_row_groups: the most decoded row groups kept, or ``None`` (no count limit).
        cache_bytes: the most bytes of decoded row groups kept (at least one is kept).
        unify_schemas: read compatible column types as their common type.
        cache: the disk cache of remote files (default: a
            :class:`~quern.pipeline.remote.cache.ShardCache` in its default folder).

    Raises:
        FileNotFoundError: a glob matches nothing, or a path does not exist.
        KeyError: a column asked for is not in the first file.
        SourceError: a file cannot be opened, or the files disagree on a column
            (naming both files and the column).
        TypeError: ``unify_schemas`` is not a bool.

    Example:
        >>> import tempfile, os
        >>> import pyarrow as pa, pyarrow.parquet as pq
        >>> with tempfile.TemporaryDirectory() as d:
        ...     pq.write_table(pa.table({"id": [1, 2], "text": ["a", None]}), os.path.join(d, "t.parquet"))
        ...     print(ParquetSource(os.path.join(d, "t.parquet")).read_many(np.array([1, 0])))
        [{'id': np.int64(2), 'text': None}, {'id': np.int64(1), 'text': 'a'}]
    """

    @keyword_only("columns", "name", "cache_row_groups", "cache_bytes", "unify_schemas", "cache")
    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        columns: Sequence[str] | None = None,
        name: str | None = None,
        cache_row_groups: int | None = None,
        cache_bytes: int = 1 << 30,
        unify_schemas: bool = False,
        cache: ShardCache | None = None,
    ):
        import pyarrow.parquet as pq

        if not isinstance(unify_schemas, bool):
            raise TypeError(f"ParquetSource: unify_schemas must be True or False, got {unify_schemas!r}")
        self.unify_schemas = unify_schemas
        given = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
        self.urls: list[str] | None = None
        self._pins: list[Any] = []
        if given and all(is_url(p) for p in given):  # fetched whole into the disk cache, held there while open
            self.cache = cache if cache is not None else ShardCache()
            self.urls = given
            held = [self.cache.get_pinned(u) for u in given]  # keyed by URL, size and ETag: a changed file is new
            self.paths = [path for path, _ in held]
            self._pins = [pin for _, pin in held]
        else:
            self.paths = expand_paths(paths, "ParquetSource")
        self._files = FileStats("ParquetSource", self.paths, ctime=self.urls is None)  # a cache hit sets ctime
        self.columns = [columns] if isinstance(columns, str) else (list(columns) if columns is not None else None)
        shown = self.urls[0].rstrip("/").rsplit("/", 1)[-1] if self.urls else os.path.basename(self.paths[0])
        self.name = name or shown.split("-")[0].split(".")[0] or "parquet"
        self.cache_row_groups = None if cache_row_groups is None else int(cache_row_groups)
        self.cache_bytes = int(cache_bytes)
        rg_rows, rg_file, rg_index, file_rows, schemas = [], [], [], [], []
        for fi, path in enumerate(self.paths):
            try:
                meta = pq.ParquetFile(path, page_checksum_verification=True).metadata
                schemas.append(meta.schema.to_arrow_schema())
            except Exception as e:
                raise SourceError(f"ParquetSource: cannot open {path!r}: {e}") from e
            if fi == 0:
                names = set(schemas[0].names)
                missing = [c for c in (self.columns or []) if c not in names]
                if missing:
                    raise KeyError(f"ParquetSource: columns {missing} not in {path!r}; it has {sorted(names)}")
            for g in range(meta.num_row_groups):
                rg_rows.append(meta.row_group(g).num_rows)
                rg_file.append(fi)
                rg_index.append(g)
            file_rows.append(meta.num_rows)
        self._names, _, self._casts = _check_schemas(self.paths, schemas, self.columns, unify_schemas)
        self.file_rows = np.asarray(file_rows, dtype=np.int64)
        self.rg_file = np.asarray(rg_file, dtype=np.int64)
        self.rg_index = np.asarray(rg_index, dtype=np.int64)
        self.rg_starts = np.concatenate([[0], np.cumsum(np.asarray(rg_rows, dtype=np.int64))]).astype(np.int64)
        self._handles = ThreadLocalHandles()
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict = collections.OrderedDict()  # row group -> (decoded, nbytes)
        self._cached_bytes = 0

    def __getstate__(self) -> dict:
        d = self.__dict__.copy()
        d["_lock"] = None
        d["_cache"] = None
        d["_pins"] = []  # the parent's pins keep the cached files while it lives
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
        """The median rows per row group: the natural read granularity.

        Returns:
            Records per row group (1 for no row group).
        """
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
                pf = handles[f] = pq.ParquetFile(path, page_checksum_verification=True)
            table = pf.read_row_group(local, columns=self.columns)
        except Exception as e:
            self._files.check(f)  # a change is the cause to report
            raise SourceError(f"ParquetSource: reading row group {local} of {path!r} failed: {e}") from e
        self._files.check(f)  # what was read came from the file the source opened
        try:
            if table.num_rows != self.rg_starts[g + 1] - self.rg_starts[g]:
                raise SourceError(f"row group {local} has {table.num_rows} rows, metadata said otherwise")
            casts = self._casts[f]
            decoded = {
                name: _column_to_numpy(table.column(name).cast(casts[name]) if name in casts else table.column(name))
                for name in self._names
            }
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
        """The records ``ids``, in that order: each row group needed decoded once.

        Args:
            ids: record ids in ``[0, len(self))``.

        Returns:
            A list of ``{column: value}`` dicts.

        Raises:
            IndexError: an id is out of range.
            SourceError: a row group cannot be read, or a file changed since the
                source opened it.
        """
        ids = check_ids(ids, len(self), f"ParquetSource {self.name!r}")
        out: list = [None] * len(ids)
        group_of = np.searchsorted(self.rg_starts, ids, side="right") - 1
        for g, where in group_by(group_of):
            decoded = self._row_group(g)
            rows = ids[where] - self.rg_starts[g]
            cols: dict[str, Any] = {}
            for name, (kind, data) in decoded.items():
                if kind == "list":
                    offsets, values, valid, value_nulls = data
                    starts, stops = offsets[rows], offsets[rows + 1]
                    col: list[Any] | np.ndarray = [values[a:b] for a, b in zip(starts.tolist(), stops.tolist())]
                    if value_nulls is not None and values.dtype.kind != "O":  # object arrays hold None already
                        for k in np.flatnonzero(value_nulls[stops] > value_nulls[starts]).tolist():
                            nulls = np.diff(value_nulls[starts[k] : stops[k] + 1]) > 0
                            col[k] = _with_null_elements(col[k], nulls)
                else:
                    values, valid = data
                    col = values[rows]
                if valid is not None and not valid[rows].all():
                    with_nulls = list(col)
                    for k in np.flatnonzero(~valid[rows]).tolist():
                        with_nulls[k] = None
                    col = with_nulls
                cols[name] = col
            names = list(cols)
            for k, i in enumerate(where.tolist()):
                out[i] = {name: cols[name][k] for name in names}
        return out

    def identity(self) -> dict:
        """A description of the data for the pipeline fingerprint.

        Returns:
            The type, name, length, the columns asked for and per file its name,
            size, record count and sampled hash (and ``unify_schemas`` when set).
        """
        out = {
            **super().identity(),
            "columns": self.columns,
            "files": file_identity(self.paths, self.file_rows, names=self.urls),
        }
        if self.unify_schemas:  # only when set: the identity of existing pipelines stays as it was
            out["unify_schemas"] = True
        return out
