"""The parent's worker pool: steps sent to worker processes, their batches taken back in order.

:class:`WorkerPool` sends each worker tasks of its steps, receives the batches
in shared memory and lends them to the caller (or copies them out). A batch
depends only on the pipeline, the step and the host slice, never on which
worker computed it or when; no step is computed in this process. The design:
``docs/design/workers.md``.
"""

from __future__ import annotations

import collections
import functools
import os
import pickle
import selectors
import socket
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from ...core.errors import WorkerError
from ...core.timing import HANDOVER, add, ema
from ...integrity.ledger import LedgerWriter
from ..feed import Batch, Feed, FeedStats, worker_figures
from . import shm
from .handles import ServerHandle, WorkerHandle, preloads, readable
from .messages import Done, Drop, ErrorReport, Failed, Fatal, Init, Ready, Span, Task
from .signals import sigint_deferred
from .sizing import fit_read_ahead, task_sizes
from .supervise import Supervisor

if TYPE_CHECKING:
    from ...definition.dataset import Pipeline

__all__ = ["WorkerPool"]

_ARRAY_INLINE_BYTES = 1 << 16  # pipeline arrays smaller than this travel inside the pickle


class _Delivered(NamedTuple):
    """A step's batch waiting in ``worker``'s slot ``slot`` (and its ledger fields)."""

    worker: WorkerHandle
    slot: int
    data: bytes
    spans: list[Span]
    digests: str = ""


class _Copied(NamedTuple):
    """A step's batch copied out of the slot of a worker that has died since (and its ledger fields)."""

    batch: Batch
    digests: str = ""


class _StepFailed(NamedTuple):
    """A step that raised in worker ``index`` (process ``pid``)."""

    worker_index: int
    pid: int | None
    report: ErrorReport


_Result = _Delivered | _Copied | _StepFailed


class WorkerPool(Feed):
    """``num_workers`` processes computing the steps of ``pipe`` for one host slice.

    The :class:`~quern.pipeline.iterate.feed.Feed` of ``num_workers > 0``.

    :meth:`get` returns the batch of a step; the caller asks for consecutive steps
    (asking again for a step that raised retries it). Each worker gets tasks of
    its steps, growing from 1 step to ``read_ahead`` (1, 2, 4, 8, ...), with at most
    ``prefetch * read_ahead`` steps in flight, so shared memory holds at most
    ``num_workers * prefetch * read_ahead`` batches in flight (each worker's
    slots, reused) plus the batches the caller holds (lent slots). A batch depends
    only on the pipeline, the step and the host slice; no step is ever computed in
    this process. Making a pool starts the fork server and asks for every worker;
    :meth:`close` stops them.

    Args:
        pipe: The pipeline (picklable with cloudpickle).
        num_workers: Worker processes, >= 1.
        process_index: The host whose steps are computed.
        process_count: The number of hosts.
        prefetch: Tasks each worker has in flight.
        read_ahead: Steps per task; ``None`` picks about
            :data:`~quern.pipeline.iterate.workers.sizing.TASK_RECORDS` records per task
            (:func:`~quern.pipeline.iterate.workers.sizing.task_sizes`), lowered once the first
            batch's size is known so that the slots stay within
            :data:`~quern.pipeline.iterate.workers.sizing.SHARED_MEMORY_BUDGET`; until then
            tasks are one step.
        end: The step where the stream ends (``None``: endless).
        copy: Copy each batch out of its slot instead of lending the slot
            (``pipe.iterator(copy_batches=True)``).
        timed: Workers send each task's stage timings (:attr:`timings`).
        digests: Workers compute each batch's ledger fields (its digests), which
            :attr:`last_digests` holds for the batch :meth:`get` returned last.

    Raises:
        TypeError: The pipeline cannot be pickled.
        WorkerError: Through :meth:`get` and :meth:`wait_ready`, when workers cannot start or keep dying.
    """

    def __init__(
        self,
        pipe: Pipeline,
        num_workers: int,
        *,
        process_index: int,
        process_count: int,
        prefetch: int,
        read_ahead: int | None,
        end: int | None,
        copy: bool = False,
        timed: bool = True,
        digests: bool = False,
    ) -> None:
        import cloudpickle  # not needed by a worker, which only unpickles

        self.pipe, self.end, self.copy = pipe, end, copy
        self.num_workers, self.prefetch = num_workers, prefetch
        self._auto = read_ahead is None
        read_ahead, self._most_in_flight = task_sizes(
            pipe.batch_size,
            num_workers,
            process_index=process_index,
            process_count=process_count,
            prefetch=prefetch,
            read_ahead=read_ahead,
        )
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
        self._sent: set[int] = set()  # steps sent to a worker and not yet delivered
        self.delivered = [0] * num_workers  # steps each worker has delivered
        self.in_parent = 0  # steps computed in this process: always 0 (kept for stats())
        self.timed = timed  # workers send each step's stage timings
        self.digests = digests  # workers send each batch's ledger fields
        self.last_digests = ""  # those of the batch get() returned last
        self.timings: dict[str, float] = {}  # seconds per stage, summed over the workers' steps
        self.timed_steps = 0  # the steps of the tasks delivered whole (whose stage seconds are in timings)
        self._cache_counts: dict[str, int] = {}  # the workers' disk-cache counters, added up (lookahead.CACHE_COUNTS)
        self._load: float | None = None  # the workers' seconds per batch over their number (a moving average)
        self._closed = False
        self.ahead = 0  # batches the iterator wants in flight in all (its prefetch window); 0: prefetch tasks
        # what becomes of a dead worker's steps: a function of these two, not of the pool (no reference cycle)
        lose = functools.partial(_lose, self._results, self._sent)
        self._procs = Supervisor(
            num_workers, process_index=process_index, process_count=process_count, selector=self._selector, lose=lose
        )
        self._definition: shm.Buffer | None = None
        try:
            self._procs.start_server()  # it starts (imports numpy...) while the pipeline is pickled
            try:
                data, buffers = shm.dumps(pipe, pickler=cloudpickle.dumps, min_bytes=_ARRAY_INLINE_BYTES)
            except Exception as e:
                raise TypeError(
                    f"num_workers={num_workers}: the pipeline cannot be sent to worker processes "
                    f"({type(e).__name__}: {e}); make its source and transforms picklable, or use num_workers=0"
                ) from e
            buffers.insert(0, pickle.PickleBuffer(data))
            spans, size = shm.layout(buffers)
            self._definition = shm.Buffer.create(size)  # shared by all workers, read-only there
            shm.write(self._definition, buffers, spans=spans)
            self._procs.load(Init(spans, size, process_index, process_count, preloads(pipe)), self._definition)
        except BaseException:
            self.close()
            raise

    @property
    def restarts(self) -> int:
        """Workers replaced after dying."""
        return self._procs.restarts

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers the fork server has started so far (empty once closed)."""
        return [] if self._closed else self._procs.pids

    @property
    def load(self) -> float | None:
        """The workers' seconds per batch over their number (a moving average; ``None``: none yet)."""
        return self._load

    @property
    def local(self) -> bool:
        """Whether the steps read here, which they do (the workers are on this machine)."""
        return True

    @property
    def cache_counts(self) -> Mapping[str, int]:
        """The workers' disk-cache counters (:data:`~quern.pipeline.remote.lookahead.CACHE_COUNTS`), added up."""
        return self._cache_counts

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every worker has started, or ``timeout`` seconds pass.

        Args:
            timeout: Seconds to wait at most (``None``: no bound).

        Returns:
            ``True`` when every worker has loaded the pipeline, ``False`` on timeout.

        Raises:
            WorkerError: The workers cannot start (the pipeline cannot be loaded, or they keep dying).
        """
        procs = self._procs
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(w is not None and w.ready for w in procs.workers):
            procs.revive()
            procs.raise_failures()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            for w, worker in enumerate(procs.workers):
                if worker is None and w not in procs.broken:
                    procs.start(w)
            self._poll(1.0 if left is None else min(left, 1.0))
        return True

    # ------------------------------------------------------------------ messages

    def _poll(self, timeout: float | None) -> None:
        """Handle every message that arrives within ``timeout`` seconds (0: only those waiting)."""
        events = self._selector.select(timeout)
        events.sort(key=lambda e: not isinstance(e[0].data, ServerHandle))  # the server's news first
        for key, _ in events:
            if key.data is None:  # wake(): another thread wants next() to look up
                try:
                    while self._wake_r.recv(512):
                        pass
                except (BlockingIOError, OSError):
                    pass
                continue
            if isinstance(key.data, ServerHandle):
                if key.data is self._procs.server:
                    self._procs.pump(key.data)
                continue
            worker: WorkerHandle = key.data
            if self._procs.workers[worker.index] is not worker:
                continue  # already replaced
            try:
                while True:
                    msg, fds = shm.recv(worker.sock)
                    try:
                        self._handle(worker, msg, fds)
                    finally:
                        for fd in fds:  # any that _handle did not take
                            os.close(fd)
                    if not readable(worker.sock):
                        break
            except (EOFError, ConnectionResetError):
                self._procs.on_death(worker)
            except BaseException:
                # interrupted half-way through a message (Ctrl-C): the stream may be out of
                # step, so this worker is replaced and its steps computed again
                if self._procs.workers[worker.index] is worker:
                    self._procs.on_death(worker, count=False)
                raise

    def _handle(self, worker: WorkerHandle, msg: object, fds: list[int]) -> None:
        if isinstance(msg, Ready):
            worker.ready = True
            worker.ready_at = time.monotonic()
            worker.server.pids.setdefault(worker.serial, msg.pid)  # the server's Forked may come later
        elif isinstance(msg, Fatal):  # a fresh-interpreter worker cannot load the pipeline: stop for good
            self._procs.fatal = WorkerError(
                f"worker {worker.index} (pid {worker.pid}) could not start: {msg.text}\n\n"
                f"worker traceback:\n{msg.traceback}"
            )
            self._procs.raise_failures()
        elif isinstance(msg, Done):
            if fds:
                if msg.slot in worker.slots:
                    worker.slots[msg.slot].close()
                worker.slots[msg.slot] = shm.Buffer(fds.pop(0), msg.size)
            if self._auto and self.read_ahead == 1 and self.max_read_ahead > 1:
                nbytes = msg.spans[-1][0] + msg.spans[-1][1] if msg.spans else 0
                self.read_ahead = fit_read_ahead(
                    nbytes, self.num_workers, prefetch=self.prefetch, max_read_ahead=self.max_read_ahead
                )
            add(self.timings, msg.timings)
            for k, v in msg.cache:
                self._cache_counts[k] = self._cache_counts.get(k, 0) + v
            if msg.task_steps:
                self.timed_steps += msg.task_steps
                self._load = ema(self._load, msg.seconds / msg.task_steps / self.num_workers)
            self._deliver(worker, msg.step, _Delivered(worker, msg.slot, msg.data, msg.spans, msg.digests))
        elif isinstance(msg, Failed):
            worker.release(msg.step)  # nothing was written to its slot
            self._deliver(worker, msg.step, _StepFailed(worker.index, worker.pid, msg.report))
        else:
            raise WorkerError(f"worker {worker.index} (pid {worker.pid}) sent an unknown message {type(msg).__name__}")

    def _deliver(self, worker: WorkerHandle, step: int, result: _Result) -> None:
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
        self._procs.delivered(worker.index)
        self.delivered[worker.index] += 1

    # ------------------------------------------------------------------ scheduling

    def _dispatch(self, step: int) -> None:
        """Send every worker its next steps (from ``step`` on, not yet sent) while it has room in flight.

        Room: fewer than :meth:`in_flight_limit` steps sent or delivered and not yet
        taken. Tasks have 1, 2, 4, 8, ... steps up to ``read_ahead`` (a worker's first
        tasks are small, so its first batches come soon). A task shorter than that
        goes only at the end of the stream or when it holds ``step`` itself. A
        worker that is still starting gets its tasks too: they wait in its socket.
        """
        num_workers, ra = self.num_workers, self.read_ahead
        limit = self.in_flight_limit()
        if self._returned:
            self._reclaim(limit)
        for worker in self._procs.workers:
            if worker is None:
                continue
            room = limit - len(worker.slot_of)
            if room <= 0:
                continue
            first = step + (worker.index - step) % num_workers
            hi = first + num_workers * limit
            if self.end is not None:
                hi = min(hi, self.end)
            todo = [s for s in range(first, hi, num_workers) if s not in self._sent and s not in self._results][:room]
            i = 0
            while i < len(todo):
                size = min(ra, 1 << min(worker.tasks, 30))
                task = todo[i : i + size]
                if len(task) < size and step not in task and (self.end is None or task[-1] + num_workers < self.end):
                    break  # wait until a whole task's worth of slots is free
                i += len(task)
                worker.tasks += 1
                slots = [worker.assign(s) for s in task]
                worker.pending.extend(task)
                self._sent.update(task)
                try:
                    shm.send(worker.sock, Task(task, slots, self.timed, self.digests))
                except (BrokenPipeError, ConnectionResetError):  # it died: _poll will see why
                    break
                except BaseException:  # Ctrl-C half-way through the message
                    self._procs.on_death(worker, count=False)
                    raise

    def in_flight_limit(self) -> int:
        """Steps each worker may have in flight (sent or delivered, not yet taken).

        Returns:
            ``prefetch`` tasks of ``read_ahead`` steps, or ``ahead / num_workers`` when
            the iterator's window (:attr:`ahead`) wants more, within the descriptors' room.
        """
        base = self.prefetch * self.read_ahead
        want = -(-self.ahead // self.num_workers)
        return max(base, min(want, self._most_in_flight))

    def stats(self) -> FeedStats:
        """The workers' figures (see :class:`~quern.pipeline.iterate.feed.FeedStats`).

        Returns:
            ``workers``, ``delivered_by_worker``, ``computed_in_parent``, ``worker_restarts``,
            ``stages``, ``stage_steps`` and ``host_prefetch`` (``ready``: steps delivered and
            not yet taken; ``in_flight``: sent and not yet delivered; nothing once closed).
        """
        out = worker_figures(self.num_workers, self.delivered, self.restarts)
        out["stages"], out["stage_steps"] = dict(self.timings), self.timed_steps
        if self._closed:
            out["host_prefetch"] = {"ready": 0, "in_flight": 0, "depth": 0}
        else:
            depth = self.num_workers * self.in_flight_limit()
            out["host_prefetch"] = {"ready": len(self._results), "in_flight": len(self._sent), "depth": depth}
        return out

    def add_to_ledger(self, ledger: LedgerWriter, step: int, batch: Batch) -> None:
        """Give ``ledger`` the fields the worker computed for the batch :meth:`get` returned last.

        Args:
            ledger: the iterator's ledger.
            step: the step.
            batch: its batch (not hashed again).
        """
        ledger.add(step, self.last_digests)

    def _reclaim(self, limit: int) -> None:
        """Take back the slots of lent batches that nobody holds any more.

        A worker keeps one spare slot beyond its ``limit`` in flight; the others are
        unmapped (here and in the worker), so memory held for batches once kept is
        given back.
        """
        touched = set()
        while self._returned:
            lease = self._leases.pop(id(self._returned.popleft()), None)
            if lease is None:  # a Ctrl-C between the weakref and its lease: the step kept its slot, lent again
                continue
            _, worker, slot = lease
            if self._procs.workers[worker.index] is worker:
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

    # ------------------------------------------------------------------ batches

    def get(self, step: int, *, stop: Callable[[], bool] | None = None, timeout: float | None = None) -> Batch:
        """The batch of ``step``, waiting for it; steps must be asked for in order.

        A step delivered is returned even if its worker has failed since; otherwise
        the failure that stops its worker is raised here.

        Args:
            step: The step (the one after the last asked for, or that one again after it raised).
            stop: Called while waiting: when it returns true, give up; :meth:`wake`
                makes a waiting ``get`` look at once.
            timeout: Seconds: when the step has not come that long after this call (or
                after its worker said it was ready, if later: start-up is not counted),
                the worker computing it is asked where it is
                (:data:`~quern.pipeline.iterate.workers.supervise.STAGE_GRACE` seconds to
                answer), killed and replaced. ``None``: no deadline.

        Returns:
            The batch: its arrays view a lent slot (or are copies with ``copy=True``).

        Raises:
            StepError: The step raised in its worker (asking again retries it).
            StepTimeoutError: ``timeout`` passed; asking again computes the step on the new worker.
            WorkerError: The workers cannot start or keep dying.
            RuntimeError: ``stop()`` became true while waiting.
        """
        procs = self._procs
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
            procs.revive()
            procs.raise_failures(w)
            procs.reap_exited()
            if procs.workers[w] is None:  # given up on after repeated deaths: try again
                procs.start(w)
            self._dispatch(step)
            wait = 1.0
            worker = procs.workers[w]
            if timeout is not None and worker is not None and worker.ready:
                left = max(began, worker.ready_at) + timeout - time.monotonic()
                if left <= 0:
                    procs.time_out(worker, step, timeout=timeout)
                wait = min(wait, left)
            self._poll(wait)

    def prime(self, step: int) -> None:
        """Send the workers their first tasks, from ``step`` on, before it is asked for.

        A pool opened ahead of the step it will serve from (``num_workers="auto"``)
        computes while its workers start and another feed serves the steps before.

        Args:
            step: the first step the pool will be asked for.
        """
        self._poll(0)
        self._dispatch(step)

    def wake(self) -> None:
        """Make a :meth:`get` waiting in another thread look at its ``stop`` at once; thread-safe."""
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def _take(self, step: int) -> Batch:
        """The batch of delivered ``step``.

        A Ctrl-C may land anywhere in here: the step stays delivered (asked again, it
        is taken again) until the lease is committed in one uninterruptible run of
        dictionary stores (no call in between); after that, a batch lost on the way
        back is computed again and its slot comes back when the lost batch dies.
        """
        result = self._results[step]
        if isinstance(result, _StepFailed):
            del self._results[step]
            raise result.report.error(f"worker {result.worker_index} (pid {result.pid})")
        self.last_digests = result.digests
        if isinstance(result, _Copied):
            batch = result.batch
            del self._results[step]
        elif self.copy:
            batch = _copy_out(result)
            del self._results[step]
            result.worker.release(step)
        else:  # lend the slot: it comes back once no array of the batch is alive
            worker, slot = result.worker, result.slot
            batch, owner = shm.lease(result.data, worker.slots[slot], spans=result.spans)
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

    # ------------------------------------------------------------------ the end

    def close(self) -> None:
        """Stop the workers and the fork server and free all shared memory; when this returns, no worker is left.

        Idempotent, and a Ctrl-C cannot stop it half-way (it is deferred until the
        end); a process forked from the pool's own only forgets its copy (:meth:`forget`).
        """
        if os.getpid() != self._pid:
            self.forget()
            return
        with sigint_deferred():
            self._procs.close()
            self._release()
            self._closed = True

    def forget(self) -> None:
        """Drop this copy of a pool made by another process (this one is a fork of it).

        This process's descriptors and mappings are closed, without a message or a
        signal to the worker processes, which belong to the other process.
        """
        self._procs.forget()
        self._release()
        self._closed = True

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


def _copy_out(result: _Delivered) -> Batch:
    """The batch of ``result``, copied out of its worker's slot."""
    return shm.loads(result.data, result.worker.slots[result.slot], spans=result.spans, copy=True)


def _lose(results: dict[int, _Result], sent: set[int], worker: WorkerHandle) -> None:
    """Keep the batches a dead (or stopped) ``worker`` delivered, and forget the steps it had not.

    The batches are copied out of its slots, which go with it; the steps forgotten are sent again.
    """
    try:
        for step, r in list(results.items()):
            if isinstance(r, _Delivered) and r.worker is worker:
                results[step] = _Copied(_copy_out(r), r.digests)
    finally:
        for step, r in list(results.items()):
            if isinstance(r, _Delivered) and r.worker is worker:
                del results[step]  # not copied out (interrupted): computed again
        sent.difference_update(worker.pending)
