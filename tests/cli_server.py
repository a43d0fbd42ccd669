"""A ``python -m quern`` that starts in milliseconds: a fork server for the tests' command lines.

The CLI tests run ``python -m quern ARGS`` about 300 times; each fresh interpreter spends
~0.3 s of CPU importing what every command imports before it reads its arguments (quern,
numpy, pydantic, yaml). Here one server process per test process imports exactly that
(``quern.pipeline.cli``, which is what ``quern/__main__.py`` imports) once, and forks a
child per command. The child becomes the command's process: it takes the caller's stdin,
stdout and stderr (passed as file descriptors), current folder, environment and
``sys.path`` (the folder, then ``PYTHONPATH``, then the interpreter's own), runs
``quern/__main__.py`` as ``__main__`` with the arguments (:func:`runpy.run_module`, as
``-m`` does), and ends as an interpreter does: ``sys.exit`` with the status, atexit
handlers and buffered output flushed, a traceback and status 1 for an uncaught exception.
Everything after the startup imports is the command's own (the libraries it imports, the
processes it starts), so only the import of the startup modules is shared.

:func:`run` is the client (:func:`helpers.run_quern` calls it): it gives back a
:class:`subprocess.CompletedProcess` as ``subprocess.run`` does, and raises
:class:`subprocess.TimeoutExpired` after killing the command. ``QUERN_TESTS_CLI=subprocess``
makes every call a fresh ``python -m quern`` again, as do a server that cannot start
and a server whose imports started a thread (forking it would not be safe).
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from typing import Any

__all__ = ["run", "enabled"]

_LOCK = threading.Lock()
_SERVER: dict[str, Any] = {}  # this process's server: "proc", "path"; "failed" once it could not start


def enabled() -> bool:
    """Whether commands go through the fork server (not with ``QUERN_TESTS_CLI=subprocess``)."""
    return os.environ.get("QUERN_TESTS_CLI", "fork") != "subprocess"


def _send(sock: socket.socket, obj: Any, fds: tuple[int, ...] | list[int] = ()) -> None:
    data = json.dumps(obj).encode()
    socket.send_fds(sock, [struct.pack("!I", len(data)) + data], list(fds))


def _recv(sock: socket.socket, nfds: int = 0) -> tuple[Any, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, 4, nfds)
    if len(head) < 4:
        raise EOFError("the fork server closed the connection")
    (n,) = struct.unpack("!I", head)
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise EOFError("the fork server closed the connection")
        data += part
    return json.loads(data), fds


# --------------------------------------------------------------------------- the server


def _serve(path: str, lifeline: int) -> dict[str, Any] | None:
    """Serve on the socket at ``path`` until ``lifeline`` (the client's end of a pipe) closes.

    Returns only in a forked child: its request (with its descriptors set up); the server
    itself exits. One thread: children are watched through pidfds, their statuses sent back
    to their callers.
    """
    import selectors

    import quern.pipeline.cli  # noqa: F401  what python -m quern imports before it reads its arguments

    if threading.active_count() != 1:
        print("NOFORK threads after the startup imports", flush=True)
        os._exit(3)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("READY", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(lifeline, selectors.EVENT_READ, "lifeline")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the caller's connection)
    while True:
        for key, _ in sel.select():
            if key.data == "lifeline":
                for pid, _conn in children.values():
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                os._exit(0)
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _recv(conn, 3)
                except (EOFError, OSError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    os.close(lifeline)
                    for other in children.values():
                        other[1].close()
                    for pidfd in children:
                        os.close(pidfd)
                    conn.close()
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    return request
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                sel.register(pidfd, selectors.EVENT_READ, "child")
                try:
                    _send(conn, {"pid": pid})
                except OSError:
                    pass
            elif key.data == "child":
                pidfd = key.fd
                pid, conn = children.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()


def _command(request: dict[str, Any], base_path: list[str]) -> int:
    """In the forked child: become ``python -m quern ARGS`` for ``request``; its exit status."""
    import importlib
    import runpy
    import traceback

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *(os.path.abspath(p) for p in extra), *base_path]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    sys.argv = ["-m", *request["args"]]
    try:
        runpy.run_module("quern", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _main() -> None:
    """The server program: ``python cli_server.py SOCKET_PATH LIFELINE_FD``."""
    path, lifeline = sys.argv[1], int(sys.argv[2])
    base_path = sys.path[1:]  # the interpreter's own, without this file's folder
    request = _serve(path, lifeline)
    assert request is not None
    sys.exit(_command(request, base_path))


# --------------------------------------------------------------------------- the client


def _server() -> str | None:
    """This process's server's socket path (started on first use), or ``None`` where it cannot run."""
    with _LOCK:
        if "path" in _SERVER and _SERVER["proc"].poll() is None:
            return _SERVER["path"]
        if _SERVER.get("failed"):
            return None
        folder = tempfile.mkdtemp(prefix="quern-cli-")
        path = os.path.join(folder, "s")
        read_end, write_end = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), path, str(read_end)],
            pass_fds=[read_end],
            env=env,
            cwd=folder,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        os.close(read_end)
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "READY":
            proc.kill()
            proc.wait()
            os.close(write_end)
            _SERVER["failed"] = True
            return None
        _SERVER.update(proc=proc, path=path, lifeline=write_end)

        def stop() -> None:
            os.close(write_end)  # the server kills what still runs and exits
            proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()
            shutil.rmtree(folder, ignore_errors=True)

        atexit.register(stop)
        return path


def run(
    args: list[str], cwd: Any = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """``python -m quern ARGS`` (``args`` without the interpreter), as ``subprocess.run`` with captured text output.

    Through the fork server where it runs (:func:`enabled`), else a fresh interpreter.

    Raises:
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds (and was killed).
    """
    path = _server() if enabled() else None
    if path is None:
        return subprocess.run(
            [sys.executable, "-m", "quern", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    request = {
        "args": list(args),
        "cwd": os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd()),
        "env": dict(os.environ if env is None else env),
    }
    with (
        open(os.devnull, "rb") as stdin,
        tempfile.TemporaryFile() as stdout,
        tempfile.TemporaryFile() as stderr,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock,
    ):
        sock.connect(path)
        _send(sock, request, [stdin.fileno(), stdout.fileno(), stderr.fileno()])
        sock.settimeout(timeout)
        pid = _recv(sock)[0]["pid"]
        try:
            status = _recv(sock)[0]["returncode"]
        except TimeoutError:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
            sock.settimeout(30)
            _recv(sock)
            raise subprocess.TimeoutExpired([sys.executable, "-m", "quern", *args], timeout) from None
        outs = []
        for f in (stdout, stderr):  # decoded as subprocess.run(text=True) does
            f.seek(0)
            outs.append(f.read().decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n"))
    return subprocess.CompletedProcess([sys.executable, "-m", "quern", *args], status, outs[0], outs[1])


if __name__ == "__main__":
    _main()
