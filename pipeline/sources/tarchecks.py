"""The check at open of a tar shard's offset index at every sample boundary, vectorised over the offsets.

A WebDataset index (:mod:`quern.pipeline.sources.offsets`) has one offset per sample: its
first header. A forged one can split a sample in two or merge two into one. At open,
:func:`check_headers` gathers the 512 bytes at every offset with NumPy over a memory map
and checks, for all of them at once:

- each offset is a multiple of 512 and holds a tar header whose checksum is right (the
  headers NumPy cannot judge, such as base-256 numbers or signed sums, go through
  :meth:`tarfile.TarInfo.frombuf`, one by one);
- no two consecutive samples start with members of one key (a split), where both headers
  are plain ones: a regular member named in its ``name`` field (no pax or GNU long-name
  header before it, no ustar prefix, not a ``__x__`` member).

A sample whose members have two keys (a merge), and a split at a header that is not plain,
are left to the read, which walks the sample's members and the header after it. A full
check at open would walk every member: the cost of a scan.
"""

from __future__ import annotations

import mmap
import tarfile

import numpy as np

__all__ = ["check_headers"]

_ROWS = 1 << 16  # headers gathered at once (32 MiB)
_PLAIN = np.frombuffer(b"0\x007", dtype=np.uint8)  # regular members: tarfile's REGTYPE, AREGTYPE, CONTTYPE
_COLUMNS = np.arange(100)


def _octal(field: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The values of 8-byte octal fields (digits, then NULs or spaces) and which ones NumPy could read."""
    digit = (field >= ord("0")) & (field <= ord("7"))
    end = np.where(digit, 0, 1).argmax(axis=1)  # the first non-digit (0 where the first is one: no digits)
    end[digit.all(axis=1)] = field.shape[1]
    cols = np.arange(field.shape[1])
    tail = cols[None, :] >= end[:, None]
    ok = (end > 0) & np.all(~tail | (field == 0) | (field == 32), axis=1)
    weights = np.int64(8) ** np.maximum(end[:, None] - 1 - cols[None, :], 0)
    value = np.where(tail, 0, (field.astype(np.int64) - ord("0")) * weights).sum(axis=1)
    return value, ok


def _slow_ok(row: bytes) -> bool:
    """Whether ``tarfile`` reads a header that NumPy could not judge."""
    try:
        tarfile.TarInfo.frombuf(row, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def _keys(rows: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per header, whether it is plain (see the module) and the length of its member's key in its name field."""
    name = rows[:, :100]
    ends = np.where(name == 0, _COLUMNS, 100).min(axis=1)
    inside = _COLUMNS[None, :] < ends[:, None]
    slash = np.where((name == ord("/")) & inside, _COLUMNS, -1).max(axis=1)
    dot = np.where((name == ord(".")) & inside & (_COLUMNS[None, :] > slash[:, None]), _COLUMNS, 100).min(axis=1)
    kind = rows[:, 156]
    ustar = np.all(rows[:, 257:263] == np.frombuffer(b"ustar\0", dtype=np.uint8), axis=1)
    plain = (
        valid
        & np.isin(kind, _PLAIN)
        & ~((kind == 0) & (name[np.arange(len(rows)), np.maximum(ends - 1, 0)] == ord("/")))  # a folder
        & ~(ustar & (rows[:, 345] != 0))  # a prefix folder
        & ~((name[:, 0] == ord("_")) & (name[:, 1] == ord("_")))  # maybe webdataset's __x__ members
        & ~np.any((name == ord("\n")) & inside, axis=1)
        & (dot < ends)
        & (dot > slash + 1)  # a key: a dot in the last part, after at least one other byte
    )
    return plain, dot


def check_headers(fd: int, size: int, off: np.ndarray, name: str) -> str | None:
    """Why the offsets of a tar shard's samples are not at sample headers (``None``: none is seen).

    Args:
        fd: the shard, open for reading.
        size: its size in bytes.
        off: the index's ``n + 1`` offsets (the last, the end of the last sample, is not checked here).
        name: how messages name the shard.

    Returns:
        ``None``, or the first offset that holds no tar header, or the first two samples that
        start with one key.
    """
    starts = off[:-1]
    odd = np.flatnonzero((starts % 512 != 0) | (starts + 512 > size))
    if odd.size:
        k = int(odd[0])
        return f"its sample {k} starts at byte {int(starts[k])}, where no 512-byte tar header can be"
    prev: tuple[int, bool, bytes] | None = None  # the last sample of the chunk before: its number, plain, key
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
        a = np.frombuffer(m, dtype=np.uint8, count=size - size % 512).reshape(-1, 512)  # the file's blocks
        try:
            for lo in range(0, len(starts), _ROWS):
                at = starts[lo : lo + _ROWS]
                rows = a[at // 512]
                chk, ok = _octal(rows[:, 148:156])
                sums = rows.sum(axis=1, dtype=np.int64) - rows[:, 148:156].sum(axis=1, dtype=np.int64) + 256
                fast = ok & (chk == sums) & (rows[:, 124] & 0x80 == 0)
                for j in np.flatnonzero(~fast).tolist():
                    if not _slow_ok(rows[j].tobytes()):
                        return (
                            f"its sample {lo + j} starts at byte {int(at[j])}, which holds no tar header (a bad "
                            "checksum): a forged or damaged index?"
                        )
                plain, dot = _keys(rows, fast)
                first = rows[0, : dot[0]].tobytes() if plain[0] else b""
                if prev is not None and prev[1] and plain[0] and prev[2] == first:
                    return _split(prev[0], int(at[0]), first, name)
                name_ = rows[:, :100]
                same = plain[:-1] & plain[1:] & (dot[:-1] == dot[1:])
                same &= np.all((name_[:-1] == name_[1:]) | (_COLUMNS[None, :] >= dot[:-1, None]), axis=1)
                if same.any():
                    j = int(np.flatnonzero(same)[0])
                    return _split(lo + j, int(at[j + 1]), rows[j, : dot[j]].tobytes(), name)
                j = len(rows) - 1
                prev = (lo + j, bool(plain[j]), rows[j, : dot[j]].tobytes() if plain[j] else b"")
                del rows, name_
        finally:
            del a
    return None


def _split(k: int, at: int, key: bytes, name: str) -> str:
    return (
        f"its samples {k} and {k + 1} (byte {at}) both hold members of key "
        f"{key.decode('utf-8', 'surrogateescape')!r}: one sample split in two (a forged or damaged index?)"
    )
