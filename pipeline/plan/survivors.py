"""The survivors of a filter: the sorted record ids a predicate keeps, as a verified cache file.

A filter's survivors are found once by a scan (:mod:`quern.pipeline.scan`) and
kept on disk, keyed by the fingerprint of the pipeline up to and including the
filter, under ``cache_dir()/filters/`` (``~/.cache/quern`` unless the
``QUERN_CACHE_DIR`` environment variable or an argument says otherwise).

File format (little-endian): the 8-byte magic ``b"QUERNSV1"``, the number of
survivors ``M`` and the number of candidate records ``N`` (uint64 each), the
SHA-256 of the id bytes (32 bytes), 8 bytes of zero padding (a 64-byte header),
then ``M`` int64 ids, strictly increasing, in ``[0, N)``. The ids are memory-mapped
(8 bytes per survivor, no Python object per id).

A file is used only after it is verified: its size, header, checksum and order.
Anything else (a partial write, a flipped bit, a truncation) is reported by
:func:`load` as ``None`` with the reason, and the caller rebuilds it. Writers
write a temporary file in the same folder and rename it into place, so a reader
never sees a partial file, and two processes building the same file at once
both succeed (the last rename wins; the contents are the same).
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile

import numpy as np

__all__ = ["MAGIC", "cache_dir", "path_for", "store", "load"]

MAGIC = b"QUERNSV1"
_HEADER = struct.Struct("<8sQQ32s8x")  # 64 bytes


def cache_dir(override: str | os.PathLike | None = None) -> str:
    """The cache folder: ``override``, else ``$QUERN_CACHE_DIR``, else ``~/.cache/quern``."""
    if override is not None:
        return os.fspath(override)
    return os.environ.get("QUERN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "quern")


def path_for(key: str, override: str | os.PathLike | None = None) -> str:
    """Where the survivors of the filter whose fingerprint is ``key`` are kept."""
    return os.path.join(cache_dir(override), "filters", f"{key}.survivors")


def _checksum(ids: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").data).digest()


def store(path: str, ids: np.ndarray, n: int) -> None:
    """Write ``ids`` (sorted survivors among ``n`` candidates) to ``path`` atomically."""
    ids = np.ascontiguousarray(ids, dtype="<i8")
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_HEADER.pack(MAGIC, len(ids), n, _checksum(ids)))
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


def load(path: str, n: int) -> tuple[np.ndarray | None, str]:
    """The verified survivors in ``path`` (a read-only memory map), or ``None`` and
    why not: missing, too short, wrong magic, another candidate count, a size that
    does not match, a checksum that does not match, ids not strictly increasing or
    out of ``[0, n)``."""
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
    if magic != MAGIC:
        return None, "not a survivors file (wrong magic)"
    if n_file != n:
        return None, f"made for {n_file} candidate records, not {n}"
    if size != _HEADER.size + 8 * m:
        return None, f"{size} bytes where {m} ids need {_HEADER.size + 8 * m} (partial or damaged)"
    if m == 0:
        return None, "holds no survivor"
    ids = np.memmap(path, dtype="<i8", mode="r", offset=_HEADER.size, shape=(m,))
    if _checksum(ids) != digest:
        return None, "its checksum does not match (damaged)"
    if ids[0] < 0 or ids[-1] >= n or (m > 1 and not bool(np.all(ids[1:] > ids[:-1]))):
        return None, "its ids are not strictly increasing within range (damaged)"
    return ids, "verified"
