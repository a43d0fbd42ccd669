"""Worker processes: each computes whole steps and hands them over in shared memory.

The parent (:class:`WorkerPool`, driven by the iterator) sends worker ``w`` the
steps ``s`` with ``s % W == w``, in tasks of its steps. The worker reads the
records of the whole task in one bulk read, then for each step runs the record
transforms, collates, runs the batch transforms, copies the batch's arrays into
the shared-memory slot the parent chose for that step and tells the parent. The
parent yields the steps in order; the arrays it yields are views into the slot,
which it *lends* to the caller: the slot goes back to its worker only once no
array of that batch is alive any more (a ``weakref.ref`` on the arrays' common
base, whose callback is a C function), so a batch you hold is never
overwritten, and no copy is made. Which process computed a step never changes
its bytes: every step is a pure function of the pipeline, the step and the host
slice. **No step is ever computed in the parent**: a transform that crashes its
process (a segfault, ``os._exit``, ``sys.exit``) takes a worker down, never the
training process.

Start-up: the parent starts one **fork server** per pool, a fresh interpreter
(``sys.executable``, never a fork of the parent: forking a process that runs
JAX, XLA or other threads can deadlock the child on a lock held by a thread
that does not exist in it). The server imports numpy and quern (and the reader
module of each of the pipeline's sources: pyarrow.parquet, array_record or
tensorstore, see :data:`READERS`), loads
the pipeline once, and forks the workers from itself, on demand: at start-up
and to replace a worker that died (see :mod:`quern.pipeline.worker_main`). So
one interpreter starts, however many workers, and a replacement starts in
milliseconds. The pipeline is sent with cloudpickle (so lambdas and functions
of ``__main__`` work); its large arrays (an ``ArraySource``'s data) are copied
once into shared memory that every worker maps copy-on-write (not once per
worker, not through the pipe), and sources open their files lazily in the
worker. The parent starts the server before it pickles the pipeline, and sends
a worker its tasks as soon as ``next()`` asks, even before the worker exists
(they wait in its socket), so that the first batch comes as soon as a worker can
compute it. Task sizes ramp up (1, 2, 4, 8, ... steps, up to
``read_ahead``), so that the first batches come one by one and the bulk reads
follow. Transforms must not depend on process-global
settings that a fresh interpreter does not share (a jax config flag set by the
script, say). The server and workers run with ``JAX_PLATFORMS=cpu`` so that a
transform importing jax never claims an accelerator, in their own process
group (a Ctrl-C at the terminal reaches the parent only), with stdout
line-buffered (what a transform prints arrives whole and is not lost when a
worker is stopped). The parent keeps one descriptor per shared-memory slot; it
raises its soft limit of open files if needed (or, with the default
``read_ahead``, makes tasks smaller to fit).

Faults: a worker that dies (a signal, the OOM killer, a crash in native code,
``os._exit``) is replaced and the steps it had not delivered are computed again,
by workers; one that dies :data:`_MAX_DEATHS` times in a row without delivering
a step raises :class:`WorkerError` at its next step. A step whose transform
raises is reported to the parent with the worker's traceback and raised there
when the iterator reaches that step. The server and workers ignore SIGINT (the
parent handles Ctrl-C and closes them). When the parent closes the pool the
server kills and reaps every worker and exits; when the parent dies, the server
and the workers see their sockets close and exit (and a forked worker dies with
its server). A worker that the fork server reports ended is replaced even
while its socket stays open (a process that a transform forked holds a copy of
it); a process that a transform forked and that comes back from the transform
into the worker's code ends at once, saying so on stderr
(:func:`quern.pipeline.errors.exit_if_forked`), so that it never computes or
answers in the worker's place.

Deadlines (``pipe.iterator(step_timeout=T)``): when :meth:`WorkerPool.get` has
waited ``T`` seconds for a step (not counting the time its worker spent
starting), the worker is sent :data:`~quern.pipeline.timing.STAGE_SIGNAL`; its
handler answers with the step and stage its main thread is in (read from the
frames, :func:`quern.pipeline.timing.stage_now`) on a datagram socket that every
process of the pool inherits, without disturbing it. The worker is then killed
(through the fork server) and replaced, and :class:`StepTimeoutError` names the
step, host slice, stage (or that the worker did not answer within
:data:`_STAGE_GRACE` seconds: native code that holds the GIL) and timeout; its
undelivered steps go to the new worker, so asking for the step again retries it.

Processes: a pool belongs to the process that made it. In a process forked
from that one (``os.fork``, multiprocessing's "fork"), :meth:`WorkerPool.forget`
drops the copy without a message or a signal to the processes, which are the
other process's.
"""

from __future__ import annotations

import collections
import os
import pickle
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from . import execute, shm
from .errors import StepError, StepTimeoutError, WorkerError
from .index import host_rows
from .messages import Done, Drop, ErrorReport, Exited, Failed, Fatal, Fork, Forked, Init, Kill, Ready, Span, Task
from .timing import HANDOVER, MAX_WINDOW, STAGE_FD_ENV, STAGE_SIGNAL, add, ema

__all__ = ["WorkerPool", "WorkerError", "sigint_deferred"]

_MAX_DEATHS = 3  # a worker dying this many times in a row without delivering a step is an error
_ARRAY_INLINE_BYTES = 1 << 16  # pipeline arrays smaller than this travel inside the pickle
TASK_RECORDS = 16384  # default task: about this many records read in one bulk call...
MAX_TASK_STEPS = 64  # ...but at most this many steps
SHARED_MEMORY_BUDGET = 256 << 20  # ...and the default task size keeps all slots within this
# The module each kind of source imports when it first reads: the fork server imports those of
# the pipeline's sources before it loads the pipeline, so that no forked worker pays for them.
READERS = {
    "ArrayRecordSource": "array_record.python.array_record_module",
    "ParquetSource": "pyarrow.parquet",
    "TensorStoreSource": "tensorstore",
}
_EXIT_GRACE = 1.0  # seconds a worker whose socket closed has to end by itself before it is killed
_SERVER_STOP = 10.0  # seconds the fork server has to stop its workers and exit before it is killed
_STAGE_GRACE = 2.0  # step_timeout: seconds a stuck worker has to say where it is before it is killed


class _SigintDeferred:
    """See :func:`sigint_deferred`."""

    def __init__(self) -> None:
        self._old: Any = None
        self._got: list[tuple[int, Any]] = []

    def __enter__(self) -> _SigintDeferred:
        if threading.current_thread() is not threading.main_thread():
            return self  # KeyboardInterrupt is raised in the main thread only
        try:
            old = signal.getsignal(signal.SIGINT)
            if not callable(old):
                return self  # SIG_IGN or SIG_DFL: no Python code runs on Ctrl-C
            got = self._got

            def hold(signum: int, frame: Any) -> None:
                got.append((signum, frame))

            signal.signal(signal.SIGINT, hold)
        except ValueError:  # not the main interpreter
            return self
        self._old = old
        return self

    def __exit__(self, *exc: object) -> None:
        old, self._old = self._old, None
        if old is None:
            return
        signal.signal(signal.SIGINT, old)
        if self._got:  # the Ctrl-C that came meanwhile, now (KeyboardInterrupt by default)
            old(*self._got[0])


def sigint_deferred() -> _SigintDeferred:
    """A context manager: inside the block, a Ctrl-C (SIGINT) cannot interrupt the
    main thread; the SIGINT handler runs when the block ends (by default raising
    ``KeyboardInterrupt`` there), once, if a Ctrl-C came meanwhile. For the short
    critical sections that must run to the end once started (stopping the workers,
    a message to the fork server). Nests; a no-op outside the main thread (no
    ``KeyboardInterrupt`` is raised there) or when SIGINT has no Python handler."""
    return _SigintDeferred()


class _Delivered(NamedTuple):
    """A step's batch waiting in ``worker``'s slot ``slot``."""

    worker: _Worker
    slot: int
    data: bytes
    spans: list[Span]


class _Copied(NamedTuple):
    """A step's batch copied out of the slot of a worker that has died since."""

    batch: Any


class _StepFailed(NamedTuple):
    """A step that raised in worker ``index`` (process ``pid``)."""

    worker_index: int
    pid: int | None
    report: ErrorReport


_Result = _Delivered | _Copied | _StepFailed


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class _Server:
    """The parent's handle on a fork server (see :mod:`quern.pipeline.worker_main`)."""

    def __init__(self) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # where a stuck worker says it is (step_timeout): datagrams, which never mix, from any worker
        stages, their_stages = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        stages.setblocking(False)
        their_stages.setblocking(False)  # a worker's answer never blocks it (the flag is shared with its copies)
        code = (
            f"import sys; sys.path[:] = {sys.path!r}; "
            f"from quern.pipeline.worker_main import serve; serve({child_sock.fileno()})"
        )
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env[STAGE_FD_ENV] = str(their_stages.fileno())
        try:  # its own process group (which its workers share): a Ctrl-C at the terminal goes to the parent only
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code],
                pass_fds=[child_sock.fileno(), their_stages.fileno()],
                env=env,
                process_group=0,
            )
        except BaseException:
            parent_sock.close()
            stages.close()
            raise
        finally:
            child_sock.close()
            their_stages.close()
        self.sock = parent_sock
        self.stages = stages
        self.ready = False  # it has loaded the pipeline
        self.dead = False  # its socket reached end of file
        self.serial = 0  # workers asked of it
        self.pids: dict[int, int] = {}  # serial -> pid of that worker
        self.exits: dict[int, int] = {}  # pid -> how that worker ended (Popen.returncode)
        self.orphans: set[int] = set()  # serials of workers given up on before their pid was known

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: object, fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send ``msg``, never half of it (Ctrl-C waits); a dead server is marked dead."""
        if self.dead:
            return
        try:
            with sigint_deferred():
                shm.send(self.sock, msg, fds)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.dead = True

    def fork(self, index: int, fd: int) -> int:
        """Ask for worker ``index`` on socket ``fd``; its serial number."""
        self.serial += 1
        self.send(Fork(index, self.serial), [fd])
        return self.serial

    def kill(self, serial: int) -> None:
        """SIGKILL the ``serial``-th worker (as soon as its pid is known)."""
        pid = self.pids.get(serial)
        if pid is None:
            self.orphans.add(serial)
        elif pid not in self.exits:
            self.send(Kill(pid))

    def handle(self, msg: object) -> None:
        if isinstance(msg, Ready):
            self.ready = True
        elif isinstance(msg, Forked):
            self.pids[msg.serial] = msg.pid
            self.exits.pop(msg.pid, None)  # an earlier worker's pid, now reused: that one was reaped before
            if msg.serial in self.orphans:
                self.orphans.discard(msg.serial)
                self.send(Kill(msg.pid))
        elif isinstance(msg, Exited):
            self.exits[msg.pid] = msg.code

    def exit_text(self) -> str:
        return _exit_text(self.proc.poll())

    def close(self) -> None:
        """Stop the server, which first kills and reaps its workers. Idempotent."""
        self.sock.close()
        self.stages.close()
        if self.proc.returncode is not None:
            return
        if not self.ready:  # still loading the pipeline, so no worker forked yet: no need to wait for it
            self.proc.kill()
        try:
            self.proc.wait(_SERVER_STOP)
        except subprocess.TimeoutExpired:  # pragma: no cover - a server that does not answer
            self.proc.kill()  # its forked workers die with it (PR_SET_PDEATHSIG)
            self.proc.wait()

    def forget(self) -> None:
        """This copy, in a forked child of the parent: close its descriptors, nothing else."""
        self.sock.close()
        self.stages.close()
        self.proc.returncode = 0  # not this process's child: never waited for (nor warned about) here


class _Worker:
    """The parent's handle on one worker process (forked by the fork server)."""

    def __init__(self, index: int, server: _Server):
        self.index = index
        self.server = server
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.serial = server.fork(index, child_sock.fileno())
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()  # the server has it now (or will never: then this end reads end of file)
        self.sock = parent_sock
        self.ready = False
        self.ready_at = 0.0  # when it said it was ready (time.monotonic()): a step's deadline runs from then
        self.slots: dict[int, shm.Buffer] = {}  # slot id -> this process's mapping of it
        self.slot_of: dict[int, int] = {}  # step -> slot, for steps sent and not yet taken
        self.free: list[int] = []  # slot ids not in use
        self.next_slot = 0  # slot ids ever made
        self.pending: list[int] = []  # steps sent and not yet delivered, in order
        self.tasks = 0  # tasks sent to it: its next task has 1, 2, 4, 8, ... steps, up to read_ahead

    @property
    def pid(self) -> int | None:
        """Its process id, once the fork server has said."""
        return self.server.pids.get(self.serial)

    @property
    def exit_code(self) -> int | None:
        pid = self.pid
        return None if pid is None else self.server.exits.get(pid)

    def exit_text(self) -> str:
        if self.exit_code is None and self.server.dead:
            return f"ended with its fork server, which {self.server.exit_text()}"
        return _exit_text(self.exit_code)

    def assign(self, step: int) -> int:
        """A free slot for ``step`` (a new slot id when none is free)."""
        if self.free:
            slot = self.free.pop()
        else:
            slot, self.next_slot = self.next_slot, self.next_slot + 1
        self.slot_of[step] = slot
        return slot

    def release(self, step: int) -> None:
        """``step`` has been copied out (or failed): its slot is free again."""
        slot = self.slot_of.pop(step, None)
        if slot is not None:
            self.free.append(slot)

    def close(self) -> None:
        """Close the socket (the worker reads end of file and exits) and unmap its slots. Idempotent."""
        try:
            self.sock.close()
        finally:
            for buf in self.slots.values():
                buf.close()
            self.slots.clear()


class WorkerPool:
    """``num_workers`` processes computing the steps of ``pipe`` for one host slice.

    :meth:`get` returns the batch of a step; the caller asks for consecutive steps
    (asking again for a step that raised retries it). Each worker gets tasks of
    its steps, growing from 1 step to ``read_ahead`` (1, 2, 4, 8, ...), with at most
    ``prefetch * read_ahead`` steps in flight, so shared memory holds at most
    ``num_workers * prefetch * read_ahead`` batches in flight (each worker's
    slots, reused) plus the batches the caller holds (lent slots). ``copy=True``
    copies each batch out of its slot instead (``pipe.iterator(copy_batches=True)``).
    ``read_ahead=None`` picks about :data:`TASK_RECORDS` records per task (at most
    :data:`MAX_TASK_STEPS` steps), lowered once the first batch's size is known so
    that the slots stay within :data:`SHARED_MEMORY_BUDGET`; until then tasks are
    one step. No step is ever computed in this process.
    """

    def __init__(
        self,
        pipe: execute.Definition,
        num_workers: int,
        process_index: int,
        process_count: int,
        prefetch: int,
        read_ahead: int | None,
        end: int | None,
        copy: bool = False,
        timed: bool = True,
    ) -> None:
        import cloudpickle  # not needed by a worker, which only unpickles

        self.pipe, self.end, self.copy = pipe, end, copy
        self.num_workers, self.prefetch = num_workers, prefetch
        self._auto = read_ahead is None
        if read_ahead is None:
            lo, hi = host_rows(pipe.batch_size or 0, process_index, process_count)
            read_ahead = execute.steps_per_read(hi - lo, TASK_RECORDS, MAX_TASK_STEPS)
        wanted = num_workers * (prefetch * read_ahead + 2)  # one descriptor per slot, plus spares
        room = _descriptor_room(wanted + MAX_WINDOW)  # and room for an adaptive prefetch window
        # steps per worker in flight: the prefetch tasks, and at most half the descriptors left for a window
        self._most_in_flight = prefetch * read_ahead + max(0, room - wanted) // 2 // num_workers
        if self._auto and room < wanted:
            read_ahead = max(1, (room // num_workers - 2) // prefetch)
        self.max_read_ahead: int = read_ahead
        self.read_ahead: int = 1 if self._auto else read_ahead  # until the size of a batch is known
        self.process_index, self.process_count = process_index, process_count
        self._pid = os.getpid()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._leases: dict[int, tuple] = {}  # id(weakref to a lent batch) -> (weakref, worker, slot)
        self._returned: collections.deque = collections.deque()  # leases whose batch died
        self._results: dict[int, _Result] = {}  # delivered steps not yet taken
        self._deaths = [0] * num_workers  # consecutive deaths without a delivered step
        self._server_deaths = 0  # consecutive deaths of the fork server without a delivered step
        self._sent: set[int] = set()  # steps sent to a worker and not yet delivered
        self._fatal: WorkerError | None = None  # the pipeline cannot be loaded: stop for good
        self._broken: dict[int, WorkerError] = {}  # worker index -> why it is not restarted
        self.delivered = [0] * num_workers  # steps each worker has delivered
        self.in_parent = 0  # steps computed in this process: always 0 (kept for stats())
        self.restarts = 0  # workers replaced after dying
        self.timed = timed  # workers send each step's stage timings
        self.timings: dict[str, float] = {}  # seconds per stage, summed over the workers' steps
        self.timed_steps = 0  # the steps of the tasks delivered whole (whose stage seconds are in timings)
        self.cache_counts: dict[str, int] = {}  # the workers' disk-cache counters, added up (lookahead.CACHE_COUNTS)
        self.load: float | None = None  # the workers' seconds per batch over their number (a moving average)
        self.ahead = 0  # batches the iterator wants in flight in all (its prefetch window); 0: prefetch tasks
        self.workers: list[_Worker | None] = [None] * num_workers
        self._server: _Server | None = None
        self._definition: shm.Buffer | None = None
        try:
            self._server = self._new_server()  # it starts (imports numpy...) while the pipeline is pickled
            try:
                data, buffers = shm.dumps(pipe, cloudpickle.dumps, _ARRAY_INLINE_BYTES)
            except Exception as e:
                raise TypeError(
                    f"num_workers={num_workers}: the pipeline cannot be sent to worker processes "
                    f"({type(e).__name__}: {e}); make its source and transforms picklable, or use num_workers=0"
                ) from e
            buffers.insert(0, pickle.PickleBuffer(data))
            spans, size = shm.layout(buffers)
            self._definition = shm.Buffer.create(size)  # shared by all workers, read-only there
            shm.write(self._definition, buffers, spans)
            self._init = Init(spans, size, process_index, process_count, _readers(pipe))
            self._server.send(self._init, [self._definition.fd])
            for w in range(num_workers):
                self._start(w)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ processes

    def _new_server(self) -> _Server:
        server = _Server()
        self._selector.register(server.sock, selectors.EVENT_READ, server)
        return server

    def _start(self, w: int) -> None:
        """Ask the fork server for worker ``w`` (tasks can be sent to it at once: they
        wait in its socket). Nothing happens while the server is being replaced."""
        server = self._server
        if server is None or server.dead:
            return
        with sigint_deferred():  # never a worker asked for and not tracked
            worker = _Worker(w, server)
            self.workers[w] = worker
            self._selector.register(worker.sock, selectors.EVENT_READ, worker)

    def _on_death(self, worker: _Worker, count: bool = True, restart: bool = True) -> None:
        """Keep what the dead worker delivered, forget what it had not, start another.

        ``count=False``: the parent itself stopped the worker (its message stream
        was interrupted half-way, by Ctrl-C say, or its fork server died), which is
        not the worker's fault. After ``_MAX_DEATHS`` deaths in a row without a
        delivered step, the worker is not restarted: :meth:`get` raises
        :class:`WorkerError` at its next step. ``restart=False``: none is started."""
        with sigint_deferred():  # never half-replaced
            self._replace(worker, count, restart)

    def _replace(self, worker: _Worker, count: bool, restart: bool) -> None:
        w = worker.index
        if self.workers[w] is worker:
            self.workers[w] = None  # first, so that an interruption below cannot leave it half-replaced
        try:
            self._selector.unregister(worker.sock)
        except (KeyError, ValueError):
            pass
        try:
            for step, r in list(self._results.items()):
                if isinstance(r, _Delivered) and r.worker is worker:
                    self._results[step] = _Copied(self._materialise(r, copy=True))
        finally:
            for step, r in list(self._results.items()):
                if isinstance(r, _Delivered) and r.worker is worker:
                    del self._results[step]  # not copied out (interrupted): computed again
            self._sent.difference_update(worker.pending)
            worker.close()
        server = worker.server
        if count:  # how it ended, for the error message
            self._await_exit(worker, _EXIT_GRACE)
        if worker.exit_code is None:  # still running, or not forked yet: make sure it ends
            server.kill(worker.serial)
            if count:
                self._await_exit(worker, _SERVER_STOP)
        if self._fatal is not None or not restart or server.dead:
            return
        self._deaths[w] += count
        if self._deaths[w] >= _MAX_DEATHS:
            self._broken[w] = WorkerError(
                f"worker {w} (pid {worker.pid}) {worker.exit_text()}; it died {self._deaths[w]} times in a row "
                f"without delivering a step (host {self.process_index} of {self.process_count}, "
                f"steps in progress: {worker.pending[:8] or 'none'}); see its output above"
            )
            self._deaths[w] = 0  # asking for the step again tries again
            return
        self.restarts += 1
        self._start(w)

    def _await_exit(self, worker: _Worker, timeout: float) -> None:
        """Handle the fork server's messages until it says how ``worker`` ended, or
        ``timeout`` seconds pass, or the server is gone."""
        server = worker.server
        deadline = time.monotonic() + timeout
        while worker.exit_code is None and not server.dead:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if _readable(server.sock, left):
                self._pump_server(server)

    def _revive(self) -> None:
        """If the fork server has died, account for its workers (gone with it) and
        start another server and workers; a server that dies before it has loaded
        the pipeline, or ``_MAX_DEATHS`` times in a row without a step delivered in
        between, stops the pool for good."""
        server = self._server
        if server is None or not server.dead or self._fatal is not None:
            return
        with sigint_deferred():  # never left without a server
            self._replace_server(server)

    def _replace_server(self, server: _Server) -> None:
        for worker in list(self.workers):
            if worker is not None and worker.server is server:
                self._on_death(worker, count=False, restart=False)
        self._server = None
        try:
            self._selector.unregister(server.sock)
        except (KeyError, ValueError):
            pass
        server.close()
        if not server.ready:
            self._fatal = WorkerError(
                f"worker processes could not start: their fork server (pid {server.pid}) {server.exit_text()} "
                "while loading the pipeline; see its output above"
            )
            return
        self._server_deaths += 1
        if self._server_deaths >= _MAX_DEATHS:
            self._fatal = WorkerError(
                f"the fork server of the worker processes (pid {server.pid}) {server.exit_text()}; it died "
                f"{self._server_deaths} times in a row without a step delivered in between"
            )
            return
        assert self._definition is not None and self._definition.fd >= 0, "the pool is closed"
        self._server = self._new_server()
        self._server.send(self._init, [self._definition.fd])
        for w in range(self.num_workers):
            if self.workers[w] is None and w not in self._broken:
                self.restarts += 1
                self._start(w)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every worker has started (True) or ``timeout`` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(w is not None and w.ready for w in self.workers):
            self._revive()
            self._raise_failures()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            for w, worker in enumerate(self.workers):
                if worker is None and w not in self._broken:
                    self._start(w)
            self._poll(1.0 if left is None else min(left, 1.0))
        return True

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers the fork server has started so far."""
        return [p for p in (w.pid for w in self.workers if w is not None) if p is not None]

    # ------------------------------------------------------------------ messages

    def _poll(self, timeout: float | None) -> None:
        """Handle every message that arrives within ``timeout`` seconds (0: only those waiting)."""
        events = self._selector.select(timeout)
        events.sort(key=lambda e: not isinstance(e[0].data, _Server))  # the server's news first
        for key, _ in events:
            if key.data is None:  # wake(): another thread wants next() to look up
                try:
                    while self._wake_r.recv(512):
                        pass
                except (BlockingIOError, OSError):
                    pass
                continue
            if isinstance(key.data, _Server):
                if key.data is self._server:
                    self._pump_server(key.data)
                continue
            worker: _Worker = key.data
            if self.workers[worker.index] is not worker:
                continue  # already replaced
            try:
                while True:
                    msg, fds = shm.recv(worker.sock)
                    try:
                        self._handle(worker, msg, fds)
                    finally:
                        for fd in fds:  # any that _handle did not take
                            os.close(fd)
                    if not _readable(worker.sock):
                        break
            except (EOFError, ConnectionResetError):
                self._on_death(worker)
            except BaseException:
                # interrupted half-way through a message (Ctrl-C): the stream may be out of
                # step, so this worker is replaced and its steps computed again
                if self.workers[worker.index] is worker:
                    self._on_death(worker, count=False)
                raise

    def _pump_server(self, server: _Server) -> None:
        """Handle the fork server's messages waiting now (never half of one: Ctrl-C waits)."""
        try:
            while True:
                with sigint_deferred():
                    msg, fds = shm.recv(server.sock)
                    for fd in fds:
                        os.close(fd)
                    if isinstance(msg, Fatal):  # it cannot load the pipeline: neither can any other
                        self._fatal = WorkerError(
                            f"worker processes could not start: their fork server (pid {server.pid}) could not "
                            f"load the pipeline: {msg.text}\n\nits traceback:\n{msg.traceback}"
                        )
                    server.handle(msg)
                if not _readable(server.sock):
                    return
        except (EOFError, OSError):
            server.dead = True
            try:
                self._selector.unregister(server.sock)
            except (KeyError, ValueError):
                pass

    def _handle(self, worker: _Worker, msg: object, fds: list[int]) -> None:
        if isinstance(msg, Ready):
            worker.ready = True
            worker.ready_at = time.monotonic()
            worker.server.pids.setdefault(worker.serial, msg.pid)  # the server's Forked may come later
        elif isinstance(msg, Fatal):  # a fresh-interpreter worker cannot load the pipeline: stop for good
            self._fatal = WorkerError(
                f"worker {worker.index} (pid {worker.pid}) could not start: {msg.text}\n\n"
                f"worker traceback:\n{msg.traceback}"
            )
            self._raise_failures()
        elif isinstance(msg, Done):
            if fds:
                if msg.slot in worker.slots:
                    worker.slots[msg.slot].close()
                worker.slots[msg.slot] = shm.Buffer(fds.pop(0), msg.size)
            if self._auto and self.read_ahead == 1 and self.max_read_ahead > 1:
                nbytes = msg.spans[-1][0] + msg.spans[-1][1] if msg.spans else 0
                fit = SHARED_MEMORY_BUDGET // (self.num_workers * self.prefetch * max(nbytes, 1))
                self.read_ahead = max(1, min(self.max_read_ahead, fit))
            add(self.timings, msg.timings)
            for k, v in msg.cache:
                self.cache_counts[k] = self.cache_counts.get(k, 0) + v
            if msg.task_steps:
                self.timed_steps += msg.task_steps
                self.load = ema(self.load, msg.seconds / msg.task_steps / self.num_workers)
            self._deliver(worker, msg.step, _Delivered(worker, msg.slot, msg.data, msg.spans))
        elif isinstance(msg, Failed):
            worker.release(msg.step)  # nothing was written to its slot
            self._deliver(worker, msg.step, _StepFailed(worker.index, worker.pid, msg.report))
        else:
            raise WorkerError(f"worker {worker.index} (pid {worker.pid}) sent an unknown message {type(msg).__name__}")

    def _deliver(self, worker: _Worker, step: int, result: _Result) -> None:
        if step not in worker.pending:  # raised out of _poll, which replaces the worker
            raise WorkerError(
                f"worker {worker.index} (pid {worker.pid}) sent the batch of step {step}, which it was not "
                f"computing (its steps in progress: {worker.pending[:8] or 'none'}): another process writes on its "
                "socket, most likely one that a transform forked (os.fork) and that came back into the worker's code "
                "instead of ending with os._exit(); the worker is replaced and its steps are computed again"
            )
        worker.pending.remove(step)
        self._sent.discard(step)
        self._results[step] = result
        self._deaths[worker.index] = 0
        self._server_deaths = 0
        self.delivered[worker.index] += 1

    # ------------------------------------------------------------------ scheduling

    def _dispatch(self, step: int) -> None:
        """Send every worker its next steps (from ``step`` on, not yet sent) while it
        has fewer than ``prefetch * read_ahead`` steps in flight (sent or delivered,
        and not yet taken), in tasks of 1, 2, 4, 8, ... steps up to ``read_ahead`` (a
        worker's first tasks are small, so its first batches come soon). A task
        shorter than that goes only at the end of the stream or when it holds
        ``step`` itself. A worker that is still starting gets its tasks too: they
        wait in its socket."""
        W, ra = self.num_workers, self.read_ahead
        limit = self.in_flight_limit()
        if self._returned:
            self._reclaim(limit)
        for worker in self.workers:
            if worker is None:
                continue
            room = limit - len(worker.slot_of)
            if room <= 0:
                continue
            first = step + (worker.index - step) % W
            hi = first + W * limit
            if self.end is not None:
                hi = min(hi, self.end)
            todo = [s for s in range(first, hi, W) if s not in self._sent and s not in self._results][:room]
            i = 0
            while i < len(todo):
                size = min(ra, 1 << min(worker.tasks, 30))
                task = todo[i : i + size]
                if len(task) < size and step not in task and (self.end is None or task[-1] + W < self.end):
                    break  # wait until a whole task's worth of slots is free
                i += len(task)
                worker.tasks += 1
                slots = [worker.assign(s) for s in task]
                worker.pending.extend(task)
                self._sent.update(task)
                try:
                    shm.send(worker.sock, Task(task, slots, self.timed))
                except (BrokenPipeError, ConnectionResetError):  # it died: _poll will see why
                    break
                except BaseException:  # Ctrl-C half-way through the message
                    self._on_death(worker, count=False)
                    raise

    def in_flight_limit(self) -> int:
        """Steps each worker may have in flight (sent or delivered, not yet taken):
        ``prefetch`` tasks of ``read_ahead`` steps, or ``ahead / num_workers`` when the
        iterator's window wants more (within the descriptors' room)."""
        base = self.prefetch * self.read_ahead
        want = -(-self.ahead // self.num_workers)
        return max(base, min(want, self._most_in_flight))

    def in_flight(self) -> tuple[int, int]:
        """``(steps delivered and not yet taken, steps sent to workers and not yet delivered)``."""
        return len(self._results), len(self._sent)

    def _reclaim(self, limit: int) -> None:
        """Take back the slots of lent batches that nobody holds any more; a worker
        keeps one spare slot beyond its ``limit`` in flight, the others are unmapped
        (here and in the worker), so memory held for batches once kept is given back."""
        touched = set()
        while self._returned:
            _, worker, slot = self._leases.pop(id(self._returned.popleft()))
            if self.workers[worker.index] is worker:
                worker.free.append(slot)
                touched.add(worker)
        for worker in touched:
            extra = min(len(worker.free), len(worker.free) + len(worker.slot_of) - limit - 1)
            if extra > 0:
                drop = [worker.free.pop() for _ in range(extra)]
                for slot in drop:
                    buf = worker.slots.pop(slot, None)
                    if buf is not None:
                        buf.close()
                try:
                    shm.send(worker.sock, Drop(drop))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # it died: _poll will see why

    def _raise_failures(self, w: int | None = None) -> None:
        """Raise the error that stops worker ``w`` (any worker when ``None``), if there is one."""
        if self._fatal is not None:
            raise WorkerError(*self._fatal.args)
        broken = [v for v in self._broken if w is None or v == w]
        if broken:
            raise self._broken.pop(broken[0])

    def get(self, step: int, stop: Callable[[], bool] | None = None, timeout: float | None = None) -> Any:
        """The batch of ``step``; steps must be asked for in order. A step delivered
        is returned even if its worker has failed since; otherwise the failure that
        stops its worker is raised here. ``stop()`` true: give up waiting
        (``RuntimeError``); :meth:`wake` makes a waiting ``get`` look at once.

        ``timeout`` (seconds): when the step has not come that long after this call
        (or after its worker said it was ready, if later: start-up is not counted),
        the worker computing it is asked where it is (:data:`_STAGE_GRACE` seconds to
        answer), killed and replaced, and :class:`StepTimeoutError` is raised; asking
        for the step again computes it again on the new worker."""
        w = step % self.num_workers
        began = time.monotonic()
        while True:
            self._poll(0)
            if step in self._results:
                t0 = time.perf_counter()
                batch = self._take(step)
                if self.timed:
                    self.timings[HANDOVER] = self.timings.get(HANDOVER, 0.0) + time.perf_counter() - t0
                return batch
            if stop is not None and stop():
                raise RuntimeError("iterator closed while next() was waiting for its batch")
            self._revive()
            self._raise_failures(w)
            self._reap_exited()
            if self.workers[w] is None:  # given up on after repeated deaths: try again
                self._start(w)
            self._dispatch(step)
            wait = 1.0
            worker = self.workers[w]
            if timeout is not None and worker is not None and worker.ready:
                left = max(began, worker.ready_at) + timeout - time.monotonic()
                if left <= 0:
                    self._time_out(worker, step, timeout)
                wait = min(wait, left)
            self._poll(wait)

    def _reap_exited(self) -> None:
        """Replace the workers that the fork server says have ended: their socket's end
        of file may never come while a process that a transform forked holds a copy of it."""
        for worker in list(self.workers):
            if worker is not None and worker.exit_code is not None and self.workers[worker.index] is worker:
                self._on_death(worker)

    def _time_out(self, worker: _Worker, step: int, timeout: float) -> None:
        """``step`` has not come within ``timeout`` seconds: ask ``worker`` where it is,
        kill it, start another in its place and raise :class:`StepTimeoutError`."""
        where = self._stage_report(worker)
        pid = worker.pid
        self._on_death(worker, count=False)  # killed through the fork server; its steps are sent again
        self._await_exit(worker, _SERVER_STOP)
        if where is None:
            where = (
                f"not answering (it ran no Python code within {_STAGE_GRACE:g} s of being asked where it was: "
                "stuck in native code?)"
            )
        else:
            where = f"stuck {where}"
        killed = "killed" if worker.exit_code is not None else "being killed"
        raise StepTimeoutError(
            f"step {step} (host {self.process_index} of {self.process_count}): no batch within step_timeout="
            f"{timeout:g} s; worker {worker.index} (pid {pid}) computing it was {where}; that worker was {killed} "
            "and a new one started in its place: next() again computes the step again (a transform that never "
            "returns will time out again), or close the iterator"
        )

    def _stage_report(self, worker: _Worker) -> str | None:
        """Where ``worker`` is (:func:`quern.pipeline.timing.stage_now` of its main
        thread), as it answers :data:`~quern.pipeline.timing.STAGE_SIGNAL` within
        :data:`_STAGE_GRACE` seconds; ``None`` when it does not."""
        server = worker.server
        if not server.dead and _readable(server.sock):
            self._pump_server(server)  # has it ended meanwhile (then its pid may not be its any more)?
        pid = worker.pid
        if pid is None or worker.exit_code is not None or server.dead:
            return None
        try:
            while server.stages.recv(65536):  # answers that came too late for an earlier question
                pass
        except OSError:
            pass
        try:
            os.kill(pid, STAGE_SIGNAL)
        except OSError:
            return None
        deadline = time.monotonic() + _STAGE_GRACE
        while (left := deadline - time.monotonic()) > 0 and _readable(server.stages, left):
            try:
                answer = server.stages.recv(65536)
            except OSError:
                continue
            who, _, where = answer.partition(b"\0")
            if who == str(pid).encode():
                return where.decode(errors="replace")
        return None

    def wake(self) -> None:
        """Make a :meth:`get` waiting in another thread look at its ``stop`` at once. Thread-safe."""
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def _take(self, step: int) -> Any:
        """The batch of delivered ``step``. A Ctrl-C may land anywhere in here: the step
        stays delivered (asked again, it is taken again) until the lease is committed in
        one uninterruptible run of dictionary stores (no call in between); after that,
        a batch lost on the way back is computed again and its slot comes back when
        the lost batch dies."""
        result = self._results[step]
        if isinstance(result, _StepFailed):
            del self._results[step]
            report = result.report
            error = StepError(
                f"{report.text}\n\nworker {result.worker_index} (pid {result.pid}) traceback:\n{report.traceback}"
            )
            if report.cause is not None:
                try:
                    error.__cause__ = pickle.loads(report.cause)
                except Exception:
                    pass
            raise error
        if isinstance(result, _Copied):
            batch = result.batch
            del self._results[step]
        elif self.copy:
            batch = self._materialise(result, copy=True)
            del self._results[step]
            result.worker.release(step)
        else:  # lend the slot: it comes back once no array of the batch is alive
            worker, slot = result.worker, result.slot
            batch, owner = shm.lease(result.data, worker.slots[slot], result.spans)
            # the callback is a C function (no Python code runs when the batch dies, so a
            # Ctrl-C can never land in it and be lost)
            ref = weakref.ref(owner, self._returned.append)
            key, lease = id(ref), (ref, worker, slot)
            self._leases[key] = lease  # commit: stores only, which a Ctrl-C cannot cut in two
            del worker.slot_of[step]
            del self._results[step]
            del owner
        self._dispatch(step + 1)
        return batch

    def _materialise(self, result: _Delivered, copy: bool) -> Any:
        return shm.loads(result.data, result.worker.slots[result.slot], result.spans, copy=copy)

    def close(self) -> None:
        """Stop the workers and the fork server (which kills and reaps every worker
        before it exits: when this returns, none is left) and free all shared memory.
        Idempotent, and a Ctrl-C cannot stop it half-way (it is deferred until the
        end); a process forked from the pool's own only forgets its copy (:meth:`forget`)."""
        if os.getpid() != self._pid:
            self.forget()
            return
        with sigint_deferred():
            for i, worker in enumerate(self.workers):
                if worker is not None:
                    worker.close()  # end of file: an idle worker exits at once
                    self.workers[i] = None
            server = self._server
            if server is not None:
                if not server.dead and not server.ready and _readable(server.sock):
                    self._pump_server(server)  # has it loaded the pipeline (and so maybe forked) yet?
                server.close()
                self._server = None
            self._release()

    def forget(self) -> None:
        """Drop this copy of a pool made by another process (this one is a fork of
        it): close this process's descriptors and mappings, without a message or a
        signal to the worker processes, which belong to the other process."""
        for i, worker in enumerate(self.workers):
            if worker is not None:
                worker.close()
                self.workers[i] = None
        if self._server is not None:
            self._server.forget()
            self._server = None
        self._release()

    def _release(self) -> None:
        self._results.clear()
        self._sent.clear()
        self._leases.clear()
        self._returned.clear()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._definition is not None:
            self._definition.close()
            self._definition = None


def _readers(pipe: execute.Definition) -> tuple[str, ...]:
    """The reader modules (:data:`READERS`) of the pipeline's sources (and of their
    parts, for a source made of others), those this process has imported: the fork
    server imports them once, before it forks the workers."""
    found: set[str] = set()
    todo: list = [leaf.source if leaf.source is not None else leaf.packing.inner.source for leaf in pipe.leaves]
    seen: set[int] = set()
    while todo:
        src = todo.pop()
        if id(src) in seen:
            continue
        seen.add(id(src))
        found.update(READERS[c.__name__] for c in type(src).__mro__ if c.__name__ in READERS)
        for attr in ("sources", "components"):  # a source made of others (a mixture, say)
            parts = getattr(src, attr, None)
            if isinstance(parts, dict):
                todo.extend(parts.values())
            elif isinstance(parts, (list, tuple)):
                todo.extend(parts)
    return tuple(sorted(m for m in found if m in sys.modules))


def _descriptor_room(wanted: int) -> int:
    """How many more files this process may open, after raising its soft limit
    (``RLIMIT_NOFILE``) towards the hard one if ``wanted`` more would not fit; the
    parent maps one descriptor per shared-memory slot, and workers inherit the limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 256
    need = in_use + wanted + 64  # 64: headroom for everything else
    if soft != resource.RLIM_INFINITY and need > soft:
        new = need if hard == resource.RLIM_INFINITY else min(hard, need)
        if new > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
    return wanted if soft == resource.RLIM_INFINITY else max(0, soft - in_use - 64)


def _readable(sock: socket.socket, timeout: float = 0.0) -> bool:
    """Whether ``sock`` has data (or end of file) waiting, within ``timeout`` seconds."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(int(timeout * 1000)))
