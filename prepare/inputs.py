"""What ``quern prepare`` reads: inputs listed as items, and the records of an item.

**Record order** (documented, and what every run reproduces): the inputs in the
order given; a directory's files sorted by their path relative to it (POSIX
form, compared as strings; links to files and folders are followed, a linked
folder's files listed under the link's path, and a link back to a folder above
it, a loop, is not), a glob's matches sorted; within a file, its records in file
order (JSON lines top to bottom, Parquet rows, ArrayRecord records).

**Changes.** Each file is listed with its size, modification time and inode
(:class:`Seen`); a file that is no longer so once read fails the run, named
(:func:`check_unchanged`), so a file rewritten while prepare reads it never
gives records of two versions or pieces of lines. An input that is not a
regular file or a folder (a FIFO, a device) is refused, named.

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
from ..pipeline.sources.base import host_name

__all__ = [
    "CHUNK",
    "FORMATS",
    "Item",
    "Rec",
    "Seen",
    "check_unchanged",
    "describe_files",
    "describe_inputs",
    "list_items",
    "read_item",
]

CHUNK = 4 << 20  # bytes per item of a JSON-lines or ArrayRecord file
_HOST = host_name()  # this process's machine (imported again on each Ray node)
FORMATS = ("files", "jsonl", "parquet", "array_record")
_BY_SUFFIX = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".array_record": "array_record",
    ".arrayrecord": "array_record",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Seen:
    """An input file as it was listed: ``(size, mtime_ns, inode, device)`` and the
    machine that took them. Every file is checked against it once all are read (one
    ``stat`` each, :func:`check_unchanged`), and so is every read of a file of several
    items (JSON lines, Parquet row groups, runs of ArrayRecord records: the failure
    comes early): a file changed during the run (rewritten, truncated, replaced)
    fails the run, named, and nothing is published, instead of records of two
    versions or line fragments. On another machine (a Ray node, where inodes
    and times differ) only the size is compared. Not seen, as for the sources'
    ``FileStats``: a same-size rewrite within one tick of the file system's clock."""

    size: int
    mtime_ns: int
    inode: int
    device: int
    host: str

    @classmethod
    def of(cls, st: os.stat_result) -> Seen:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, _HOST)

    def changed(self, st: os.stat_result) -> str | None:
        """How the file ``st`` describes differs from this one, or ``None``."""
        if st.st_size != self.size:
            return f"its size went from {self.size} to {st.st_size} bytes"
        if self.host != _HOST:
            return None
        if (st.st_ino, st.st_dev) != (self.inode, self.device):
            return "it was replaced by another file"
        if st.st_mtime_ns != self.mtime_ns:
            return "it was modified"
        return None


@dataclasses.dataclass(frozen=True)
class Item:
    """Records ``[lo, hi)`` of one input file, in the file's own units: a small file
    ``(0, size)``; JSON lines: byte offsets of whole lines; Parquet: row groups;
    ArrayRecord: record numbers. ``size`` is the estimated input bytes, ``name``
    the file as messages and the manifest show it (relative to its input);
    ``seen`` the file as it was listed (see :class:`Seen`)."""

    kind: str
    path: str
    name: str
    lo: int
    hi: int
    size: int
    seen: Seen | None = None


def _changed_error(name: str, path: str, how: str) -> PrepareError:
    return PrepareError(
        f"prepare: the input {name!r} ({path}) changed during the run ({how}): what was read of it may mix two "
        "versions, so nothing was published; run prepare again once it no longer changes"
    )


def _check_read(item: Item, fd: int | None = None) -> None:
    """Raise :class:`PrepareError` naming ``item``'s file if it is not the file that was
    listed (``fd``: the file as opened, else its path is stat'ed)."""
    if item.seen is None:
        return
    try:
        st = os.fstat(fd) if fd is not None else os.stat(item.path)
    except FileNotFoundError:
        return  # removed once read (or before: then reading it failed, named, or it was skipped): no mixture
    except OSError as e:
        raise _changed_error(item.name, item.path, f"it cannot be stat'ed: {e}") from e
    how = item.seen.changed(st)
    if how is not None:
        raise _changed_error(item.name, item.path, how)


def check_unchanged(items: Sequence[Item]) -> None:
    """Raise :class:`PrepareError` naming the first input file of ``items`` that is no
    longer as it was listed (one ``stat`` per file): run after every item was read. A
    file removed is not one changed (reading it failed, or what was read is whole)."""
    done: set[str] = set()
    for it in items:
        if it.seen is not None and it.path not in done:
            done.add(it.path)
            _check_read(it)


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


def _walk(root: str, include: Sequence[str], skip: str | None) -> list[tuple[str, os.stat_result]]:
    """Regular files under ``root``, as (relative POSIX path, stat), sorted by path,
    matching one of ``include`` (all when empty), outside ``skip`` (the output
    folder). Links are followed, to files and to folders (a linked folder's files
    are listed under the link's path); a link to the folder holding it or to one of
    its ancestors (a loop) adds no file and is not followed again. FIFOs, sockets,
    devices and dangling links are no files: not listed. One ``stat`` per file and
    per folder. Raises :class:`PrepareError` naming a folder that cannot be listed."""
    out = []
    cut = len(root.rstrip(os.sep)) + 1

    def key(path: str) -> tuple[int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    skip_key = key(skip) if skip is not None else None
    top = key(root)
    stack: list[tuple[str, frozenset[tuple[int, int]]]] = [(root, frozenset([top] if top else []))]
    while stack:
        d, above = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError as e:
            raise PrepareError(f"prepare: cannot list the folder {d!r}: {e}") from e
        for entry in entries:
            full = entry.path
            try:
                is_dir = entry.is_dir()  # follows a link
            except OSError:
                is_dir = False
            if is_dir:
                k = key(full)
                if k is None or k in above or k == skip_key or (skip is not None and os.path.abspath(full) == skip):
                    continue  # a loop (the folder is this one or above it), or the output folder
                stack.append((full, above | {k}))
                continue
            rel = full[cut:] if os.sep == "/" else full[cut:].replace(os.sep, "/")
            if include and not any(fnmatch.fnmatchcase(rel, p) for p in include):
                continue
            try:
                st = os.stat(full)
            except OSError:
                continue  # a dangling link: no file there
            if stat.S_ISREG(st.st_mode):
                out.append((rel, st))
    return sorted(out, key=lambda x: x[0])


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
        st = os.stat(path)
    except OSError as e:
        raise PrepareError(f"prepare: cannot read {name!r}: {e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise PrepareError(f"prepare: the input {name!r} ({path}) is not a regular file ({_what(st)})")
    size, seen = st.st_size, Seen.of(st)
    if kind == "files":
        return [Item("file", path, name, 0, size, size, seen)]
    if kind == "jsonl":
        with open(path, "rb") as f:
            bounds = sorted({_line_start(f, o) for o in range(0, size, chunk)} | {size})
        return [Item("jsonl", path, name, a, b, b - a, seen) for a, b in zip(bounds, bounds[1:]) if b > a]
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
            Item("parquet", path, name, g, g + 1, meta.row_group(g).total_byte_size, seen)
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
            Item("array_record", path, name, a, min(a + per, n), size * (min(a + per, n) - a) // n, seen)
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
                for rel, st in found:
                    p, what = os.path.join(root, rel), f"{base}/{rel}"
                    if fmt in (None, "files"):  # the common case, 100,000s of files: no second stat
                        items.append(Item("file", p, what, 0, st.st_size, st.st_size, Seen.of(st)))
                    else:
                        items += _file_items(fmt, p, what, columns, chunk)
                name, files = base, len(found)
        elif os.path.isfile(given):
            items += _file_items(_kind(given, fmt), os.path.abspath(given), os.path.basename(given), columns, chunk)
            name, files = os.path.basename(given), 1
        elif os.path.lexists(given):
            try:
                what = _what(os.stat(given))
            except OSError as e:
                what = f"a link to nothing: {e}"
            raise PrepareError(f"prepare: the input {given!r} is not a regular file or a folder ({what})")
        else:
            raise PrepareError(f"prepare: input {given!r} does not exist")
        kinds_seen = sorted({"files" if it.kind == "file" else it.kind for it in items[start:]}) or [fmt or "files"]
        kind_name = kinds_seen[0] if len(kinds_seen) == 1 else "mixed"
        described.append(
            {"name": name, "format": kind_name, "files": files, "bytes": int(sum(it.size for it in items[start:]))}
        )
    return items, described


def _what(st: os.stat_result) -> str:
    """What a file that is not a regular file or a folder is, in words."""
    mode = st.st_mode
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return name
    return f"file mode {stat.filemode(mode)}"


def describe_inputs(items: Sequence[Item]) -> str:
    """A hash of the items (kind, name, range, size): what a rerun must find again."""
    h = hashlib.sha256()
    for it in items:
        h.update(f"{it.kind}\0{it.name}\0{it.lo}\0{it.hi}\0{it.size}\n".encode())
    return h.hexdigest()


def describe_files(items: Sequence[Item]) -> str:
    """A hash of the input files as listed (path, size, modification time, inode,
    device): an unfinished prepare keeps its finished shards only for the very same
    files (the job's hash, :func:`describe_inputs`, leaves times and inodes out, so
    that a copied input gives the same manifest)."""
    h = hashlib.sha256()
    done: set[str] = set()
    for it in items:
        if it.path not in done:
            done.add(it.path)
            s = it.seen
            h.update(f"{it.path}\0{s and (s.size, s.mtime_ns, s.inode, s.device)}\n".encode())
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
            with open(item.path, "rb") as f:  # checked once all are read (check_unchanged): one stat
                data = f.read()
            yield Rec(data, None, None, item.name, len(data))
        elif item.kind == "jsonl":
            with open(item.path, "rb") as f:
                f.seek(item.lo)
                data = f.read(item.hi - item.lo)
                _check_read(item, f.fileno())
            yield from _jsonl(item, data, jsonl_field)
        elif item.kind == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(item.path)
            have = set(pf.schema_arrow.names)  # fields may also come from the map's dict, not from a column
            want = list(dict.fromkeys([*columns, *(f for f in fields if f in have)])) if columns else None
            table = pf.read_row_group(item.lo, columns=want)
            _check_read(item)
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
            _check_read(item)
            for k, rec in enumerate(records):
                yield Rec(rec, None, None, f"{item.name} record {item.lo + k}", len(rec))
        else:  # pragma: no cover - listed kinds only
            raise ValueError(item.kind)
    except PrepareError:
        raise  # the file changed during the run: never a record to skip
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
