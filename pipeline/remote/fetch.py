"""Fetching a remote file over the network: file systems, timeouts, retries and readable errors.

:class:`~quern.pipeline.remote.cache.ShardCache` fetches through a :class:`Fetcher`; this
module knows nothing of the cache folder's entries, locks or sidecars. A URL
(anything fsspec opens) is read with connect and read timeouts, failed tries
are retried with exponential backoff (continuing a download with Range requests
where the server takes them), a file's version (ETag, else modification time)
is checked so that a file changed on the server is never taken for the one
asked for, and every failure becomes a :class:`~quern.pipeline.core.errors.SourceError`
naming the URL and the cause. The details are in ``docs/design/remote-cache.md``.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..core.errors import SourceError

__all__ = ["BLOCK", "CONNECT_TIMEOUT", "READ_TIMEOUT", "RETRIES", "Fetcher", "identity", "is_url", "version"]

RETRIES = 4
CONNECT_TIMEOUT = 30.0
READ_TIMEOUT = 60.0
BLOCK = 8 << 20  # bytes read (and written) at a time
_T = TypeVar("_T")


def is_url(path: Any) -> bool:
    """Whether ``path`` names a remote file.

    Args:
        path: anything; only a string can be a URL.

    Returns:
        Whether ``path`` is a string of the form ``scheme://...`` (``file://`` too).

    Example:
        >>> is_url("gs://bucket/a.parquet"), is_url("data/a.parquet")
        (True, False)
    """
    return isinstance(path, str) and "://" in path.split("/", 1)[0] + "//"


def version(info: dict[str, Any]) -> str | None:
    """What tells one version of a remote file from another.

    Args:
        info: the file's fsspec ``info``.

    Returns:
        Its ETag (``"etag ..."``), else its modification time (``"Last-Modified ..."``,
        S3's ``LastModified``, GCS's ``generation`` or ``updated``, a local file's
        ``mtime``...); ``None`` when the server gives neither.
    """
    for k in ("ETag", "etag"):
        if info.get(k):
            return f"etag {info[k]}"
    for k in ("generation", "Last-Modified", "LastModified", "last_modified", "updated", "mtime"):
        if info.get(k) is not None:
            return f"{k} {info[k]}"
    return None


def identity(url: str, info: dict[str, Any]) -> str:
    """The URL, size and version of a remote file, as one string.

    Args:
        url: the file's URL.
        info: its fsspec ``info``.

    Returns:
        Three lines: ``url URL``, ``size SIZE`` and the :func:`version`; equal for two
        ``info`` of the same version of the file.

    Example:
        >>> print(identity("s3://b/f", {"size": 3, "ETag": "x1"}))
        url s3://b/f
        size 3
        etag x1
    """
    return f"url {url}\nsize {info.get('size')}\n{version(info)}"


def unreachable(e: BaseException) -> bool:
    """Whether fsspec's ``FileNotFoundError`` hides a connection that failed.

    fsspec's HTTP file system reports a refused, broken or timed-out connection as a
    missing file; the connection's error is then the cause of it.

    Args:
        e: a ``FileNotFoundError`` raised by fsspec.

    Returns:
        Whether its cause is a connection error or a timeout.
    """
    cause = e.__cause__ or e.__context__
    return cause is not None and (
        isinstance(cause, (ConnectionError, TimeoutError)) or "Connect" in type(cause).__name__
    )


def _ignore(_name: str, _n: int) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class Fetcher:
    """Reads and downloads of remote files, with timeouts and retries (see the module docstring).

    The values are taken as given (:class:`~quern.pipeline.remote.cache.ShardCache` checks them).

    Args:
        retries: how many times a failed try is made again.
        backoff: seconds before the first retry (doubled at each).
        connect_timeout: seconds to make a connection (HTTP(S), GCS, S3).
        read_timeout: the most seconds without a byte from the server (HTTP(S), GCS, S3).
        folder: the folder downloads are written to, named when the disk under it is full.
        count: ``count(name, n)``, called with ``("retries", 1)`` before each retry and
            ``("bytes_fetched", n)`` for each block of ``n`` bytes downloaded (the cache's stats).
    """

    retries: int = RETRIES
    backoff: float = 0.5
    connect_timeout: float = CONNECT_TIMEOUT
    read_timeout: float = READ_TIMEOUT
    folder: str = ""
    count: Callable[[str, int], None] = _ignore

    def filesystem(self, url: str) -> tuple[Any, str]:
        """The fsspec file system for ``url`` and the path in it, with this fetcher's timeouts.

        HTTP(S) and GCS take an aiohttp ``ClientTimeout``, S3 botocore's ``connect_timeout``
        and ``read_timeout``, merged over fsspec's configuration of that protocol.

        Args:
            url: the file's URL.

        Returns:
            ``(file system, path in it)``, as ``fsspec.core.url_to_fs`` gives them.
        """
        import fsspec
        import fsspec.config

        protocol = url.split("://", 1)[0].lower()
        options: dict[str, Any] = {}
        if protocol in ("http", "https", "gs", "gcs"):
            import aiohttp

            timeout = aiohttp.ClientTimeout(
                total=None, connect=self.connect_timeout, sock_connect=self.connect_timeout, sock_read=self.read_timeout
            )
            if protocol.startswith("http"):
                conf = {
                    k: v
                    for p in ("http", "https")
                    for k, v in (fsspec.config.conf.get(p, {}).get("client_kwargs") or {}).items()
                }
                options["client_kwargs"] = {**conf, "timeout": timeout}
            else:
                options["requests_timeout"] = timeout  # gcsfs passes it to every request
        elif protocol in ("s3", "s3a"):
            conf = fsspec.config.conf.get("s3", {}).get("config_kwargs") or {}
            options["config_kwargs"] = {
                **conf,
                "connect_timeout": self.connect_timeout,
                "read_timeout": self.read_timeout,
            }
        return fsspec.core.url_to_fs(url, **options)

    def read(self, url: str) -> bytes:
        """The bytes of the small file ``url`` (a manifest), read once (not retried).

        Args:
            url: the file's URL.

        Returns:
            Its bytes.

        Raises:
            FileNotFoundError: the server says it is missing.
            SourceError: any other failure, naming the URL and the cause.
        """
        try:
            fs, path = self.filesystem(url)
            return bytes(fs.cat_file(path))
        except FileNotFoundError as e:
            if not unreachable(e):
                raise
            raise SourceError(f"{url}: cannot be read: {self.reason(e)}") from e
        except Exception as e:
            raise SourceError(f"{url}: cannot be read: {self.reason(e)}") from e

    def info(self, url: str) -> dict[str, Any]:
        """The server's ``info`` of ``url`` (its size, ETag, modification time...), with retries.

        Args:
            url: the file's URL.

        Returns:
            fsspec's ``info`` of it, as a dict.

        Raises:
            SourceError: it is missing, or every try failed (see :meth:`attempts`).
        """

        def once(_attempt: int) -> dict[str, Any]:
            fs, path = self.filesystem(url)
            return dict(fs.info(path))

        return self.attempts(url, once)

    def attempts(self, url: str, once: Callable[[int], _T]) -> _T:
        """``once(attempt)`` until it succeeds, at most ``retries + 1`` times with exponential backoff.

        Args:
            url: the URL ``once`` reads, named in the errors.
            once: one try; ``attempt`` counts from 0.

        Returns:
            What the first try that succeeds returns.

        Raises:
            SourceError: the file is missing (404), the disk under :attr:`folder` is full,
                ``once`` raised one (none of these is retried), or the last try failed
                (the message names the cause, see :meth:`reason`).
        """
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return once(attempt)
            except SourceError:
                raise
            except FileNotFoundError as e:
                if not unreachable(e):
                    raise SourceError(f"{url}: not found on the server (404)") from e
                err: BaseException = e
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise SourceError(f"{url}: the cache folder {self.folder!r} is full: {e}") from e
                err = e
            except Exception as e:  # aiohttp's and the server's errors
                if "404" in str(e) or "Not Found" in str(e):
                    raise SourceError(f"{url}: not found on the server (404)") from e
                err = e
            if attempt == self.retries:
                raise SourceError(
                    f"{url}: cannot be fetched after {self.retries + 1} tries: {self.reason(err)}"
                ) from err
            self.count("retries", 1)
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def reason(self, e: BaseException) -> str:
        """What went wrong in ``e``, for a message.

        Args:
            e: the error of a try.

        Returns:
            The timeout that expired (with this fetcher's setting), else the type and message
            of the first error of its chain that has a message, else the type of the last.
        """
        chain: list[BaseException] = []
        x: BaseException | None = e
        while x is not None and all(x is not c for c in chain):
            chain.append(x)
            x = x.__cause__ or x.__context__
        timeouts = [c for c in chain if isinstance(c, TimeoutError)]
        if timeouts:
            shown = next((c for c in timeouts if str(c)), timeouts[-1])  # fsspec's FSTimeoutError() has no text
            name, text = type(shown).__name__, str(shown)
            if any("connect" in (type(c).__name__ + str(c)).lower() for c in timeouts):
                what = f"no connection within {self.connect_timeout:g} s (connect_timeout)"
            else:
                what = f"no byte for {self.read_timeout:g} s (read_timeout)"
            return f"{name}: {what}" + (f" ({text})" if text else "")
        for c in chain:
            text = str(c)
            if text and not (is_url(text) and len(chain) > 1):  # fsspec's FileNotFoundError(url): its cause says why
                return f"{type(c).__name__}: {text}"
        return type(chain[-1]).__name__

    def fetch(self, url: str, part: str, *, size: int | None, expect: str | None) -> None:
        """Download ``url`` to the local file ``part``, with retries.

        HTTP: one streamed GET from the start (servers without Range requests work too); a
        retry with bytes already in ``part`` continues them with a Range request, or starts
        again from the first byte where the server takes none. The bytes are fsynced.

        Args:
            url: the file's URL.
            part: the local file written (replaced at the first try).
            size: the file's size when known (spares HTTP a HEAD).
            expect: the file's :func:`identity`, checked before each retry and after the
                download (the file did not change meanwhile); ``None`` (a file verified by
                its SHA-256 afterwards): no request but the download.

        Raises:
            SourceError: the file changed on the server (see :meth:`same`), or as
                :meth:`attempts`.
        """
        http = url.lower().startswith(("http://", "https://"))
        state = {"ranges": True}  # until the server shows it has none

        def stream(fs: Any, path: str, have: int) -> None:
            # HTTP: one streamed GET from the start (servers without Range requests work too); a retry
            # with bytes already here continues them with a Range request (ranged reads)
            block = BLOCK if (have or not http) else 0
            known = {"size": size} if http and size else {}  # else fsspec asks first (HEAD, then GET)
            with fs.open(path, "rb", block_size=block, **known) as src, open(part, "ab" if have else "wb") as out:
                if have:
                    src.seek(have)
                while chunk := src.read(BLOCK):
                    out.write(chunk)
                    self.count("bytes_fetched", len(chunk))
                out.flush()
                os.fsync(out.fileno())

        def once(attempt: int) -> None:
            have = os.path.getsize(part) if attempt and state["ranges"] and os.path.exists(part) else 0
            fs, path = self.filesystem(url)
            if expect is not None and attempt:
                self.same(url, fs, path, expect)
            try:
                stream(fs, path, have)
            except ValueError as e:
                if not (have and "range" in str(e).lower()):
                    raise
                state["ranges"] = False  # no Range requests: this try starts again from the first byte
                stream(fs, path, 0)
            if expect is not None:
                self.same(url, fs, path, expect)

        self.attempts(url, once)

    def same(self, url: str, fs: Any, path: str, expect: str) -> None:
        """Check that the file on the server is still the one ``expect`` names.

        Args:
            url: the file's URL.
            fs: its file system (see :meth:`filesystem`).
            path: its path in ``fs``.
            expect: its :func:`identity` when it was asked for.

        Raises:
            SourceError: its identity is another now (naming what was and what became).
        """
        now = identity(url, fs.info(path))
        if now != expect:
            was, became = expect.split("\n", 1)[1].replace("\n", ", "), now.split("\n", 1)[1].replace("\n", ", ")
            raise SourceError(
                f"{url}: the file changed on the server while it was fetched ({was} -> {became}); open the source again"
            )
