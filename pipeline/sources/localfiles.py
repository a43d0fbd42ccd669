"""Which local files can be read by record offset: regular, not empty, not compressed; sidecars left out of globs."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from ..core.errors import SourceError
from . import offsets as offsets_mod
from .base import expand_paths

__all__ = ["COMPRESSED", "check_file", "compression_of", "data_files"]

COMPRESSED = {
    b"\x1f\x8b": "gzip",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
}
"""Magic bytes of compressed files, which cannot be read by offset."""
_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def compression_of(head: bytes) -> str | None:
    """The compression a file's first bytes show, if any.

    Args:
        head: the file's first 6 bytes (or fewer).

    Returns:
        ``"gzip"``, ``"zstd"``, ``"bzip2"`` or ``"xz"``, else ``None``.

    Example:
        >>> import gzip
        >>> compression_of(gzip.compress(b"x")[:6]), compression_of(b'{"a": 1}')
        ('gzip', None)
    """
    for magic, name in COMPRESSED.items():
        if head.startswith(magic):
            return name
    return None


def check_file(what: str, fmt: str, name: str, path: str, size: int) -> None:
    """Refuse a file that cannot be read by offset: not a regular file, empty, or compressed.

    Args:
        what: the source's class name, for the message.
        fmt: the format.
        name: how messages name the file (its path or URL).
        path: the local file.
        size: its size in bytes.

    Raises:
        SourceError: the file is a directory, a FIFO or another file that is not a regular one,
            is empty, or is compressed (with what to do instead).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise SourceError(f"{what}: {name!r}: cannot stat it: {e}") from e
    if not stat.S_ISREG(mode):
        other = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise SourceError(f"{what}: {name!r} is {other}, not a {fmt} file: only regular files can be read by offset")
    if size == 0:
        raise SourceError(f"{what}: {name!r} is empty (0 bytes): it holds no {fmt} records")
    with open(path, "rb") as f:
        head = f.read(6)
    kind = compression_of(head)
    if kind is not None:
        raise SourceError(
            f"{what}: {name!r} is {kind}-compressed: its records cannot be read by offset (random access into a "
            f"{kind} stream is impossible). Decompress it (for gzip: gunzip), or convert it to ArrayRecord with "
            "`quern prepare`"
        )


def data_files(paths: str | os.PathLike | Sequence[str | os.PathLike], what: str) -> list[str]:
    """The files named by a glob, a path, or a list of them, less the sidecar indexes globs match.

    Args:
        paths: a path or glob, or a list of them.
        what: the source's name, for the messages.

    Returns:
        The files (:func:`~quern.pipeline.sources.base.expand_paths`), without the files a glob
        matched that end with :data:`~quern.pipeline.sources.offsets.SIDECAR` (``data/*`` matches
        the sidecars ``quern index`` wrote there).

    Raises:
        FileNotFoundError: a glob matches nothing but sidecars, or a path does not exist.
        ValueError: no path is given, or a path named (not matched) is a sidecar.
    """
    given = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[str] = []
    for p in (os.fspath(g) for g in given):
        files = expand_paths(p, what)
        if not any(c in p for c in "*?["):
            if p.endswith(offsets_mod.SIDECAR):
                raise ValueError(f"{what}: {p!r} is a sidecar index (`quern index` writes them), not a data file")
            out.extend(files)
            continue
        kept = [f for f in files if not f.endswith(offsets_mod.SIDECAR)]
        if not kept:
            raise FileNotFoundError(f"{what}: no file but sidecar indexes matches {p!r}")
        out.extend(kept)
    if not out:
        raise ValueError(f"{what}: no files given")
    return out
