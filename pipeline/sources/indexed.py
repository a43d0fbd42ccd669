"""Files read in place by record offset: what the tar, TFRecord and JSON-lines sources share.

A subclass names its format (:attr:`~quern.sources.IndexedSource.FORMAT`), scans a file for
its records' byte ranges (:meth:`~quern.sources.IndexedSource.scan`, once per file: the
offsets are kept in a verified index, :mod:`quern.pipeline.sources.offsets`)
and decodes one record from its bytes (:meth:`~quern.sources.IndexedSource.decode`). This
module does the rest: paths, globs and URLs (fetched whole into the disk cache,
keyed there by URL and the server's size and ETag or Last-Modified), refusing
compressed files, finding or building the indexes (a sidecar, the cache, else a
scan, in parallel over files), bulk reads grouped per file (consecutive records
in one ``pread``), the checks that a file did not change, and the identity.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from ..cache import ShardCache, is_url
from ..errors import SourceError
from . import offsets as offsets_mod
from .base import FileStats, Source, check_ids, expand_paths, group_by, sample_hash

__all__ = ["COMPRESSED", "IndexedSource", "Sidecar", "check_file", "compression_of"]

COMPRESSED = {
    b"\x1f\x8b": "gzip",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
}
"""Magic bytes of compressed files, which cannot be read by offset."""
_RUN_BYTES = 64 << 20  # the most bytes one pread reads (a run of consecutive records is cut beyond it)
_MAX_FDS = 256  # open files kept per process


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
    """Refuse a file that cannot be read by offset: an empty or a compressed one.

    Args:
        what: the source's class name, for the message.
        fmt: the format.
        name: how messages name the file (its path or URL).
        path: the local file.
        size: its size in bytes.

    Raises:
        SourceError: the file is empty, or compressed (with what to do instead).
    """
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


class Sidecar(NamedTuple):
    """What :meth:`~quern.sources.IndexedSource.write_sidecars` did for one file."""

    path: str
    """The data file."""
    records: int
    """Its records."""
    sidecar: str
    """Its sidecar index."""
    built: bool
    """Whether it was written (``False``: the sidecar there was already right for the file)."""


class _Fds:
    """This process's open files, by file index, each counted while in use (``pread`` needs no lock).

    At most :data:`_MAX_FDS` are kept; beyond that the least recently used ones not in use are closed.
    A file dropped (or evicted) while a thread reads it is closed when that thread is done. After a fork
    the inherited descriptors (the child's own copies) are closed and files are opened again.
    """

    def __init__(self) -> None:
        self._fds: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # k -> [fd, users]
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _forked(self) -> None:
        if self._pid != os.getpid():
            for fd, _ in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()
            self._pid = os.getpid()

    @contextlib.contextmanager
    def use(self, k: int, path: str) -> Iterator[int]:
        """The open descriptor of file ``k`` (``path``), held open while the block runs."""
        with self._lock:
            self._forked()
            entry = self._fds.get(k)
            if entry is None:
                entry = self._fds[k] = [os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), 0]
            entry[1] += 1
            self._fds.move_to_end(k)
            while len(self._fds) > _MAX_FDS:
                idle = next((j for j, e in self._fds.items() if e[1] == 0), None)
                if idle is None:
                    break
                os.close(self._fds.pop(idle)[0])
        try:
            yield entry[0]
        finally:
            with self._lock:
                entry[1] -= 1
                gone = self._fds.get(k) is not entry  # dropped or evicted meanwhile: closed by its last user
                if gone and entry[1] == 0 and self._pid == os.getpid():
                    os.close(entry[0])

    def drop(self, k: int) -> None:
        """Forget file ``k``'s descriptor (closed now, or by the thread using it when it is done)."""
        with self._lock:
            entry = self._fds.pop(k, None) if self._pid == os.getpid() else None
            if entry is not None and entry[1] == 0:
                os.close(entry[0])

    def close(self) -> None:
        with self._lock:
            entries = list(self._fds.values()) if self._pid == os.getpid() else []
            self._fds.clear()
            for fd, users in entries:
                if users == 0:
                    os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class IndexedSource(Source):
    """Base class of the sources that read files in place by record offset.

    Subclasses set :attr:`FORMAT` and :attr:`SUFFIXES`, and implement :meth:`scan` and
    :meth:`decode` (and may add to :meth:`identity`). Record ids are global over the
    files in the given order (globs sorted).

    Args:
        paths: a path or glob, or a list of them; or URLs (``http(s)://``, ``s3://``,
            ``gs://``, ``file://``), fetched whole into ``cache`` when the source opens.
        name: the source's name (default: from the first file's name).
        cache: the disk cache of remote files (default: a :class:`~quern.pipeline.cache.ShardCache`
            in its default folder).
        index_cache: the folder of cached indexes (default: ``$QUERN_CACHE_DIR``, else
            ``~/.cache/quern``; indexes go in its ``offsets/``).
        index_threads: files scanned at once when indexes are built (default: up to 8).

    Raises:
        FileNotFoundError: a glob matches nothing, or a path does not exist.
        SourceError: a file is empty, compressed or holds bad data (naming the file and where),
            or a URL cannot be fetched.

    Attributes:
        paths: the local files read (for URLs, their copies in the cache).
        urls: the URLs given, else ``None``.
        counts: the records of each file.
        starts: the first record id of each file, and the total.
        index_sources: per file, where its index came from: ``"sidecar"``, ``"cache"`` or ``"built"``.
    """

    FORMAT = ""
    """The format's name in index files and messages."""
    SUFFIXES: tuple[str, ...] = ()
    """File name endings the default ``name`` drops."""

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        name: str | None = None,
        cache: ShardCache | None = None,
        index_cache: str | os.PathLike | None = None,
        index_threads: int | None = None,
    ) -> None:
        what = type(self).__name__
        given = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
        self.urls: list[str] | None = None
        self.cache: ShardCache | None = None
        self._pins: list[Any] = []
        if given and all(is_url(p) for p in given):
            self.cache = cache if cache is not None else ShardCache()
            self.urls = given
            held = [self.cache.get_pinned(u) for u in given]  # keyed by URL, size and ETag: a changed file is new
            self.paths = [path for path, _ in held]
            self._pins = [pin for _, pin in held]
        elif any(is_url(p) for p in given):
            raise ValueError(f"{what}: give local paths or URLs, not both: {given!r}")
        else:
            self.paths = expand_paths(given, what)
        self.names = list(self.urls or self.paths)  # how messages name the files
        base = self.names[0].rstrip("/").rsplit("/", 1)[-1]
        for suffix in self.SUFFIXES:
            if base.lower().endswith(suffix):
                base = base[: -len(suffix)]
                break
        self.name = name or base or self.FORMAT
        self.index_cache = None if index_cache is None else os.fspath(index_cache)
        self._files = FileStats(what, self.paths)  # before any byte is read
        self.sizes = [st[0] for st in self._files.stats]
        for k, (path, size) in enumerate(zip(self.paths, self.sizes)):
            check_file(what, self.FORMAT, self.names[k], path, size)
        self.samples = [sample_hash(p, s) for p, s in zip(self.paths, self.sizes)]
        self._offsets: list[np.ndarray] = []
        self._index_files: list[str | None] = []
        self.index_sources: list[str] = []
        self._find_indexes(index_threads)
        for k, off in enumerate(self._offsets):
            if len(off) < 2:
                raise SourceError(f"{what}: {self.names[k]!r} holds no {self.FORMAT} records")
        self.counts = np.asarray([len(o) - 1 for o in self._offsets], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self._fds = _Fds()

    # -- opening -----------------------------------------------------------------------------------------

    def _find_indexes(self, threads: int | None) -> None:
        """Each file's offsets: from its sidecar, else the cache, else a scan (stored in the cache)."""
        what = type(self).__name__
        found: list[np.ndarray | None] = []
        for k in range(len(self.paths)):
            off, src, where = self._known_index(k)
            found.append(off)
            self._index_files.append(where)
            self.index_sources.append(src)
        missing = [k for k, off in enumerate(found) if off is None]
        if missing:
            built = offsets_mod.build(
                self.scan, [self.paths[k] for k in missing], [self.names[k] for k in missing], threads=threads
            )
            for k, off in zip(missing, built):
                self._files.check(k)  # scanned from the file the source opened
                found[k] = off
                target = offsets_mod.cache_path(self.FORMAT, self.sizes[k], self.samples[k], self.index_cache)
                try:
                    offsets_mod.store(target, offsets_mod.dump(self.FORMAT, self.sizes[k], self.samples[k], off))
                    self._index_files[k] = target
                except OSError as e:
                    warnings.warn(f"{what}: cannot cache the index of {self.names[k]!r} in {target}: {e}", stacklevel=3)
        self._offsets = [off for off in found if off is not None]

    def _known_index(self, k: int) -> tuple[np.ndarray | None, str, str | None]:
        """File ``k``'s verified offsets from its sidecar or the cache: ``(offsets, from, file)``."""
        fmt, size, sample = self.FORMAT, self.sizes[k], self.samples[k]
        cached = offsets_mod.cache_path(fmt, size, sample, self.index_cache)
        candidates: list[tuple[str, bytes | str, str | None]] = []
        if self.urls is None:
            candidates.append(
                ("sidecar", offsets_mod.sidecar_path(self.paths[k]), offsets_mod.sidecar_path(self.paths[k]))
            )
        candidates.append(("cache", cached, cached))
        for src, data, where in candidates:
            off, why = offsets_mod.load(data, fmt, size, sample)
            if off is not None:
                return off, src, where
            if src == "sidecar" and why != "not built yet":
                warnings.warn(
                    f"{type(self).__name__}: the sidecar index {where} is not used: {why}",
                    stacklevel=4,
                )
        if self.urls is not None and self.cache is not None:  # a sidecar beside the URL, fetched once
            url = offsets_mod.sidecar_path(self.urls[k])
            try:
                blob = self.cache.read(url)
            except FileNotFoundError:
                return None, "built", None
            except SourceError as e:  # a sidecar that cannot be fetched (forbidden, the network): index the file
                warnings.warn(f"{type(self).__name__}: the sidecar index {url} cannot be fetched: {e}", stacklevel=4)
                return None, "built", None
            off, why = offsets_mod.load(blob, fmt, size, sample)
            if off is None:
                warnings.warn(f"{type(self).__name__}: the sidecar index {url} is not used: {why}", stacklevel=4)
                return None, "built", None
            try:
                offsets_mod.store(cached, blob)
                return off, "sidecar", cached
            except OSError:
                return off, "sidecar", None
        return None, "built", None

    @classmethod
    def write_sidecars(
        cls, paths: str | os.PathLike | Sequence[str | os.PathLike], *, threads: int | None = None
    ) -> list[Sidecar]:
        """Index local files and write each index beside its file (``FILE.quern.idx``): ``quern index``.

        A sidecar already right for its file (verified as when a source opens it) is kept.

        Args:
            paths: a path or glob, or a list of them.
            threads: files scanned at once (default: up to 8).

        Returns:
            Per file, in order, what was done.

        Raises:
            FileNotFoundError: a glob matches nothing, or a path does not exist.
            SourceError: a file is empty, compressed or holds bad data (naming it and where).
            OSError: a sidecar cannot be written.
        """
        what = cls.__name__
        files = expand_paths(paths, what)
        sizes = [os.path.getsize(p) for p in files]
        for p, size in zip(files, sizes):
            check_file(what, cls.FORMAT, p, p, size)
        samples = [sample_hash(p, size) for p, size in zip(files, sizes)]
        found = [
            offsets_mod.load(offsets_mod.sidecar_path(p), cls.FORMAT, size, h)[0]
            for p, size, h in zip(files, sizes, samples)
        ]
        missing = [k for k, off in enumerate(found) if off is None]
        built = dict(
            zip(
                missing,
                offsets_mod.build(cls.scan, [files[k] for k in missing], [files[k] for k in missing], threads=threads),
            )
        )
        out = []
        for k, off in enumerate(found):
            new = off is None
            if off is None:
                off = built[k]
                offsets_mod.store(
                    offsets_mod.sidecar_path(files[k]), offsets_mod.dump(cls.FORMAT, sizes[k], samples[k], off)
                )
            out.append(Sidecar(files[k], len(off) - 1, offsets_mod.sidecar_path(files[k]), new))
        return out

    # -- what subclasses implement -------------------------------------------------------------------------

    @classmethod
    def scan(cls, f: BinaryIO, size: int, name: str) -> np.ndarray:  # pragma: no cover - abstract
        """The record offsets of one file, by one sequential scan.

        Args:
            f: the file, opened for reading (unbuffered).
            size: its size in bytes.
            name: how messages name it.

        Returns:
            ``n + 1`` int64 offsets: record ``k`` is the bytes ``[offsets[k], offsets[k + 1])``.

        Raises:
            SourceError: the file holds bad data, naming it and where.
        """
        raise NotImplementedError

    def decode(self, file_index: int, record: int, data: memoryview) -> Any:  # pragma: no cover - abstract
        """One record from its bytes.

        Args:
            file_index: the file's index in :attr:`paths`.
            record: the record's number in its file.
            data: its bytes ``[offsets[record], offsets[record + 1])``.

        Returns:
            The record.

        Raises:
            SourceError: the bytes are not a good record of the format (naming the file and record).
        """
        raise NotImplementedError

    # -- reading -----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.starts[-1])

    def offsets(self, file_index: int) -> np.ndarray:
        """File ``file_index``'s record offsets (``counts[file_index] + 1``, read-only).

        Args:
            file_index: the file's index in :attr:`paths`.

        Returns:
            Record ``k`` is the file's bytes ``[offsets[k], offsets[k + 1])``.
        """
        off = self._offsets[file_index]
        off.flags.writeable = False
        return off

    def where(self, file_index: int, record: int) -> str:
        """A record's name in messages.

        Args:
            file_index: the file's index in :attr:`paths`.
            record: the record's number in its file.

        Returns:
            ``"'data/a.tfrecord' record 12 (bytes 1024-2048)"``.
        """
        off = self._offsets[file_index]
        return f"{self.names[file_index]!r} record {record} (bytes {int(off[record])}-{int(off[record + 1])})"

    def read_many(self, ids: np.ndarray) -> list:
        """The records ``ids``, in that order: per file, one ``pread`` per run of consecutive records.

        Args:
            ids: record ids in ``[0, len(self))``; they may repeat.

        Returns:
            A list of records.

        Raises:
            IndexError: an id is out of range.
            SourceError: a read failed, a record is bad, or a file changed since the source opened it.
        """
        ids = check_ids(ids, len(self), f"{type(self).__name__} {self.name!r}")
        out: list = [None] * len(ids)
        file_of = np.searchsorted(self.starts, ids, side="right") - 1
        for f, where in group_by(file_of):
            local = ids[where] - self.starts[f]
            wanted, inverse = np.unique(local, return_inverse=True)
            records = self._read_file(f, wanted)
            for k, j in zip(where.tolist(), inverse.tolist()):
                out[k] = records[j]
        return out

    def _read_file(self, f: int, wanted: np.ndarray) -> list:
        """The records ``wanted`` (sorted, distinct) of file ``f``: one ``pread`` per run, one ``stat`` after all."""
        off = self._offsets[f]
        cut = np.flatnonzero(np.diff(wanted) != 1)  # runs of consecutive records
        firsts = np.concatenate([wanted[:1], wanted[cut + 1]]).tolist()
        lasts = np.concatenate([wanted[cut], wanted[-1:]]).tolist()
        try:
            with self._fds.use(f, self.paths[f]) as fd:
                reads = self._pread_runs(f, fd, firsts, lasts)
        except OSError as e:
            self._files.check(f)
            raise SourceError(f"{type(self).__name__}: cannot open {self.names[f]!r}: {e}") from e
        self._files.check(f)  # what the reads returned came from the file the source opened
        out: list = []
        for first, last, lo, data in reads:
            if first == last:
                out.append(self.decode(f, first, memoryview(data)))
                continue
            view = memoryview(data)
            ends = off[first : last + 2].tolist()
            for r, a, b in zip(range(first, last + 1), ends, ends[1:]):
                out.append(self.decode(f, r, view[a - lo : b - lo]))
        return out

    def _pread_runs(self, f: int, fd: int, firsts: list[int], lasts: list[int]) -> list[tuple[int, int, int, bytes]]:
        """One ``pread`` per run of records ``[first, last]`` (a long run cut at :data:`_RUN_BYTES`)."""
        off = self._offsets[f]
        reads: list[tuple[int, int, int, bytes]] = []  # (first record, last record, first byte, bytes)
        for first, end in zip(firsts, lasts):
            while first <= end:
                last = end
                if last > first and int(off[last + 1]) - int(off[first]) > _RUN_BYTES:  # cut a long run
                    cap = int(np.searchsorted(off, off[first] + _RUN_BYTES, side="right")) - 1
                    last = min(end, max(first, cap - 1))  # at least one record per read
                lo, hi = int(off[first]), int(off[last + 1])
                try:
                    data = os.pread(fd, hi - lo, lo)
                except OSError as e:
                    self._fds.drop(f)
                    self._files.check(f)
                    raise SourceError(f"{type(self).__name__}: reading {self.where(f, first)} failed: {e}") from e
                if len(data) != hi - lo:
                    self._files.check(f)
                    raise SourceError(
                        f"{type(self).__name__}: {self.names[f]!r} ends at byte {lo + len(data)}, inside the "
                        f"records from {self.where(f, first)}: the file is shorter than when it was indexed"
                    )
                reads.append((first, last, lo, data))
                first = last + 1
        return reads

    # -- identity and pickling ---------------------------------------------------------------------------

    def identity(self) -> dict:
        """A description of the data for the pipeline fingerprint.

        Returns:
            The type, name, length and per file its name, size, record count and sampled hash.
        """
        files = [
            {"file": n.rstrip("/").rsplit("/", 1)[-1], "size": s, "records": int(c), "sample": h}
            for n, s, c, h in zip(self.names, self.sizes, self.counts, self.samples)
        ]
        return {**super().identity(), "files": files}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pins"] = []  # the parent's pins keep the cached files while it lives
        state["_fds"] = None
        # offsets kept in an index file travel as its path (verified again where unpickled)
        state["_offsets"] = [None if p is not None else o for o, p in zip(self._offsets, self._index_files)]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fds = _Fds()
        for k, off in enumerate(self._offsets):
            if off is not None:
                continue
            path = self._index_files[k]
            assert path is not None
            got, why = offsets_mod.load(path, self.FORMAT, self.sizes[k], self.samples[k])
            if got is None and os.path.exists(self.paths[k]):  # another machine, a cleaned cache: made again here
                got = self._known_index(k)[0]
                if got is None:
                    got = offsets_mod.build(self.scan, [self.paths[k]], [self.names[k]])[0]
            if got is None or len(got) != self.counts[k] + 1:
                why = why if got is None else f"it holds {len(got) - 1} records, not {int(self.counts[k])}"
                raise SourceError(
                    f"{type(self).__name__}: the index {path} of {self.names[k]!r} cannot be used here: {why}"
                )
            self._offsets[k] = got
