"""The local-disk cache of remote files (shards), shared by every process of the host.

A remote file (anything fsspec opens) is fetched whole into the cache folder
(:func:`default_folder`) and read from there. An entry is keyed by the file's
SHA-256 when the caller knows it (a manifest), else by its URL, size and
version; it is checked against its sidecar at every hit, downloaded once
however many processes want it (under a lock), renamed into place only once
verified, and evicted beyond ``capacity`` (least recently used, or the one
needed furthest ahead) unless in use. Every entry lies inside the cache
folder, whatever name a server gives.

The network side is :mod:`quern.pipeline.remote.fetch`; the checks of an entry
(its bytes, its sidecar) :mod:`quern.pipeline.remote.cache_checks`; the lock, use and
part files beside it :mod:`quern.pipeline.remote.cache_locks`. The design is in
``docs/design/remote-cache.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..core.deprecation import keyword_only
from ..core.errors import SourceError
from . import cache_checks as cache_verify
from . import cache_locks
from .cache_locks import Pin, flock
from .fetch import CONNECT_TIMEOUT as CONNECT_TIMEOUT
from .fetch import READ_TIMEOUT as READ_TIMEOUT
from .fetch import RETRIES as RETRIES
from .fetch import Fetcher, identity
from .fetch import is_url as is_url
from .fetch import unreachable as _unreachable  # noqa: F401 (importable from here, as before)
from .fetch import version as _version

__all__ = ["CACHE_VARIABLE", "RETRIES", "ShardCache", "default_folder", "is_url"]

CACHE_VARIABLE = "QUERN_CACHE_DIR"
_AUX = (".lock", ".use", ".part", ".ok")  # the suffixes of the files beside each entry
_SHA256 = re.compile(r"[0-9a-f]{64}")


def default_folder() -> str:
    """The default cache folder of remote files.

    Returns:
        ``$QUERN_CACHE_DIR/remote``, or ``~/.cache/quern/remote``.
    """
    base = os.environ.get(CACHE_VARIABLE) or os.path.join(os.path.expanduser("~"), ".cache", "quern")
    return os.path.join(base, "remote")


def _base(url: str) -> str:
    """The URL's base name, made a safe file name (letters, digits, ``-_.``; at most 80)."""
    base = url.rstrip("/").rsplit("/", 1)[-1].split("?")[0] or "file"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in base)[:80]


class ShardCache:
    """Remote files fetched whole into ``folder`` (see the module docstring).

    Several caches (in several processes) may share one folder.

    Args:
        folder: the cache folder (default :func:`default_folder`).
        capacity: the most bytes kept, or ``None`` (no cap).
        next_use: ``next_use(name)``, the time (step) at which entry ``name`` is next
            needed (``inf``: never); evicts by Belady's rule when given.
        retries: how many times a failed fetch is tried again.
        backoff: seconds before the first retry (doubled at each).
        connect_timeout: seconds to make a connection (HTTP(S), GCS, S3).
        read_timeout: the most seconds without a byte from the server (HTTP(S), GCS, S3).

    Raises:
        ValueError: ``capacity`` is not a positive int or ``None``, or a timeout is
            not a positive number.

    Attributes:
        stats: this process's counts: ``hits``, ``misses``, ``bytes_fetched``,
            ``evictions`` and ``retries``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     cache = ShardCache(folder, capacity=1 << 30)
        ...     print(cache.size(), cache.stats["hits"])
        0 0
    """

    @keyword_only("capacity", "next_use", "retries", "backoff", "connect_timeout", "read_timeout")
    def __init__(
        self,
        folder: str | os.PathLike | None = None,
        *,
        capacity: int | None = None,
        next_use: Callable[[str], float] | None = None,
        retries: int = RETRIES,
        backoff: float = 0.5,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
    ) -> None:
        self.folder = os.path.abspath(os.fspath(folder)) if folder is not None else default_folder()
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"ShardCache: capacity must be a positive number of bytes or None, got {capacity!r}")
        for what, t in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout)):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
                raise ValueError(f"ShardCache: {what} must be a positive number of seconds, got {t!r}")
        self.capacity = capacity
        self.next_use = next_use
        self.retries, self.backoff = int(retries), float(backoff)
        self.connect_timeout, self.read_timeout = float(connect_timeout), float(read_timeout)
        self.stats = {"hits": 0, "misses": 0, "bytes_fetched": 0, "evictions": 0, "retries": 0}
        self._lock = threading.Lock()
        self._ready = False
        self._sealed: dict[str, dict[str, Any]] = {}  # entry -> the sidecar this process found right for it

    def _open(self) -> None:
        with self._lock:
            if self._ready:
                return
            try:
                os.makedirs(self.folder, exist_ok=True)
            except OSError as e:
                raise SourceError(f"cache folder {self.folder!r} cannot be made: {e}") from e
            for n in os.listdir(self.folder):  # what killed downloads left
                if n.endswith(".part"):
                    cache_locks.remove_part(os.path.join(self.folder, n))
            self._ready = True

    def _make_folder(self) -> None:
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:
            raise SourceError(f"cache folder {self.folder!r} cannot be made: {e}") from e

    # -- names -----------------------------------------------------------------------------------------------

    def filesystem(self, url: str) -> tuple[Any, str]:
        """The fsspec file system for ``url`` and the path in it, with this cache's timeouts.

        Args:
            url: the file's URL.

        Returns:
            ``(file system, path in it)`` (see :meth:`quern.pipeline.remote.fetch.Fetcher.filesystem`).
        """
        return self._fetcher().filesystem(url)

    def _fetcher(self) -> Fetcher:
        """The network side of this cache, with its current settings; it counts into :attr:`stats`."""
        return Fetcher(
            retries=self.retries,
            backoff=self.backoff,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            folder=self.folder,
            count=self._count,
        )

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self.stats[name] += n

    def _entry(self, name: str) -> str:
        """``folder/name``, checked to lie inside the cache folder.

        ``name`` is a digest and a sanitised base name: it always does, unless the
        folder itself holds a link.
        """
        path = os.path.join(self.folder, name)
        if os.path.dirname(path) != self.folder or not name or name in (".", ".."):
            raise SourceError(f"cache entry {name!r} is not a file name inside the cache folder {self.folder!r}")
        return path

    def _inside(self, path: str) -> None:
        """Raise :class:`SourceError` unless ``path`` resolves (links followed) to a file inside the cache folder."""
        root = os.path.realpath(self.folder)
        real = os.path.realpath(path)
        if os.path.dirname(real) != root:
            raise SourceError(
                f"cache entry {path!r} leads outside the cache folder {self.folder!r} (to {real!r}): nothing is "
                "written there"
            )

    def path(self, url: str, sha256: str | None = None) -> str:
        """Where ``url``'s bytes are (or will be) in the cache.

        Args:
            url: the file's URL.
            sha256: its SHA-256, when known: the entry is named by it (no request);
                else by the URL and the server's size and version (one request).

        Returns:
            The entry's path, inside the cache folder.

        Raises:
            SourceError: ``sha256`` is not a SHA-256 hex digest, or the server cannot
                be asked (see :meth:`quern.pipeline.remote.fetch.Fetcher.info`).
        """
        if sha256 is not None:
            return self._entry(self._digest_name(url, sha256))
        return self._url_entry(url)[0]

    def _digest_name(self, url: str, sha256: str) -> str:
        if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
            raise SourceError(f"{url}: {sha256!r} is not a SHA-256 hex digest (64 lowercase hex digits)")
        return f"{sha256}-{_base(url)}"

    def _url_entry(self, url: str) -> tuple[str, str, int | None, bool]:
        """``(path, key, server size, refetch)`` of a file fetched by URL alone.

        It is keyed by the URL, the server's size and version (``refetch``: the
        server gives no version).
        """
        info = self._fetcher().info(url)
        size = info.get("size")
        key = identity(url, info)
        name = f"{hashlib.sha256(key.encode()).hexdigest()[:32]}-{_base(url)}"
        return self._entry(name), key, (int(size) if size is not None else None), _version(info) is None

    def read(self, url: str) -> bytes:
        """The bytes of the small file ``url`` (a manifest), read once with this cache's timeouts.

        Not cached, not retried.

        Args:
            url: the file's URL.

        Returns:
            Its bytes.

        Raises:
            FileNotFoundError: the server says it is missing.
            SourceError: any other failure, naming the URL and the cause.
        """
        return self._fetcher().read(url)

    def _resolve(self, url_or_path: str, sha256: str | None) -> str:
        """The entry path of a URL (see :meth:`path`), or ``url_or_path`` itself when it is one."""
        if not is_url(url_or_path) and os.path.dirname(os.path.abspath(url_or_path)) == self.folder:
            return os.path.abspath(url_or_path)
        return self.path(url_or_path, sha256)

    # -- get -------------------------------------------------------------------------------------------------

    @keyword_only("size", "sha256")
    def get(self, url: str, *, size: int | None = None, sha256: str | None = None) -> str:
        """The local path of ``url``'s bytes, fetched first if missing or no longer right.

        Args:
            url: the file's URL.
            size: its size in bytes, when known (a manifest); checked after the download.
            sha256: its SHA-256, when known: the entry is keyed by it and the download
                checked against it; without it the entry is keyed by the URL and the
                server's size and version (one request).

        Returns:
            The path of the verified entry in the cache folder.

        Raises:
            SourceError: the file is missing on the server, cannot be fetched (after
                the retries), changed while it was fetched, or its bytes are wrong
                twice; the message names the URL.
        """
        return self._get(url, size, sha256, pin=False)[0]

    @keyword_only("size", "sha256")
    def get_pinned(self, url: str, *, size: int | None = None, sha256: str | None = None) -> tuple[str, Any]:
        """:meth:`get`, with the entry held in use (never evicted) until the pin's ``close()``.

        The entry is held from before it is looked at. With ``sha256``, the pin is
        taken, then :meth:`get` called (a subclass's ``get`` sees every read of a
        shard).

        Args:
            url: the file's URL.
            size: as :meth:`get`.
            sha256: as :meth:`get`.

        Returns:
            ``(path, pin)``; ``pin.close()`` lets the entry be evicted again.

        Raises:
            SourceError: as :meth:`get`.
        """
        if sha256 is None:
            path, pin = self._get(url, size, sha256, pin=True)  # one request names the entry: made once
            assert pin is not None
            return path, pin
        self._open()
        pin = self._pin_path(self.path(url, sha256))
        try:
            return self.get(url, size=size, sha256=sha256), pin
        except BaseException:
            pin.close()
            raise

    def _get(self, url: str, size: int | None, sha256: str | None, pin: bool) -> tuple[str, Any]:
        self._open()
        expect: str | None = None  # the version the entry is keyed by (files by URL alone)
        refetch = False
        if sha256 is not None:
            final = self._entry(self._digest_name(url, sha256))
            key = f"sha256 {sha256}"
        else:
            final, key, server_size, refetch = self._url_entry(url)
            expect = key
            if size is None:
                size = server_size
        held = self._pin_path(final) if pin else None
        try:
            if not refetch and (st := self._valid(final, key, size)) is not None:
                self._hit(final, st)
                return final, held
            self._make_folder()  # deleted while running: made again
            self._inside(final)
            with flock(final + ".lock", fcntl.LOCK_EX):
                if not refetch and (st := self._valid(final, key, size)) is not None:  # fetched meanwhile
                    self._hit(final, st)
                    return final, held
                if sha256 is not None and not refetch and cache_verify.still_right(final, key, size, sha256):
                    self._hit(final, None)  # its sidecar was lost or stale, its bytes are right
                    return final, held
                cache_verify.discard(final)  # stale, damaged or swapped: never used
                with self._lock:
                    self.stats["misses"] += 1
                self._download(url, final, key, size, sha256, expect)
                self._touch(final)  # its last use in ns: the file system's own times are coarser (a tick)
            self._evict(keep=final)
            return final, held
        except BaseException:
            if held is not None:
                held.close()
            raise

    def _hit(self, final: str, st: os.stat_result | None) -> None:
        self._touch(final, st)
        with self._lock:
            self.stats["hits"] += 1

    def _download(
        self, url: str, final: str, key: str, size: int | None, sha256: str | None, expect: str | None
    ) -> None:
        for attempt in (1, 2):
            part = f"{final}.{os.getpid()}.{threading.get_ident()}.part"
            try:
                self._fetcher().fetch(url, part, size=size, expect=expect)
                why = cache_verify.check(part, size, sha256)
                if why is None:
                    os.replace(part, final)
                    cache_verify.seal(final, key)
                    return
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(part)
            if attempt == 2:
                raise SourceError(f"{url}: the downloaded file {why}, twice; the server's copy is damaged")

    def _valid(self, final: str, key: str, size: int | None) -> os.stat_result | None:
        """``final``'s stat if the entry is the file its sidecar was written for (:func:`.cache_verify.valid`)."""
        return cache_verify.valid(final, key, size, self._sealed)

    def verify(self) -> list[str]:
        """Hash every entry keyed by SHA-256 and remove those whose bytes differ.

        Returns:
            The names of the entries removed, sorted.
        """
        removed: list[str] = []
        if not os.path.isdir(self.folder):
            return removed
        for n in sorted(os.listdir(self.folder)):
            p = os.path.join(self.folder, n)
            if n.endswith(_AUX) or not _SHA256.fullmatch(n[:64]) or not os.path.isfile(p):
                continue
            with flock(p + ".lock", fcntl.LOCK_EX):
                if cache_verify.check(p, None, n[:64]) is not None:
                    cache_verify.discard(p)
                    removed.append(n)
        return removed

    def _touch(self, path: str, st: os.stat_result | None = None) -> None:
        """Mark ``path`` used now (its access time: its modification time is part of its sidecar)."""
        with contextlib.suppress(OSError):
            os.utime(path, ns=(time.time_ns(), (st or os.stat(path)).st_mtime_ns))

    def reason(self, e: BaseException) -> str:
        """What went wrong in ``e``, for a message.

        Args:
            e: the error of a try.

        Returns:
            The timeout that expired (with this cache's settings), else the type and
            message of the first error of its chain that has a message (see
            :meth:`quern.pipeline.remote.fetch.Fetcher.reason`).
        """
        return self._fetcher().reason(e)

    # -- in use ----------------------------------------------------------------------------------------------

    def pin(self, url: str, sha256: str | None = None) -> Any:
        """Hold an entry in use (never evicted) until the returned object's ``close()``.

        The pin is a shared ``flock`` on the entry's ``.use`` file.

        Args:
            url: the entry's URL (see :meth:`path`), or its path in the cache.
            sha256: the file's SHA-256, when the entry is keyed by it.

        Returns:
            The pin: an object with ``close()``.
        """
        self._open()
        return self._pin_path(self._resolve(url, sha256))

    def _pin_path(self, final: str) -> Pin:
        try:
            return cache_locks.pin(final)
        except FileNotFoundError:  # the cache folder was deleted while running: made again
            self._make_folder()
            return cache_locks.pin(final)

    def __getstate__(self) -> dict:
        keys = ("folder", "capacity", "next_use", "retries", "backoff", "connect_timeout", "read_timeout")
        return {k: getattr(self, k) for k in keys}

    def __setstate__(self, d: dict) -> None:
        ShardCache.__init__(self, **d)

    @contextlib.contextmanager
    def use(self, url: str, sha256: str | None = None) -> Iterator[str]:
        """Context manager: an entry's local path, held in use (never evicted) until the block ends.

        Args:
            url: as :meth:`pin`.
            sha256: as :meth:`pin`.

        Yields:
            The entry's path in the cache folder.
        """
        self._open()
        final = self._resolve(url, sha256)
        with flock(final + ".use", fcntl.LOCK_SH):
            yield final

    # -- size and eviction -----------------------------------------------------------------------------------

    def _entries(self, keep: str | None = None) -> list[tuple[str, str, int, int]]:
        """``(name, path, bytes, last use in ns)`` of the entries.

        Entries are regular files, not their lock, use, part or sidecar files,
        nor ``keep``.
        """
        out: list[tuple[str, str, int, int]] = []
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return out
        for n in names:
            p = os.path.join(self.folder, n)
            if n.endswith(_AUX) or p == keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(p)
                if stat.S_ISREG(st.st_mode):  # never a folder (an older quern's metadata-<job>/) or a link
                    out.append((n, p, st.st_size, max(st.st_atime_ns, st.st_mtime_ns)))
        return out

    def size(self) -> int:
        """The size of the cache.

        Returns:
            The bytes of the files in the cache folder (every process's entries).
        """
        return sum(e[2] for e in self._entries())

    def _evict(self, keep: str) -> None:
        if self.capacity is None:
            return
        entries = self._entries(keep)
        total = sum(e[2] for e in entries) + (os.path.getsize(keep) if os.path.exists(keep) else 0)
        if total <= self.capacity:
            return
        if self.next_use is not None:
            nu = self.next_use
            entries.sort(key=lambda e: (-nu(e[0]), e[3]))  # furthest next use first (Belady), then oldest
        else:
            entries.sort(key=lambda e: e[3])  # least recently used first
        for _n, p, nbytes, _ in entries:
            if total <= self.capacity:
                break
            with cache_locks.unused(p) as free:
                if not free:
                    continue  # in use
                with contextlib.suppress(FileNotFoundError):
                    os.remove(p)
                    total -= nbytes
                    with self._lock:
                        self.stats["evictions"] += 1
                with contextlib.suppress(FileNotFoundError):
                    os.remove(p + ".ok")
