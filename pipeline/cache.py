"""The local-disk cache of remote files (shards), shared by every process of the host.

A remote file (``http(s)://``, ``s3://``, ``gs://``, ``file://``: anything fsspec
opens) is fetched whole into the cache folder (default
``$QUERN_CACHE_DIR/remote`` or ``~/.cache/quern/remote``) and read from there.

- **One download per file**, however many processes and threads want it at once:
  the download holds an exclusive ``flock`` on the file's lock file; the others
  wait for it, then find the file there.
- **Atomic and verified**: the bytes go to ``NAME.PID.part`` and are renamed to
  ``NAME`` only after their size (from the caller, e.g. a manifest, or the
  server's Content-Length) and their SHA-256 (when the caller knows it) or the
  server's ETag (the same before and after the download) are checked. A file
  that fails the check is fetched once more, then a :class:`SourceError` names
  the URL. A process killed mid-download leaves only a ``.part`` file, which
  is removed when the cache is next opened (or by the next download of it);
  a partial file is never seen under its final name.
- **Retries**: a connection that fails or breaks is tried again with
  exponential backoff (``retries``, default :data:`RETRIES`, times from
  ``backoff`` = 0.5 s; where the server takes Range requests, a retry
  continues from the bytes already fetched), then a
  :class:`SourceError` names the URL; a missing file (404) is not retried.
- **Capped**: after a download, files are evicted until the cache holds at
  most ``capacity`` bytes (more only while the files in use at that moment
  leave no other choice: a file in use is never evicted): by default the least recently used first, or by the
  caller's ``next_use(name)`` (Belady's rule: the file needed furthest in the
  future first). A file in use is never evicted: a reader holds a shared
  ``flock`` on its ``.use`` file (:meth:`ShardCache.pin`, :meth:`ShardCache.use`),
  and eviction takes that lock without waiting or leaves the file. (Downloads
  lock another file, ``.lock``: a file pinned before it is fetched is fetched.)

Files are named by a hash of their URL and their base name
(``0123abcd...-shard-00000-of-00009.array_record``), so the same URL is the
same cache entry in every process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .errors import SourceError

__all__ = ["CACHE_VARIABLE", "RETRIES", "ShardCache", "default_folder", "is_url"]

CACHE_VARIABLE = "QUERN_CACHE_DIR"
RETRIES = 4
_BLOCK = 8 << 20


def is_url(path: Any) -> bool:
    """Whether ``path`` names a remote file (``scheme://...``; ``file://`` too)."""
    return isinstance(path, str) and "://" in path.split("/", 1)[0] + "//"


def default_folder() -> str:
    """``$QUERN_CACHE_DIR/remote``, or ``~/.cache/quern/remote``."""
    base = os.environ.get(CACHE_VARIABLE) or os.path.join(os.path.expanduser("~"), ".cache", "quern")
    return os.path.join(base, "remote")


def _name(url: str) -> str:
    base = url.rstrip("/").rsplit("/", 1)[-1].split("?")[0] or "file"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in base)[:80]
    return f"{hashlib.sha256(url.encode()).hexdigest()[:32]}-{safe}"


@contextlib.contextmanager
def _flock(path: str, mode: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)  # closing releases the lock


class ShardCache:
    """Remote files fetched whole into ``folder`` (see the module docstring), at most
    ``capacity`` bytes (``None``: no cap) kept."""

    def __init__(
        self,
        folder: str | os.PathLike | None = None,
        capacity: int | None = None,
        next_use: Callable[[str], float] | None = None,
        retries: int = RETRIES,
        backoff: float = 0.5,
    ) -> None:
        self.folder = os.path.abspath(os.fspath(folder)) if folder is not None else default_folder()
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"ShardCache: capacity must be a positive number of bytes or None, got {capacity!r}")
        self.capacity = capacity
        self.next_use = next_use
        self.retries, self.backoff = int(retries), float(backoff)
        self.stats = {"hits": 0, "misses": 0, "bytes_fetched": 0, "evictions": 0, "retries": 0}
        self._lock = threading.Lock()
        self._ready = False

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
                    self._remove_part(os.path.join(self.folder, n))
            self._ready = True

    def _remove_part(self, part: str) -> None:
        """Remove ``part`` (``NAME.PID.THREAD.part``) unless its download may still run:
        its process is this one or alive."""
        try:
            pid = int(part.rsplit(".", 3)[-3])
        except (IndexError, ValueError):
            pid = -1
        if pid == os.getpid():
            return
        if pid > 0:
            try:
                os.kill(pid, 0)
                return  # still downloading
            except (ProcessLookupError, OverflowError):
                pass
            except PermissionError:
                return
        with contextlib.suppress(FileNotFoundError):
            os.remove(part)

    def path(self, url: str) -> str:
        """Where ``url`` is (or will be) in the cache."""
        return os.path.join(self.folder, _name(url))

    def get(self, url: str, size: int | None = None, sha256: str | None = None) -> str:
        """The local path of ``url``'s bytes, fetched first if missing (see the module docstring)."""
        self._open()
        final = self.path(url)
        if os.path.exists(final):
            self._touch(final)
            with self._lock:
                self.stats["hits"] += 1
            return final
        try:
            os.makedirs(self.folder, exist_ok=True)  # deleted while running: made again
        except OSError as e:
            raise SourceError(f"cache folder {self.folder!r} cannot be made: {e}") from e
        with _flock(final + ".lock", fcntl.LOCK_EX):
            if os.path.exists(final):  # another process fetched it while this one waited
                self._touch(final)
                with self._lock:
                    self.stats["hits"] += 1
                return final
            with self._lock:
                self.stats["misses"] += 1
            for attempt in (1, 2):
                part = f"{final}.{os.getpid()}.{threading.get_ident()}.part"
                try:
                    server_size, _ = self._fetch(url, part, size, check_etag=sha256 is None)
                    why = self._check(part, size if size is not None else server_size, sha256)
                    if why is None:
                        os.replace(part, final)
                        break
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(part)
                if attempt == 2:
                    raise SourceError(f"{url}: the downloaded file {why}, twice; the server's copy is damaged")
        self._evict(keep=final)
        return final

    def _touch(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(path)

    def _fetch(self, url: str, part: str, size: int | None, check_etag: bool = True) -> tuple[int | None, str | None]:
        """Download ``url`` to ``part``, with retries; the server's size and ETag (or ``None``).
        With ``check_etag`` (no checksum to verify against), the ETag is checked to be the
        same after the download (the file did not change meanwhile); without it and with
        ``size`` given, no request but the download is made."""
        import fsspec

        delay = self.backoff
        http = url.lower().startswith(("http://", "https://"))
        ranges = True  # until the server shows it has none
        first_etag: str | None = None
        for attempt in range(self.retries + 1):
            have = os.path.getsize(part) if attempt and ranges and os.path.exists(part) else 0
            try:
                fs, path = fsspec.core.url_to_fs(url)
                info = fs.info(path) if check_etag or size is None else {"size": size}
                etag = (info.get("ETag") or info.get("etag")) if check_etag else None
                if have and etag and first_etag and etag != first_etag:
                    have = 0  # the file changed since the bytes already here: start again
                first_etag = first_etag or (str(etag) if etag else None)
                # HTTP: one streamed GET from the start (servers without Range requests work too); a retry
                # with bytes already here continues them with a Range request (ranged reads)
                block = _BLOCK if (have or not http) else 0
                with fs.open(path, "rb", block_size=block) as src, open(part, "ab" if have else "wb") as out:
                    if have:
                        src.seek(have)
                    while chunk := src.read(_BLOCK):
                        out.write(chunk)
                        with self._lock:
                            self.stats["bytes_fetched"] += len(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                after = fs.info(path).get("ETag") if etag else None
                if etag and after != etag:
                    raise ConnectionError(
                        f"the file changed on the server during the download (ETag {etag} -> {after})"
                    )
                server_size = info.get("size")
                return (int(server_size) if server_size is not None else None), (str(etag) if etag else None)
            except ValueError as e:
                if have and "range" in str(e).lower():  # no Range requests: the next try starts again
                    ranges = False
                elif attempt == self.retries:
                    raise SourceError(f"{url}: cannot be fetched after {self.retries + 1} tries: {e}") from e
            except FileNotFoundError as e:
                if not _unreachable(e):
                    raise SourceError(f"{url}: not found on the server (404)") from e
                if attempt == self.retries:
                    reason = e.__cause__ or e.__context__
                    raise SourceError(f"{url}: cannot be fetched after {self.retries + 1} tries: {reason}") from e
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise SourceError(f"{url}: the cache folder {self.folder!r} is full: {e}") from e
                if attempt == self.retries:
                    raise SourceError(f"{url}: cannot be fetched after {self.retries + 1} tries: {e}") from e
            except Exception as e:  # aiohttp's and the server's errors
                if "404" in str(e) or "Not Found" in str(e):
                    raise SourceError(f"{url}: not found on the server (404)") from e
                if attempt == self.retries:
                    raise SourceError(f"{url}: cannot be fetched after {self.retries + 1} tries: {e}") from e
            with self._lock:
                self.stats["retries"] += 1
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def _check(self, part: str, size: int | None, sha256: str | None) -> str | None:
        """Why the file at ``part`` is not the one wanted (``None``: it is)."""
        got = os.path.getsize(part)
        if size is not None and got != size:
            return f"has {got} bytes, not {size}"
        if sha256 is not None:
            h = hashlib.sha256()
            with open(part, "rb") as f:
                while block := f.read(_BLOCK):
                    h.update(block)
            if h.hexdigest() != sha256:
                return "does not match its SHA-256"
        return None

    def pin(self, url: str) -> Any:
        """Hold ``url``'s cache entry in use (never evicted) until the returned object's
        ``close()``: a shared ``flock`` on its lock file."""
        self._open()
        fd = os.open(self.path(url) + ".use", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return _Pin(fd)

    def __getstate__(self) -> dict:
        keys = ("folder", "capacity", "next_use", "retries", "backoff")
        return {k: getattr(self, k) for k in keys}

    def __setstate__(self, d: dict) -> None:
        ShardCache.__init__(self, **d)

    @contextlib.contextmanager
    def use(self, url: str) -> Iterator[str]:
        """``url``'s local path, held in use (never evicted) until the block ends."""
        final = self.path(url)
        self._open()
        with _flock(final + ".use", fcntl.LOCK_SH):
            yield final

    def size(self) -> int:
        """Bytes of the files in the cache."""
        total = 0
        if not os.path.isdir(self.folder):
            return 0
        for n in os.listdir(self.folder):
            if not n.endswith((".lock", ".use", ".part")):
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(self.folder, n))
        return total

    def _evict(self, keep: str) -> None:
        if self.capacity is None:
            return
        entries = []
        for n in os.listdir(self.folder):
            p = os.path.join(self.folder, n)
            if n.endswith((".lock", ".use", ".part")) or p == keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(p)
                entries.append((n, p, st.st_size, st.st_mtime))
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
            try:
                fd = os.open(p + ".use", os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # in use
                with contextlib.suppress(FileNotFoundError):
                    os.remove(p)
                    total -= nbytes
                    with self._lock:
                        self.stats["evictions"] += 1
            finally:
                os.close(fd)


def _unreachable(e: BaseException) -> bool:
    """Whether fsspec's ``FileNotFoundError`` hides a connection that failed (fsspec's HTTP
    file system reports a refused or broken connection as a missing file)."""
    cause = e.__cause__ or e.__context__
    return cause is not None and (
        isinstance(cause, (ConnectionError, TimeoutError)) or "Connect" in type(cause).__name__
    )


class _Pin:
    """A shared lock on a cache entry's lock file, released by :meth:`close` (or when collected)."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()
