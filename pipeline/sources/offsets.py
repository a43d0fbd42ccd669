"""Record offset indexes: where each record of a tar, TFRecord or JSON-lines file starts.

A file read by offset (:mod:`quern.pipeline.sources.indexed`) needs, once, one
sequential scan that finds its records' byte ranges: record ``k`` is the bytes
``[offsets[k], offsets[k + 1])`` of the file. The scan's result is kept in an
*index file*, in the cache folder (``$QUERN_CACHE_DIR``, else
``~/.cache/quern``, folder ``offsets/``) under the data file's size and content
hash, or beside the data file as a *sidecar* (``FILE.quern.idx``, written by
``quern index``). Both have one format, verified before use (:func:`load`):

- a 128-byte header: the magic ``QUERNOX2``, the format (``webdataset``,
  ``tfrecord`` or ``jsonl``), the data file's size and its content hash (the
  XXH3-128 of every byte, :func:`~quern.pipeline.sources.contents.content_hash`),
  the record count ``n`` and an XXH3-128 checksum of the header's fields and the
  offsets;
- ``n + 1`` offsets, 64-bit little-endian, strictly increasing within the file.

An index is used only for the file whose every byte it was made for: the same
format, size and content hash (a copy of the file elsewhere keeps its index; a
file changed in any byte does not), a matching checksum and offsets that fit.
The checksum is no signature (anyone can compute it), so the source also checks
an index against the file's bytes at its ends before using it
(:meth:`~quern.sources.IndexedSource.check_bounds`): no record lies before the
first offset or after the last. An index fetched beside a URL is kept in
``offsets/fetched/``, never where the indexes of local files are looked up.
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from ..core.errors import SourceError
from ..order.indexfile import cache_dir, write_atomically
from .contents import HashedFile

__all__ = [
    "MAGIC",
    "SIDECAR",
    "build",
    "cache_path",
    "checked",
    "dump",
    "load",
    "mark_checked",
    "sidecar_path",
    "store",
]

MAGIC = b"QUERNOX2"  # version 1 held a sampled hash of the file, not of all of it
SIDECAR = ".quern.idx"
"""The suffix of a sidecar index: ``data.tar`` has ``data.tar.quern.idx``."""
_FIELDS = struct.Struct("<8s16sQ16sQ")  # magic, format, data size, content hash, records
_HEADER = struct.Struct("<8s16sQ16sQ16s56x")  # the fields, their checksum, padding: 128 bytes
_FORMAT_BYTES = 16

Scan = Callable[[HashedFile, int, str], np.ndarray]
"""A format's scan: ``(file, size, name) -> offsets`` (``n + 1`` int64), raising SourceError on bad data."""


def cache_path(
    fmt: str, size: int, content: str, folder: str | os.PathLike | None = None, *, fetched: bool = False
) -> str:
    """Where the cached index of a data file is kept.

    Args:
        fmt: the format.
        size: the data file's size in bytes.
        content: its content hash (32 hex digits).
        folder: the cache folder (default: ``$QUERN_CACHE_DIR``, else ``~/.cache/quern``).
        fetched: the index of a file fetched from a URL, taken from the sidecar beside it (kept
            apart: only the sources of URLs look there).

    Returns:
        ``offsets/<fmt>-<size>-<content>.idx`` in the cache folder (``offsets/fetched/...``
        with ``fetched``): named by the file's contents, not its path, so a copy of the file
        finds it.

    Example:
        >>> cache_path("jsonl", 10, "ab" * 16, "/c")
        '/c/offsets/jsonl-10-abababababababababababababababab.idx'
    """
    return os.path.join(cache_dir(folder), "offsets", *(["fetched"] if fetched else []), f"{fmt}-{size}-{content}.idx")


def sidecar_path(data: str) -> str:
    """The sidecar index of the data file (or URL) ``data``: ``data`` + :data:`SIDECAR`.

    Args:
        data: the data file's path or URL.

    Returns:
        The sidecar's path or URL.
    """
    return data + SIDECAR


def _checksum(head: bytes, offsets: np.ndarray) -> bytes:
    h = xxhash.xxh3_128(head)
    h.update(np.ascontiguousarray(offsets, dtype="<i8").data)
    return h.digest()


def _format_field(fmt: str) -> bytes:
    raw = fmt.encode("ascii")
    if len(raw) > _FORMAT_BYTES:  # pragma: no cover - our own format names are short
        raise ValueError(f"format name {fmt!r} is longer than {_FORMAT_BYTES} bytes")
    return raw.ljust(_FORMAT_BYTES, b"\0")


def dump(fmt: str, size: int, content: str, offsets: np.ndarray) -> bytes:
    """An index file's bytes.

    Args:
        fmt: the format.
        size: the data file's size in bytes.
        content: its content hash (32 hex digits).
        offsets: ``n + 1`` offsets, strictly increasing, the last at most ``size``.

    Returns:
        The header and the offsets.
    """
    offsets = np.ascontiguousarray(offsets, dtype="<i8")
    n = len(offsets) - 1
    fields = (MAGIC, _format_field(fmt), size, bytes.fromhex(content), n)
    head = _FIELDS.pack(*fields)
    return _HEADER.pack(*fields, _checksum(head, offsets)) + offsets.tobytes()


CHECKS_VERSION = 2
"""The version of the checks a verdict records: bump it when a check of offsets at open gets stricter,
and every index is checked again once (a verdict of older checks is another file name)."""


def _verdict_path(fmt: str, content: str, offsets: np.ndarray, folder: str | os.PathLike | None) -> str:
    digest = xxhash.xxh3_128_hexdigest(np.ascontiguousarray(offsets, dtype="<i8").data)
    name = f"{fmt}-v{CHECKS_VERSION}-{content}-{digest}"
    return os.path.join(cache_dir(folder), "offsets", "checked", name)


def checked(fmt: str, content: str, offsets: np.ndarray, folder: str | os.PathLike | None = None) -> bool:
    """Whether these offsets were checked against every boundary of the file of this content on this host.

    A verdict is an empty file named by the format, :data:`CHECKS_VERSION`, the file's content
    hash and the XXH3-128 of the offsets, in ``offsets/checked/`` of the cache folder; only
    :func:`mark_checked` makes one, after the check passed (or a scan made the offsets).

    Args:
        fmt: the format.
        content: the data file's content hash.
        offsets: the index's offsets.
        folder: the cache folder.

    Returns:
        Whether a verdict is there.
    """
    return os.path.exists(_verdict_path(fmt, content, offsets, folder))


def mark_checked(fmt: str, content: str, offsets: np.ndarray, folder: str | os.PathLike | None = None) -> None:
    """Keep the verdict that these offsets fit every boundary of the file of this content (:func:`checked`).

    A verdict that cannot be written costs the check again at the next open, nothing else.
    """
    try:
        write_atomically(_verdict_path(fmt, content, offsets, folder), [b""], durable=False)
    except OSError:
        pass


def store(path: str, data: bytes) -> None:
    """Write an index file atomically (:func:`~quern.pipeline.order.indexfile.write_atomically`).

    Args:
        path: where (its folder is made if missing).
        data: what :func:`dump` made.

    Raises:
        OSError: it cannot be written.
    """
    write_atomically(path, [data])


def load(data: bytes | str, fmt: str, size: int, content: str) -> tuple[np.ndarray | None, str]:
    """The verified offsets of an index, or why it cannot be used for this data file.

    Args:
        data: the index file's bytes, or its path.
        fmt: the format the data file is read as.
        size: the data file's size in bytes.
        content: the data file's content hash (32 hex digits).

    Returns:
        ``(offsets, "verified")``, or ``(None, why)``: missing, too short, not an index (wrong
        magic; version 1), of another format, made for another file (its size or contents),
        damaged (its length or checksum), or offsets that do not fit the file's size. That the
        offsets fit the file's bytes is the source's check
        (:meth:`~quern.sources.IndexedSource.check_bounds`).

    Example:
        >>> blob = dump("jsonl", 10, "00" * 16, np.array([0, 4, 10]))
        >>> load(blob, "jsonl", 10, "00" * 16)[0].tolist(), load(blob, "jsonl", 11, "00" * 16)[1]
        ([0, 4, 10], 'made for a file of 10 bytes, not 11')
    """
    if isinstance(data, str):
        try:
            with open(data, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None, "not built yet"
        except OSError as e:
            return None, f"cannot read it ({e})"
    if len(data) < _HEADER.size:
        return None, f"{len(data)} bytes, shorter than its header"
    magic, got_fmt, got_size, got_content, n, digest = _HEADER.unpack_from(data)
    if magic == b"QUERNOX1":
        return None, "an old format (version 1, made for a sampled hash of the file): index it again"
    if magic != MAGIC:
        return None, "not a quern index file (wrong magic)"
    if got_fmt != _format_field(fmt):
        other = got_fmt.rstrip(b"\0").decode("ascii", "replace")
        return None, f"an index of a {other} file, not {fmt}"
    if got_size != size:
        return None, f"made for a file of {got_size} bytes, not {size}"
    if got_content != bytes.fromhex(content):
        return None, "made for other contents of a file of this size (the file changed since it was indexed?)"
    if len(data) != _HEADER.size + 8 * (n + 1):
        return None, f"{len(data)} bytes where {n} records need {_HEADER.size + 8 * (n + 1)} (partial or damaged)"
    offsets = np.frombuffer(data, dtype="<i8", offset=_HEADER.size).astype(np.int64)
    if _checksum(data[: _FIELDS.size], offsets) != digest:
        return None, "its checksum does not match (damaged)"
    if offsets[0] < 0 or offsets[-1] > size or (n and not bool(np.all(offsets[1:] > offsets[:-1]))):
        return None, "its offsets do not fit the file (damaged)"
    return offsets, "verified"


def build(
    scan: Scan,
    paths: Sequence[str],
    names: Sequence[str],
    *,
    threads: int | None = None,
) -> list[tuple[np.ndarray, str]]:
    """Scan files for their record offsets, in parallel over files, hashing each in the same pass.

    Each scan reads its file through a :class:`~quern.pipeline.sources.contents.HashedFile`:
    the content hash returned is of exactly the bytes the offsets were found in. A caller
    keeps the offsets only if it is the hash it looked the index up by.

    Args:
        scan: the format's scan.
        paths: the files.
        names: how messages name them (their paths, or their URLs).
        threads: files scanned at once (default: up to 8, at most the CPUs and the files).

    Returns:
        Each file's offsets and content hash, in order.

    Raises:
        SourceError: a file cannot be read or holds bad data (the first such file's error).
    """

    def one(k: int) -> tuple[np.ndarray, str]:
        size = os.path.getsize(paths[k])
        try:
            with open(paths[k], "rb", buffering=0) as f:
                hashed = HashedFile(f, size, names[k])
                off = scan(hashed, size, names[k])
                return off, hashed.finish()
        except OSError as e:
            raise SourceError(f"{names[k]}: cannot read it to index its records: {e}") from e

    if len(paths) == 1:
        return [one(0)]
    workers = threads or max(1, min(8, os.cpu_count() or 1, len(paths)))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="quern-index") as pool:
        return list(pool.map(one, range(len(paths))))
