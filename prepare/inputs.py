"""What ``quern prepare`` reads: inputs listed as items, and the records of an item.

An :class:`Item` is an atomic piece of input (one small file, a run of whole
lines of a JSON-lines file, a Parquet row group, a run of ArrayRecord records,
of WebDataset samples or of TFRecord records), listed from file sizes and
metadata alone (tar and TFRecord files from their offset index, built once and
kept: :mod:`quern.pipeline.sources.offsets`); :mod:`quern.prepare.records` reads
their records. The kinds of input, the record order
(what every run reproduces) and how a file changed during the run is caught:
``docs/design/prepare.md``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob as _glob
import hashlib
import os
import stat
from collections.abc import Sequence
from typing import Any, Literal, get_args

import numpy as np

from ..pipeline.core.errors import PrepareError, SourceError
from ..pipeline.sources import prepared
from ..pipeline.sources.base import host_name
from ..pipeline.sources.indexed import IndexedSource, compression_of
from ..pipeline.sources.offsets import SIDECAR
from ..pipeline.sources.tfrecord import TFRecordSource
from ..pipeline.sources.webdataset import WebDatasetSource

__all__ = [
    "CHUNK",
    "FORMATS",
    "INDEXED",
    "Format",
    "Item",
    "Seen",
    "check_read",
    "check_unchanged",
    "describe_files",
    "describe_inputs",
    "list_items",
    "open_indexed",
]

CHUNK = 4 << 20  # bytes per item of a JSON-lines, ArrayRecord, tar or TFRecord file
_HOST = host_name()  # this process's machine (imported again on each Ray node)
Format = Literal["files", "jsonl", "parquet", "array_record", "webdataset", "tfrecord"]  # the kinds (``format=``)
FORMATS: tuple[Format, ...] = get_args(Format)
_BY_SUFFIX: dict[str, Format] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".array_record": "array_record",
    ".arrayrecord": "array_record",
    ".tar": "webdataset",
    ".tfrecord": "tfrecord",
    ".tfrecords": "tfrecord",
    ".tfrec": "tfrecord",
}
INDEXED: tuple[Format, ...] = ("webdataset", "tfrecord")
"""The kinds read by record offset, through their source (:func:`open_indexed`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Seen:
    """An input file as it was listed, to catch a file changed during the run.

    Every file is checked against it once all are read (one ``stat`` each,
    :func:`check_unchanged`), and so is every read of a file of several items
    (JSON lines, Parquet row groups, runs of ArrayRecord records: the failure
    comes early). On another machine (a Ray node, where inodes and times
    differ) only the size is compared. Not seen: a same-size rewrite within one
    tick of the file system's clock.

    Attributes:
        size: the file's size in bytes.
        mtime_ns: its modification time.
        inode: its inode number.
        device: the device holding it.
        host: the machine that took these.
    """

    size: int
    mtime_ns: int
    inode: int
    device: int
    host: str

    @classmethod
    def of(cls, st: os.stat_result) -> Seen:
        """The file ``st`` describes, as seen on this machine.

        Args:
            st: the file's ``os.stat`` result.

        Returns:
            Its :class:`Seen`.
        """
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, _HOST)

    def changed(self, st: os.stat_result) -> str | None:
        """How the file ``st`` describes differs from this one.

        Args:
            st: the file's ``os.stat`` result now.

        Returns:
            The difference in words (``"it was modified"``), or ``None``.
        """
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
    """Records ``[lo, hi)`` of one input file, in the file's own units.

    Attributes:
        kind: ``"file"``, ``"jsonl"``, ``"parquet"``, ``"array_record"``, ``"webdataset"`` or ``"tfrecord"``.
        path: the file.
        name: the file as messages and the manifest show it (relative to its input).
        lo: the first unit: a small file ``(0, size)``; JSON lines: byte offsets
            of whole lines; Parquet: row groups; ArrayRecord: record numbers; WebDataset: sample
            numbers; TFRecord: record numbers.
        hi: the unit after the last.
        size: the estimated input bytes.
        seen: the file as it was listed (see :class:`Seen`).
    """

    kind: Literal["file", "jsonl", "parquet", "array_record", "webdataset", "tfrecord"]
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


def check_read(item: Item, fd: int | None = None) -> None:
    """Check that ``item``'s file is still the file that was listed.

    Args:
        item: the item.
        fd: the file as opened (``None``: its path is stat'ed).

    Raises:
        PrepareError: naming the file, saying how it changed.
    """
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
    """Check that every input file is still as it was listed (one ``stat`` per file).

    Run after every item was read. A file removed is not one changed (reading it
    failed, or what was read is whole).

    Args:
        items: the items read.

    Raises:
        PrepareError: naming the first file that changed.
    """
    done: set[str] = set()
    for it in items:
        if it.seen is not None and it.path not in done:
            done.add(it.path)
            check_read(it)


def _kind(path: str, fmt: Format | None) -> Format:
    if fmt is not None:
        return fmt
    for suffix, kind in _BY_SUFFIX.items():
        if path.lower().endswith(suffix):
            return kind
    return "files"


def _walk(root: str, include: Sequence[str], skip: str | None) -> list[tuple[str, os.stat_result]]:
    """Regular files under ``root``, as (relative POSIX path, stat), sorted by path.

    Only those matching one of ``include`` (all when empty), outside ``skip``
    (the output folder). Links are followed, to files and to folders (a linked
    folder's files are listed under the link's path); a link to the folder
    holding it or to one of its ancestors (a loop) adds no file and is not
    followed again. FIFOs, sockets, devices and dangling links are no files: not
    listed. One ``stat`` per file and per folder. Raises :class:`PrepareError`
    naming a folder that cannot be listed.
    """
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


_INDEXED_WHAT = {"webdataset": "WebDataset tar shard", "tfrecord": "TFRecord file"}


def _indexed_class(kind: str) -> type[IndexedSource]:
    return WebDatasetSource if kind == "webdataset" else TFRecordSource


def open_indexed(kind: str, path: str) -> IndexedSource:
    """The source that reads the tar shard or TFRecord file ``path`` by record offset.

    Its offset index is the file's verified sidecar (``quern index``) or cached
    index, else one scan of the file builds it (checking every tar header, or
    every TFRecord length's CRC) and keeps it in the cache
    (:mod:`quern.pipeline.sources.offsets`): a file is scanned once, not per item.

    Args:
        kind: ``"webdataset"`` or ``"tfrecord"``.
        path: the local file (glob characters in it are literal).

    Returns:
        A ``WebDatasetSource`` or ``TFRecordSource`` of that one file.

    Raises:
        SourceError: the file is empty, compressed, holds no record or bad data (naming it and where).
        OSError: it cannot be read.
    """
    return _indexed_class(kind)(_glob.escape(path))


def _holds_no_record(kind: str, path: str, size: int, name: str) -> bool:
    """Whether a file the source refused is a well-formed one that holds no record (a tar of end blocks only)."""
    try:
        with open(path, "rb", buffering=0) as f:
            return len(_indexed_class(kind).scan(f, size, name)) < 2
    except (OSError, SourceError):
        return False


def _indexed_items(
    kind: Literal["webdataset", "tfrecord"], path: str, name: str, st: os.stat_result, chunk: int
) -> list[Item]:
    """The items of a tar shard or TFRecord file: runs of whole records of about ``chunk`` bytes."""
    what, size = _INDEXED_WHAT[kind], st.st_size
    if size == 0 and kind == "tfrecord":
        return []  # an empty TFRecord file is one of no record (a tar has end blocks: an empty one is no tar)
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise PrepareError(f"prepare: cannot read {name!r}: {e}") from e
    packed = compression_of(head)
    if packed is not None:
        raise PrepareError(
            f"prepare: the input {name!r} ({path}) is {packed}-compressed: a {what} is read by record offset, "
            f"which a {packed} stream does not allow; decompress it first (for gzip: gunzip), then prepare it"
        )
    try:
        off = open_indexed(kind, path).offsets(0)
    except SourceError as e:
        if _holds_no_record(kind, path, size, name):
            return []
        raise PrepareError(f"prepare: the input {name!r} ({path}) is not a readable {what}: {e}") from e
    except OSError as e:
        raise PrepareError(f"prepare: cannot read {name!r}: {e}") from e
    n = len(off) - 1
    cuts = np.searchsorted(off, np.arange(int(off[0]), int(off[-1]), chunk), side="left")  # a record starting there
    bounds = sorted({*cuts.tolist(), 0, n})
    seen = Seen.of(st)
    return [Item(kind, path, name, a, b, int(off[b] - off[a]), seen) for a, b in zip(bounds, bounds[1:]) if b > a]


def _sidecars(paths: Sequence[str]) -> set[str]:
    """The offset sidecars (``FILE.quern.idx``, ``quern index``) among ``paths`` whose data file is there too.

    They are the index of an input read by offset (of any format: JSON lines too), not inputs.
    """
    there = set(paths)
    return {p for p in paths if p.endswith(SIDECAR) and p[: -len(SIDECAR)] in there}


def _file_items(kind: Format, path: str, name: str, columns: Sequence[str], chunk: int = CHUNK) -> list[Item]:
    try:
        st = os.stat(path)
    except OSError as e:
        raise PrepareError(f"prepare: cannot read {name!r}: {e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise PrepareError(f"prepare: the input {name!r} ({path}) is not a regular file ({_what(st)})")
    size, seen = st.st_size, Seen.of(st)
    if kind == "webdataset" or kind == "tfrecord":
        return _indexed_items(kind, path, name, st, chunk)
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
    *,
    fmt: Format | None,
    include: Sequence[str],
    columns: Sequence[str],
    output: str,
    chunk: int = CHUNK,
) -> tuple[list[Item], list[dict[str, Any]]]:
    """The items of ``inputs`` in record order, from file sizes and metadata alone (no record read).

    Args:
        inputs: paths of files or folders, or glob patterns.
        fmt: the kind of every input (``None``: by name).
        include: glob patterns a directory's files must match (all when empty).
        columns: the Parquet columns that must exist.
        output: the output folder (absolute): skipped inside a directory, refused as an input.
        chunk: JSON-lines, ArrayRecord, tar and TFRecord files are cut into items of about this many bytes
            (whole lines and records).

    Returns:
        ``(items, described)``: the items, and per input its ``name``,
        ``format``, ``files`` and ``bytes``.

    Raises:
        PrepareError: an input does not exist, cannot be read, is not a
            regular file or a folder, or (a tar shard or TFRecord file) is
            compressed or holds bad data.
        ValueError: ``fmt`` is not one of :data:`FORMATS`, or an input is ``output``.
    """
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
            for p in _sidecars(list(kinds)):
                del kinds[p]
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
                drop = _sidecars([rel for rel, _ in found])
                found = [(rel, st) for rel, st in found if rel not in drop]
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
    """A hash of the items (kind, name, range, size): what a rerun must find again.

    Args:
        items: the items.

    Returns:
        The SHA-256, in hex; it leaves paths, times and inodes out, so a copied
        input gives the same hash.
    """
    h = hashlib.sha256()
    for it in items:
        h.update(f"{it.kind}\0{it.name}\0{it.lo}\0{it.hi}\0{it.size}\n".encode())
    return h.hexdigest()


def describe_files(items: Sequence[Item]) -> str:
    """A hash of the input files as listed: path, size, modification time, inode, device.

    An unfinished prepare keeps its finished shards only for the very same files
    (the job's hash, :func:`describe_inputs`, leaves times and inodes out, so
    that a copied input gives the same manifest).

    Args:
        items: the items.

    Returns:
        The SHA-256, in hex.
    """
    h = hashlib.sha256()
    done: set[str] = set()
    for it in items:
        if it.path not in done:
            done.add(it.path)
            s = it.seen
            h.update(f"{it.path}\0{s and (s.size, s.mtime_ns, s.inode, s.device)}\n".encode())
    return h.hexdigest()
