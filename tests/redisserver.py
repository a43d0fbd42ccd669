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

Every server is one ``redis-server`` process run in the foreground (``--daemonize no``) as a child of
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
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any, Self

import pytest
from helpers import free_port
from servers import _read_from, _size

REDIS_MISSING = "redis-server is not installed (make services installs it with apt-get)"
START_TIMEOUT = 10.0  # seconds for redis-server to answer PING with its data loaded
STOP_TIMEOUT = 5.0  # seconds after SIGTERM before SIGKILL

_SETPRIV = shutil.which("setpriv")


@functools.cache
def redis_binary() -> str | None:
    """The path of redis-server, or None where it is not installed (skip with :data:`REDIS_MISSING`)."""
    for path in (shutil.which("redis-server"), "/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


needs_redis = pytest.mark.skipif(redis_binary() is None, reason=REDIS_MISSING)


class _PortTaken(RuntimeError):
    pass


class RedisServer:
    """One private redis-server; see the module's text. ``start()``, ``kill()``, ``stop()`` and
    ``restart()`` may be called any number of times; the port and the folder stay the same. Where the
    first start finds the free port it picked taken meanwhile, it picks another (up to 3 tries); a
    ``port`` given is never changed. ``with RedisServer() as srv`` starts it (unless running) and
    closes it on exit."""

    def __init__(self, port: int | None = None):
        binary = redis_binary()
        if binary is None:
            raise RuntimeError(REDIS_MISSING)
        self._binary = binary
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self.dir = tempfile.mkdtemp(prefix="quern-redis-")
        self.output = os.path.join(self.dir, "output.log")  # the process's stdout and stderr: its log
        self.version: tuple[int, ...] = ()  # redis_version of the last start, such as (7, 0, 15)
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The process's id while it runs, else None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def command(self) -> list[str]:
        """The command line of a start."""
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

    def start(self) -> None:
        """Start the process and wait until it answers PING with its data loaded (else RuntimeError
        with its log; the process started is ended)."""
        if self.pid is not None:
            raise RuntimeError(f"redis-server is already running at {self.url}")
        for attempt in range(3):
            try:
                self._start_once()
                break
            except _PortTaken:
                if self._fixed_port or self._started or attempt == 2:
                    raise
                self.port = free_port()  # another process took the free port picked: pick another
        self._started = True

    def _start_once(self) -> None:
        cmd = self.command()
        if _SETPRIV:
            cmd = [_SETPRIV, "--pdeathsig", "TERM", *cmd]
        log_from = _size(self.output)
        with open(self.output, "ab") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self._proc = proc
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while True:
                version = _ready(self.port, proc.pid)
                if version is not None:
                    self.version = version
                    return
                if proc.poll() is not None:
                    log = _read_from(self.output, log_from)
                    if "Address already in use" in log:
                        raise _PortTaken(self._failure(f"port {self.port} is taken", log))
                    raise RuntimeError(self._failure(f"redis-server exited with status {proc.returncode}", log))
                if time.monotonic() > deadline:
                    why = f"redis-server did not answer PING on port {self.port} within {START_TIMEOUT:g} s"
                    raise RuntimeError(self._failure(why, _read_from(self.output, log_from)))
                time.sleep(0.01)
        except BaseException:
            self.kill()
            raise

    def _failure(self, why: str, log: str) -> str:
        return f"{why} (folder {self.dir}, command {' '.join(self.command())!r})\noutput.log:\n{log.rstrip()}"

    def kill(self) -> None:
        """SIGKILL the process and wait for it to end: what it answered is in its AOF, nothing else is
        written. Nothing to do when it is not running."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()

    def stop(self) -> None:
        """Stop the process (SIGTERM: redis-server fsyncs its AOF and exits; SIGKILL after STOP_TIMEOUT
        s): its port refuses connections. Nothing to do when it is not running."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        """Start again on the same port and folder (stopped first where it runs): the server replays its
        AOF, and answers PING with all of it loaded when this returns. After a ``kill()``, what a crash
        and a restart of the server leave."""
        self.stop()
        self.start()

    def close(self) -> None:
        """stop(), and remove the temporary folder."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        if self.pid is None:
            try:
                self.start()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.pid is not None else "stopped"
        return f"<RedisServer {self.url} in {self.dir}, {state}>"


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
