"""Servers the tests start themselves on 127.0.0.1, each private to the test that starts it, all
through one launcher, :class:`ServerProcess` (a free port, a start that waits until the server is
ready, with a timeout, and a stop that leaves no process nor folder): nginx and Prometheus here,
redis-server in tests/redisserver.py, and any command listening on a port (:func:`process_on_port`).

nginx (``make services`` installs it with apt-get; without it the tests marked ``needs_nginx`` skip,
saying so)::

    @needs_nginx
    def test_read(tmp_path):
        (tmp_path / "a.bin").write_bytes(b"...")
        with nginx(tmp_path, limit_rate="1m") as srv:
            urllib.request.urlopen(srv.url + "/a.bin").read()
            srv.stop()  # the server goes away: connections are refused (and transfers cut) ...
            srv.start()  # ... and it comes back on the same port
            srv.requests()  # what it served, from its access log

The folder ``root`` is served read-only as static files (GET and HEAD; nginx's defaults: an ETag,
Last-Modified, Range requests answered 206, a missing file 404). Every server has its own
configuration, pid file, temp and log paths in a temporary folder, and is one nginx process
(``master_process off``) run in the foreground as a child of the test; leaving the ``with`` stops it
(SIGTERM, then SIGKILL) and removes that folder. Where ``setpriv`` is there (util-linux) the process
also gets SIGTERM when the thread that started it dies (a killed pytest leaves no nginx behind).

``limit_rate`` (bytes per second per request, an int or nginx's size such as ``"512k"`` or ``"50m"``,
where k = 1024 and m = 1024**2) emulates a slow link. nginx sends the first second's worth of bytes at
once, then after each write waits as long as that write takes at the rate: ``n`` bytes take about
``n / rate - 1`` seconds (3 MiB at ``"1m"``: 2.0 s). Its clock counts whole seconds, so rarely a
transfer takes up to a second less: a test may count on no more than ``n / rate - 2``. A stop() in the
meantime cuts the transfer.

Prometheus (``make services`` installs Debian's with apt-get; without it the tests marked
``needs_prometheus`` skip, saying so)::

    @needs_prometheus
    def test_metrics():
        with prometheus(["127.0.0.1:8000"], scrape_interval="1s") as prom:  # scrapes :8000/metrics
            prom.wait_for('demo_metric{a="b"}')  # polls until the query has a result: that result
            prom.query("rate(demo_metric[5s])")  # the HTTP API's data.result, a list of series
            prom.targets()  # each target's health, last error and labels

Every server has its own configuration (one scrape job, ``job``, of the static ``targets``), TSDB and
output log in a temporary folder, and is one process run as a child of the test on a free port
(``.url``), ready (``/-/ready``) when ``prometheus()`` yields; leaving the ``with`` stops it (SIGTERM,
then SIGKILL) and removes that folder; setpriv as for nginx. Prometheus hands the targets to its
scrapers no sooner than 5 s after it starts (a throttle of its service discovery that 2.42 cannot
shorten), so the first scrape, and the first result of ``wait_for``, comes 5 to 6 s after the start
at ``scrape_interval="1s"``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Self

import pytest
from helpers import free_port


def _find_nginx() -> str | None:
    # /usr/sbin is often not on a non-root PATH
    for path in (shutil.which("nginx"), "/usr/sbin/nginx", "/usr/local/sbin/nginx"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _find_prometheus() -> str | None:
    for path in (shutil.which("prometheus"), "/usr/bin/prometheus", "/usr/local/bin/prometheus"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


NGINX: str | None = _find_nginx()
NGINX_MISSING = "nginx is not installed (make services installs it with apt-get)"
needs_nginx = pytest.mark.skipif(NGINX is None, reason=NGINX_MISSING)

PROMETHEUS: str | None = _find_prometheus()
PROMETHEUS_MISSING = "prometheus is not installed (make services installs it with apt-get)"
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason=PROMETHEUS_MISSING)

START_TIMEOUT = 10.0  # seconds for nginx to accept connections, for prometheus to be ready
STOP_TIMEOUT = 5.0  # seconds after SIGTERM before SIGKILL

_SETPRIV = shutil.which("setpriv")


@functools.cache
def _nginx_build(nginx: str) -> tuple[tuple[int, ...], str]:
    """nginx's version and its configure arguments (``nginx -V``)."""
    out = subprocess.run([nginx, "-V"], capture_output=True, text=True, timeout=10).stderr
    m = re.search(r"nginx/(\d+(?:\.\d+)*)", out)
    return (tuple(int(x) for x in m.group(1).split(".")) if m else (0,)), out


def _quote(path: str) -> str:
    if "$" in path:  # nginx would read a variable there
        raise ValueError(f"nginx cannot serve a path with '$' in it: {path!r}")
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _rate(limit_rate: int | str | None) -> str | None:
    if limit_rate is None:
        return None
    text = str(limit_rate).strip()
    if isinstance(limit_rate, bool) or not re.fullmatch(r"[0-9]+[kKmM]?", text) or not re.search(r"[1-9]", text):
        raise ValueError(f"limit_rate is bytes per second > 0, an int or such as '512k' or '50m', not {limit_rate!r}")
    return text


@dataclass(frozen=True)
class Request:
    """One request nginx answered (a line of its access log, written when the response is done)."""

    method: str
    path: str  # as the client sent it, query included
    status: int
    sent: int  # body bytes sent
    range: str | None  # the Range header, None without one


class _PortTaken(RuntimeError):
    pass


class ServerProcess:
    """The one launcher of the servers the tests start themselves (nginx and Prometheus here, redis-server
    in tests/redisserver.py, the emulators of :func:`process_on_port`): one child process on a port of
    127.0.0.1 (``port``, a free one unless given; ``url``), a temporary folder (``dir``) with its
    configuration (``conf``, where the subclass has one) and its stdout and stderr (``output``).
    ``start()`` runs it and waits until it is ready, up to ``start_timeout`` s (else RuntimeError with
    its logs, and the process it started is ended); ``stop()`` ends it (SIGTERM, then SIGKILL after
    STOP_TIMEOUT s), ``kill()`` at once (SIGKILL), ``restart()`` stops and starts it; any number of
    times, the port staying the same. Where the first start finds the free port it picked taken
    meanwhile, it picks another (up to 3 tries); a ``port`` given is never changed. ``close()``, or
    leaving the ``with``, stops it and removes the folder. Where ``setpriv`` is there the process also
    gets SIGTERM when the thread that started it dies (a killed pytest leaves no server behind).

    A subclass gives ``name``, ``_command()``, ``_not_ready()`` and ``_port_taken()``, and may give
    ``conf_name`` with ``config()``, add logs to ``_logs`` and say more in ``_about()``."""

    name = ""  # "nginx": in messages and the temporary folder's name
    scheme = "http"  # of ``url``
    conf_name: str | None = None  # the configuration file start() writes into ``dir``, if any
    start_timeout = START_TIMEOUT  # seconds for a start to be ready
    _poll_s = 0.01  # seconds between the checks of a start

    def __init__(self, binary: str, port: int | None = None, cwd: str | None = None):
        self._binary = binary
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self.dir = tempfile.mkdtemp(prefix=f"quern-{self.name}-")
        self.conf = os.path.join(self.dir, self.conf_name or "")
        self.output = os.path.join(self.dir, "output.log")  # the process's stdout and stderr
        self.cwd = cwd
        self._logs = [self.output]  # what a start that fails shows, from where that start began
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False
        self._last_command: list[str] = [binary]

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The process's id while it runs, else None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def config(self) -> str:
        """The configuration that start() writes to ``conf`` (where ``conf_name`` is set)."""
        raise NotImplementedError

    def _command(self) -> list[str]:
        """The command line of a start, made just before it runs (``conf`` written)."""
        raise NotImplementedError

    def _not_ready(self, proc: subprocess.Popen[bytes]) -> str | None:
        """None once the process started is ready, else why not, for a message after ``name``: "did
        not accept connections on port 8080"."""
        raise NotImplementedError

    def _port_taken(self, logs: str, exited: bool) -> bool:
        """Whether the logs of this start (``exited``: the process ended) say that the port is taken."""
        raise NotImplementedError

    def _about(self) -> str:
        """What a failed start's message says of the server before its config and command."""
        return ""

    def start(self) -> None:
        """Start the process and wait until it is ready (else RuntimeError with its logs)."""
        if self.pid is not None:
            raise RuntimeError(f"{self.name} is already running at {self.url}")
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
        if self.conf_name:
            with open(self.conf, "w") as f:
                f.write(self.config())
        cmd = self._last_command = self._command()
        log_from = {p: _size(p) for p in self._logs}
        if _SETPRIV:
            cmd = [_SETPRIV, "--pdeathsig", "TERM", *cmd]
        with open(self.output, "ab") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd)
        self._proc = proc
        try:
            deadline = time.monotonic() + self.start_timeout
            while True:
                not_yet = self._not_ready(proc)
                if not_yet is None:
                    return
                exited = proc.poll() is not None
                if self._port_taken("".join(_read_from(p, n) for p, n in log_from.items()), exited):
                    raise _PortTaken(self._failure(f"port {self.port} is taken", log_from))
                if exited:
                    raise RuntimeError(self._failure(f"{self.name} exited with status {proc.returncode}", log_from))
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        self._failure(f"{self.name} {not_yet} within {self.start_timeout:g} s", log_from)
                    )
                time.sleep(self._poll_s)
        except BaseException:
            self.stop()
            raise

    def _failure(self, why: str, log_from: dict[str, int]) -> str:
        logs = "\n".join(f"{os.path.basename(p)}:\n{_read_from(p, n).rstrip()}" for p, n in log_from.items())
        conf = f"config {self.conf}, " if self.conf_name else ""
        return f"{why} ({self._about()}{conf}command {' '.join(self._last_command)!r})\n{logs}"

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after STOP_TIMEOUT s): its port refuses connections,
        and transfers under way are cut. Nothing to do when it is not running."""
        proc, self._proc = self._proc, None
        _terminate(proc)

    def kill(self) -> None:
        """SIGKILL the process and wait for it to end. Nothing to do when it is not running."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()

    def restart(self) -> None:
        """Start again on the same port and folder (stopped first where it runs)."""
        self.stop()
        self.start()

    def close(self) -> None:
        """stop(), and remove the temporary folder."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _state(self) -> str:
        return f"pid {self.pid}" if self.pid is not None else "stopped"


class Nginx(ServerProcess):
    """One private nginx serving ``root``; see the module's text. ``start()`` and ``stop()`` may be
    called any number of times; the port stays the same. ``limit_rate`` may be changed between a
    ``stop()`` and a ``start()``."""

    name = "nginx"
    conf_name = "nginx.conf"

    def __init__(self, root: str | os.PathLike[str], limit_rate: int | str | None = None, port: int | None = None):
        if NGINX is None:
            raise RuntimeError(NGINX_MISSING)
        self.root = os.path.abspath(root)
        if not os.path.isdir(self.root):
            raise NotADirectoryError(self.root)
        _quote(self.root)  # a '$' in it: ValueError now, not at start()
        self.limit_rate = limit_rate
        _rate(limit_rate)
        super().__init__(NGINX, port)
        self.pid_file = os.path.join(self.dir, "nginx.pid")
        self.error_log = os.path.join(self.dir, "error.log")
        self.access_log = os.path.join(self.dir, "access.log")
        self._logs = [self.error_log, self.output]

    def config(self) -> str:
        """The nginx.conf that start() writes."""
        build = _nginx_build(self._binary)[1]
        temp = [f"client_body_temp_path {_quote(os.path.join(self.dir, 'client_body'))};"]
        for module in ("proxy", "fastcgi", "uwsgi", "scgi"):  # the modules nginx was built without have no directive
            if f"--without-http_{module}_module" not in build:
                temp.append(f"{module}_temp_path {_quote(os.path.join(self.dir, module))};")
        rate = _rate(self.limit_rate)
        lines = [
            "daemon off;",
            "master_process off;",
            f"pid {_quote(self.pid_file)};",
            f"error_log {_quote(self.error_log)} warn;",
            "events { worker_connections 1024; }",
            "http {",
            "    default_type application/octet-stream;",
            "    sendfile on;",
            *("    " + t for t in temp),
            "    log_format quern '$request_method\\t$request_uri\\t$status\\t$body_bytes_sent\\t$http_range';",
            f"    access_log {_quote(self.access_log)} quern;",
            "    server {",
            f"        listen 127.0.0.1:{self.port};",
            f"        root {_quote(self.root)};",
            *([f"        limit_rate {rate};"] if rate else []),
            "    }",
            "}",
        ]
        return "\n".join(lines) + "\n"

    def _command(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.pid_file)  # left by a SIGKILL; nginx writes it once it listens
        cmd = [self._binary, "-p", self.dir + os.sep, "-c", self.conf]
        if _nginx_build(self._binary)[0] >= (1, 19, 5):
            cmd += ["-e", self.error_log]  # before the config is read too, not the built-in /var/log/nginx
        return cmd

    def _not_ready(self, proc: subprocess.Popen[bytes]) -> str | None:
        if _read_pid(self.pid_file) == proc.pid and _accepts(self.port):
            return None
        return f"did not accept connections on port {self.port}"

    def _port_taken(self, logs: str, exited: bool) -> bool:
        return "Address already in use" in logs  # nginx retries binding for 2.5 s before it exits: not that long

    def _about(self) -> str:
        return f"serving {self.root}; "

    def requests(self, at_least: int = 0, timeout: float = 5.0, settle: float = 0.05) -> list[Request]:
        """The requests answered so far (since the first start), oldest first. nginx logs a
        request just after its response is sent, so a client can have its answer before the
        line is written: the log is read once it has not grown for ``settle`` seconds, and
        with at least ``at_least`` lines (waiting up to ``timeout`` seconds for them)."""
        deadline = time.monotonic() + timeout
        size = _size(self.access_log)
        while True:
            time.sleep(settle)
            now = _size(self.access_log)
            if now == size:
                found = self._read_log()
                if len(found) >= at_least or time.monotonic() > deadline:
                    return found
            size = now

    def _read_log(self) -> list[Request]:
        found = []
        try:
            with open(self.access_log, encoding="utf-8", errors="replace") as f:
                for line in f:
                    method, path, status, sent, range_ = line.rstrip("\n").split("\t")
                    found.append(Request(method, path, int(status), int(sent), None if range_ == "-" else range_))
        except FileNotFoundError:
            pass
        return found

    def __repr__(self) -> str:
        return f"<Nginx {self.url} serving {self.root}, {self._state()}>"


@contextlib.contextmanager
def nginx(
    root: str | os.PathLike[str], limit_rate: int | str | None = None, port: int | None = None
) -> Iterator[Nginx]:
    """A private nginx serving the folder ``root`` read-only at ``.url`` (http://127.0.0.1:PORT, a free
    port unless ``port`` is given), started, and stopped on exit with no process of it left. Skips the
    test where nginx is not installed."""
    if NGINX is None:
        pytest.skip(NGINX_MISSING)
    with Nginx(root, limit_rate=limit_rate, port=port) as server:
        server.start()
        yield server


class Prometheus(ServerProcess):
    """One private Prometheus scraping ``targets`` (``"127.0.0.1:PORT"``, each at ``/metrics``) every
    ``scrape_interval`` as the job ``job``; see the module's text. ``start()`` and ``stop()`` may be
    called any number of times; the port stays the same, and so do the samples scraped."""

    name = "prometheus"
    conf_name = "prometheus.yml"
    _poll_s = 0.02

    def __init__(self, targets: list[str], scrape_interval: str = "1s", job: str = "quern"):
        if PROMETHEUS is None:
            raise RuntimeError(PROMETHEUS_MISSING)
        if isinstance(targets, str):
            raise TypeError(f"targets is a list of 'host:port', not a str: {targets!r}")
        self.scrape_targets = [str(t) for t in targets]
        self.scrape_interval = scrape_interval
        self.job = job
        super().__init__(PROMETHEUS)
        self.data = os.path.join(self.dir, "data")

    def config(self) -> str:
        """The prometheus.yml that start() writes (JSON, which is YAML). The global interval is the
        job's too, so that the scrape timeout (at most 10 s) is no longer than the interval."""
        interval = self.scrape_interval
        job = {"job_name": self.job, "scrape_interval": interval, "static_configs": [{"targets": self.scrape_targets}]}
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [job],
        }
        return json.dumps(config, indent=2) + "\n"

    def _command(self) -> list[str]:
        return [
            self._binary,
            f"--config.file={self.conf}",
            f"--storage.tsdb.path={self.data}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]

    def _not_ready(self, proc: subprocess.Popen[bytes]) -> str | None:
        not_yet = f"was not ready at {self.url}"
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                return None if r.status == 200 else not_yet
        except urllib.error.HTTPError as e:  # 503 while it starts
            e.close()
            return not_yet
        except OSError:  # refused before it listens
            return not_yet

    def _port_taken(self, logs: str, exited: bool) -> bool:
        return exited and "address already in use" in logs

    def api(self, path: str, **params: str) -> Any:
        """The ``data`` of an answer of the HTTP API (``path`` such as ``"/api/v1/targets"``); an
        answer that is not a success raises RuntimeError with it."""
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                status, body = r.status, r.read()
        except urllib.error.HTTPError as e:  # 400 for a query that does not parse, 422 one that fails
            with e:
                status, body = e.code, e.read()
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if status != 200 or not isinstance(answer, dict) or answer.get("status") != "success":
            text = body.decode("utf-8", "replace")
            raise RuntimeError(f"prometheus answered {path} {params} with HTTP {status}: {text}")
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The result of the PromQL ``expr`` now (``/api/v1/query``): a list of series, each
        ``{"metric": {labels}, "value": [time, "value"]}`` for a vector."""
        return self.api("/api/v1/query", query=expr)["result"]

    def targets(self) -> list[dict[str, Any]]:
        """The active targets (``/api/v1/targets``), each with its ``health`` ("up", "down" or
        "unknown" before its first scrape), ``lastError``, ``scrapeUrl`` and ``labels``."""
        return self.api("/api/v1/targets")["activeTargets"]

    def wait_for(self, expr: str, timeout: float = 30) -> list[dict[str, Any]]:
        """Query ``expr`` until the result is not empty, and return it; after ``timeout`` s,
        AssertionError with the last result and the targets' health."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        health = [f"{t['scrapeUrl']}: {t['health']} {t['lastError']!r}".rstrip() for t in self.targets()]
        raise AssertionError(
            f"prometheus at {self.url} had no result for {expr!r} within {timeout:g} s (last: {result!r}); "
            f"targets: {'; '.join(health) or 'none yet'}"
        )

    def __repr__(self) -> str:
        return f"<Prometheus {self.url} scraping {self.scrape_targets}, {self._state()}>"


@contextlib.contextmanager
def prometheus(targets: list[str], scrape_interval: str = "1s", job: str = "quern") -> Iterator[Prometheus]:
    """A private Prometheus at ``.url`` (http://127.0.0.1:PORT, a free port) scraping ``targets``
    (``"127.0.0.1:PORT"``, at ``/metrics``) every ``scrape_interval`` as the job ``job``, ready, and
    stopped on exit with no process of it left. Skips the test where prometheus is not installed."""
    if PROMETHEUS is None:
        pytest.skip(PROMETHEUS_MISSING)
    with Prometheus(targets, scrape_interval=scrape_interval, job=job) as server:
        server.start()
        yield server


def _terminate(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT s; wait for the process to end."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


class _Command(ServerProcess):
    """A server of the tests that is a command listening on the port it is given (:func:`process_on_port`)."""

    start_timeout = 30.0
    _poll_s = 0.1

    def __init__(self, argv: Callable[[int], list[str]], what: str, cwd: str | None = None):
        self.name = what
        self._argv = argv
        super().__init__(what, cwd=cwd)

    def _command(self) -> list[str]:
        return self._argv(self.port)

    def _not_ready(self, proc: subprocess.Popen[bytes]) -> str | None:
        return None if _accepts(self.port) else f"did not accept connections on port {self.port}"

    def _port_taken(self, logs: str, exited: bool) -> bool:
        return exited and "address already in use" in logs.lower()


@contextlib.contextmanager
def process_on_port(argv: Callable[[int], list[str]], what: str, cwd: str | None = None) -> Iterator[int]:
    """Start ``argv(port)`` (a server of the tests: moto, the GCS emulator) on a free port of
    127.0.0.1 (:class:`ServerProcess`), wait up to 30 s until the port accepts connections, yield the
    port; stopped on exit, with no process of it left."""
    with _Command(argv, what, cwd=cwd) as server:
        server.start()
        yield server.port


@contextlib.contextmanager
def fsspec_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> Iterator[None]:
    """Set ``env`` (e.g. ``FSSPEC_S3_ENDPOINT_URL``) and reload fsspec's config from the
    environment, so that file systems opened by URL use it; the config is reloaded on exit."""
    import fsspec.config

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fsspec.config.conf.clear()
    fsspec.config.set_conf_env(fsspec.config.conf)
    try:
        yield
    finally:
        for k in env:
            monkeypatch.delenv(k, raising=False)
        fsspec.config.conf.clear()
        fsspec.config.set_conf_env(fsspec.config.conf)
