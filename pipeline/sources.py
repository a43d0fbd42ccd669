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
:func:`_sample_ids`), so the same data always samples the same ones.

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

import collections
import glob as _glob
import hashlib
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from .collate import CollatedRows
from .digest import digest
from .errors import FingerprintError, SourceError

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

    def read_many(self, ids: np.ndarray) -> Sequence[Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __getitem__(self, i: int) -> Any:
        return self.read_many(np.asarray([i], dtype=np.int64))[0]

    def __getitems__(self, ids: Sequence[int]) -> Sequence[Any]:
        return self.read_many(np.asarray(ids, dtype=np.int64))

    def identity(self) -> dict:
        """Type, name and length; subclasses add what describes their data (see the module docstring)."""
        return {"type": type(self).__name__, "name": self.name, "len": len(self)}

    def block_size(self) -> int:
        """Natural read granularity in records (row-group size); 1 for pure random access."""
        return 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, len={len(self)})"


_WHOLE_FILE_MAX = 1 << 20  # files up to this size are hashed whole
_HEAD = 64 << 10  # bigger files: their first _HEAD bytes,
_TAIL = 128 << 10  # their last _TAIL bytes (ArrayRecord's zero padding is under 64 KiB),
_BLOCKS, _BLOCK = 16, 4 << 10  # and _BLOCKS blocks of _BLOCK bytes, one centred in each 1/_BLOCKS of the file


def _sample_ranges(size: int) -> list[tuple[int, int]]:
    """The byte ranges ``[start, stop)`` of a file of ``size`` bytes that :func:`_sample_hash` reads."""
    if size <= _WHOLE_FILE_MAX:
        return [(0, size)]
    centres = [(2 * j + 1) * size // (2 * _BLOCKS) for j in range(_BLOCKS)]
    return [(0, _HEAD), *((c - _BLOCK // 2, c + _BLOCK // 2) for c in centres), (size - _TAIL, size)]


def _sample_hash(path: str, size: int) -> str:
    """Hex digest (32 characters) of the bytes of ``path`` in :func:`_sample_ranges` of ``size``.

    A file of at most 1 MiB is hashed whole, so any byte changed in it changes
    the hash. A bigger file is hashed over its first 64 KiB, its last 128 KiB
    (ArrayRecord pads files with under 64 KiB of zeros, so this holds at least
    its last 64 KiB of data: the footer index of record offsets and the last
    records; Parquet's footer is at the end) and 16 blocks of 4 KiB, one
    centred in each sixteenth of the file: 256 KiB read, at most 1 MiB for any
    file. A change touching any of these ranges changes the hash; a change
    confined to the other bytes of a file over 1 MiB does not. Depends only on
    the bytes (not on the path's directory or the modification time)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for start, stop in _sample_ranges(size):
            f.seek(start)
            h.update(f.read(stop - start))
    return h.hexdigest()


def _file_identity(paths: list[str], counts: Sequence[int] | np.ndarray) -> list[dict]:
    """``{"file", "size", "records", "sample"}`` per file: its base name, size in bytes,
    record count and :func:`_sample_hash`.

    Any change of a file's name, size or record count changes it, as does any
    byte changed in a file of at most 1 MiB and, in a bigger file, any change
    touching a sampled range (see :func:`_sample_hash`); a same-size change
    confined to the unsampled bytes of a file over 1 MiB is not seen. Exact
    checks need a manifest of checksums (a later ``quern prepare``). The
    directory and the modification time are not part of it: a copy of the
    files elsewhere keeps the identity."""
    out = []
    for p, c in zip(paths, counts):
        size = os.path.getsize(p)
        out.append({"file": os.path.basename(p), "size": size, "records": int(c), "sample": _sample_hash(p, size)})
    return out


def _sample_ids(n: int, k: int = 5) -> list[int]:
    """Sorted distinct record ids sampled for an identity: ``0``, ``n - 1`` and one id
    in each of ``k`` equal strata of ``[0, n)``, placed by a hash of ``n``.

    Depends only on ``n`` (the same in every process and session)."""
    if n <= 0:
        return []
    key = hashlib.blake2b(f"quern.sample_ids:{n}".encode(), digest_size=8 * k).digest()
    ids = {0, n - 1}
    for j in range(k):
        lo, hi = j * n // k, (j + 1) * n // k
        if hi > lo:
            ids.add(lo + int.from_bytes(key[8 * j : 8 * j + 8], "little") % (hi - lo))
    return sorted(ids)


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
        self._local = threading.local()
        self._pid = os.getpid()


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
        _HandlePool.__init__(self, state["limit"])


# --------------------------------------------------------------------------- ArrayRecord


def _host() -> str:
    """This machine's name: file stats (inodes, times) are compared only on the machine that took them."""
    return os.uname().nodename


_Stat = tuple[int, int | None, int | None, int | None]  # size, mtime_ns, inode, device


class _FileStats:
    """What a source's files were when it opened them, to refuse reading them once changed.

    Holds each file's ``(size, mtime_ns, inode, device)``, taken before the source
    reads it. :meth:`check` stats the file again (one ``os.stat``) and raises
    :class:`SourceError` naming it if anything differs: a reader of a file
    truncated, rewritten or replaced under it returns empty, stale or other
    records without an error. Pickled to another machine (where inodes and times
    differ), the size is kept and the rest is taken at the first check there. Not
    seen: a same-size rewrite that keeps the inode within one tick of the file
    system's clock."""

    def __init__(self, what: str, paths: Sequence[str]) -> None:
        self.what, self.paths, self.host = what, list(paths), _host()
        self.stats: list[_Stat] = [self._stat(i) for i in range(len(self.paths))]

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        if self.host != _host():  # another machine: other inodes and times; the size stays
            self.stats = [(size, None, None, None) for size, *_ in self.stats]
            self.host = _host()

    def _stat(self, i: int, gone: str = "cannot stat it") -> _Stat:
        try:
            st = os.stat(self.paths[i])
        except OSError as e:
            raise SourceError(f"{self.what}: {self.paths[i]!r}: {gone}: {e}") from e
        return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev

    def check(self, i: int) -> None:
        """Raise :class:`SourceError` naming file ``i`` if it is not the file the source opened."""
        want = self.stats[i]
        now = self._stat(i, "it was removed since the source opened it")
        if want[1] is None and now[0] == want[0]:  # first check on this machine: its own times and inode
            self.stats[i] = now
            return
        if now != want:
            what = (
                f"its size went from {want[0]} to {now[0]} bytes"
                if now[0] != want[0]
                else ("it was replaced by another file" if now[2:] != want[2:] else "it was modified")
            )
            raise SourceError(
                f"{self.what}: {self.paths[i]!r} changed since the source opened it ({what}): reads of a file "
                "truncated or rewritten under an open reader return empty or wrong records; open a new source "
                "to read it"
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
    closed (see :class:`_FileStats`).
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
        self._files = _FileStats("ArrayRecordSource", self.paths)  # before a reader sees them
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
        ids = _check_ids(ids, len(self), f"ArrayRecordSource {self.name!r}")
        out: list = [None] * len(ids)
        file_of = np.searchsorted(self.starts, ids, side="right") - 1
        for f, where in _group_by(file_of):
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
        return {**super().identity(), "files": _file_identity(self.paths, self.counts)}


# --------------------------------------------------------------------------- Parquet


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
    ``None`` when there is no null."""
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
    rounded), number with string, or timestamps of other units or zones."""
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
    """Check that Parquet files agree on the ``columns`` they are read for (all of
    the first file's when ``None``); return the column names (the first file's
    order), the type each column is read as, and per file the columns to cast.

    Every file must have every column (and, with ``columns=None``, no other), of
    the first file's type; with ``unify``, of a type :func:`_widen` unifies with
    the others, read as the unified type. Raises :class:`SourceError` naming the
    two files and the column that disagree. Nullability and metadata are not
    compared."""
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
    """Parquet files (a glob, a path or a list); records are ``{column: value}`` dicts.

    Random access by row through the row-group index: ids map to
    ``(file, row group, row)``; ``read_many`` decodes each needed row group once
    (kept in an LRU cache bounded by ``cache_bytes`` of decoded data and, if
    given, ``cache_row_groups`` row groups), converts
    it to NumPy column by column in bulk, and slices rows out.

    A column's non-null values have one type whatever row group they come from
    (with or without nulls): scalar columns give NumPy scalars of the column's
    dtype (``np.int64``, ``np.float64``, ``np.bool_``, ``np.datetime64`` for
    timestamps and dates, ...), strings/binary ``str``/``bytes``; list columns
    give read-only 1-D arrays of the element dtype (views of the cached row
    group: copy before changing them in place). A null is ``None`` in every
    column type; a list holding a null element is a read-only object array of
    NumPy scalars of the element dtype and ``None``.

    All files must have one schema over the columns read (``columns``, or all
    the first file's columns; the order may differ, records follow the first
    file's): a missing or extra column or a column of another type raises
    :class:`SourceError` when the source opens, naming both files and the
    column. With ``unify_schemas=True``, columns of compatible types are read
    as their common type (int32 and int64 as int64, float32 and float64 as
    float64, string as large_string, a null column as the other files' type; see
    :func:`_widen`), cast on read; other differences are still refused.

    Page checksums are verified when the file has them (written with
    ``pq.write_table(..., write_page_checksum=True)``): a damaged page is then a
    :class:`SourceError`; without them, Parquet cannot tell a changed byte inside
    a page from data (``benchmarks/faults.py`` shows how often that happens).
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        columns: Sequence[str] | None = None,
        name: str | None = None,
        cache_row_groups: int | None = None,
        cache_bytes: int = 1 << 30,
        unify_schemas: bool = False,
    ):
        import pyarrow.parquet as pq

        if not isinstance(unify_schemas, bool):
            raise TypeError(f"ParquetSource: unify_schemas must be True or False, got {unify_schemas!r}")
        self.unify_schemas = unify_schemas
        self.paths = _expand_paths(paths, "ParquetSource")
        self._files = _FileStats("ParquetSource", self.paths)  # before reading them
        self.columns = [columns] if isinstance(columns, str) else (list(columns) if columns is not None else None)
        self.name = name or os.path.basename(self.paths[0]).split("-")[0].split(".")[0] or "parquet"
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
        ids = _check_ids(ids, len(self), f"ParquetSource {self.name!r}")
        out: list = [None] * len(ids)
        group_of = np.searchsorted(self.rg_starts, ids, side="right") - 1
        for g, where in _group_by(group_of):
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
        out = {
            **super().identity(),
            "columns": self.columns,
            "files": _file_identity(self.paths, self.file_rows),
        }
        if self.unify_schemas:  # only when set: the identity of existing pipelines stays as it was
            out["unify_schemas"] = True
        return out


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

    SAMPLE_BAND_BYTES = 8 << 20

    def identity(self) -> dict:
        """Type, name, length, the specs (with each ``path`` cut to its last component,
        so that an array copied to another folder keeps its identity) and, per array
        (``arrays[key]``, key ``""`` for a single array), its shape, dtype, chunk
        layout and a content sample (see :meth:`_array_identity`)."""
        return {
            **super().identity(),
            "specs": {k: _json_safe(_relocatable(v)) for k, v in self.specs.items()},
            "arrays": {k: self._array_identity(k) for k in self.specs},
        }

    def _array_identity(self, key: str) -> dict:
        """``{"shape", "dtype", "chunk_layout", "sample"}`` of array ``key``.

        ``sample`` is the digest of the bands of rows that share a read chunk
        along the record axis with the rows :func:`_sample_ids` picks (first,
        last and five keyed ones; reading a row fetches those chunks anyway), or
        of the picked row alone where its band exceeds ``SAMPLE_BAND_BYTES``.
        Rewriting values of the same shape and dtype changes it when a sampled
        band changes; a change confined to other chunks is not seen."""
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
                for lo in (i - (i - origin0) % rows_per_chunk for i in _sample_ids(n))
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


# --------------------------------------------------------------------------- in memory and generic


class ArraySource(Source):
    """In-memory arrays. ``ArraySource({"x": ndarray, ...})``: record ``i`` is
    ``{"x": x[i], ...}``; ``ArraySource(ndarray)``: record ``i`` is ``x[i]``.

    ``read_many`` gathers each array once with the whole id array and returns
    the rows already stacked (a :class:`~quern.pipeline.collate.CollatedRows`), so
    collation costs no copy. The identity hashes the arrays' contents.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray] | np.ndarray, name: str = "arrays") -> None:
        self._single = isinstance(arrays, np.ndarray)
        named: Mapping[str, np.ndarray] = {"": arrays} if isinstance(arrays, np.ndarray) else arrays
        if not isinstance(named, Mapping) or not named:
            raise TypeError("ArraySource expects an array or a non-empty dict of name -> array")
        self.arrays = {str(k): np.asarray(v) for k, v in named.items()}
        lengths = {k: (int(v.shape[0]) if v.ndim else None) for k, v in self.arrays.items()}
        first = next(iter(lengths.values()))
        if first is None or len(set(lengths.values())) != 1:
            raise ValueError(f"ArraySource: arrays must share their first dimension, got {lengths}")
        self._len: int = first
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
        return digest(self.arrays, f"ArraySource {self.name!r}")


class SequenceSource(Source):
    """Any object with ``__len__`` and ``__getitem__`` (grain's data-source protocol).

    ``read_many`` calls the object's ``__getitems__`` when it has one, else
    ``__getitem__`` per id. See :meth:`identity` for how it is described.
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
                raise SourceError(
                    f"source {self.name!r}: __getitems__ returned {len(records)} records for {len(ids)} ids"
                )
            return records
        return [self.obj[i] for i in ids.tolist()]

    def identity(self) -> dict:
        """Type, name, length, the wrapped object's type (``object``) and either

        - ``identity``: the digest of ``obj.identity()`` when the object has
          that method (a quern source, or any object that describes its data),
        - ``fingerprint``: the string ``obj.fingerprint()`` returns when it has
          that method, or else
        - ``sample``: the digest of the records :func:`_sample_ids` picks (first,
          last and five keyed ones, read in one ``read_many``), by content
          (:func:`~quern.pipeline.digest.digest`), never by ``repr``: the same
          data gives the same identity in every process.

        Raises :class:`FingerprintError` naming the source and the record when a
        sampled record cannot be described by its content."""
        obj = self.obj
        out = {**super().identity(), "object": type(obj).__qualname__}  # not its module: __main__ or imported
        if callable(getattr(obj, "identity", None)):
            return {**out, "identity": digest(obj.identity(), f"source {self.name!r}: identity()")}
        if callable(getattr(obj, "fingerprint", None)):
            fp = obj.fingerprint()
            if not isinstance(fp, str):
                raise FingerprintError(
                    f"source {self.name!r}: {type(obj).__qualname__}.fingerprint() returned {type(fp).__name__}, "
                    "not a string"
                )
            return {**out, "fingerprint": fp}
        ids = _sample_ids(len(self))
        records = self.read_many(np.asarray(ids, dtype=np.int64))
        for i, rec in zip(ids, records):
            try:
                digest(rec, f"record {i}")
            except FingerprintError as e:
                what = str(e).split("; ", 1)[0]  # digest's own advice is about transforms, not sources
                raise FingerprintError(
                    f"source {self.name!r} ({out['object']}): cannot fingerprint record {i} ({what}); give the "
                    "source object an identity() method returning a description of its data (a dict of numbers "
                    "and strings) or a fingerprint() method returning a string that changes whenever its data does"
                ) from e
        return {**out, "sample": digest(list(zip(ids, records)), f"source {self.name!r}")}


def as_source(obj: Any) -> Source:
    """Wrap ``obj`` as a :class:`Source`: quern sources pass through, arrays and dicts
    of arrays become :class:`ArraySource`, other ``__len__``/``__getitem__`` objects :class:`SequenceSource`."""
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, (Mapping, np.ndarray)):
        return ArraySource(obj)
    return SequenceSource(obj)
