"""What ``quern prepare`` reads: inputs listed as items, and the records of an item.

**Record order** (documented, and what every run reproduces): the inputs in the
order given; a directory's files sorted by their path relative to it (POSIX
form, compared as strings), a glob's matches sorted; within a file, its records
in file order (JSON lines top to bottom, Parquet rows, ArrayRecord records).

**Kinds** (``format``; ``None`` picks by name): a directory is a tree of small
files (one record per file: its bytes), unless it is a folder written by
``quern prepare`` (its shards are re-sharded); a file named ``*.jsonl`` or
``*.ndjson`` is JSON lines; ``*.parquet`` or ``*.pq`` is Parquet;
``*.array_record`` or ``*.arrayrecord`` is ArrayRecord; any other file is one
small file.

An :class:`Item` is an atomic piece of input: one small file, a run of whole
lines of a JSON-lines file (about :data:`CHUNK` bytes), a Parquet row group, or
a run of ArrayRecord records. Items are listed from file sizes and metadata
alone (no record is read), so the plan costs a stat per file.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob as _glob
import hashlib
import json
import os
import stat
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..pipeline.errors import PrepareError, RecordError
from ..pipeline.sources import prepared

__all__ = ["CHUNK", "FORMATS", "Item", "Rec", "describe_inputs", "list_items", "read_item"]

CHUNK = 4 << 20  # bytes per item of a JSON-lines or ArrayRecord file
FORMATS = ("files", "jsonl", "parquet", "array_record")
_BY_SUFFIX = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".array_record": "array_record",
    ".arrayrecord": "array_record",
}


@dataclasses.dataclass(frozen=True)
class Item:
    """Records ``[lo, hi)`` of one input file, in the file's own units: a small file
    ``(0, size)``; JSON lines: byte offsets of whole lines; Parquet: row groups;
    ArrayRecord: record numbers. ``size`` is the estimated input bytes, ``name``
    the file as messages and the manifest show it (relative to its input)."""

    kind: str
    path: str
    name: str
    lo: int
    hi: int
    size: int


@dataclasses.dataclass
class Rec:
    """One input record: ``value`` is what a map receives; ``raw`` what is stored
    without a map (``None``: ``value`` itself); ``fields`` where ``--fields`` are
    looked up without a map's dict; ``where`` names it in messages; ``nbytes``
    its estimated input bytes."""

    value: Any
    raw: Any
    fields: Any
    where: str
    nbytes: int
    line: int = -1  # JSON lines: the line's index in its item (numbered only when a message needs it)


def _kind(path: str, fmt: str | None) -> str:
    if fmt is not None:
        return fmt
    for suffix, kind in _BY_SUFFIX.items():
        if path.lower().endswith(suffix):
            return kind
    return "files"


def _walk(root: str, include: Sequence[str], skip: str | None) -> list[tuple[str, int]]:
    """Regular files under ``root`` (following links), as (relative POSIX path, size),
    sorted by path, matching one of ``include`` (all when empty), outside ``skip`` (the
    output folder). One ``stat`` per file."""
    out = []
    cut = len(root.rstrip(os.sep)) + 1
    for d, dirs, names in os.walk(root):
        if skip is not None and os.path.abspath(d) == skip:
            dirs[:] = []
            continue
        for n in names:
            full = os.path.join(d, n)
            rel = full[cut:] if os.sep == "/" else full[cut:].replace(os.sep, "/")
            if include and not any(fnmatch.fnmatchcase(rel, p) for p in include):
                continue
            try:
                st = os.stat(full)
            except OSError:
                continue  # a dangling link: no file there
            if stat.S_ISREG(st.st_mode):
                out.append((rel, st.st_size))
    return sorted(out)


def _line_start(f: Any, offset: int) -> int:
    """The offset of the first line that starts at or after ``offset``."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    pos = offset - 1
    while True:
        block = f.read(1 << 16)
        if not block:
            return pos
        nl = block.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(block)


def _file_items(kind: str, path: str, name: str, columns: Sequence[str], chunk: int = CHUNK) -> list[Item]:
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise PrepareError(f"prepare: cannot read {name!r}: {e}") from e
    if kind == "files":
        return [Item("file", path, name, 0, size, size)]
    if kind == "jsonl":
        with open(path, "rb") as f:
            bounds = sorted({_line_start(f, o) for o in range(0, size, chunk)} | {size})
        return [Item("jsonl", path, name, a, b, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as e:
            raise PrepareError(f"prepare: {name!r} is not a readable Parquet file: {e}") from e
        names = set(meta.schema.to_arrow_schema().names)
        for c in columns:
            if c not in names:
                raise PrepareError(f"prepare: {name!r} has no column {c!r} (it has {sorted(names)})")
        return [
            Item("parquet", path, name, g, g + 1, meta.row_group(g).total_byte_size)
            for g in range(meta.num_row_groups)
            if meta.row_group(g).num_rows
        ]
    if kind == "array_record":
        from array_record.python import array_record_module

        try:
            r = array_record_module.ArrayRecordReader(path, "readahead_buffer_size:0")
            n = r.num_records()
            r.close()
        except Exception as e:
            raise PrepareError(f"prepare: {name!r} is not a readable ArrayRecord file: {e}") from e
        per = max(1, int(n * chunk // max(size, 1)))
        return [
            Item("array_record", path, name, a, min(a + per, n), size * (min(a + per, n) - a) // n)
            for a in range(0, n, per)
        ]
    raise ValueError(f"prepare: unknown input format {kind!r}; one of {FORMATS}")


def list_items(
    inputs: Sequence[str],
    fmt: str | None,
    include: Sequence[str],
    columns: Sequence[str],
    output: str,
    chunk: int = CHUNK,
) -> tuple[list[Item], list[dict[str, Any]]]:
    """The items of ``inputs`` in record order, and a description of each input
    (``name``, ``format``, ``files``, ``bytes``). ``output`` (absolute) is skipped
    inside a directory and refused as an input. JSON-lines and ArrayRecord files
    are cut into items of about ``chunk`` bytes."""
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"prepare: format must be one of {FORMATS}, got {fmt!r}")
    items: list[Item] = []
    described = []
    for given in inputs:
        given = os.fspath(given)
        start = len(items)
        if any(c in given for c in "*?["):
            paths = sorted(_glob.glob(given))
            if not paths:
                raise PrepareError(f"prepare: no file matches {given!r}")
            kinds = {p: _kind(p, fmt) for p in paths if os.path.isfile(p)}
            for p, kind in kinds.items():
                items += _file_items(kind, p, os.path.basename(p), columns, chunk)
            name, files = os.path.basename(given), len(kinds)  # the pattern, not where it was: relocatable
        elif os.path.isdir(given):
            root = os.path.abspath(given)
            if root == output:
                raise ValueError(f"prepare: the output folder {output!r} is the input {given!r}")
            base = os.path.basename(root.rstrip(os.sep)) or root
            if os.path.exists(os.path.join(root, prepared.MANIFEST)) and fmt in (None, "array_record"):
                m = prepared.open_manifest(root)
                for s in m["shards"]:
                    items += _file_items(
                        "array_record", os.path.join(root, s["file"]), f"{base}/{s['file']}", (), chunk
                    )
                name, files = base, len(m["shards"])
            else:
                found = _walk(root, include, output)
                for rel, size in found:
                    p, what = os.path.join(root, rel), f"{base}/{rel}"
                    if fmt in (None, "files"):  # the common case, 100,000s of files: no second stat
                        items.append(Item("file", p, what, 0, size, size))
                    else:
                        items += _file_items(fmt, p, what, columns, chunk)
                name, files = base, len(found)
        elif os.path.isfile(given):
            items += _file_items(_kind(given, fmt), os.path.abspath(given), os.path.basename(given), columns, chunk)
            name, files = os.path.basename(given), 1
        else:
            raise PrepareError(f"prepare: input {given!r} does not exist")
        kinds_seen = sorted({"files" if it.kind == "file" else it.kind for it in items[start:]}) or [fmt or "files"]
        kind_name = kinds_seen[0] if len(kinds_seen) == 1 else "mixed"
        described.append(
            {"name": name, "format": kind_name, "files": files, "bytes": int(sum(it.size for it in items[start:]))}
        )
    return items, described


def describe_inputs(items: Sequence[Item]) -> str:
    """A hash of the items (kind, name, range, size): what a rerun must find again."""
    h = hashlib.sha256()
    for it in items:
        h.update(f"{it.kind}\0{it.name}\0{it.lo}\0{it.hi}\0{it.size}\n".encode())
    return h.hexdigest()


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


def read_item(
    item: Item, jsonl_field: str | None, columns: Sequence[str], fields: Sequence[str]
) -> Iterator[Rec | RecordError]:
    """The records of ``item`` in order; a record that cannot be read is yielded as a
    :class:`RecordError` (and a file that cannot be read as one for the whole item)."""
    try:
        if item.kind == "file":
            with open(item.path, "rb") as f:
                data = f.read()
            yield Rec(data, None, None, item.name, len(data))
        elif item.kind == "jsonl":
            with open(item.path, "rb") as f:
                f.seek(item.lo)
                data = f.read(item.hi - item.lo)
            yield from _jsonl(item, data, jsonl_field)
        elif item.kind == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(item.path)
            have = set(pf.schema_arrow.names)  # fields may also come from the map's dict, not from a column
            want = list(dict.fromkeys([*columns, *(f for f in fields if f in have)])) if columns else None
            table = pf.read_row_group(item.lo, columns=want)
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
            for k, rec in enumerate(records):
                yield Rec(rec, None, None, f"{item.name} record {item.lo + k}", len(rec))
        else:  # pragma: no cover - listed kinds only
            raise ValueError(item.kind)
    except (OSError, ValueError, RuntimeError) as e:
        what = {"file": "", "jsonl": f" bytes {item.lo}-{item.hi}", "parquet": f" row group {item.lo}"}
        span = what.get(item.kind, f" records {item.lo}-{item.hi}")
        yield RecordError(f"{item.name}{span}", f"cannot read it: {type(e).__name__}: {e}")


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
    """``rec``'s name in messages (JSON lines are numbered only when a message needs it)."""
    if rec.line >= 0:
        return f"{item.name} line {_line_number(item.path, item.lo, rec.line)}"
    return rec.where or item.name


def as_record(out: Any) -> tuple[bytes, str, int]:
    """What a map returned (or the input, without a map) as a stored record:
    ``(bytes, type, length)``; ``type`` is ``"bytes"`` or the dtype of a 1-D array
    (stored as its raw bytes, ``length`` its element count). ``str`` is UTF-8."""
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
