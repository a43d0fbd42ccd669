"""Files read in place by record offset: what the tar, TFRecord and JSON-lines sources share.

A subclass names its format (:attr:`~quern.sources.IndexedSource.FORMAT`), scans a file for
its records' byte ranges (:meth:`~quern.sources.IndexedSource.scan`, once per file: the
offsets are kept in a verified index, :mod:`quern.pipeline.sources.offsets`)
and decodes one record from its bytes (:meth:`~quern.sources.IndexedSource.decode`). This
module does the rest: paths, globs and URLs (fetched whole into the disk cache,
keyed there by URL and the server's size and ETag or Last-Modified), refusing
what is not a regular file and compressed files, each file's content hash
(:mod:`quern.pipeline.sources.contents`), finding, checking or building the
indexes (a sidecar, the cache, else a scan, in parallel over files), bulk reads
grouped per file (consecutive records in one ``pread``), the checks that a file
did not change, and the identity.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from ..core.errors import SourceError
from ..remote.cache import ShardCache, is_url
from . import contents as contents_mod
from . import offsets as offsets_mod
from .base import FileStats, Source, check_ids, group_by
from .contents import HashedFile
from .descriptors import Descriptors
from .localfiles import COMPRESSED, check_file, compression_of, data_files

__all__ = ["COMPRESSED", "IndexedSource", "Sidecar", "check_file", "compression_of", "data_files"]

_RUN_BYTES = 64 << 20  # the most bytes one pread reads (a run of consecutive records is cut beyond it)


def _same_bytes(what: str, name: str, content: str, scanned: str) -> None:
    """Refuse an index scanned from other bytes than those hashed before (a write between the two reads)."""
    if scanned != content:
        raise SourceError(
            f"{what}: {name!r} changed while it was indexed (the bytes scanned are not those hashed before: "
            f"content hash {scanned}, not {content}): open it again once it is written"
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


class IndexedSource(Source):
    """Base class of the sources that read files in place by record offset.

    Subclasses set :attr:`FORMAT` and :attr:`SUFFIXES`, and implement :meth:`scan` and
    :meth:`decode` (and may add to :meth:`identity`). Record ids are global over the
    files in the given order (globs sorted).

    Args:
        paths: a path or glob, or a list of them; or URLs (``http(s)://``, ``s3://``,
            ``gs://``, ``file://``), fetched whole into ``cache`` when the source opens.
        name: the source's name (default: from the first file's name).
        cache: the disk cache of remote files (default: a :class:`~quern.pipeline.remote.cache.ShardCache`
            in its default folder).
        index_cache: the folder of cached indexes (default: ``$QUERN_CACHE_DIR``, else
            ``~/.cache/quern``; indexes go in its ``offsets/``).
        index_threads: files scanned at once when indexes are built (default: up to 8).

    Raises:
        FileNotFoundError: a glob matches nothing, or a path does not exist.
        SourceError: a file is not a regular file, is empty, compressed or holds bad data (naming
            the file and where), or a URL cannot be fetched.

    Attributes:
        paths: the local files read (for URLs, their copies in the cache).
        urls: the URLs given, else ``None``.
        contents: each file's content hash (:mod:`quern.pipeline.sources.contents`), taken when the
            source opened it (or remembered for its unchanged stat identity).
        counts: the records of each file.
        starts: the first record id of each file, and the total.
        index_sources: per file, where its index came from: ``"sidecar"``, ``"cache"`` or ``"built"``.
    """

    FORMAT = ""
    """The format's name in index files and messages."""
    SUFFIXES: tuple[str, ...] = ()
    """File name endings the default ``name`` drops."""
    FILLER = b""
    """The bytes a file may hold outside its records (the base :meth:`check_bounds`): none by default."""

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
            self.paths = data_files(given, what)
        self.names = list(self.urls or self.paths)  # how messages name the files
        base = self.names[0].rstrip("/").rsplit("/", 1)[-1]
        for suffix in self.SUFFIXES:
            if base.lower().endswith(suffix):
                base = base[: -len(suffix)]
                break
        self.name = name or base or self.FORMAT
        self.index_cache = None if index_cache is None else os.fspath(index_cache)
        self._files = FileStats(what, self.paths, ctime=self.urls is None)  # before any byte is read
        self.sizes = [st[0] for st in self._files.stats]
        for k, (path, size) in enumerate(zip(self.paths, self.sizes)):
            check_file(what, self.FORMAT, self.names[k], path, size)
        self._fds = Descriptors()
        known = contents_mod.know(
            self.paths, self.names, self.index_cache, threads=index_threads, ctime=self.urls is None
        )
        self.contents = [k.content for k in known]
        for k, kn in enumerate(known):
            self._files.check(k)  # hashed from the file the source opened
            if kn.before is not None:
                warnings.warn(
                    f"{what}: {self.names[k]!r} changed in place since it was last opened here (its contents "
                    "differ): the index of its old contents is not used",
                    stacklevel=2,
                )
        self._offsets: list[np.ndarray] = []
        self._index_files: list[str | None] = []
        self.index_sources: list[str] = []
        self._find_indexes(index_threads, [kn.stat for kn in known])
        for k, off in enumerate(self._offsets):
            if len(off) < 2:
                raise SourceError(f"{what}: {self.names[k]!r} holds no {self.FORMAT} records")
        self.counts = np.asarray([len(o) - 1 for o in self._offsets], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    # -- opening -----------------------------------------------------------------------------------------

    def _find_indexes(self, threads: int | None, stats: list[os.stat_result]) -> None:
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
            for k, (off, content) in zip(missing, built):
                self._files.check(k)  # scanned from the file the source opened,
                contents_mod.unchanged(  # the one its contents were hashed of
                    self.paths[k], stats[k], self.names[k], ctime=self.urls is None
                )
                _same_bytes(what, self.names[k], self.contents[k], content)  # and in the bytes hashed
                found[k] = off
                offsets_mod.mark_checked(self.FORMAT, self.contents[k], off, self.index_cache)
                target = offsets_mod.cache_path(self.FORMAT, self.sizes[k], self.contents[k], self.index_cache)
                try:
                    offsets_mod.store(target, offsets_mod.dump(self.FORMAT, self.sizes[k], self.contents[k], off))
                    self._index_files[k] = target
                except OSError as e:
                    warnings.warn(f"{what}: cannot cache the index of {self.names[k]!r} in {target}: {e}", stacklevel=3)
        self._offsets = [off for off in found if off is not None]

    def _checked(self, k: int, data: bytes | str) -> tuple[np.ndarray | None, str]:
        """An index (its bytes or path) verified for file ``k`` (:func:`offsets.load`) and checked against its bytes."""
        off, why = offsets_mod.load(data, self.FORMAT, self.sizes[k], self.contents[k])
        if off is None:
            return None, why
        try:
            with self._fds.use(k, self.paths[k]) as fd:
                bad = self.fits(fd, self.sizes[k], off, self.contents[k], self.names[k], self.index_cache)
        except OSError as e:
            return None, f"the file cannot be read to check it ({e})"
        return (None, bad) if bad is not None else (off, why)

    def _known_index(self, k: int) -> tuple[np.ndarray | None, str, str | None]:
        """File ``k``'s checked offsets from its sidecar or the cache: ``(offsets, from, file)``."""
        what, fmt, size, content = type(self).__name__, self.FORMAT, self.sizes[k], self.contents[k]
        candidates = [("sidecar", offsets_mod.sidecar_path(self.paths[k]), "sidecar")] if self.urls is None else []
        candidates.append(("cache", offsets_mod.cache_path(fmt, size, content, self.index_cache), "cached"))
        fetched = offsets_mod.cache_path(fmt, size, content, self.index_cache, fetched=True)
        if self.urls is not None:  # a sidecar fetched beside the URL before: kept apart from the local files' indexes
            candidates.append(("cache", fetched, "fetched sidecar"))
        for src, where, kind in candidates:
            off, why = self._checked(k, where)
            if off is not None:
                return off, src, where
            if why != "not built yet" and not (src == "cache" and why.startswith("cannot read it")):
                warnings.warn(f"{what}: the {kind} index {where} is not used: {why}", stacklevel=4)
        if self.urls is None or self.cache is None:
            return None, "built", None
        url = offsets_mod.sidecar_path(self.urls[k])  # a sidecar beside the URL, fetched once
        try:
            blob = self.cache.read(url)
        except FileNotFoundError:
            return None, "built", None
        except SourceError as e:  # a sidecar that cannot be fetched (forbidden, the network): index the file
            warnings.warn(f"{what}: the sidecar index {url} cannot be fetched: {e}", stacklevel=4)
            return None, "built", None
        off, why = self._checked(k, blob)
        if off is None:
            warnings.warn(f"{what}: the sidecar index {url} is not used: {why}", stacklevel=4)
            return None, "built", None
        try:
            offsets_mod.store(fetched, blob)
            return off, "sidecar", fetched
        except OSError:
            return off, "sidecar", None

    @classmethod
    def write_sidecars(
        cls, paths: str | os.PathLike | Sequence[str | os.PathLike], *, threads: int | None = None
    ) -> list[Sidecar]:
        """Index local files and write each index beside its file (``FILE.quern.idx``): ``quern index``.

        A sidecar already right for its file (verified and checked as when a source opens it) is
        kept. The sidecars a glob matches are left out (``data/*``).

        Args:
            paths: a path or glob, or a list of them.
            threads: files hashed and scanned at once (default: up to 8).

        Returns:
            Per file, in order, what was done.

        Raises:
            FileNotFoundError: a glob matches nothing, or a path does not exist.
            ValueError: a path named is a sidecar.
            SourceError: a file is not a regular file, is empty, compressed or holds bad data
                (naming it and where).
            OSError: a sidecar cannot be written.
        """
        what = cls.__name__
        files = data_files(paths, what)
        stats = FileStats(what, files)
        sizes = [st[0] for st in stats.stats]
        for p, size in zip(files, sizes):
            check_file(what, cls.FORMAT, p, p, size)
        known = contents_mod.know(files, files, threads=threads)
        found: list[np.ndarray | None] = []
        for k, p in enumerate(files):
            off, _ = offsets_mod.load(offsets_mod.sidecar_path(p), cls.FORMAT, sizes[k], known[k].content)
            if off is not None:
                with open(p, "rb", buffering=0) as f:
                    off = None if cls.fits(f.fileno(), sizes[k], off, known[k].content, p) else off
            found.append(off)
        missing = [k for k, off in enumerate(found) if off is None]
        scanned = offsets_mod.build(cls.scan, [files[k] for k in missing], [files[k] for k in missing], threads=threads)
        built = dict(zip(missing, scanned))
        out = []
        for k, off in enumerate(found):
            if off is None:
                stats.check(k)
                contents_mod.unchanged(files[k], known[k].stat, files[k])
                off, content = built[k]
                _same_bytes(what, files[k], known[k].content, content)
                offsets_mod.mark_checked(cls.FORMAT, content, off)
                dump = offsets_mod.dump(cls.FORMAT, sizes[k], known[k].content, off)
                offsets_mod.store(offsets_mod.sidecar_path(files[k]), dump)
            out.append(Sidecar(files[k], len(off) - 1, offsets_mod.sidecar_path(files[k]), k in built))
        return out

    @classmethod
    def fits(
        cls, fd: int, size: int, off: np.ndarray, content: str, name: str, folder: str | os.PathLike | None = None
    ) -> str | None:
        """Why an index does not fit a file (``None``: it does), checked at most once per content and index on a host.

        The checksum of an index file is no signature: one made by hand can leave records out at
        either end (:meth:`check_bounds`) or cut records at other places inside
        (:meth:`check_inside`). A verdict that both passed is kept in the cache folder
        (:func:`~quern.pipeline.sources.offsets.checked`): the next open of the same bytes with
        the same index checks nothing.

        Args:
            fd: the file, open for reading.
            size: its size in bytes.
            off: the index's offsets.
            content: the file's content hash.
            name: how messages name the file.
            folder: the cache folder of the verdicts.

        Returns:
            ``None``, or why the index does not fit the file.
        """
        if offsets_mod.checked(cls.FORMAT, content, off, folder):
            return None
        bad = cls.check_bounds(fd, size, int(off[0]), int(off[-1]), name) or cls.check_inside(
            fd, size, off, content, name
        )
        if bad is None:
            offsets_mod.mark_checked(cls.FORMAT, content, off, folder)
        return bad

    @classmethod
    def check_inside(cls, fd: int, size: int, off: np.ndarray, content: str, name: str) -> str | None:
        """Why an index's boundaries inside a file are not its records' (``None``: they are, or cannot be told here).

        The base checks nothing; a format overrides it with what can be checked at every
        boundary at once (vectorised), or with a scan compared to the index.

        Args:
            fd: the file, open for reading.
            size: its size in bytes.
            off: the index's offsets (its ends already checked by :meth:`check_bounds`).
            content: the file's content hash.
            name: how messages name the file.

        Returns:
            ``None``, or why the index does not fit the file.
        """
        return None

    @classmethod
    def check_bounds(cls, fd: int, size: int, first: int, last: int, name: str) -> str | None:
        """Why an index's records cannot run from byte ``first`` to byte ``last`` of a file (``None``: they can).

        An index file's checksum is no signature: one made by hand, or for other rules, can leave
        records out at either end. This reads the file's bytes outside ``[first, last)``: they must
        be :attr:`FILLER` only (the base: none, so the records run from byte 0 to the file's end).
        A format whose records are framed otherwise overrides it. Records inside are framed by what
        each read checks.

        Args:
            fd: the file, open for reading.
            size: its size in bytes.
            first: the index's first offset.
            last: its last offset.
            name: how messages name the file.

        Returns:
            ``None``, or why the index does not fit the file.
        """
        for lo, hi in ((0, first), (last, size)):
            at = lo
            while at < hi:
                chunk = os.pread(fd, min(hi - at, 1 << 20), at)
                if not chunk:
                    return f"the file ends at byte {at}, inside the bytes {lo}-{hi} outside its records"
                if chunk.translate(None, cls.FILLER):
                    return (
                        f"its records run from byte {first} to {last} of {size}, and the bytes {lo}-{hi} outside them "
                        "hold data (records it leaves out: a forged or damaged index?)"
                    )
                at += len(chunk)
        return None

    # -- what subclasses implement -------------------------------------------------------------------------

    @classmethod
    def scan(cls, f: HashedFile | BinaryIO, size: int, name: str) -> np.ndarray:  # pragma: no cover - abstract
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
            The type, name, length and per file its name, size, record count and content hash
            (of every byte: any change of a file changes it).
        """
        files = [
            {"file": n.rstrip("/").rsplit("/", 1)[-1], "size": s, "records": int(c), "content": h}
            for n, s, c, h in zip(self.names, self.sizes, self.counts, self.contents)
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
        what = type(self).__name__
        self._fds = Descriptors()
        elsewhere = [k for k, st in enumerate(self._files.stats) if st[1] is None and os.path.exists(self.paths[k])]
        if elsewhere:  # another machine (FileStats keeps sizes only): its copies of the files must be the same
            paths, names = [self.paths[k] for k in elsewhere], [self.names[k] for k in elsewhere]
            known = contents_mod.know(paths, names, self.index_cache, ctime=self.urls is None)
            for k, kn in zip(elsewhere, known):
                if kn.content != self.contents[k]:
                    raise SourceError(
                        f"{what}: {self.names[k]!r} on this machine is not the file the source opened: its contents "
                        f"differ (content hash {kn.content}, not {self.contents[k]})"
                    )
        for k, off in enumerate(self._offsets):
            if off is not None:
                continue
            path = self._index_files[k]
            assert path is not None
            got, why = self._checked(k, path) if os.path.exists(self.paths[k]) else (None, "the file is missing")
            if got is None and os.path.exists(self.paths[k]):  # another machine, a cleaned cache: made again here
                got = self._known_index(k)[0]
                if got is None:
                    got, content = offsets_mod.build(self.scan, [self.paths[k]], [self.names[k]])[0]
                    _same_bytes(what, self.names[k], self.contents[k], content)
            if got is None or len(got) != self.counts[k] + 1:
                why = why if got is None else f"it holds {len(got) - 1} records, not {int(self.counts[k])}"
                raise SourceError(f"{what}: the index {path} of {self.names[k]!r} cannot be used here: {why}")
            self._offsets[k] = got
