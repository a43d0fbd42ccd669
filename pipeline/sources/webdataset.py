"""WebDataset tar shards read in place: a record per sample, found by offset.

A WebDataset shard is a tar file whose members are named ``KEY.EXTENSION``;
consecutive members sharing a key are one sample, read as
``{"__key__": KEY, EXTENSION: bytes, ...}`` the way the ``webdataset`` library
groups them: the key is the name up to the first dot of its last path part
(``shard0/000012.seg.png`` has key ``shard0/000012`` and extension ``seg.png``),
extensions are lowercased, a sample ends where the key changes (a key seen before
starts a new sample), and members that are not regular files (folders, links) and
``__*__`` metadata files are not part of any sample. An extension repeated within a
sample is an error, as in the library; unlike the library, so is a regular member
without a key (a name with no dot in its last part), which it silently drops.

Tar headers are parsed here (ustar, GNU long names, POSIX pax ``path`` and
``size``), their checksums checked, both when the shard is indexed and when a
sample is read. Sparse members (GNU type ``S``, or POSIX ``GNU.sparse.*`` pax
records, which GNU tar ``--sparse`` writes) are refused by name: their bytes in
the tar are not the file's. The index (:mod:`quern.pipeline.sources.offsets`)
holds each sample's byte range, from its first member's header to the next
sample's; a read checks that framing: the sample's members share its key, and
the samples just before and after it (their first headers, read for the
purpose) have other keys, as consecutive samples always do.
"""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from ..core.errors import SourceError
from .contents import HashedFile, hashed
from .indexed import IndexedSource
from .tarchecks import check_headers

__all__ = ["WebDatasetSource", "read_sample", "split_name"]

_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext, verbatim
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta: matched at the start of a name
_BLOCK = 512
_ZERO = bytes(_BLOCK)
_SKIPPED_HEADERS = {tarfile.GNUTYPE_LONGLINK, tarfile.XGLTYPE}  # a long link name, pax globals: not names
_REGULAR = {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE}  # what tarfile's isreg() calls regular


def split_name(name: str) -> tuple[str, str] | None:
    """A member name's key and extension, as WebDataset splits them.

    Args:
        name: the member's path in the tar.

    Returns:
        ``(key, extension)``, the extension lowercased; ``None`` for a name without a dot in
        its last part.

    Example:
        >>> split_name("shard0/000012.Seg.PNG"), split_name("README")
        (('shard0/000012', 'seg.png'), None)
    """
    m = _KEY.match(name)
    return None if m is None else (m.group(1), m.group(2).lower())


class _Member(NamedTuple):
    header: int  # the offset of its first header (a pax or GNU long-name header, if any)
    name: str
    regular: bool
    data: int  # the offset of its data
    size: int


def _padded(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def _pax(data: bytes) -> dict[str, str]:
    r"""The records of a pax extended header: ``LENGTH KEY=VALUE\n`` each.

    Raises:
        ValueError: a record whose length does not fit (it would not move on, or runs past the header).
    """
    out, pos = {}, 0
    while pos < len(data) and data[pos : pos + 1] != b"\0":
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        if length <= space - pos or pos + length > len(data):
            raise ValueError(f"a pax record of length {length} at byte {pos} of the extended header")
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def _header(block: bytes, pos: int, name: str) -> tuple[str, bytes, int]:
    """A tar header's ``(name, type, size)``, its checksum checked (ustar and GNU; the rest through ``tarfile``)."""
    want = block[148:156].rstrip(b" \0")
    if block[124] & 0x80 or not want.isdigit() or b"8" in want or b"9" in want:  # base-256, odd fields: tarfile
        return _slow_header(block, pos, name)
    if sum(block) - sum(block[148:156]) + 256 != int(want, 8):  # the checksum counts its own field as spaces
        return _slow_header(block, pos, name)  # (or a signed sum, as some old tars have)
    path = block[:100].split(b"\0", 1)[0]
    if block[257:263] == b"ustar\0" and block[345] != 0:  # POSIX: a prefix folder
        path = block[345:500].split(b"\0", 1)[0] + b"/" + path
    size = block[124:136].rstrip(b" \0")
    try:
        return path.decode("utf-8", "surrogateescape"), block[156:157], int(size, 8) if size else 0
    except ValueError:  # not an octal size
        return _slow_header(block, pos, name)


def _slow_header(block: bytes, pos: int, name: str) -> tuple[str, bytes, int]:
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError as e:
        raise SourceError(
            f"WebDatasetSource: {name!r}: bad tar header at byte {pos} ({e}): the file is damaged or not a tar"
        ) from e
    kind = b"5" if info.type == tarfile.AREGTYPE and info.isdir() else info.type  # frombuf's folder rule
    return info.name, kind, info.size


def _sparse(name: str, member: str, at: int, pax: dict[str, str]) -> str:
    """The refusal of a sparse member: an old GNU one (type ``S``) or a POSIX one (``GNU.sparse.*`` pax records).

    A POSIX sparse member's header names it ``./GNUSparseFile.<pid>/NAME`` (formats 0.1 and 1.0) and its
    data holds the file's non-zero parts only (after a map of them, in 1.0): read as bytes, it is neither
    the file nor under the file's name. The message names the file's own name (``GNU.sparse.name``).
    """
    real = pax.get("GNU.sparse.name", member)
    if not any(k.startswith("GNU.sparse.") for k in pax):
        how = "an old GNU sparse member (type S)"
    else:
        version = (
            f"{pax['GNU.sparse.major']}.{pax.get('GNU.sparse.minor', '0')}"
            if "GNU.sparse.major" in pax
            else ("0.1" if "GNU.sparse.map" in pax else "0.0")
        )
        stored = "" if real == member else f", stored as {member!r}"
        how = f"a POSIX sparse member (GNU.sparse.* pax records, format {version}{stored})"
    return (
        f"WebDatasetSource: {name!r}: member {real!r} (header at byte {at}) is a sparse file, {how}: its bytes in "
        "the tar are not the file's, and quern reads members in place without expanding them; write the shard "
        "without --sparse (GNU tar: drop -S/--sparse)"
    )


def _plain_key(head: bytes) -> str | None:
    """The key of the first member of ``head`` when it is plainly a keyed regular file, else ``None``.

    Plainly: a ustar header of a regular file, after at most one pax header (whose ``path`` names
    it). Checksums are not checked, nor what :func:`_members` checks: the framing check takes a key
    read so only when it differs from its neighbours', and reads it in full otherwise.
    """
    try:
        pax: dict[str, str] = {}
        at = 0
        if head[156:157] == tarfile.XHDTYPE:
            size = int(head[124:136].rstrip(b" \0"), 8)
            pax, at = _pax(head[_BLOCK : _BLOCK + size]), _BLOCK + _padded(size)
        block = head[at : at + _BLOCK]
        if len(block) < _BLOCK or block[156:157] not in (tarfile.REGTYPE, tarfile.AREGTYPE) or "GNU.sparse.name" in pax:
            return None
        name = pax.get("path")
        if name is None:
            path = block[:100].split(b"\0", 1)[0]
            if block[257:263] == b"ustar\0" and block[345] != 0:
                path = block[345:500].split(b"\0", 1)[0] + b"/" + path
            name = path.decode("utf-8", "surrogateescape")
    except (ValueError, IndexError):
        return None
    split = None if _META.match(name) or name.endswith("/") else split_name(name)
    return None if split is None else split[0]


def _members(
    get: Callable[[int, int], bytes], pos: int, end: int, name: str, where: str | None = None
) -> Iterator[_Member | int]:
    """The members of the tar bytes ``[pos, end)``, then the offset where they stop (an int).

    ``get(offset, n)`` returns the bytes at ``offset`` (fewer at the file's end). The
    iteration stops at the end-of-archive block (yielding its offset) or at ``end``; a pax
    or GNU long-name header with no member after it before ``end`` is refused, naming
    ``where`` (the record; default: the file ``name``).
    """
    first: int | None = None
    long_name: str | None = None
    pax: dict[str, str] = {}
    while pos < end:
        block = get(pos, _BLOCK)
        if len(block) < _BLOCK:
            raise SourceError(
                f"WebDatasetSource: {name!r}: the tar header at byte {pos} is cut short ({len(block)} of 512 "
                "bytes): the file is truncated"
            )
        if block == _ZERO:
            if first is not None:
                raise SourceError(f"WebDatasetSource: {name!r}: an extended tar header at byte {first} has no member")
            yield pos
            return
        path, kind, size = _header(block, pos, name)
        if first is None:
            first = pos
        data = pos + _BLOCK
        try:
            if kind == tarfile.GNUTYPE_LONGNAME:
                long_name = get(data, size).rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif kind == tarfile.XHDTYPE:
                pax = _pax(get(data, size))
            elif kind not in _SKIPPED_HEADERS and "size" in pax:  # a member: the pax header's size is its own
                size = int(pax["size"])
        except ValueError as e:
            raise SourceError(
                f"WebDatasetSource: {name!r}: bad tar header at byte {pos} ({e}): the file is damaged"
            ) from e
        if size < 0:
            raise SourceError(
                f"WebDatasetSource: {name!r}: the tar header at byte {pos} gives a negative size ({size})"
            )
        if kind in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE):
            pass
        elif kind not in _SKIPPED_HEADERS:
            member = pax.get("path") or long_name or path
            if kind == tarfile.GNUTYPE_SPARSE or any(k.startswith("GNU.sparse.") for k in pax):
                raise SourceError(_sparse(name, member, first, pax))
            folder = kind == tarfile.DIRTYPE or (kind == tarfile.AREGTYPE and path.endswith("/"))
            if folder or (kind in tarfile.SUPPORTED_TYPES and kind not in _REGULAR):
                size = 0  # as tarfile: data follows regular members and unknown types only, whatever the size field
            yield _Member(first, member, kind in _REGULAR and not folder, data, size)
            first, long_name, pax = None, None, {}
        pos = data + _padded(size)
    if first is not None:
        raise SourceError(
            f"WebDatasetSource: {where or repr(name)}: the extended tar header (pax or GNU long name) at byte {first} "
            f"has no member after it before byte {end}: a member cut from its header (a forged or damaged index?)"
        )
    yield pos


def _zeros_to_end(fd: int, at: int, size: int, last: int) -> str | None:
    """Why the bytes from the end-of-archive block at ``at`` to the file's end are not all zero (``None``: they are).

    A tar ends with zero blocks and zero padding: a zero block followed by anything else is
    inside a member's data, not the end (an index whose last offset points into zeros there).
    """
    pos = at
    while pos < size:
        chunk = os.pread(fd, min(size - pos, 1 << 20), pos)
        if not chunk:
            break
        if chunk.count(0) != len(chunk):
            nonzero = pos + len(chunk) - len(chunk.lstrip(b"\0"))
            return (
                f"its last sample ends at byte {last}, and the zero block at byte {at} after it is no end of the archive: "
                f"byte {nonzero} is not zero (samples left out: a forged or damaged index?)"
            )
        pos += len(chunk)
    return None


class WebDatasetSource(IndexedSource):
    """WebDataset tar shards, read in place by offset; a record is a sample, ``{"__key__": str, ext: bytes}``.

    The shards are indexed on first open (one scan of their tar headers per shard,
    in parallel over shards), kept in the cache or taken from a sidecar written by
    ``quern index`` (:mod:`quern.pipeline.sources.offsets`); reads are grouped per
    shard, one ``pread`` per run of consecutive samples. Samples are grouped as the
    ``webdataset`` library groups them (see :mod:`quern.pipeline.sources.webdataset`);
    decode the members in a map (``json.loads(sample["json"])``, an image decoder for
    ``sample["jpg"]``). Compressed shards (``.tar.gz``) cannot be read by offset: they
    are refused, with what to do instead.

    Args:
        paths: a path or glob, or a list of them; or URLs, fetched whole into the disk cache.
        name: the source's name (default: the first shard's name without ``.tar``).
        cache: the disk cache of remote files.
        index_cache: the folder of cached indexes (default: ``$QUERN_CACHE_DIR``, else ``~/.cache/quern``).
        index_threads: shards scanned at once when indexes are built.

    Raises:
        FileNotFoundError: a glob matches nothing, or a path does not exist.
        SourceError: a shard is empty, compressed, not a tar, truncated (a member cut short,
            no end-of-archive block), has a member without a key or a sparse member (naming the
            shard and where).

    Example:
        >>> import tempfile, os, io, tarfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = os.path.join(d, "shard-000.tar")
        ...     with tarfile.open(path, "w") as tar:
        ...         for member, data in [("a.txt", b"hi"), ("a.json", b"{}"), ("b.txt", b"yo")]:
        ...             info = tarfile.TarInfo(member)
        ...             info.size = len(data)
        ...             tar.addfile(info, io.BytesIO(data))
        ...     src = WebDatasetSource(path, index_cache=d)
        ...     print(src.name, len(src), src[0])
        shard-000 2 {'__key__': 'a', 'txt': b'hi', 'json': b'{}'}
    """

    FORMAT = "webdataset"
    SUFFIXES = (".tar",)

    @staticmethod
    def _keyed(member: _Member, name: str) -> tuple[str, str] | None:
        """A member's (key, extension); ``None`` for one that is part of no sample."""
        if not member.regular:
            return None
        base = member.name
        if _META.match(base):
            return None  # webdataset's metadata files (``__x__``, ``__x__/...``)
        split = split_name(base)
        if split is None:
            raise SourceError(
                f"WebDatasetSource: {name!r}: tar member {base!r} (header at byte {member.header}) has no key: "
                "WebDataset names members KEY.EXTENSION (the webdataset library drops such a member; quern refuses "
                "to lose data: rename it, or remove it from the shard)"
            )
        return split

    @classmethod
    def check_inside(cls, fd: int, size: int, off: np.ndarray, content: str, name: str) -> str | None:
        """Why the index's sample boundaries are not the shard's (:func:`~quern.pipeline.sources.tarchecks.check_headers`)."""
        return check_headers(fd, size, off, name)

    @classmethod
    def check_bounds(cls, fd: int, size: int, first: int, last: int, name: str) -> str | None:
        """Why an index's samples cannot run from byte ``first`` to ``last`` of a shard (``None``: they can).

        The shard's first sample member (its first header, a pax one included) must be at ``first``,
        and from ``last`` on, up to the end-of-archive block, no member may be part of a sample.

        Args:
            fd: the shard, open for reading.
            size: its size in bytes.
            first: the index's first offset.
            last: its last offset.
            name: how messages name the shard.

        Returns:
            ``None``, or why the index does not fit the shard.
        """

        def get(at: int, n: int) -> bytes:
            return os.pread(fd, n, at)

        try:
            for m in _members(get, 0, size, name):
                if isinstance(m, int) or cls._keyed(m, name) is not None:
                    at = m if isinstance(m, int) else m.header
                    if at != first:
                        return f"its first sample starts at byte {first}, and the shard's first sample at byte {at}"
                    break
            for m in _members(get, last, size, name):
                if isinstance(m, int):
                    return (
                        _zeros_to_end(fd, m, size, last)
                        if m < size
                        else (f"no end-of-archive block follows its last sample (byte {last})")
                    )
                if cls._keyed(m, name) is not None:
                    return f"tar member {m.name!r} (header at byte {m.header}) lies after its last sample"
        except SourceError as e:
            return f"the tar headers at its first or last offset do not parse: {e}"
        return None  # pragma: no cover - _members ends with an int

    @classmethod
    def scan(cls, f: HashedFile | BinaryIO, size: int, name: str) -> np.ndarray:
        """The offsets of a shard's samples.

        Args:
            f: the shard.
            size: its size.
            name: how messages name it.

        Returns:
            ``n + 1`` offsets: sample ``k`` runs from its first member's header to the next
            sample's first header (the last: to its last member's padded end).

        Raises:
            SourceError: a bad or truncated header, a member cut short, no end-of-archive block,
                a member without a key, or a sparse member.
        """
        f = hashed(f, size, name)
        starts: list[int] = []
        key: str | None = None
        exts: set[str] = set()
        last_end = 0
        for m in _members(f.read_at, 0, size, name):
            if isinstance(m, int):
                if m >= size:
                    raise SourceError(
                        f"WebDatasetSource: {name!r} ends at byte {size} without the tar end-of-archive block: the "
                        "file is truncated (or still being written)"
                    )
                break
            if m.data + m.size > size:
                raise SourceError(
                    f"WebDatasetSource: {name!r}: tar member {m.name!r} (header at byte {m.header}) is cut short: "
                    f"its {m.size} bytes need the file to reach byte {m.data + m.size}, and it has {size}"
                )
            split = cls._keyed(m, name)
            if split is None:
                continue
            if split[0] == key and split[1] in exts:
                raise SourceError(
                    f"WebDatasetSource: {name!r}: tar member {m.name!r} (header at byte {m.header}) repeats the "
                    f"extension {split[1]!r} of sample {key!r} (extensions are lowercased): a duplicate file name, "
                    "which the webdataset library refuses too"
                )
            if split[0] != key:
                starts.append(m.header)
                key, exts = split[0], set()
            exts.add(split[1])
            last_end = min(m.data + _padded(m.size), size)
        if starts:
            starts.append(last_end)
        else:
            starts.append(0)
        return np.asarray(starts, dtype=np.int64)

    def _read_file(self, f: int, wanted: np.ndarray) -> list:
        """The samples ``wanted`` (sorted, distinct) of shard ``f``, the framing around each checked.

        Consecutive samples have different keys, so each sample read is compared with its neighbours:
        by key if read with it, else by a ``pread`` of their first 1.5 KiB. An index that splits a
        sample would otherwise read it as two. An index this source built by scanning the shard
        frames it by construction (reads check the shard is unchanged): its reads skip this.

        Raises:
            SourceError: two consecutive samples with one key, naming them; or what a read raises.
        """
        out = super()._read_file(f, wanted)
        if self.index_sources[f] == "built":
            return out
        records = wanted.tolist()
        keys: dict[int, str | None] = {r: s["__key__"] for r, s in zip(records, out)}
        count = len(self._offsets[f]) - 1
        others = sorted({n for r in records for n in (r - 1, r + 1) if 0 <= n < count} - keys.keys())
        try:
            with self._fds.use(f, self.paths[f]) as fd:
                heads = {r: self._head(fd, f, r) for r in others}
                keys.update((r, _plain_key(head)) for r, head in heads.items())
                for r in records:
                    for a in (r - 1, r):
                        if a not in keys or a + 1 not in keys:
                            continue
                        for b in (a, a + 1):  # a key not read plainly, or equal: read in full
                            if b in heads and (keys[b] is None or keys[a] == keys[a + 1]):
                                keys[b] = self._first_key(fd, f, b, heads.pop(b))
                        if keys[a] == keys[a + 1]:
                            raise SourceError(
                                f"WebDatasetSource: {self.where(f, a)} and record {a + 1} both hold sample "
                                f"{keys[a]!r}: consecutive samples have different keys, so the index does not "
                                "frame this shard's samples (the file changed since it was indexed?)"
                            )
        except OSError as e:
            raise SourceError(f"WebDatasetSource: cannot read {self.names[f]!r}: {e}") from e
        return out

    def _head(self, fd: int, f: int, record: int) -> bytes:
        """The first bytes of a sample (at most 1.5 KiB: its first member's header, after a pax or long-name one)."""
        off = self._offsets[f]
        return os.pread(fd, min(int(off[record + 1]) - int(off[record]), 3 * _BLOCK), int(off[record]))

    def _first_key(self, fd: int, f: int, record: int, head: bytes) -> str:
        """The key of a sample's first member, its headers parsed and checked as a read does (``head``: its first bytes)."""
        off = self._offsets[f]
        lo, hi = int(off[record]), int(off[record + 1])

        def get(at: int, n: int) -> bytes:
            return head[at - lo : at - lo + n] if at + n <= lo + len(head) else os.pread(fd, n, at)

        for m in _members(get, lo, hi, self.names[f], self.where(f, record)):
            if isinstance(m, int):
                break
            split = self._keyed(m, self.names[f])
            if split is not None:
                return split[0]
        raise SourceError(
            f"WebDatasetSource: {self.where(f, record)}: no sample where the index says (the file changed since "
            "it was indexed?)"
        )

    def decode(self, file_index: int, record: int, data: memoryview) -> Any:
        """A sample from its members' bytes.

        Args:
            file_index: the shard.
            record: the sample's number in it.
            data: its bytes (its members' headers and data).

        Returns:
            ``{"__key__": key, ext: bytes, ...}``, extensions in tar order.

        Raises:
            SourceError: a bad header, or members that are not one sample where the index says.
        """
        name = self.names[file_index]
        sample: dict[str, Any] = {}
        lo = int(self._offsets[file_index][record])
        n = len(data)
        for m in _members(
            lambda at, k: bytes(data[at - lo : at - lo + k]), lo, lo + n, name, self.where(file_index, record)
        ):
            if isinstance(m, int):
                if m < lo + n:  # a record's bytes end at its last member's padding, never at a zero block
                    raise SourceError(
                        f"WebDatasetSource: {self.where(file_index, record)}: a zero block (the end of a tar) at byte "
                        f"{m}, inside the record: the index does not frame this shard's samples"
                    )
                break
            split = self._keyed(m, name)
            overruns = m.data + m.size > lo + n  # any member, one skipped (``__x__``, not regular) too
            if split is None and not overruns:
                continue
            key, ext = split or ("", "")
            if overruns or sample and (key != sample["__key__"] or ext in sample):
                raise SourceError(
                    f"WebDatasetSource: {self.where(file_index, record)}: its members are not one sample where the "
                    "index says (the file changed since it was indexed?)"
                )
            if not sample:
                sample["__key__"] = key
            sample[ext] = bytes(data[m.data - lo : m.data - lo + m.size])
        if not sample:
            raise SourceError(
                f"WebDatasetSource: {self.where(file_index, record)}: no sample where the index says (the file "
                "changed since it was indexed?)"
            )
        return sample

    def config(self) -> dict[str, Any]:
        """This source's config section (``source: {type: webdataset, ...}``).

        Returns:
            ``{"type": "webdataset", "paths": ..., "name": ...}`` (URLs as given).
        """
        return {"type": "webdataset", "paths": list(self.urls or self.paths), "name": self.name}


def read_sample(record: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A WebDataset sample from a tar holding one sample: a record ``quern prepare`` made of a tar shard's sample.

    ``quern prepare`` keeps a sample whole as one record: its members' headers and data as they
    are in the shard, then tar's end-of-archive. This reads such a record (or any tar of one
    sample) the way ``WebDatasetSource`` reads a shard's sample: members that are not regular
    files and ``__*__`` metadata files are skipped, extensions are lowercased.

    Args:
        record: the tar's bytes.

    Returns:
        ``{"__key__": key, ext: bytes, ...}``, extensions in tar order.

    Raises:
        SourceError: a bad or truncated tar header, a member cut short, a member without a key,
            a sparse member, members of two samples, a repeated extension, or no sample at all.

    Example:
        >>> import io, tarfile
        >>> buf = io.BytesIO()
        >>> with tarfile.open(fileobj=buf, mode="w") as tar:
        ...     for member, data in [("a.txt", b"hi"), ("a.JSON", b"{}")]:
        ...         info = tarfile.TarInfo(member)
        ...         info.size = len(data)
        ...         tar.addfile(info, io.BytesIO(data))
        >>> read_sample(buf.getvalue())
        {'__key__': 'a', 'txt': b'hi', 'json': b'{}'}
    """
    data = memoryview(record).cast("B")
    name = "a WebDataset sample record"
    sample: dict[str, Any] = {}
    for m in _members(lambda at, n: bytes(data[at : at + n]), 0, len(data), name):
        if isinstance(m, int):
            break
        if m.data + m.size > len(data):
            raise SourceError(
                f"read_sample: tar member {m.name!r} (header at byte {m.header}) is cut short: its {m.size} bytes "
                f"need the record to reach byte {m.data + m.size}, and it has {len(data)}"
            )
        split = WebDatasetSource._keyed(m, name)
        if split is None:
            continue
        key, ext = split
        if sample and key != sample["__key__"]:
            raise SourceError(
                f"read_sample: the record holds more than one sample: {sample['__key__']!r}, then {key!r} (tar member "
                f"{m.name!r} at byte {m.header})"
            )
        if ext in sample:
            raise SourceError(f"read_sample: tar member {m.name!r} repeats the extension {ext!r} of sample {key!r}")
        if not sample:
            sample["__key__"] = key
        sample[ext] = bytes(data[m.data : m.data + m.size])
    if not sample:
        raise SourceError("read_sample: the record holds no sample (no regular member named KEY.EXTENSION)")
    return sample
