"""The programs of the fork server and of a worker process (see
:mod:`quern.pipeline.workers` for the parent's side).

The **fork server** (:func:`serve`) is a fresh interpreter that the parent
starts once per iterator. It imports what the workers need (numpy and quern,
then the reader modules of the pipeline's sources: pyarrow.parquet, ...), loads
the pipeline from shared memory, says so, and then forks a worker whenever the
parent asks (at start-up, and to replace one that died), reaps them and
reports how each one ended. It computes nothing itself. It forks only while it
has no thread besides those of the modules it imported before loading the
pipeline (numpy's BLAS threads, pyarrow's allocator thread, which handle
``fork``), and checks that it is the parent's definition (a module global changed
at run time in the parent is seen here with its value at import: the server then
reports a :class:`Fatal` error naming it, which the parent raises, instead of
computing other batches; see :mod:`quern.pipeline.samedef`); if loading the
pipeline started a thread (a transform's module, say),
each worker is started as a fresh interpreter instead (:func:`main`), which is
slower but never forks a multi-threaded process. When the parent closes its
socket (or dies), the server kills and reaps every worker, then exits; a
forked worker also dies with the server (``PR_SET_PDEATHSIG``).

A **worker** computes the tasks the parent sends over its own socket: for each
step of a task (records read in one bulk call for the whole task), the batch is
pickled with its arrays out of band, the arrays are copied into the
shared-memory slot the parent chose, and the parent is told. A step that fails
is reported with its traceback; the worker goes on with the next one. A worker
ends (``os._exit``) when the parent closes its socket or goes away.
"""

from __future__ import annotations

import functools
import gc
import importlib
import io
import os
import pickle
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

from . import execute, samedef, shm
from .errors import StepError, exit_if_forked
from .lookahead import cache_counts
from .messages import Done, Drop, ErrorReport, Exited, Failed, Fatal, Fork, Forked, Init, Kill, Ready, Task
from .timing import SEND, Clock, report_stage_on_signal

__all__ = ["main", "serve"]

_PR_SET_PDEATHSIG = 1  # prctl option: the signal a process gets when its parent dies


def _setup_process() -> None:
    """What every process of a worker pool starts with: Ctrl-C ignored (the parent
    handles it and stops the pool), and whole lines written as they come, so that
    what a transform prints is not lost when a worker is killed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except Exception:
        pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _load(init: Init, fds: list[int], where: str) -> tuple[shm.Buffer, Any]:
    """The shared buffer of the pipeline (mapped copy-on-write: its arrays are
    writable here, and nobody else sees the writes) and the pipeline loaded from it:
    its pickle is the buffer's first span, its large arrays the others. The pipeline
    is checked to be the parent's definition (:func:`quern.pipeline.samedef.check_sent`:
    ``FingerprintError`` naming what differs, sent to the parent as :class:`Fatal`);
    ``where`` names this process in that message."""
    definition = shm.Buffer(fds[0], init.size, private=True, keep_fd=True)
    (start, n), spans = init.spans[0], init.spans[1:]
    pipe = shm.loads(definition.view(start, n), definition, spans, copy=False)
    samedef.check_sent(pipe, where)
    return definition, pipe


# --------------------------------------------------------------------------- a worker started as a fresh interpreter


def main(fd: int, init_fd: int) -> None:
    """Entry point of a worker started as a fresh interpreter; ``fd`` is its socket to
    the parent, ``init_fd`` a socket on which the fork server has sent it the
    :class:`Init` message. Ends the process (``os._exit``) when the parent closes
    the socket or goes away."""
    _setup_process()
    os.set_inheritable(fd, False)  # a process a transform starts must not hold the parent's socket
    sock = socket.socket(fileno=fd)

    def work() -> None:
        with socket.socket(fileno=init_fd) as from_server:
            init, fds = shm.recv(from_server)
        if not isinstance(init, Init):
            raise RuntimeError(f"expected the Init message first, got {type(init).__name__}")
        try:
            definition, pipe = _load(init, fds, "the worker (a fresh interpreter)")
            definition.drop_fd()
        except BaseException as e:
            shm.send(sock, Fatal(f"{type(e).__name__}: {e}", traceback.format_exc()))
            return
        _serve_tasks(sock, pipe, init.process_index, init.process_count)

    _work_then_exit(work)


def _work_then_exit(work: Callable[[], None]) -> NoReturn:
    """Run a worker's ``work``, then end the process (``os._exit``): status 0 when the
    parent closed the socket or went away, what ``sys.exit`` asked for when a transform
    called it, 1 (with the traceback printed) on any other error."""
    status = 0
    try:
        work()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent closed the iterator or exited
    except SystemExit as e:  # a transform called sys.exit: the worker ends as it asked
        status = _exit_status(e)
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        _flush()
        os._exit(status)  # not even a non-daemon thread a transform started keeps a worker alive


def _exit_status(e: SystemExit) -> int:
    """The exit status ``sys.exit(code)`` asks for (a message is printed, status 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def _serve_tasks(sock: socket.socket, pipe: Any, index: int, count: int) -> None:
    """Say the worker is ready, then compute the tasks the parent sends, until end of file."""
    me = os.getpid()
    report_stage_on_signal()  # step_timeout: the parent may ask where a stuck step is
    shm.send(sock, Ready(me))
    slots: dict[int, shm.Buffer] = {}
    reported = cache_counts(pipe)  # the disk caches' counters the parent has (its own reads are not ours)
    while True:
        msg, _ = shm.recv(sock)
        if isinstance(msg, Drop):  # slots the parent no longer needs
            for slot in msg.slots:
                if slot in slots:
                    slots.pop(slot).close()
            continue
        if not isinstance(msg, Task):
            raise RuntimeError(f"unexpected message {type(msg).__name__} from the parent")
        timings: dict[str, float] | None = {} if msg.timed else None
        clock = Clock(timings)
        t0 = time.perf_counter()
        results = execute.step_results(pipe, msg.steps, index, count, timings)
        last = msg.steps[-1]
        for (step, batch, error), slot in zip(results, msg.slots):
            exit_if_forked(me, "worker process")  # a transform's forked child came back here: it must not answer
            clock.t = time.perf_counter()
            if error is None:
                try:
                    data, buffers = shm.dumps(batch, _pickle_for_parent)
                except Exception as e:
                    error = StepError(
                        f"step {step} (host {index} of {count}), stage 'send': the batch cannot be pickled "
                        f"to send it to the parent: {type(e).__name__}: {e}"
                    )
                    error.__cause__ = e
            if error is not None:
                shm.send(sock, Failed(step, _error_report(error)))
                continue
            spans, size = shm.layout(buffers)
            fds = []
            if slot not in slots or slots[slot].size < size:
                if slot in slots:
                    slots[slot].close()
                slots[slot] = shm.Buffer.create(size)
                fds = [slots[slot].fd]
            shm.write(slots[slot], buffers, spans)
            clock.lap(SEND)
            if step == last:  # the task's figures travel with its last batch: one small tuple per task
                spent = tuple(timings.items()) if timings is not None else ()
                seconds = time.perf_counter() - t0
                now = cache_counts(pipe)
                grew = tuple((k, v - reported[k]) for k, v in now.items() if v != reported[k])
                reported = now
                done = Done(step, slot, data, spans, slots[slot].size, spent, seconds, len(msg.steps), grew)
                shm.send(sock, done, fds)
            else:
                shm.send(sock, Done(step, slot, data, spans, slots[slot].size), fds)
            slots[slot].drop_fd()  # sent: the mapping is all this process needs


# --------------------------------------------------------------------------- the fork server


def serve(fd: int) -> None:
    """Entry point of the fork server; ``fd`` is its socket to the parent. Ends the
    process, after killing and reaping every worker it started, when the parent
    closes the socket or goes away."""
    _setup_process()
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
            _flush()
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
            self.definition, self.pipe = _load(init, fds, "the fork server")
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
        """Start worker ``msg.worker`` on the socket ``fds[0]``: forked from this process,
        or, if it has more threads than before it loaded the pipeline (or any Python
        thread besides the main one), as a fresh interpreter."""
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
        _flush()  # nothing buffered here is written twice
        with warnings.catch_warnings():
            # Python >= 3.12 warns when a process with threads forks; this one's are the BLAS and
            # allocator threads of numpy and pyarrow (checked above), which prepare for fork
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid:
            return pid
        _work_then_exit(functools.partial(self._forked, fd, server))  # it never returns into the server's code

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
        _serve_tasks(socket.socket(fileno=fd), self.pipe, self.init.process_index, self.init.process_count)

    def spawn(self, fd: int) -> int:
        """A worker as a fresh interpreter, which gets the pipeline on a socket of its own."""
        assert self.init is not None and self.definition is not None
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            shm.send(mine, self.init, [self.definition.fd])  # small: it waits in the socket
            code = (
                f"import sys; sys.path[:] = {sys.path!r}; "
                f"from quern.pipeline.worker_main import main; main({fd}, {theirs.fileno()})"
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


# --------------------------------------------------------------------------- batches and errors for the parent


class _ParentPickler(pickle.Pickler):
    """Pickles classes of ``__main__`` by name, so that a batch or an exception whose
    class the user's script defines is rebuilt in the parent with the parent's class
    (a worker's ``__main__`` is not the script; cloudpickle rebuilt those classes by value)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) and obj.__module__ == "__main__":
            return _from_main, (obj.__qualname__,)
        return NotImplemented


def _from_main(qualname: str) -> Any:
    return functools.reduce(getattr, qualname.split("."), sys.modules["__main__"])


def _pickle_for_parent(obj: Any, protocol: int = 5, buffer_callback: Callable[[Any], Any] | None = None) -> bytes:
    out = io.BytesIO()
    _ParentPickler(out, protocol=protocol, buffer_callback=buffer_callback).dump(obj)
    return out.getvalue()


def _error_report(error: BaseException) -> ErrorReport:
    """(message, traceback text, pickled exception or None) of a failed step."""
    tb = "".join(traceback.format_exception(error))
    try:  # the user's own exception, for ``__cause__`` in the parent
        cause = _pickle_for_parent(error.__cause__ or error)
    except Exception:
        cause = None
    return ErrorReport(str(error), tb, cause)
