"""ArrayRecord files: records are the raw ``bytes``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.deprecation import keyword_only
from ..core.errors import SourceError
from ..remote.cache import ShardCache, is_url
from . import prepared, reading
from .base import (
    FileStats,
    HandlePool,
    Source,
    check_ids,
    expand_paths,
    file_identity,
    group_by,
)


class ArrayRecordSource(Source):
    """ArrayRecord files, or a folder written by ``quern prepare``; records are the raw ``bytes``.

    Ids are global over the files in the given order (globs sorted). Reads
    are grouped by file (one read call per file per ``read_many``), through
    readers opened for random access and shared by threads from a pool. In the
    worker processes of a pool that fills the cores, a file of one record per
    chunk is read a record at a time on the calling thread instead, not spread
    over ArrayRecord's own thread pool (:mod:`~quern.pipeline.sources.reading`).

    ``paths`` may also be a prepared folder (or its ``manifest.json``; alone,
    or as the one item of a list), or the URL of one (``http(s)://``,
    ``s3://``, ``gs://``, ``file://``: what fsspec opens): the source reads
    the shards its manifest names, in order, checked against the manifest
    (:func:`~quern.pipeline.sources.prepared.open_manifest`); a remote shard is
    fetched whole into ``cache`` when first read and verified against the
    manifest's size and SHA-256. ``manifest`` is then the manifest,
    :attr:`metadata` its metadata index, ``name`` the folder's name, and the
    identity holds the manifest's SHA-256 checksums of the shards instead of
    sampled hashes. Files given by URL are fetched whole into the cache when
    the source opens.

    The files must not change while the source is in use: each file is
    checked after every read of it (one ``stat``), and a change raises
    :class:`SourceError` naming the file. What is checked when, and what is
    not, is in ``docs/design/sources.md``.

    Args:
        paths: a glob, a path or a list of them; or a prepared folder, its
            manifest, or the URL of either; or a list of ``.array_record`` URLs.
        name: the source's name (default: from the first file's or the folder's name).
        max_open_files: the most idle readers kept open.
        cache: the disk cache of remote files (default: a
            :class:`~quern.pipeline.remote.cache.ShardCache` in its default folder).
        fields: a prepared folder's metadata fields to read with each record: records are then
            ``{"bytes": the record, field: its value, ...}`` (the labels of ``quern prepare
            --labels-from-dirs``, say).

    Raises:
        FileNotFoundError: a glob matches nothing, or a path does not exist.
        SourceError: a file cannot be opened, a prepared folder is incomplete or
            its manifest is wrong (naming what), a remote file cannot be fetched, or a field is
            not in the metadata.

    Attributes:
        paths: the files read (local paths, or URLs of a remote prepared folder).
        counts: the records of each file.
        manifest: a prepared folder's manifest, else ``None``.
        cache: the disk cache, for remote files; else ``None``.

    Example:
        >>> import tempfile, os
        >>> from array_record.python import array_record_module
        >>> with tempfile.TemporaryDirectory() as d:
        ...     w = array_record_module.ArrayRecordWriter(os.path.join(d, "t-0.array_record"), "group_size:1")
        ...     for r in (b"a", b"bc"):
        ...         w.write(r)
        ...     w.close()
        ...     src = ArrayRecordSource(os.path.join(d, "*.array_record"))
        ...     print(src.name, len(src), src.read_many(np.array([1, 0])))
        t 2 [b'bc', b'a']
    """

    READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"
    #: bytes a reader fills from its file at a time: a random read of a small record then reads a page, not
    #: the library's 1 MiB (larger records are read whole, past the buffer); measured no slower for bulk reads
    READER_BUFFER = 4096
    _fetcher: Any  # remote files: the threads fetching ahead (see prefetch)
    _fetch_lock: Any
    _fetching: set[int]
    _next_use: dict[str, np.ndarray]  # cache entry -> the steps of the lookahead that read it
    now: int  # the step the iterator is at (set by its lookahead)

    @keyword_only("name", "max_open_files", "cache", "fields")
    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        name: str | None = None,
        max_open_files: int = 256,
        cache: ShardCache | None = None,
        fields: Sequence[str] = (),
    ):
        if isinstance(fields, (str, bytes)):
            raise TypeError(f"ArrayRecordSource: fields must be a list of field names, got the string {fields!r}")
        self.fields = tuple(str(f) for f in fields)
        self._open(paths, name, max_open_files, cache)
        if self.fields:
            have = sorted(self.manifest["metadata"]) if self.manifest is not None else None
            missing = [f for f in self.fields if have is None or f not in have]
            if missing:
                where = f"its metadata has {have}" if have is not None else "it reads files, not a prepared folder"
                raise SourceError(f"ArrayRecordSource {self.name!r}: no metadata field {missing[0]!r} ({where})")

    def _open(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        name: str | None,
        max_open_files: int,
        cache: ShardCache | None,
    ) -> None:
        self.folder: str | None = None
        self.manifest: dict[str, Any] | None = None
        self._metadata: dict[str, np.ndarray] | None = None
        self.cache: ShardCache | None = None
        self.urls: list[str] | None = None
        if isinstance(paths, (str, os.PathLike)):
            one: str | None = os.fspath(paths)
        else:
            one = os.fspath(paths[0]) if len(paths) == 1 else None
        if one is not None and os.path.basename(one) == prepared.MANIFEST and os.path.isfile(one):
            one = os.path.dirname(one) or "."
        given = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
        self._pins: list[Any] = []
        self._file_urls: list[str] | None = None
        if one is not None and is_url(one) and not one.lower().endswith((".array_record", ".arrayrecord")):
            self._open_remote(one, name, max_open_files, cache)
            return
        if given and all(is_url(p) for p in given):  # files by URL: fetched whole at open, held in the cache
            self.cache = cache if cache is not None else ShardCache()
            self._file_urls = given
            held = [self.cache.get_pinned(u) for u in given]  # keyed by URL, size and ETag: a changed file is new
            self.paths = [path for path, _ in held]
            self._pins = [pin for _, pin in held]
            default = given[0].rstrip("/").rsplit("/", 1)[-1].split("-")[0].split(".")[0] or "array_record"
        elif one is not None and os.path.isdir(one):
            self.folder = os.path.abspath(one)
            self.manifest = prepared.open_manifest(self.folder)
            self.paths = [os.path.join(self.folder, s["file"]) for s in self.manifest["shards"]]
            default = os.path.basename(self.folder) or "prepared"
        else:
            self.paths = expand_paths(paths, "ArrayRecordSource")
            default = os.path.basename(self.paths[0]).split("-")[0].split(".")[0] or "array_record"
        self.name = name or default
        self._pool = HandlePool(max_open_files)
        self._fetch_state()
        self._files: FileStats | None = FileStats(  # before a reader sees them; a cache hit sets a cached file's ctime
            "ArrayRecordSource", self.paths, ctime=self._file_urls is None
        )
        counts = []
        for i in range(len(self.paths)):
            reader = self._reader(i)
            counts.append(reader.num_records())
            self._pool.give(i, reader)
        self.counts = np.asarray(counts, dtype=np.int64)
        if self.manifest is not None:
            for s, c in zip(self.manifest["shards"], counts):
                if c != s["records"]:
                    raise SourceError(
                        f"ArrayRecordSource: {self.folder!r}: shard {s['file']!r} holds {c} records; its manifest "
                        f"says {s['records']}"
                    )
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    def _open_remote(self, url: str, name: str | None, max_open_files: int, cache: ShardCache | None) -> None:
        """Open the prepared folder at ``url`` (its folder or its ``manifest.json``).

        The manifest is read (not cached); the shards are fetched into ``cache``
        when first read.
        """
        import json

        base = url[: -len(prepared.MANIFEST)].rstrip("/") if url.endswith("/" + prepared.MANIFEST) else url.rstrip("/")
        murl = f"{base}/{prepared.MANIFEST}"
        self.cache = cache if cache is not None else ShardCache()
        try:
            text = self.cache.read(murl)  # not cached; with the cache's connect and read timeouts
        except FileNotFoundError as e:
            raise SourceError(
                f"ArrayRecordSource: {murl} does not exist: {base} is not a folder written by quern prepare, or its prepare did not finish"
            ) from e
        except SourceError as e:
            raise SourceError(f"ArrayRecordSource: {e}") from e
        try:
            self.manifest = prepared.check_manifest(json.loads(text), murl)
        except ValueError as e:
            raise SourceError(f"ArrayRecordSource: cannot read {murl}: {e}") from e
        self.folder = base
        self.urls = [f"{base}/{s['file']}" for s in self.manifest["shards"]]
        self.paths = list(self.urls)
        self.name = name or base.rsplit("/", 1)[-1] or "prepared"
        self._pool = HandlePool(max_open_files)
        self._files = None
        self._fetch_state()
        self.counts = np.asarray([s["records"] for s in self.manifest["shards"]], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    @property
    def fetches_ahead(self) -> bool:
        """Whether :meth:`prefetch` does anything: the files are remote."""
        return self.urls is not None

    def prefetch(self, ids: np.ndarray, steps: np.ndarray, *, threads: int = 4) -> None:
        """Fetch the files that records ``ids`` lie in into the cache, in order, on background threads.

        Files are fetched as far as they fit in half the cache's capacity (the
        other half: files being read, and room to evict), and the cache is told
        when each is next needed (the first of its steps at or after :attr:`now`;
        a file not among them: never): it then evicts the file needed furthest
        ahead (Belady's rule). Files cached or being fetched are not fetched
        again; errors surface when the records are read. Nothing for local files.

        Args:
            ids: the records the next steps read, in read order.
            steps: the step that reads each of ``ids``.
            threads: the most fetches at once.
        """
        if self.urls is None or self.cache is None or self.manifest is None:
            return
        ids, steps = np.asarray(ids, dtype=np.int64), np.asarray(steps, dtype=np.int64)
        files = np.searchsorted(self.starts, ids, side="right") - 1
        order = files[np.sort(np.unique(files, return_index=True)[1])]
        with self._fetch_lock:
            if self._fetcher is None:
                import concurrent.futures

                self._fetcher = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="quern-fetch")
                if self.cache.next_use is None:
                    self.cache.next_use = self._next_use_of
            pairs = np.unique(np.stack([files, steps], axis=1), axis=0)  # (file, step), sorted by file then step
            cuts = np.flatnonzero(np.diff(pairs[:, 0])) + 1
            self._next_use = {
                os.path.basename(self._cache_path(int(part[0, 0]))): part[:, 1] for part in np.split(pairs, cuts)
            }
            room = None if self.cache.capacity is None else 0.5 * self.cache.capacity
            for f in order.tolist():
                if room is not None:
                    room -= self.manifest["shards"][f]["bytes"]
                    if room < 0:
                        break  # what would not fit would evict what is needed sooner
                if f in self._fetching or os.path.exists(self._cache_path(f)):
                    continue
                self._fetching.add(f)
                self._fetcher.submit(self._fetch_one, f)

    def _next_use_of(self, name: str) -> float:
        """The step at which the cache entry ``name`` is next read (``inf``: not in the lookahead)."""
        at = self._next_use.get(name)
        if at is None:
            return float("inf")
        k = int(np.searchsorted(at, self.now))
        return float(at[k]) if k < len(at) else float("inf")

    def stop_prefetch(self) -> None:
        """Drop the queued fetches ahead and end their threads (a fetch under way finishes)."""
        with self._fetch_lock:
            fetcher, self._fetcher = self._fetcher, None
            self._fetching.clear()
        if fetcher is not None:
            fetcher.shutdown(wait=True, cancel_futures=True)

    def _fetch_one(self, f: int) -> None:
        try:
            self.local_path(f)
        except Exception:  # the read that needs it fetches again and reports the error at its step
            pass
        finally:
            with self._fetch_lock:
                self._fetching.discard(f)

    def local_path(self, file_index: int) -> str:
        """Where file ``file_index`` is read from.

        Args:
            file_index: the file's index in :attr:`paths`.

        Returns:
            Its path, or for a URL its copy in the cache (fetched first if missing,
            verified against the manifest's size and SHA-256).

        Raises:
            SourceError: a remote file cannot be fetched.
        """
        if self.urls is None or self.cache is None or self.manifest is None:
            return self.paths[file_index]
        s = self.manifest["shards"][file_index]
        return self.cache.get(self.urls[file_index], size=s["bytes"], sha256=s["sha256"])

    def _cache_path(self, file_index: int) -> str:
        """Where remote shard ``file_index`` is (or will be) in the cache: named by its SHA-256."""
        assert self.urls is not None and self.cache is not None and self.manifest is not None
        return self.cache.path(self.urls[file_index], self.manifest["shards"][file_index]["sha256"])

    def _reader(self, file_index: int) -> Any:
        """A reader of file ``file_index`` for this thread's exclusive use; give it back to ``self._pool``."""
        r = self._pool.take(file_index)
        if r is None and self.urls is not None:
            return self._remote_reader(file_index)
        if r is None:
            from array_record.python import array_record_module

            path = self.paths[file_index]
            counts = getattr(self, "counts", None)  # None while __init__ counts the records
            try:
                r = array_record_module.ArrayRecordReader(
                    path, self.READER_OPTIONS, file_reader_buffer_size=self.READER_BUFFER
                )
                if not r.ok():
                    r.read([0])  # the reader keeps the failure status: reading raises it
                    raise SourceError("reader is not ok")
            except Exception as e:
                if counts is not None and self._files is not None:  # opened before: a change is the cause
                    self._files.check(file_index)
                raise SourceError(f"ArrayRecordSource: cannot open {path!r}: {e}") from e
            if counts is not None and r.num_records() != counts[file_index]:
                if self._files is not None:
                    self._files.check(file_index)
                raise SourceError(
                    f"ArrayRecordSource: {path!r} now holds {r.num_records()} records, not the "
                    f"{int(counts[file_index])} it held when the source opened it; open a new source to read it"
                )
        return r

    def _give(self, file_index: int, reader: Any) -> None:
        """Done with ``reader``: kept for the next read of its file, or closed for a cached remote file.

        A closed cached file is no longer in use and may be evicted.
        """
        if isinstance(reader, _Pinned):
            reader.close()
        else:
            self._pool.give(file_index, reader)

    def _remote_reader(self, file_index: int) -> Any:
        from array_record.python import array_record_module

        assert self.cache is not None and self.urls is not None and self.manifest is not None
        s = self.manifest["shards"][file_index]
        path, pin = self.cache.get_pinned(self.urls[file_index], size=s["bytes"], sha256=s["sha256"])  # in use first
        try:
            r = array_record_module.ArrayRecordReader(
                path, self.READER_OPTIONS, file_reader_buffer_size=self.READER_BUFFER
            )
            if not r.ok():
                r.read([0])  # the reader keeps the failure status: reading raises it
                raise SourceError("reader is not ok")
        except Exception as e:
            pin.close()
            raise SourceError(f"ArrayRecordSource: cannot open the cached copy of {self.paths[file_index]}: {e}") from e
        if r.num_records() != s["records"]:  # the bytes are the manifest's, its count is not theirs
            got = r.num_records()
            r.close()
            pin.close()
            raise SourceError(
                f"ArrayRecordSource: {self.folder}: shard {s['file']!r} holds {got} records; its manifest says "
                f"{s['records']}: the manifest is wrong (its record ids would map to other records)"
            )
        return _Pinned(r, pin)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read_many(self, ids: np.ndarray) -> list:
        """The records ``ids``, in that order: one read per file.

        Args:
            ids: record ids in ``[0, len(self))``.

        Returns:
            A list of ``bytes``.

        Raises:
            IndexError: an id is out of range.
            SourceError: a read failed, or a file changed since the source opened it.
        """
        ids = check_ids(ids, len(self), f"ArrayRecordSource {self.name!r}")
        out: list = [None] * len(ids)
        file_of = np.searchsorted(self.starts, ids, side="right") - 1
        for f, where in group_by(file_of):
            local = (ids[where] - self.starts[f]).tolist()
            reader = self._reader(f)
            try:
                if reading.library_threads() or not _one_record_chunks(reader):
                    records = reader.read(local)
                else:
                    records = _read_in_caller(reader, local)
            except Exception as e:
                _close_failed(reader)
                if self._files is not None:
                    self._files.check(f)  # a change is the cause to report (the reader is dropped)
                raise SourceError(
                    f"ArrayRecordSource: reading records {local[:8]}{'...' if len(local) > 8 else ''} "
                    f"of {self.paths[f]!r} failed: {e}"
                ) from e
            if self._files is not None:  # cached remote files are verified when fetched and never rewritten
                self._files.check(f)  # after the read: what it returned came from the file the source opened
            self._give(f, reader)
            for k, rec in zip(where.tolist(), records):
                out[k] = rec
        if self.fields:
            meta = self.metadata
            values = {f: meta[f][ids] for f in self.fields}
            return [{"bytes": rec, **{f: v[k] for f, v in values.items()}} for k, rec in enumerate(out)]
        return out

    @property
    def metadata(self) -> dict[str, np.ndarray]:
        """The metadata index of a prepared folder, checked against the manifest when first read.

        Returns:
            ``{field: read-only array}``, one value per record (``length`` and the
            prepared fields).

        Raises:
            ValueError: the source reads files, not a prepared folder.
            SourceError: a metadata file does not match the manifest.
        """
        if self.manifest is None or self.folder is None:
            raise ValueError(
                f"ArrayRecordSource {self.name!r} has no metadata: it reads files, not a folder written by quern prepare"
            )
        if self._metadata is None and self.urls is not None and self.cache is not None:  # remote: via the cache
            pins = []
            try:
                files = {}  # each read from its cache entry (named by its SHA-256), held in use while it loads
                for field, spec in self.manifest["metadata"].items():
                    files[field], pin = self.cache.get_pinned(f"{self.folder}/{spec['file']}", sha256=spec["sha256"])
                    pins.append(pin)
                self._metadata = prepared.load_metadata(self.folder, self.manifest, files=files)
            finally:
                for pin in pins:
                    pin.close()
        if self._metadata is None:
            self._metadata = prepared.load_metadata(self.folder, self.manifest)
        return self._metadata

    @property
    def has_metadata(self) -> bool:
        """Whether the source is a prepared folder with a metadata index."""
        return self.manifest is not None

    def _fetch_state(self) -> None:
        import threading

        self._fetcher = None
        self._fetch_lock = threading.Lock()
        self._fetching = set()
        self._next_use = {}
        self.now = 0

    def __getstate__(self) -> dict:
        state = {**self.__dict__, "_metadata": None}  # workers read the metadata again if they need it
        for k in ("_fetcher", "_fetch_lock", "_fetching", "_next_use"):
            state.pop(k, None)
        state["_pins"] = []  # the parent's pins keep the cached files while it lives
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fetch_state()

    def identity(self) -> dict:
        """A description of the data for the pipeline fingerprint.

        Returns:
            The type, name, length and per file its name, size and record count,
            with the manifest's SHA-256 (a prepared folder) or a sampled hash.
        """
        if self.manifest is not None:  # exact: the manifest's checksums
            shards = [
                {"file": s["file"], "size": s["bytes"], "records": s["records"], "sha256": s["sha256"]}
                for s in self.manifest["shards"]
            ]
            out = {**super().identity(), "files": shards}
            if self.fields:  # only when read: the fields' checksums in the manifest
                out["fields"] = {f: self.manifest["metadata"][f] for f in self.fields}
            return out
        return {**super().identity(), "files": file_identity(self.paths, self.counts, names=self._file_urls)}


def _close_failed(reader: Any) -> None:
    """Close a reader whose read raised: it may keep its failure, so the next read of its file opens a new one.

    Its close may report the same failure again; that is not a second error.
    """
    try:
        reader.close()
    except Exception:
        pass


def _one_record_chunks(reader: Any) -> bool:
    """Whether the reader's file holds one record per chunk (``group_size:1``, as ``quern prepare`` writes).

    Only such a file is read a record at a time: a reader keeps the chunk it decoded last, and an idle reader
    in the pool then holds one record, not a chunk of up to 65,536.
    """
    return "group_size:1," in reader.writer_options_string() + ","


def _read_in_caller(reader: Any, local: list[int]) -> list[bytes]:
    """The records ``local`` of one file, read one by one on this thread (in ascending order), in the given order.

    The same records as ``reader.read(local)``, without the library's thread pool: the cheaper read where the
    process's parallelism comes from other processes (:mod:`~quern.pipeline.sources.reading`).
    """
    out: list[Any] = [None] * len(local)
    seek, read = reader.seek, reader.read
    for k in sorted(range(len(local)), key=local.__getitem__):
        seek(local[k])
        out[k] = read()
    return out


class _Pinned:
    """A reader of a cached file that keeps the file in use (never evicted) while it is open."""

    def __init__(self, reader: Any, pin: Any) -> None:
        self.reader, self.pin = reader, pin

    def read(self, ids: list[int] | None = None) -> Any:
        return self.reader.read() if ids is None else self.reader.read(ids)

    def seek(self, record: int) -> None:
        self.reader.seek(record)

    def writer_options_string(self) -> str:
        return self.reader.writer_options_string()

    def num_records(self) -> int:
        return self.reader.num_records()

    def close(self) -> None:
        try:
            self.reader.close()  # a reader whose read failed reports the failure again here
        finally:
            self.pin.close()

    def __del__(self) -> None:
        self.pin.close()
