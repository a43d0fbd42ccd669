"""The test server of tests/redisserver.py: a private redis-server on 127.0.0.1 keeps every stream
entry it answered across a SIGKILL and a restart on the same port (its AOF, fsynced always), refuses
connections while down, and leaves no process behind, not even after a start that fails."""

from __future__ import annotations

import os

import psutil
import pytest
import redis
from helpers import alive
from redisserver import RedisServer, needs_redis, redis_binary

pytestmark = needs_redis


def redis_children() -> list[psutil.Process]:
    """The redis-server processes this test process started (and that have not ended)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() == "redis-server" and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def test_entries_survive_kill_and_restart():
    with RedisServer() as srv:
        assert srv.version >= (7, 0)
        assert srv.url == f"redis://127.0.0.1:{srv.port}/0"
        r = redis.Redis.from_url(srv.url, socket_timeout=10)
        ids = [r.xadd("s", {"i": str(i), "text": f"entry {i}"}) for i in range(5)]
        first_pid, port = srv.pid, srv.port
        srv.kill()
        assert srv.pid is None and alive([first_pid]) == []
        with pytest.raises(redis.ConnectionError):
            r.ping()
        srv.restart()
        assert srv.port == port and srv.pid not in (None, first_pid)
        entries = r.xrange("s")
        assert [e[0] for e in entries] == ids
        assert [e[1] for e in entries] == [{b"i": str(i).encode(), b"text": f"entry {i}".encode()} for i in range(5)]
        assert r.xinfo_stream("s")["entries-added"] == 5
        srv.restart()  # running: stopped first (SIGTERM), then started again, the entries still there
        assert r.xlen("s") == 5
        r.close()


def test_stop_and_close_leave_no_process_nor_folder():
    srv = RedisServer()
    with srv:
        (child,) = redis_children()
        assert child.pid == srv.pid
        assert child.exe() == os.path.realpath(redis_binary())  # its title is "redis-server 127.0.0.1:PORT"
        srv.stop()
        assert srv.pid is None and alive([child.pid]) == []
        with pytest.raises(redis.ConnectionError):
            srv.client().ping()
        srv.start()
        assert srv.client().ping() is True
        second = srv.pid
    assert second is not None and alive([second]) == []
    assert redis_children() == []
    assert not os.path.exists(srv.dir)


def test_failed_start_leaves_no_process():
    with RedisServer() as first:
        with pytest.raises(RuntimeError, match=f"port {first.port} is taken"):
            with RedisServer(port=first.port):  # a port given is not changed: the start fails
                pass
        assert [p.pid for p in redis_children()] == [first.pid]
        assert first.client().ping() is True
    assert redis_children() == []
