"""The test servers of tests/servers.py: a private nginx on 127.0.0.1 serves a folder as the HTTP
tests expect (byte-identical files, ETag, Range, 404), slowly when asked, goes away and comes back
on the same port, and leaves no process behind; a private Prometheus scrapes a target, answers
queries, says why when a query fails or has no result, and leaves no process behind."""

from __future__ import annotations

import http.client
import http.server
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest
import servers
from servers import Nginx, Prometheus, needs_nginx, needs_prometheus, nginx, prometheus


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


def processes_of(server: Nginx | Prometheus) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(server.conf in arg for arg in p.info["cmdline"] or []):  # nginx -c CONF, --config.file=CONF
            found.append(p)
    return found


@needs_nginx
def test_files_are_served_byte_identical(site):
    root, data = site
    with nginx(root) as srv:
        assert srv.url.startswith("http://127.0.0.1:") and int(srv.url.rsplit(":", 1)[1]) == srv.port
        status, headers, body = get(srv.url + "/data.bin")
        assert status == 200 and body == data and int(headers["Content-Length"]) == len(data)
        assert get(srv.url + "/sub/empty")[2] == b""
        assert srv.requests(at_least=2) == [
            servers.Request("GET", "/data.bin", 200, len(data), None),
            servers.Request("GET", "/sub/empty", 200, 0, None),
        ]


@needs_nginx
def test_etag_and_if_none_match(site):
    root, _ = site
    with nginx(root) as srv:
        _, headers, _ = get(srv.url + "/data.bin")
        etag = headers["ETag"]
        assert etag.startswith('"') and headers["Last-Modified"] and headers["Accept-Ranges"] == "bytes"
        with pytest.raises(urllib.error.HTTPError) as e:
            get(srv.url + "/data.bin", {"If-None-Match": etag})
        assert e.value.code == 304


@needs_nginx
def test_range_request(site):
    root, data = site
    with nginx(root) as srv:
        status, headers, body = get(srv.url + "/data.bin", {"Range": "bytes=10-19"})
        assert status == 206 and body == data[10:20]
        assert headers["Content-Range"] == f"bytes 10-19/{len(data)}"
        assert srv.requests(at_least=1)[-1] == servers.Request("GET", "/data.bin", 206, 10, "bytes=10-19")


@needs_nginx
def test_missing_file_is_404(site):
    root, _ = site
    with nginx(root) as srv:
        with pytest.raises(urllib.error.HTTPError) as e:
            get(srv.url + "/nothing.bin")
        assert e.value.code == 404


@needs_nginx
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


@needs_nginx
def test_limit_rate_must_be_a_rate(site):
    root, _ = site
    for bad in [0, "0", "fast", "1 m", -1, True]:
        with pytest.raises(ValueError, match="limit_rate"):
            Nginx(root, limit_rate=bad)


@needs_nginx
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


@needs_nginx
def test_stop_cuts_a_transfer_under_way(site):
    root, _ = site
    (root / "big.bin").write_bytes(bytes(3 * 2**20))
    with nginx(root, limit_rate="1m") as srv:
        with urllib.request.urlopen(srv.url + "/big.bin", timeout=10) as r:
            assert len(r.read(1000)) == 1000
            srv.stop()
            with pytest.raises((http.client.IncompleteRead, ConnectionError)):
                r.read()


@needs_nginx
def test_no_process_is_left_after_the_context(site):
    root, _ = site
    with nginx(root) as srv:
        pid = srv.pid
        assert [p.pid for p in processes_of(srv)] == [pid]
        assert psutil.Process(pid).name() == "nginx"
    assert not psutil.pid_exists(pid) and processes_of(srv) == []
    assert srv.pid is None


@needs_nginx
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


@needs_nginx
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
        free_port = servers.free_port
        monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or free_port())
        with nginx(root) as srv:
            assert srv.port != taken and get(srv.url + "/data.bin")[2] == data


@pytest.fixture
def exporter():
    """A target for Prometheus on 127.0.0.1: ``"127.0.0.1:PORT"``, serving a metric at /metrics."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'demo_metric{a="b"} 42\n' if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


@needs_prometheus
def test_prometheus_scrapes_a_target_and_says_why_when_a_query_has_no_result(exporter):
    dead = f"127.0.0.1:{servers.free_port()}"  # nothing listens there
    with prometheus([exporter, dead], job="demo") as prom:
        assert prom.url == f"http://127.0.0.1:{prom.port}"
        [series] = prom.wait_for("demo_metric")
        assert series["metric"] == {"__name__": "demo_metric", "a": "b", "instance": exporter, "job": "demo"}
        assert float(series["value"][1]) == 42
        assert prom.query('demo_metric{a="c"}') == []
        prom.wait_for(f'up{{instance="{dead}"}} == 0', timeout=5)  # its first scrape failed
        health = {t["scrapeUrl"]: t["health"] for t in prom.targets()}
        assert health == {f"http://{exporter}/metrics": "up", f"http://{dead}/metrics": "down"}
        t = time.monotonic()
        with pytest.raises(AssertionError) as e:
            prom.wait_for("no_such_metric", timeout=0.3)
        assert time.monotonic() - t < 2
        message = str(e.value)
        assert "'no_such_metric'" in message and "(last: [])" in message
        assert f"http://{exporter}/metrics: up" in message and f"http://{dead}/metrics: down" in message
        assert "connection refused" in message


@needs_prometheus
def test_prometheus_query_that_fails_raises_with_the_answer():
    with prometheus([]) as prom:
        assert prom.query("vector(1)")[0]["value"][1] == "1"
        with pytest.raises(RuntimeError, match=r"HTTP 400: .*bad_data.*parse error"):
            prom.query("sum(")
        assert prom.targets() == []


@needs_prometheus
def test_no_prometheus_process_is_left_after_the_context(exporter):
    t = time.monotonic()
    with prometheus([exporter]) as prom:
        started = time.monotonic() - t
        pid, port, folder = prom.pid, prom.port, prom.dir
        assert [p.pid for p in processes_of(prom)] == [pid]
        assert psutil.Process(pid).name() == "prometheus"
        assert os.path.isdir(os.path.join(folder, "data"))
    assert started < servers.START_TIMEOUT
    assert not psutil.pid_exists(pid) and processes_of(prom) == [] and prom.pid is None
    assert refused(port) and not os.path.exists(folder)


@needs_prometheus
def test_a_prometheus_start_that_fails_says_why_with_its_output():
    with Prometheus(["127.0.0.1:1"], scrape_interval="soon") as prom:
        with pytest.raises(RuntimeError, match=r"(?s)prometheus exited with status \d+.*soon"):
            prom.start()
        assert processes_of(prom) == [] and prom.pid is None


@needs_prometheus
def test_prometheus_picks_another_port_when_the_one_picked_is_taken(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken])
        free_port = servers.free_port
        monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or free_port())
        with prometheus([]) as prom:
            assert prom.port != taken and prom.query("vector(1)")
