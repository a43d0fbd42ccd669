"""The test servers of tests/servers.py: a private nginx on 127.0.0.1 serves a folder as the HTTP
tests expect (byte-identical files, ETag, Range, 404), slowly when asked, goes away and comes back
on the same port, and leaves no process behind."""

from __future__ import annotations

import http.client
import random
import socket
import time
import urllib.error
import urllib.request

import psutil
import pytest
import servers
from servers import Nginx, needs_nginx, nginx

pytestmark = needs_nginx


@pytest.fixture
def site(tmp_path):
    root = tmp_path / "site"
    (root / "sub").mkdir(parents=True)
    data = random.Random(0).randbytes(100_000)
    (root / "data.bin").write_bytes(data)
    (root / "sub" / "empty").write_bytes(b"")
    return root, data


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
        return r.status, dict(r.headers), r.read()


def processes_of(server: Nginx) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if server.conf in (p.info["cmdline"] or []):
            found.append(p)
    return found


def test_files_are_served_byte_identical(site):
    root, data = site
    with nginx(root) as srv:
        assert srv.url.startswith("http://127.0.0.1:") and int(srv.url.rsplit(":", 1)[1]) == srv.port
        status, headers, body = get(srv.url + "/data.bin")
        assert status == 200 and body == data and int(headers["Content-Length"]) == len(data)
        assert get(srv.url + "/sub/empty")[2] == b""
        assert srv.requests() == [
            servers.Request("GET", "/data.bin", 200, len(data), None),
            servers.Request("GET", "/sub/empty", 200, 0, None),
        ]


def test_etag_and_if_none_match(site):
    root, _ = site
    with nginx(root) as srv:
        _, headers, _ = get(srv.url + "/data.bin")
        etag = headers["ETag"]
        assert etag.startswith('"') and headers["Last-Modified"] and headers["Accept-Ranges"] == "bytes"
        with pytest.raises(urllib.error.HTTPError) as e:
            get(srv.url + "/data.bin", {"If-None-Match": etag})
        assert e.value.code == 304


def test_range_request(site):
    root, data = site
    with nginx(root) as srv:
        status, headers, body = get(srv.url + "/data.bin", {"Range": "bytes=10-19"})
        assert status == 206 and body == data[10:20]
        assert headers["Content-Range"] == f"bytes 10-19/{len(data)}"
        assert srv.requests()[-1] == servers.Request("GET", "/data.bin", 206, 10, "bytes=10-19")


def test_missing_file_is_404(site):
    root, _ = site
    with nginx(root) as srv:
        with pytest.raises(urllib.error.HTTPError) as e:
            get(srv.url + "/nothing.bin")
        assert e.value.code == 404


def test_limit_rate_slows_transfers(site):
    root, _ = site
    data = random.Random(1).randbytes(3 * 2**20)
    (root / "big.bin").write_bytes(data)
    with nginx(root, limit_rate="1m") as srv:
        t = time.monotonic()
        body = get(srv.url + "/big.bin")[2]
        took = time.monotonic() - t
    assert body == data
    # 3 MiB at 1 MiB/s takes about 2 s (nginx sends the first second's worth at once); its clock counts
    # whole seconds, so no less than 1 s is certain (unlimited, the same transfer takes milliseconds)
    assert took >= 0.95, took


def test_limit_rate_must_be_a_rate(site):
    root, _ = site
    for bad in [0, "0", "fast", "1 m", -1, True]:
        with pytest.raises(ValueError, match="limit_rate"):
            Nginx(root, limit_rate=bad)


def test_stop_refuses_connections_and_start_serves_again_on_the_same_port(site):
    root, data = site
    with nginx(root) as srv:
        url, pid = srv.url, srv.pid
        assert get(url + "/data.bin")[2] == data
        srv.stop()
        assert srv.pid is None and not psutil.pid_exists(pid)
        with pytest.raises(urllib.error.URLError) as e:
            get(url + "/data.bin")
        assert isinstance(e.value.reason, ConnectionRefusedError)
        srv.stop()  # again: nothing to do
        srv.start()
        assert srv.url == url and srv.pid not in (None, pid)
        assert get(url + "/data.bin")[2] == data


def test_stop_cuts_a_transfer_under_way(site):
    root, _ = site
    (root / "big.bin").write_bytes(bytes(3 * 2**20))
    with nginx(root, limit_rate="1m") as srv:
        with urllib.request.urlopen(srv.url + "/big.bin", timeout=10) as r:
            assert len(r.read(1000)) == 1000
            srv.stop()
            with pytest.raises((http.client.IncompleteRead, ConnectionError)):
                r.read()


def test_no_process_is_left_after_the_context(site):
    root, _ = site
    with nginx(root) as srv:
        pid = srv.pid
        assert [p.pid for p in processes_of(srv)] == [pid]
        assert psutil.Process(pid).name() == "nginx"
    assert not psutil.pid_exists(pid) and processes_of(srv) == []
    assert srv.pid is None


def test_a_start_that_fails_says_why_with_the_error_log(site):
    root, _ = site

    class Broken(Nginx):
        def config(self) -> str:
            return super().config() + "no_such_directive on;\n"

    with Broken(root) as srv:
        with pytest.raises(
            RuntimeError, match=r"(?s)nginx exited with status 1.*unknown directive \"no_such_directive\""
        ):
            srv.start()
        assert processes_of(srv) == []


def test_a_port_taken_is_an_error_when_given_and_another_is_picked_when_not(site, monkeypatch):
    root, data = site
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        t = time.monotonic()
        with pytest.raises(RuntimeError, match=f"port {taken} is taken"):
            with nginx(root, port=taken):
                pass
        assert time.monotonic() - t < 2  # not nginx's own retries (5 x 0.5 s)

        ports = iter([taken])
        free_port = servers._free_port
        monkeypatch.setattr(servers, "_free_port", lambda: next(ports, None) or free_port())
        with nginx(root) as srv:
            assert srv.port != taken and get(srv.url + "/data.bin")[2] == data
