"""Verified index files: an int64 array per record (or per survivor) kept on disk.

A filter's survivors (the sorted record ids it keeps) and a length index (tokens
per record) are found once by a scan (:mod:`quern.pipeline.scan`) and kept in
the cache folder (``cache_dir()``: ``~/.cache/quern`` unless the
``QUERN_CACHE_DIR`` environment variable or an argument says otherwise), keyed
by the fingerprint of what they depend on.

File format (little-endian): an 8-byte magic (``b"QUERNSV1"`` for survivors,
``b"QUERNLN1"`` for lengths), the number of values ``M`` and the number of
records ``N`` they were made for (uint64 each), the SHA-256 of the value bytes
(32 bytes), 8 bytes of zero padding (a 64-byte header), then ``M`` int64 values.
The values are memory-mapped read-only (8 bytes each, no Python object per
value).

A file is used only after it is verified: its size, header, checksum and the
kind's own check (survivors: strictly increasing within ``[0, N)``; lengths:
``>= -1``). Anything else (a partial write, a flipped bit, a truncation) is
reported by :func:`load` as ``None`` with the reason, and the caller rebuilds
it. Writers write a temporary file in the same folder and rename it into
place, so a reader never sees a partial file, and two processes building the
same file at once both succeed (the last rename wins; the contents are the
same).
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile

import numpy as np

__all__ = ["SURVIVORS", "LENGTHS", "cache_dir", "path_for", "store", "load"]

SURVIVORS = b"QUERNSV1"
LENGTHS = b"QUERNLN1"
_FOLDERS = {SURVIVORS: ("filters", ".survivors"), LENGTHS: ("lengths", ".lengths")}
_HEADER = struct.Struct("<8sQQ32s8x")  # 64 bytes


def cache_dir(override: str | os.PathLike | None = None) -> str:
    """The cache folder: ``override``, else ``$QUERN_CACHE_DIR``, else ``~/.cache/quern``."""
    if override is not None:
        return os.fspath(override)
    return os.environ.get("QUERN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "quern")


def path_for(key: str, override: str | os.PathLike | None = None, kind: bytes = SURVIVORS) -> str:
    """Where the index of ``kind`` whose fingerprint is ``key`` is kept: ``filters/<key>.survivors``
    or ``lengths/<key>.lengths`` in the cache folder."""
    folder, suffix = _FOLDERS[kind]
    return os.path.join(cache_dir(override), folder, f"{key}{suffix}")


def _checksum(ids: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").data).digest()


def store(path: str, ids: np.ndarray, n: int, kind: bytes = SURVIVORS) -> None:
    """Write ``ids`` (the values of ``kind`` made for ``n`` records) to ``path`` atomically."""
    ids = np.ascontiguousarray(ids, dtype="<i8")
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_HEADER.pack(kind, len(ids), n, _checksum(ids)))
            f.write(ids.view(np.uint8).data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load(path: str, n: int, kind: bytes = SURVIVORS) -> tuple[np.ndarray | None, str]:
    """The verified values in ``path`` (a read-only memory map), or ``None`` and why
    not: missing, too short, wrong magic, made for another record count, a size
    that does not match, a checksum that does not match, or values that fail the
    kind's check (survivors: strictly increasing within ``[0, n)``, at least one;
    lengths: ``n`` values ``>= -1``)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except FileNotFoundError:
        return None, "not built yet"
    except OSError as e:
        return None, f"cannot read it ({e})"
    if len(head) < _HEADER.size:
        return None, f"{size} bytes, shorter than its header"
    magic, m, n_file, digest = _HEADER.unpack(head)
    if magic != kind:
        return None, f"not a {_FOLDERS[kind][1][1:]} file (wrong magic)"
    if n_file != n:
        return None, f"made for {n_file} records, not {n}"
    if size != _HEADER.size + 8 * m:
        return None, f"{size} bytes where {m} values need {_HEADER.size + 8 * m} (partial or damaged)"
    if m == 0:
        return None, "holds no value"
    ids = np.memmap(path, dtype="<i8", mode="r", offset=_HEADER.size, shape=(m,))
    if _checksum(ids) != digest:
        return None, "its checksum does not match (damaged)"
    if kind == SURVIVORS:
        if ids[0] < 0 or ids[-1] >= n or (m > 1 and not bool(np.all(ids[1:] > ids[:-1]))):
            return None, "its ids are not strictly increasing within range (damaged)"
    elif m != n or int(ids.min()) < -1:
        return None, "its lengths do not fit the records (damaged)"
    return ids, "verified"
