"""Whether a cache entry is the file wanted: its bytes, and its sidecar record (``NAME.ok``).

A download is checked (:func:`check`: its size, and its SHA-256 when known)
before it is renamed into place, then sealed (:func:`seal`): the sidecar
records the entry's key, size, modification time (ns), inode and device. A
hit compares the record with the file (:func:`valid`: one ``stat`` and one
small read), so an entry replaced, rewritten, renamed or swapped on disk is
never used; an entry keyed by SHA-256 whose record is stale is hashed again
(:func:`still_right`). The design is in ``docs/design/remote-cache.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
from typing import Any

from ..core.errors import SourceError
from .fetch import BLOCK

__all__ = ["check", "discard", "record", "seal", "still_right", "valid"]


def record(key: str, st: os.stat_result) -> dict[str, Any]:
    """The sidecar record of a file.

    Args:
        key: the key the entry is named by.
        st: the file's stat.

    Returns:
        ``{"key", "size", "mtime_ns", "ino", "dev"}``.
    """
    return {"key": key, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev}


def check(path: str, size: int | None, sha256: str | None) -> str | None:
    """Why the file at ``path`` is not the one wanted.

    Args:
        path: the file (a download, or an entry).
        size: its size in bytes, when known.
        sha256: its SHA-256, when known (the file is then read whole).

    Returns:
        ``None`` when it is the one wanted, else why not (for a message).
    """
    got = os.path.getsize(path)
    if size is not None and got != size:
        return f"has {got} bytes, not {size}"
    if sha256 is not None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(BLOCK):
                h.update(block)
        if h.hexdigest() != sha256:
            return "does not match its SHA-256"
    return None


def valid(final: str, key: str, size: int | None, sealed: dict[str, dict[str, Any]]) -> os.stat_result | None:
    """``final``'s stat if the entry is the file its sidecar was written for.

    The entry must be there, a regular file, of ``size`` (when known), under
    ``key`` (one ``stat`` and one small read).

    Args:
        final: the entry's path.
        key: the key it must be named by.
        size: its size in bytes, when known.
        sealed: entry -> the record this process already found right for it
            (read, and added to, here).

    Returns:
        Its stat, or ``None`` when it is missing or not the file sealed.
    """
    try:
        st = os.stat(final)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
        return None
    rec = record(key, st)
    if sealed.get(final) == rec:  # this process read that sidecar for this very file
        return st
    try:
        with open(final + ".ok", "rb") as f:
            found = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    if found != rec:
        return None
    sealed[final] = rec
    return st


def seal(final: str, key: str) -> None:
    """Write ``final``'s sidecar (atomically).

    A cache folder that cannot take it re-checks the entry at the next hit.

    Args:
        final: the entry's path.
        key: the key it is named by.
    """
    tmp = f"{final}.ok.{os.getpid()}.{threading.get_ident()}.part"
    try:
        st = os.stat(final)
        with open(tmp, "w") as f:
            f.write(json.dumps(record(key, st)))
        os.replace(tmp, final + ".ok")
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def still_right(final: str, key: str, size: int | None, sha256: str) -> bool:
    """Whether the entry ``final`` (keyed by ``sha256``) holds those bytes although its sidecar is stale.

    The entry is hashed once, and sealed again when right.

    Args:
        final: the entry's path.
        key: the key it is named by.
        size: its size in bytes, when known.
        sha256: its SHA-256.

    Returns:
        Whether its bytes are right (it is then sealed again).
    """
    try:
        st = os.stat(final)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or os.path.islink(final):
        return False
    if check(final, size, sha256) is not None:
        return False
    seal(final, key)
    return True


def discard(final: str) -> None:
    """Remove the entry ``final`` and its sidecar (never used again).

    Args:
        final: the entry's path.

    Raises:
        SourceError: the entry or its sidecar is a folder.
    """
    for p in (final + ".ok", final):
        with contextlib.suppress(FileNotFoundError):
            if os.path.isdir(p) and not os.path.islink(p):
                raise SourceError(f"cache entry {p!r} is a folder: remove it")
            os.remove(p)
