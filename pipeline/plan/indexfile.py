"""Verified index files: an int64 array per record (or per survivor) kept on disk.

A filter's survivors (the sorted record ids it keeps) and a length index (tokens
per record) are found once by a scan (:mod:`quern.pipeline.scan`) and kept in
the cache folder (``cache_dir()``: ``~/.cache/quern`` unless the
``QUERN_CACHE_DIR`` environment variable or an argument says otherwise), keyed
by the fingerprint of what they depend on.

File format, version 2 (little-endian): an 8-byte magic (``b"QUERNSV2"`` for
survivors, ``b"QUERNLN2"`` for lengths), the number of values ``M`` and the
number of records ``N`` they were made for (uint64 each), the SHA-256 (32
bytes) of the key field followed by the value bytes, the key field (32 bytes:
the key the file was built for, ASCII, zero-padded; keys are 32-hex-digit
fingerprints), 40 bytes of zero padding (a 128-byte header), then ``M`` int64
values. The values are memory-mapped read-only (8 bytes each, no Python object
per value).

A file is used only after it is verified: its size, header, the key it was
built for (the key asked for: a file copied or renamed from another filter's
or index's, or written by hand for another key, is refused), its checksum and
the kind's own check (survivors: strictly increasing within ``[0, N)``;
lengths: ``>= -1``). Anything else (a partial write, a flipped bit, a
truncation, a version-1 file, which holds no key) is reported by :func:`load`
as ``None`` with the reason, and the caller rebuilds it. Writers write a temporary file in the same folder and rename it into
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

SURVIVORS = b"QUERNSV2"
LENGTHS = b"QUERNLN2"
_FOLDERS = {SURVIVORS: ("filters", ".survivors"), LENGTHS: ("lengths", ".lengths")}
_OLD = {SURVIVORS: b"QUERNSV1", LENGTHS: b"QUERNLN1"}  # version 1: no key
_HEADER = struct.Struct("<8sQQ32s32s40x")  # 128 bytes
_KEY_BYTES = 32


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


def _key_field(key: str) -> bytes:
    raw = key.encode("ascii")
    if len(raw) > _KEY_BYTES:
        raise ValueError(f"an index file key has at most {_KEY_BYTES} ASCII characters, got {key!r}")
    return raw.ljust(_KEY_BYTES, b"\0")


def _checksum(key: bytes, ids: np.ndarray) -> bytes:
    h = hashlib.sha256(key)
    h.update(np.ascontiguousarray(ids, dtype="<i8").data)
    return h.digest()


def _key_of(path: str, key: str | None) -> str:
    """``key``, or by default the one ``path`` is named for (:func:`path_for`: ``<key>.survivors``)."""
    return os.path.basename(path).partition(".")[0] if key is None else key


def store(path: str, ids: np.ndarray, n: int, kind: bytes = SURVIVORS, key: str | None = None) -> None:
    """Write ``ids`` (the values of ``kind`` made for ``n`` records, under ``key``: the
    fingerprint they were built for; default: the key ``path`` is named for) to ``path``
    atomically."""
    field = _key_field(_key_of(path, key))
    ids = np.ascontiguousarray(ids, dtype="<i8")
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_HEADER.pack(kind, len(ids), n, _checksum(field, ids), field))
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


def load(path: str, n: int, kind: bytes = SURVIVORS, key: str | None = None) -> tuple[np.ndarray | None, str]:
    """The verified values in ``path`` (a read-only memory map), or ``None`` and why
    not: missing, too short, wrong magic (or version 1, without a key), made for
    another key or record count, a size that does not match, a checksum that does
    not match, or values that fail the kind's check (survivors: strictly increasing
    within ``[0, n)``, at least one; lengths: ``n`` values ``>= -1``). ``key``: the key
    the file must have been built for (default: the one ``path`` is named for)."""
    key = _key_of(path, key)
    field = _key_field(key)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except FileNotFoundError:
        return None, "not built yet"
    except OSError as e:
        return None, f"cannot read it ({e})"
    if head[:8] == _OLD[kind]:
        return None, "an old format (version 1) file, which does not record the key it was built for"
    if len(head) < _HEADER.size:
        return None, f"{size} bytes, shorter than its header"
    magic, m, n_file, digest, made_for = _HEADER.unpack(head)
    if magic != kind:
        return None, f"not a {_FOLDERS[kind][1][1:]} file (wrong magic)"
    if made_for != field:
        shown = made_for.rstrip(b"\0").decode("ascii", "replace")
        return None, f"built for key {shown!r}, not {key!r} (copied or renamed from another cache file?)"
    if n_file != n:
        return None, f"made for {n_file} records, not {n}"
    if size != _HEADER.size + 8 * m:
        return None, f"{size} bytes where {m} values need {_HEADER.size + 8 * m} (partial or damaged)"
    if m == 0:
        return None, "holds no value"
    ids = np.memmap(path, dtype="<i8", mode="r", offset=_HEADER.size, shape=(m,))
    if _checksum(field, ids) != digest:
        return None, "its checksum does not match (damaged)"
    if kind == SURVIVORS:
        if ids[0] < 0 or ids[-1] >= n or (m > 1 and not bool(np.all(ids[1:] > ids[:-1]))):
            return None, "its ids are not strictly increasing within range (damaged)"
    elif m != n or int(ids.min()) < -1:
        return None, "its lengths do not fit the records (damaged)"
    return ids, "verified"
