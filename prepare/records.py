"""The records of an input item, and what a record becomes when stored.

:func:`read_item` yields the records of an :class:`~quern.prepare.inputs.Item`
in file order (the record order: ``docs/design/prepare.md``); :func:`as_record`
turns what a map returned into stored bytes.

A WebDataset sample kept whole (no map, no ``member``) is stored as a tar of its
own: the bytes of its members in the shard, from its first member's header to
the next sample's (headers, pax and GNU long-name headers, data and padding, as
they are there), then tar's end-of-archive (two zero blocks).
:func:`quern.pipeline.sources.webdataset.read_sample` turns it back into the
sample, and so do ``tarfile`` and the ``webdataset`` library. Members between
two samples that belong to none (a folder, a ``__*__`` file) stay in the record
of the sample before them; those readers skip them as the shard's readers do.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..pipeline.core.errors import PrepareError, RecordError
from ..pipeline.sources.indexed import IndexedSource
from .inputs import INDEXED, Item, Seen, check_read, open_indexed

__all__ = ["Rec", "as_record", "read_item", "where_of"]


@dataclasses.dataclass
class Rec:
    """One input record.

    Attributes:
        value: what a map receives.
        raw: what is stored without a map (``None``: ``value`` itself).
        fields: where ``--fields`` are looked up without a map's dict.
        where: names it in messages.
        nbytes: its estimated input bytes.
        line: JSON lines: the line's index in its item (numbered only when a message needs it).
    """

    value: Any
    raw: Any
    fields: Any
    where: str
    nbytes: int
    line: int = -1


def _line_number(path: str, offset: int, k: int) -> int:
    """The 1-based number of the ``k``-th line (0-based) after byte ``offset`` (counted on an error only)."""
    n = 0
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n + k + 1


def _values(column: Any) -> list[Any]:
    """A Parquet column's values: list columns as numpy arrays, the rest as Python values."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        flat = column.flatten().to_numpy(zero_copy_only=False)
        offsets = column.offsets.to_numpy()
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        return [flat[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(column))]
    return column.to_pylist()


_TAR_END = bytes(1024)  # tar's end-of-archive: two zero blocks
_OPEN: dict[tuple[str, str, Seen | None], IndexedSource] = {}  # the source of the file last read (its offsets)


def _indexed(item: Item) -> IndexedSource:
    """The source of ``item``'s tar shard or TFRecord file, kept while this process reads that file."""
    key = (item.kind, item.path, item.seen)
    src = _OPEN.get(key)
    if src is None:
        _OPEN.clear()
        src = _OPEN[key] = open_indexed(item.kind, item.path)
    return src


def read_item(
    item: Item,
    *,
    jsonl_field: str | None,
    columns: Sequence[str],
    fields: Sequence[str],
    member: str | None = None,
) -> Iterator[Rec | RecordError]:
    """The records of ``item``, in file order.

    Args:
        item: the item.
        jsonl_field: the JSON field holding the record (``None``: the whole line).
        columns: the Parquet columns making the record (empty: all but ``fields``).
        fields: the metadata fields to read beside the record.
        member: WebDataset: the extension of the member that is the record (``None``: the whole
            sample, stored as a tar of its own; a map receives the sample dict).

    Yields:
        A :class:`Rec` per record; a record that cannot be read as a
        :class:`RecordError` (a file that cannot be read as one for the whole item;
        a WebDataset sample without ``member`` as one naming the shard and the sample's key).

    Raises:
        PrepareError: the file changed since it was listed.
    """
    try:
        if item.kind == "file":
            with open(item.path, "rb") as f:  # checked once all are read (check_unchanged): one stat
                data = f.read()
            yield Rec(data, None, None, item.name, len(data))
        elif item.kind == "jsonl":
            with open(item.path, "rb") as f:
                f.seek(item.lo)
                data = f.read(item.hi - item.lo)
                check_read(item, f.fileno())
            yield from _jsonl(item, data, jsonl_field)
        elif item.kind == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(item.path)
            have = set(pf.schema_arrow.names)  # fields may also come from the map's dict, not from a column
            want = list(dict.fromkeys([*columns, *(f for f in fields if f in have)])) if columns else None
            table = pf.read_row_group(item.lo, columns=want)
            check_read(item)
            cols = {c: _values(table.column(c)) for c in table.column_names}
            chosen = list(columns) or [c for c in table.column_names if c not in fields]
            per = item.size // max(table.num_rows, 1)
            for r in range(table.num_rows):
                where = f"{item.name} row group {item.lo} row {r}"
                value = cols[chosen[0]][r] if len(chosen) == 1 else {c: cols[c][r] for c in chosen}
                yield Rec(value, None, {c: cols[c][r] for c in cols}, where, per)
        elif item.kind == "array_record":
            from array_record.python import array_record_module

            r = array_record_module.ArrayRecordReader(item.path, "readahead_buffer_size:0")
            records = r.read(list(range(item.lo, item.hi)))
            r.close()
            check_read(item)
            for k, rec in enumerate(records):
                yield Rec(rec, None, None, f"{item.name} record {item.lo + k}", len(rec))
        elif item.kind in INDEXED:
            yield from _indexed_records(item, member)
        else:  # pragma: no cover - listed kinds only
            raise ValueError(item.kind)
    except PrepareError:
        raise  # the file changed during the run: never a record to skip
    except (OSError, ValueError, RuntimeError) as e:
        if item.kind in INDEXED:
            check_read(item)  # a file changed since it was listed is said as such, never skipped
        what = {
            "file": "",
            "jsonl": f" bytes {item.lo}-{item.hi}",
            "parquet": f" row group {item.lo}",
            "webdataset": f" samples {item.lo}-{item.hi}",
        }
        span = what.get(item.kind, f" records {item.lo}-{item.hi}")
        yield RecordError(f"{item.name}{span}", f"cannot read it: {type(e).__name__}: {e}")


def _indexed_records(item: Item, member: str | None) -> Iterator[Rec | RecordError]:
    """The records of a run of WebDataset samples or TFRecord records: one read, each record decoded by its source.

    The source's verified offsets give the run's bytes, read at once; its ``decode`` checks each
    record (a tar header's checksum and the sample's members, a TFRecord's two CRCs). A record
    that fails it is a :class:`RecordError` naming it; the others are read.
    """
    src = _indexed(item)
    off = src.offsets(0)
    if item.hi >= len(off):
        raise ValueError(f"it holds {len(off) - 1} records now, where {item.hi} were listed")
    lo, hi = int(off[item.lo]), int(off[item.hi])
    with open(item.path, "rb") as f:
        parts, at = [], lo
        while at < hi:  # one pread returns at most about 2 GB
            part = os.pread(f.fileno(), min(hi - at, 1 << 30), at)
            if not part:
                break
            parts.append(part)
            at += len(part)
        data = b"".join(parts)
        check_read(item, f.fileno())
    if len(data) != hi - lo:
        raise ValueError(f"it ends at byte {lo + len(data)}, inside the records read (bytes {lo}-{hi})")
    view = memoryview(data)
    for r in range(item.lo, item.hi):
        a, b = int(off[r]) - lo, int(off[r + 1]) - lo
        where = f"{item.name} {'sample' if item.kind == 'webdataset' else 'record'} {r}"
        try:
            value = src.decode(0, r, view[a:b])
        except (ValueError, RuntimeError) as e:  # a SourceError: a bad header or CRC
            yield RecordError(where, f"cannot read it: {type(e).__name__}: {e}")
            continue
        if item.kind == "tfrecord":
            yield Rec(value, None, None, where, b - a)
            continue
        where = f"{where} (key {value['__key__']!r})"
        if member is None:
            yield Rec(value, bytes(view[a:b]) + _TAR_END, None, where, b - a)
        elif member in value:
            yield Rec(value[member], None, None, where, b - a)
        else:
            has = [k for k in value if k != "__key__"]
            yield RecordError(where, f"this sample has no member {member!r} (it has {has})")


def _jsonl(item: Item, data: bytes, field: str | None) -> Iterator[Rec | RecordError]:
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    for k, line in enumerate(lines):
        raw = line[:-1] if line.endswith(b"\r") else line
        if not raw.strip():
            continue  # a blank line holds no record
        try:
            obj = json.loads(raw)
        except ValueError as e:
            where = f"{item.name} line {_line_number(item.path, item.lo, k)}"
            yield RecordError(where, f"invalid JSON: {e}")
            continue
        if field is None:
            yield Rec(obj, raw, obj, "", len(line) + 1, k)
            continue
        if not isinstance(obj, dict) or field not in obj:
            where = f"{item.name} line {_line_number(item.path, item.lo, k)}"
            yield RecordError(where, f"no field {field!r} in this JSON line")
            continue
        yield Rec(obj[field], None, obj, "", len(line) + 1, k)


def where_of(item: Item, rec: Rec) -> str:
    """``rec``'s name in messages (JSON lines are numbered only when a message needs it).

    Args:
        item: the item ``rec`` was read from.
        rec: the record.

    Returns:
        ``"docs/a.jsonl line 12"``, ``"data.parquet row group 0 row 3"``, ``"a.tar sample 4 (key 'x/0004')"``,
        or the file's name.
    """
    if rec.line >= 0:
        return f"{item.name} line {_line_number(item.path, item.lo, rec.line)}"
    return rec.where or item.name


def as_record(out: Any) -> tuple[bytes, str, int]:
    """What a map returned (or the input, without a map) as a stored record.

    Args:
        out: bytes, ``str`` (stored as UTF-8) or a 1-D numpy array of a
            native-order number dtype (stored as its raw bytes).

    Returns:
        ``(bytes, type, length)``: ``type`` is ``"bytes"`` or the array's dtype,
        ``length`` the bytes or the element count.

    Raises:
        TypeError: ``out`` is none of these.

    Example:
        >>> import numpy as np
        >>> as_record("hi"), as_record(np.arange(3, dtype=np.int32))[1:]
        ((b'hi', 'bytes', 2), ('int32', 3))
    """
    if isinstance(out, (bytes, bytearray, memoryview)):
        b = bytes(out)
        return b, "bytes", len(b)
    if isinstance(out, str):
        b = out.encode("utf-8")
        return b, "bytes", len(b)
    if isinstance(out, np.ndarray):
        if out.ndim != 1 or out.dtype.kind not in "biuf" or out.dtype.byteorder == ">":
            raise TypeError(f"an array must be 1-D of a native-order number dtype, got shape {out.shape} {out.dtype}")
        return np.ascontiguousarray(out).tobytes(), str(out.dtype), int(out.shape[0])
    raise TypeError(
        f"a record must be bytes, str or a 1-D numpy array (or a dict with 'record' and scalar fields), "
        f"got {type(out).__name__}"
    )
