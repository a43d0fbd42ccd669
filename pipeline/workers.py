"""Worker processes: each computes whole steps and hands them over in shared memory.

The parent (:class:`WorkerPool`, driven by the iterator) sends worker ``w`` the
steps ``s`` with ``s % W == w``, a task of up to ``read_ahead`` steps at a time.
The worker reads the records of the whole task in one bulk read, then for each
step runs the record transforms, collates, runs the batch transforms, copies the
batch's arrays into the shared-memory slot the parent chose for that step and
tells the parent. The parent yields the steps in order; the arrays it yields are
views into the slot, which it *lends* to the caller: the slot goes back to its
worker only once no array of that batch is alive any more (a
``weakref.ref`` on the arrays' common base, whose callback is a C function), so a batch you hold is never
overwritten, and no copy is made. Which process computed a step never changes
its bytes: every step is a pure function of the pipeline, the step and the host
slice.

Start method: workers are fresh interpreters (``sys.executable``, like
multiprocessing's "spawn"), never ``fork()``: forking a parent that runs JAX,
XLA or other threads can deadlock the child on a lock held by a thread that
does not exist in it. The pipeline is sent with cloudpickle (so lambdas and
functions of ``__main__`` work); its large arrays (an ``ArraySource``'s data)
are copied once into shared memory that every worker maps copy-on-write (not
once per worker, not through the pipe), and sources open their files lazily in
the worker. While a worker starts (about 0.15 s: an interpreter plus numpy),
the parent computes the steps that worker owns itself, so the first batch
comes as fast as with ``num_workers=0``; this is why transforms must not depend
on process-global settings that a fresh interpreter does not share (a jax
config flag set by the script, say). Workers run with ``JAX_PLATFORMS=cpu`` so
that a transform importing jax never claims an accelerator, in their own
process group (a Ctrl-C at the terminal reaches the parent only), with stdout
line-buffered (what a transform prints arrives whole and is not lost when a
worker is stopped). The parent keeps one descriptor per shared-memory slot; it
raises its soft limit of open files if needed (or, with the default
``read_ahead``, makes tasks smaller to fit).

Faults: a worker that dies (a signal, the OOM killer, a crash in native code)
is replaced and the steps it had not delivered are computed again; a step
whose transform raises is reported to the parent with the worker's traceback
and raised there when the iterator reaches that step. Workers ignore SIGINT
(the parent handles Ctrl-C and closes them) and exit by themselves when the
parent goes away, because their socket to it reaches end of file.
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
import time
import weakref
from typing import Any, NamedTuple

from . import execute, shm
from .errors import StepError, WorkerError
from .index import host_rows
from .messages import Done, Drop, ErrorReport, Failed, Fatal, Init, Ready, Span, Task

__all__ = ["WorkerPool", "WorkerError"]

_MAX_DEATHS = 3  # a worker dying this many times in a row without delivering a step is an error
_ARRAY_INLINE_BYTES = 1 << 16  # pipeline arrays smaller than this travel inside the pickle
TASK_RECORDS = 16384  # default task: about this many records read in one bulk call...
MAX_TASK_STEPS = 64  # ...but at most this many steps
SHARED_MEMORY_BUDGET = 256 << 20  # ...and the default task size keeps all slots within this


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
    pid: int
    report: ErrorReport


_Result = _Delivered | _Copied | _StepFailed


class _Worker:
    """The parent's handle on one worker process."""

    def __init__(self, index: int, init_message: Init, init_fds: list[int]):
        self.index = index
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        code = (
            f"import sys; sys.path[:] = {sys.path!r}; "
            f"from quern.pipeline.worker_main import main; main({child_sock.fileno()})"
        )
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        try:  # its own process group: a Ctrl-C at the terminal goes to the parent only
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=[child_sock.fileno()], env=env, process_group=0
            )
        finally:
            child_sock.close()
        self.sock = parent_sock
        self.ready = False
        self.slots: dict[int, shm.Buffer] = {}  # slot id -> this process's mapping of it
        self.slot_of: dict[int, int] = {}  # step -> slot, for steps sent and not yet taken
        self.free: list[int] = []  # slot ids not in use
        self.next_slot = 0  # slot ids ever made
        self.pending: list[int] = []  # steps sent and not yet delivered, in order
        shm.send(self.sock, init_message, init_fds)

    @property
    def pid(self) -> int:
        return self.proc.pid

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

    def exit_text(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with status {code}"

    def close(self, grace: float = 0.0) -> None:
        """Stop the process (after up to ``grace`` seconds for it to exit by itself) and unmap its slots."""
        try:
            if grace and self.proc.poll() is None:
                try:
                    self.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                self.proc.kill()  # a worker holds nothing that needs cleaning up
            self.sock.close()
            self.proc.wait()
        finally:
            for buf in self.slots.values():
                buf.close()
            self.slots.clear()


class WorkerPool:
    """``num_workers`` processes computing the steps of ``pipe`` for one host slice.

    :meth:`get` returns the batch of a step; the caller asks for consecutive steps
    (asking again for a step that raised retries it). Each worker gets tasks of
    ``read_ahead`` of its steps and has at most ``prefetch`` tasks in flight, so
    shared memory holds at most ``num_workers * prefetch * read_ahead`` batches
    in flight (each worker's slots, reused) plus the batches the caller holds
    (lent slots). ``copy=True`` copies each batch out of its slot instead
    (``pipe.iterator(copy_batches=True)``). ``read_ahead=None`` picks about
    :data:`TASK_RECORDS` records per task (at most :data:`MAX_TASK_STEPS` steps),
    lowered once the first batch's size is known so that the slots stay within
    :data:`SHARED_MEMORY_BUDGET`; until then tasks are one step.
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
    ) -> None:
        import cloudpickle  # not needed by a worker, which only unpickles

        self.pipe, self.end, self.copy = pipe, end, copy
        self.num_workers, self.prefetch = num_workers, prefetch
        self._auto = read_ahead is None
        if read_ahead is None:
            lo, hi = host_rows(pipe.batch_size or 0, process_index, process_count)
            read_ahead = execute.steps_per_read(hi - lo, TASK_RECORDS, MAX_TASK_STEPS)
        room = _descriptor_room(num_workers * (prefetch * read_ahead + 2))  # one per slot, plus spares
        if self._auto and room < num_workers * (prefetch * read_ahead + 2):
            read_ahead = max(1, (room // num_workers - 2) // prefetch)
        self.max_read_ahead: int = read_ahead
        self.read_ahead: int = 1 if self._auto else read_ahead  # until the size of a batch is known
        self.process_index, self.process_count = process_index, process_count
        try:
            data, buffers = shm.dumps(pipe, cloudpickle.dumps, _ARRAY_INLINE_BYTES)
        except Exception as e:
            raise TypeError(
                f"num_workers={num_workers}: the pipeline cannot be sent to worker processes "
                f"({type(e).__name__}: {e}); make its source and transforms picklable, or use num_workers=0"
            ) from e
        buffers.insert(0, pickle.PickleBuffer(data))
        spans, size = shm.layout(buffers)
        self._definition: shm.Buffer | None = shm.Buffer.create(size)  # shared by all workers, read-only there
        shm.write(self._definition, buffers, spans)
        self._init = Init(spans, size, process_index, process_count)
        self._selector = selectors.DefaultSelector()
        self._leases: dict[int, tuple] = {}  # id(weakref to a lent batch) -> (weakref, worker, slot)
        self._returned: collections.deque = collections.deque()  # leases whose batch died
        self._results: dict[int, _Result] = {}  # delivered steps not yet taken
        self._deaths = [0] * num_workers  # consecutive deaths without a delivered step
        self._sent: set[int] = set()  # steps sent to a worker and not yet delivered
        self._suspect: set[int] = set()  # steps in progress when a worker died: never computed here
        self._fatal: WorkerError | None = None  # a worker could not load the pipeline
        self._broken: dict[int, WorkerError] = {}  # worker index -> why it is not restarted
        self.delivered = [0] * num_workers  # steps each worker has delivered
        self.in_parent = 0  # steps computed in the parent while their worker was starting
        self.restarts = 0  # workers replaced after dying
        self.workers: list[_Worker | None] = [None] * num_workers
        try:
            for w in range(num_workers):
                self._start(w)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ processes

    def _start(self, w: int) -> None:
        assert self._definition is not None and self._definition.fd is not None, "the pool is closed"
        worker = _Worker(w, self._init, [self._definition.fd])
        self.workers[w] = worker
        self._selector.register(worker.sock, selectors.EVENT_READ, worker)

    def _on_death(self, worker: _Worker, count: bool = True) -> None:
        """Keep what the dead worker delivered, forget what it had not, start another.

        ``count=False``: the parent itself stopped the worker (its message stream
        was interrupted half-way, by Ctrl-C say), which is not the worker's fault.
        After ``_MAX_DEATHS`` deaths in a row without a delivered step, the worker
        is not restarted: :meth:`get` raises :class:`WorkerError` at its next step."""
        w = worker.index
        if self.workers[w] is worker:
            self.workers[w] = None  # first, so that an interruption below cannot leave it half-replaced
        self._selector.unregister(worker.sock)
        try:
            for step, r in list(self._results.items()):
                if isinstance(r, _Delivered) and r.worker is worker:
                    self._results[step] = _Copied(self._materialise(r, copy=True))
            if count:  # one of these steps may crash whatever process computes it
                self._suspect.update(worker.pending)
        finally:
            for step, r in list(self._results.items()):
                if isinstance(r, _Delivered) and r.worker is worker:
                    del self._results[step]  # not copied out (interrupted): computed again
            self._sent.difference_update(worker.pending)
            worker.close(grace=1.0 if count else 0.0)
        if self._fatal is not None:
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

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every worker has started (True) or ``timeout`` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(w is not None and w.ready for w in self.workers):
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
        return [w.pid for w in self.workers if w is not None]

    # ------------------------------------------------------------------ messages

    def _poll(self, timeout: float | None) -> None:
        """Handle every message that arrives within ``timeout`` seconds (0: only those waiting)."""
        for key, _ in self._selector.select(timeout):
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

    def _handle(self, worker: _Worker, msg: object, fds: list[int]) -> None:
        if isinstance(msg, Ready):
            worker.ready = True
        elif isinstance(msg, Fatal):  # it cannot load the pipeline: neither can any other, so stop for good
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
            self._deliver(worker, msg.step, _Delivered(worker, msg.slot, msg.data, msg.spans))
        elif isinstance(msg, Failed):
            worker.release(msg.step)  # nothing was written to its slot
            self._deliver(worker, msg.step, _StepFailed(worker.index, worker.pid, msg.report))
        else:
            raise WorkerError(f"worker {worker.index} (pid {worker.pid}) sent an unknown message {type(msg).__name__}")

    def _deliver(self, worker: _Worker, step: int, result: _Result) -> None:
        worker.pending.remove(step)
        self._sent.discard(step)
        self._results[step] = result
        self._suspect.discard(step)
        self._deaths[worker.index] = 0
        self.delivered[worker.index] += 1

    # ------------------------------------------------------------------ scheduling

    def _dispatch(self, step: int) -> None:
        """Send every ready worker its next steps (from ``step`` on, not yet sent),
        ``read_ahead`` at a time, while it has fewer than ``prefetch * read_ahead``
        steps in flight (sent or delivered, and not yet taken). A shorter task goes
        only at the end of the stream or when it holds ``step`` itself."""
        W, ra = self.num_workers, self.read_ahead
        limit = self.prefetch * ra
        if self._returned:
            self._reclaim(limit)
        for worker in self.workers:
            if worker is None or not worker.ready:
                continue
            room = limit - len(worker.slot_of)
            first = step + (worker.index - step) % W
            if room < ra and first != step and (self.end is None or first + W * room < self.end):
                continue  # no room for a whole task, and nothing urgent
            hi = first + W * limit
            if self.end is not None:
                hi = min(hi, self.end)
            todo = [s for s in range(first, hi, W) if s not in self._sent and s not in self._results][: max(room, 0)]
            for i in range(0, len(todo), ra):
                task = todo[i : i + ra]
                if len(task) < ra and step not in task and (self.end is None or task[-1] + W < self.end):
                    break  # wait until a whole task's worth of slots is free
                slots = [worker.assign(s) for s in task]
                worker.pending.extend(task)
                self._sent.update(task)
                try:
                    shm.send(worker.sock, Task(task, slots))
                except (BrokenPipeError, ConnectionResetError):  # it died: _poll will see why
                    break
                except BaseException:  # Ctrl-C half-way through the message
                    self._on_death(worker, count=False)
                    raise

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

    def get(self, step: int) -> Any:
        """The batch of ``step``; steps must be asked for in order."""
        w = step % self.num_workers
        while True:
            self._raise_failures(w)
            if self.workers[w] is None:  # given up on after repeated deaths: try again
                self._start(w)
            self._poll(0)
            if step in self._results:
                return self._take(step)
            self._dispatch(step)
            if step not in self._sent and step not in self._suspect:  # its worker is starting: compute it here
                self._dispatch(step + 1)
                batch = execute.batches_at(self.pipe, step, 1, self.process_index, self.process_count)[0]
                self.in_parent += 1
                return batch
            self._poll(1.0)

    def _take(self, step: int) -> Any:
        result = self._results.pop(step)
        if isinstance(result, _StepFailed):
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
        elif self.copy:
            batch = self._materialise(result, copy=True)
            result.worker.release(step)
        else:  # lend the slot: it comes back once no array of the batch is alive
            worker, slot = result.worker, result.slot
            del worker.slot_of[step]
            batch, owner = shm.lease(result.data, worker.slots[slot], result.spans)
            # the callback is a C function (no Python code runs when the batch dies, so a
            # Ctrl-C can never land in it and be lost)
            ref = weakref.ref(owner, self._returned.append)
            self._leases[id(ref)] = (ref, worker, slot)
            del owner
        self._dispatch(step + 1)
        return batch

    def _materialise(self, result: _Delivered, copy: bool) -> Any:
        return shm.loads(result.data, result.worker.slots[result.slot], result.spans, copy=copy)

    def close(self) -> None:
        """Kill the workers and free all shared memory. Idempotent. (In a process
        forked from this one, ``Popen`` sees that the workers are not its children
        and leaves them alone.)"""
        for i, worker in enumerate(self.workers):
            if worker is not None:
                self.workers[i] = None
                worker.close()
        self._results.clear()
        self._sent.clear()
        self._leases.clear()
        self._returned.clear()
        self._selector.close()
        if self._definition is not None:
            self._definition.close()
            self._definition = None


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


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has data (or end of file) waiting."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
