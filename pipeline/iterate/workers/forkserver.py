"""The program of the fork server: one fresh interpreter that forks a pool's workers.

The parent starts it once per pool (:class:`~quern.pipeline.iterate.workers.handles.ServerHandle`).
It imports what the workers need (the reader modules of the pipeline's sources),
loads the pipeline from shared memory, checks that it is the parent's definition,
says so (:class:`Ready`, or :class:`Fatal`), and then starts a worker whenever
the parent asks (:class:`Fork`): forked from itself while it has no thread
besides those it had before loading the pipeline, else as a fresh interpreter
(:func:`quern.pipeline.iterate.workers.worker.main`). It reaps its workers and reports
how each ended (:class:`Exited`); it computes nothing itself. When the parent
closes its socket (or dies), it kills and reaps every worker, then exits. The
design: ``docs/design/workers.md``.
"""

from __future__ import annotations

import functools
import gc
import importlib
import os
import selectors
import signal
import socket
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from . import shm
from .messages import Exited, Fatal, Fork, Forked, Init, Kill, Ready
from .worker import flush, load_pipeline, serve_tasks, setup_process, work_then_exit

__all__ = ["serve"]

_PR_SET_PDEATHSIG = 1  # prctl option: the signal a process gets when its parent dies


def serve(fd: int) -> None:
    """Run the fork server; it ends the process (``os._exit``).

    The process ends, after killing and reaping every worker it started, when the
    parent closes the socket or goes away: status 0, or 1 (with the traceback
    printed) on an error of its own.

    Args:
        fd: The fork server's socket to the parent.
    """
    setup_process()
    os.set_inheritable(fd, False)
    server = _ForkServer(socket.socket(fileno=fd))
    status = 0
    try:
        server.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent closed the iterator or exited
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        try:
            server.end_children()
        finally:
            flush()
            os._exit(status)


def _thread_count() -> int:
    """Threads of this process, native ones included."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # pragma: no cover - no /proc: Python's threads only
        return threading.active_count()


def _ignore(signum: int, frame: object) -> None:
    """SIGCHLD handler: nothing to do; the signal wakes the server through its wake-up descriptor."""


class _ForkServer:
    """The fork server's state: its socket to the parent, the loaded pipeline, its children."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.children: dict[int, int] = {}  # pid -> serial, of the workers not yet reaped
        self.definition: shm.Buffer | None = None
        self.pipe: Any = None
        self.init: Init | None = None
        self.threads = 1  # threads before the pipeline was loaded: forking is safe with these
        self.selector: selectors.BaseSelector | None = None
        self.wake: tuple[int, int] | None = None
        self.prctl: Callable[..., int] | None = None

    def run(self) -> None:
        init, fds = shm.recv(self.sock)
        if not isinstance(init, Init):
            raise RuntimeError(f"expected the Init message first, got {type(init).__name__}")
        self.init = init
        try:
            for name in init.preload:  # the readers the sources import when they first read
                try:
                    importlib.import_module(name)
                except Exception:
                    pass  # a source that needs it imports it, and fails, by itself
            try:
                import ctypes

                self.prctl = ctypes.CDLL(None, use_errno=True).prctl
            except Exception:  # pragma: no cover - no libc prctl: workers still end with their socket
                self.prctl = None
            self.threads = _thread_count()
            self.definition, self.pipe = load_pipeline(init, fds, where="the fork server")
        except BaseException as e:
            shm.send(self.sock, Fatal(f"{type(e).__name__}: {e}", traceback.format_exc()))
            return
        gc.freeze()  # what is loaded now is never collected: fewer pages copied into the forked workers
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.wake = (r, w)
        signal.set_wakeup_fd(w)
        signal.signal(signal.SIGCHLD, _ignore)  # a Python handler, so that SIGCHLD wakes the selector
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.selector.register(r, selectors.EVENT_READ)
        shm.send(self.sock, Ready(os.getpid()))
        while True:
            self.reap()
            for key, _ in self.selector.select():
                if key.fileobj == r:
                    try:
                        while os.read(r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                msg, fds = shm.recv(self.sock)
                if isinstance(msg, Fork):
                    self.start(msg, fds)
                elif isinstance(msg, Kill):
                    for fd in fds:
                        os.close(fd)
                    if msg.pid in self.children:  # not reaped yet, so the pid is still this child's
                        os.kill(msg.pid, signal.SIGKILL)
                else:
                    raise RuntimeError(f"unexpected message {type(msg).__name__} from the parent")

    def reap(self) -> None:
        """Tell the parent how each worker that ended did."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.children.pop(pid, None) is not None:
                shm.send(self.sock, Exited(pid, os.waitstatus_to_exitcode(status)))

    def start(self, msg: Fork, fds: list[int]) -> None:
        """Start worker ``msg.worker`` on the socket ``fds[0]``, and tell the parent its pid.

        It is forked from this process, or started as a fresh interpreter if this
        process has more threads than before it loaded the pipeline (or any Python
        thread besides the main one).
        """
        fd, rest = fds[0], fds[1:]
        for extra in rest:
            os.close(extra)
        try:
            if _thread_count() > self.threads or threading.active_count() > 1:
                pid = self.spawn(fd)
            else:
                pid = self.fork(fd)
        finally:
            os.close(fd)  # the worker has its own; a copy here would hide the parent's end of file from it
        self.children[pid] = msg.serial
        shm.send(self.sock, Forked(msg.serial, pid))

    def fork(self, fd: int) -> int:
        assert self.init is not None and self.wake is not None and self.selector is not None
        server = os.getpid()
        flush()  # nothing buffered here is written twice
        with warnings.catch_warnings():
            # Python >= 3.12 warns when a process with threads forks; this one's are the BLAS and
            # allocator threads of numpy and pyarrow (checked above), which prepare for fork
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid:
            return pid
        work_then_exit(functools.partial(self._forked, fd, server))  # it never returns into the server's code

    def _forked(self, fd: int, server: int) -> None:
        """The forked worker: drop what is the server's, then compute the parent's tasks."""
        assert self.init is not None and self.wake is not None and self.selector is not None
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        for w in self.wake:
            os.close(w)
        self.sock.close()
        if self.definition is not None:
            self.definition.drop_fd()
        if self.prctl is not None:
            self.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with the fork server
        if os.getppid() != server:  # it died before that: so do we
            os._exit(0)
        self.children.clear()
        serve_tasks(
            socket.socket(fileno=fd),
            self.pipe,
            process_index=self.init.process_index,
            process_count=self.init.process_count,
            library_threads=self.init.library_threads,
        )

    def spawn(self, fd: int) -> int:
        """A worker as a fresh interpreter, which gets the pipeline on a socket of its own."""
        assert self.init is not None and self.definition is not None
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            shm.send(mine, self.init, fds=[self.definition.fd])  # small: it waits in the socket
            code = (
                f"import sys; sys.path[:] = {sys.path!r}; "
                f"from quern.pipeline.iterate.workers.worker import main; main({fd}, {theirs.fileno()})"
            )
            os.set_inheritable(fd, True)
            os.set_inheritable(theirs.fileno(), True)
            return os.posix_spawn(sys.executable, [sys.executable, "-c", code], os.environ)
        finally:
            mine.close()
            theirs.close()

    def end_children(self) -> None:
        """Kill every worker and wait until each is gone."""
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(self.children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            del self.children[pid]
