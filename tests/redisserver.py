"""A redis-server the tests start themselves on 127.0.0.1, private to the test that starts it.

``make services`` installs Debian's redis-server with apt-get; where it is missing, :func:`redis_binary`
is None and a test skips with :data:`REDIS_MISSING` (or is marked ``needs_redis``)::

    def test_stream():
        if redis_binary() is None:
            pytest.skip(REDIS_MISSING)
        with RedisServer() as srv:  # started: it answers PING, with its data loaded
            r = srv.client()  # a redis.Redis of srv.url (redis://127.0.0.1:PORT/0)
            r.xadd("s", {"a": "1"})
            srv.kill()  # SIGKILL: connections are refused, commands under way cut ...
            srv.restart()  # ... and it comes back on the same port and folder: the AOF replayed
            assert r.xlen("s") == 1
            srv.stop()  # SIGTERM, then SIGKILL: no process left

Every server is one ``redis-server`` process, started and stopped by tests/servers.py's launcher
(:class:`~servers.ServerProcess`), run in the foreground (``--daemonize no``) as a child of
the test, on a free port (``.port``) of 127.0.0.1 only, with its data and its output log
(``output.log``) in a temporary folder (``.dir``). It writes an append-only file fsynced before each
write is answered (``--appendonly yes --appendfsync always``) and no RDB snapshots (``--save ""``), so
every write a client saw answered survives a :meth:`RedisServer.kill` and is back after the
:meth:`RedisServer.restart`. Leaving the ``with``, or ``close()``, stops it and removes the folder;
a start that fails ends the process it started. Where ``setpriv`` is there (util-linux) the process
also gets SIGTERM when the thread that started it dies (a killed pytest leaves no redis-server behind).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
from typing import Any, Self

import pytest
from servers import ServerProcess

REDIS_MISSING = "redis-server is not installed (make services installs it with apt-get)"


@functools.cache
def redis_binary() -> str | None:
    """The path of redis-server, or None where it is not installed (skip with :data:`REDIS_MISSING`)."""
    for path in (shutil.which("redis-server"), "/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


needs_redis = pytest.mark.skipif(redis_binary() is None, reason=REDIS_MISSING)


class RedisServer(ServerProcess):
    """One private redis-server (tests/servers.py's :class:`~servers.ServerProcess`); see the module's
    text. ``start()``, ``kill()``, ``stop()`` and ``restart()`` may be called any number of times; the
    port and the folder stay the same. ``with RedisServer() as srv`` starts it (unless running) and
    closes it on exit."""

    name = "redis-server"
    scheme = "redis"

    def __init__(self, port: int | None = None):
        binary = redis_binary()
        if binary is None:
            raise RuntimeError(REDIS_MISSING)
        super().__init__(binary, port)
        self.version: tuple[int, ...] = ()  # redis_version of the last start, such as (7, 0, 15)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def _command(self) -> list[str]:
        return [
            self._binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--protected-mode",
            "yes",
            "--dir",
            self.dir,
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--daemonize",
            "no",
        ]

    def _not_ready(self, proc: subprocess.Popen[bytes]) -> str | None:
        version = _ready(self.port, proc.pid)
        if version is None:
            return f"did not answer PING on port {self.port}"
        self.version = version
        return None

    def _port_taken(self, logs: str, exited: bool) -> bool:
        return exited and "Address already in use" in logs

    def _about(self) -> str:
        return f"folder {self.dir}; "

    def client(self, **kwargs: Any) -> Any:
        """A ``redis.Redis`` (redis-py) of this server that does not retry (a command on a server down
        raises ConnectionError at once; ``redis.Redis(host=..., port=...)`` retries 10 times over about
        4 s by default), with ``socket_timeout=10``; ``kwargs`` go to ``redis.Redis`` and win."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kwargs.setdefault("socket_timeout", 10)
        kwargs.setdefault("retry", Retry(NoBackoff(), 0))
        return redis.Redis(host="127.0.0.1", port=self.port, db=0, **kwargs)

    def __enter__(self) -> Self:
        if self.pid is None:
            try:
                self.start()
            except BaseException:
                self.close()
                raise
        return self

    def __repr__(self) -> str:
        return f"<RedisServer {self.url} in {self.dir}, {self._state()}>"


def _ready(port: int, pid: int) -> tuple[int, ...] | None:
    """redis_version where the server on ``port`` is the process ``pid``, answers PING (not -LOADING)
    and has loaded its data; None otherwise (not listening yet, loading, another process's port)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            if _ask(s, b"PING") != b"PONG":
                return None
            info = _ask(s, b"INFO", b"server", b"persistence")
    except (OSError, ValueError):  # not listening yet, or not answering as redis-server does
        return None
    fields = dict(line.split(":", 1) for line in info.decode("utf-8", "replace").splitlines() if ":" in line)
    if fields.get("process_id") != str(pid) or fields.get("loading") != "0":
        return None
    return tuple(int(x) for x in fields.get("redis_version", "0").split(".") if x.isdigit())


def _ask(s: socket.socket, *args: bytes) -> bytes:
    """One command's reply, read raw: a simple string or a bulk string's bytes; an error reply (such
    as ``-LOADING``) as b"" (none of the replies asked for is empty)."""
    s.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
    buf = b""
    while b"\r\n" not in buf:
        buf += _recv(s)
    head, _, rest = buf.partition(b"\r\n")
    if head[:1] == b"+":
        return head[1:]
    if head[:1] != b"$" or int(head[1:]) < 0:
        return b""
    size = int(head[1:])
    while len(rest) < size + 2:
        rest += _recv(s)
    return rest[:size]


def _recv(s: socket.socket) -> bytes:
    data = s.recv(65536)
    if not data:
        raise ConnectionResetError("redis-server closed the connection")
    return data


PAD = 6
"""Bytes of the ``pad`` field of the entries :func:`produce` adds."""


def pad_of(i: int) -> bytes:
    """Entry ``i``'s ``pad`` field: :data:`PAD` bytes that depend on ``i``."""
    return bytes((i * 7 + k) % 256 for k in range(PAD))


def produce(r: Any, start: int, stop: int, key: str = "ev") -> list[str]:
    """Add entries ``v=i, pad=pad_of(i)`` for ``i`` in ``[start, stop)`` to stream ``key``; their IDs, in order."""
    p = r.pipeline(transaction=False)
    for i in range(start, stop):
        p.xadd(key, {"v": str(i), "pad": pad_of(i)})
    return [x.decode() for x in p.execute()]
