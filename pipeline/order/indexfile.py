"""Verified index files: an int64 array per record (or per survivor) kept on disk.

A filter's survivors and a length index are kept in the cache folder
(:func:`cache_dir`) under the fingerprint of what they depend on, in a
128-byte header (magic, counts, checksum, the key built for) followed by the
values. :func:`load` verifies a file before anything uses it, and says why
one cannot be used; :func:`store` writes atomically. The format and its
checks are described in ``docs/design/index-files.md``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct

import numpy as np

__all__ = ["SURVIVORS", "LENGTHS", "cache_dir", "path_for", "store", "load", "write_atomically"]

SURVIVORS = b"QUERNSV2"
LENGTHS = b"QUERNLN2"
_FOLDERS = {SURVIVORS: ("filters", ".survivors"), LENGTHS: ("lengths", ".lengths")}
_OLD = {SURVIVORS: b"QUERNSV1", LENGTHS: b"QUERNLN1"}  # version 1: no key
_HEADER = struct.Struct("<8sQQ32s32s40x")  # 128 bytes
_KEY_BYTES = 32


def cache_dir(override: str | os.PathLike | None = None) -> str:
    """The cache folder.

    Args:
        override: a folder to use instead.

    Returns:
        ``override``, else ``$QUERN_CACHE_DIR``, else ``~/.cache/quern``.
    """
    if override is not None:
        return os.fspath(override)
    return os.environ.get("QUERN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "quern")


def path_for(key: str, override: str | os.PathLike | None = None, *, kind: bytes = SURVIVORS) -> str:
    """Where the index of ``kind`` whose fingerprint is ``key`` is kept.

    Args:
        key: the fingerprint the index is built for.
        override: the cache folder to use instead of :func:`cache_dir`'s default.
        kind: :data:`SURVIVORS` or :data:`LENGTHS`.

    Returns:
        ``filters/<key>.survivors`` or ``lengths/<key>.lengths`` in the cache folder.

    Example:
        >>> path_for("ab12", "/cache", kind=LENGTHS)
        '/cache/lengths/ab12.lengths'
    """
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


def store(path: str, ids: np.ndarray, n: int, *, kind: bytes = SURVIVORS, key: str | None = None) -> None:
    """Write an index file atomically (:func:`write_atomically`).

    Args:
        path: where to write it (its folder is made if missing).
        ids: the values (survivors, or a length per record).
        n: the number of records they were made for.
        kind: :data:`SURVIVORS` or :data:`LENGTHS`.
        key: the fingerprint they were built for (default: the one ``path`` is named
            for, see :func:`path_for`).

    Raises:
        ValueError: ``key`` is longer than 32 ASCII characters.
        OSError: the file cannot be written.
    """
    field = _key_field(_key_of(path, key))
    ids = np.ascontiguousarray(ids, dtype="<i8")
    write_atomically(path, [_HEADER.pack(kind, len(ids), n, _checksum(field, ids), field), ids.view(np.uint8).data])


def write_atomically(path: str, chunks: list[bytes | memoryview], *, durable: bool = True) -> None:
    """Write ``chunks`` to ``path`` atomically: a temporary file in its folder, renamed into place.

    The file gets the mode a file made by ``open(path, "w")`` gets (``0o666`` less the umask),
    not ``0o600`` as from :func:`tempfile.mkstemp`.

    Args:
        path: the file (its folder is made if missing).
        chunks: its bytes, in order.
        durable: fsync it before the rename (``False``: a file whose loss in a crash costs
            nothing but work, such as a record the reader verifies).

    Raises:
        OSError: it cannot be written (no temporary file is left).
    """
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = _temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _temporary(path: str) -> tuple[int, str]:
    """A new file beside ``path`` (``PATH.<random>.tmp``), open for writing, its mode ``0o666`` less the umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = f"{path}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp  # the umask applies, as to any file made by open()
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path!r}")  # pragma: no cover - 100 collisions of 48 bits


def load(path: str, n: int, *, kind: bytes = SURVIVORS, key: str | None = None) -> tuple[np.ndarray | None, str]:
    """The verified values of an index file, or why it cannot be used.

    Args:
        path: the file.
        n: the number of records the values must have been made for.
        kind: :data:`SURVIVORS` or :data:`LENGTHS`.
        key: the key the file must have been built for (default: the one ``path``
            is named for).

    Returns:
        ``(values, "verified")``, the values a read-only memory map; or ``(None, why)``:
        missing, too short, wrong magic (or version 1, without a key), made for
        another key or record count, a size or checksum that does not match, or
        values that fail the kind's check (survivors: strictly increasing within
        ``[0, n)``, at least one; lengths: ``n`` values ``>= -1``).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     store(path_for("k1", folder), np.array([1, 3]), 5)
        ...     print(load(path_for("k1", folder), 5)[0].tolist(), load(path_for("k1", folder), 6)[1])
        [1, 3] made for 5 records, not 6
    """
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
