"""The iterator: a pipeline's steps in order, computed ahead on threads or in worker processes.

The iterator holds no data-order state beyond the next step number: what it
yields at step ``s`` is exactly ``pipe.batch_at(s, process_index, process_count)``,
whatever the worker count, thread count, prefetch depth or timing. The threads'
side is :mod:`quern.pipeline.iterate.threads`, the worker processes'
:mod:`quern.pipeline.iterate.workers`; the design is in ``docs/design/iterator.md``.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn, TypedDict, cast

from .. import execute
from ..core.errors import StepTimeoutError, StreamTimeoutError
from ..integrity.ledger import DIGEST, LedgerWriter
from ..order.index import check_int, host_rows
from ..remote.lookahead import CACHE_COUNTS, LOOKAHEAD, Lookahead
from . import threads as loader_threads
from .service import RayService, ServiceFeed
from .threads import Chunk
from .timing import LIVE, StepClock, add, batch_nbytes, ema, prefetch_window
from .workers import WorkerPool, sigint_deferred

__all__ = [
    "PipelineIterator",
    "IteratorOptions",
    "PREFETCH",
    "PREFETCH_MEMORY",
    "THREAD_READ_RECORDS",
    "THREAD_READ_STEPS",
]

THREAD_READ_RECORDS = 4096  # num_workers=0: about this many records per bulk read...
THREAD_READ_STEPS = 16  # ...but at most this many steps
PREFETCH = 2  # chunks (threads) or tasks per worker always in flight
PREFETCH_MEMORY = 2 << 30  # bytes of batches the adaptive prefetch window may hold
WINDOW_EVERY = 8  # steps between updates of the adaptive prefetch window


class IteratorOptions(TypedDict, total=False):
    """The keyword-only options of :class:`PipelineIterator`, typed.

    Their defaults are its signature's; ``Pipeline.iterator(start_step, **options)``
    and ``Pipeline.resume(state, **options)`` take them.
    """

    process_index: int
    process_count: int
    num_workers: int
    prefetch: int | None
    num_threads: int
    read_ahead: int | None
    copy_batches: bool
    lookahead: int
    prefetch_memory: int
    timings: bool
    step_timeout: float | None
    ledger: str | os.PathLike | None
    service: RayService | None


class PipelineIterator:
    """Yields the batches of ``pipe`` for steps ``start_step, start_step + 1, ...`` in order.

    What it yields at step ``s`` is exactly ``pipe.batch_at(s, process_index,
    process_count)``; no option below changes a byte of a batch, only when and
    where it is computed. How chunks, the prefetch window, workers, lookahead,
    the deadline and closing work: ``docs/design/iterator.md``.

    Args:
        pipe: the pipeline.
        start_step: the first step to yield.
        process_index: this host.
        process_count: the number of hosts.
        num_workers: worker processes computing the steps (0: threads in this process).
        prefetch: chunks (threads) or tasks per worker kept in flight (``None``:
            adaptive, at least :data:`PREFETCH`).
        num_threads: threads computing chunks (``num_workers=0`` only).
        read_ahead: steps per chunk or task, read in one bulk call (``None``: chosen
            from the records per step).
        copy_batches: with workers, copy each batch out of shared memory instead of
            lending its slot.
        lookahead: steps whose remote shards are fetched ahead (0: off).
        prefetch_memory: the bytes of batches the adaptive prefetch window may hold.
        timings: measure the seconds per stage (see :meth:`stats`).
        step_timeout: the most seconds ``next()`` waits for a batch (``None``: no
            deadline); then :class:`quern.StepTimeoutError`.
        ledger: append a line per step yielded to this file (``{process_index}`` in it
            is replaced by this host's index): the step's fingerprint, host slice and
            digests, computed where the batch is made (with workers, in the workers);
            see :mod:`quern.pipeline.integrity.ledger`. ``None``: no ledger.
        service: compute the steps on this :class:`quern.RayService`'s actors instead of
            here (``prefetch``: units per actor in flight; ``read_ahead``: steps per unit;
            see :mod:`quern.pipeline.iterate.service`). ``None``: no service.

    Raises:
        ValueError: an option is out of range, ``num_threads`` is given with workers, or
            ``service`` with ``num_workers``.
        ServiceError: the service is closed, holds another pipeline, or its actors disagree
            with this process (quern version, index format, fingerprint).
        TypeError: ``step_timeout`` is not a number.
        OSError: the ledger cannot be opened for appending.

    Attributes:
        step: the step of the batch the next ``next()`` returns.
        window: the adaptive prefetch window, in batches (0: not adaptive).
    """

    def __init__(
        self,
        pipe: execute.Definition,
        start_step: int = 0,
        *,
        process_index: int = 0,
        process_count: int = 1,
        num_workers: int = 0,
        prefetch: int | None = None,
        num_threads: int = 1,
        read_ahead: int | None = None,
        copy_batches: bool = False,
        lookahead: int = LOOKAHEAD,
        prefetch_memory: int = PREFETCH_MEMORY,
        timings: bool = True,
        step_timeout: float | None = None,
        ledger: str | os.PathLike | None = None,
        service: RayService | None = None,
    ) -> None:
        self._closed = True
        self._ledger: LedgerWriter | None = None
        self._pid = os.getpid()  # the process it belongs to
        self._owner: dict[str, int] = {}  # "thread": the ident of the thread that has the iterator
        self._inside = False  # that thread is inside next() or close()
        self._stop_waiting = False  # close() was called: a waiting next() gives up
        self._close_after = False  # close() was called from inside next() (a signal handler): close on return
        self.pipe = pipe
        self.step = pipe.check_step(start_step, name="start_step", end_ok=True)
        self.num_workers = check_int(num_workers, "num_workers", 0)
        self.adaptive = prefetch is None
        self.prefetch = PREFETCH if prefetch is None else check_int(prefetch, "prefetch", 1)
        self.prefetch_memory = check_int(prefetch_memory, "prefetch_memory", 1)
        self.timed = bool(timings)
        self.step_timeout = loader_threads.check_step_timeout(step_timeout)
        self._failed: StepTimeoutError | None = None  # num_workers=0: a step timed out, its thread left running
        self._abandon = threading.Event()  # ...and the prefetch threads stop waiting for the stuck chunk
        self._computing: dict[int, threading.Thread] = {}  # with step_timeout: first step -> thread computing it
        self.clock = StepClock()  # the caller's side: data wait, step period
        self.timings: dict[str, float] = {}  # seconds per stage, over the threads' chunks (workers: the pool's)
        self._computed = 0  # steps the threads computed (whose stage times are in timings)
        self._load: float | None = None  # the threads' seconds per batch over their number (a moving average)
        self._batch_bytes: int | None = None  # the largest batch measured: what the window's budget counts
        self.window = 0  # the adaptive prefetch window, batches (0: not adaptive)
        self.num_threads = check_int(num_threads, "num_threads", 1)
        if self.num_workers and self.num_threads != 1:
            raise ValueError(
                f"num_threads={num_threads} applies to num_workers=0 only; with num_workers={num_workers} "
                "each worker process computes its steps on one thread"
            )
        if service is not None and not isinstance(service, RayService):
            raise TypeError(f"service must be a quern.RayService or None, got {type(service).__name__}")
        if service is not None and self.num_workers:
            raise ValueError(
                f"service= and num_workers={num_workers} cannot be used together: the service's actors compute "
                "the steps (num_workers=0)"
            )
        self._service = service
        execute.check_hosts(pipe, process_count)  # every bucket's batch size, before the first step
        lo, hi = host_rows(pipe.batch_size or 0, process_index, process_count)  # validates the host slice now
        # remote sources: fetch the files of the next steps ahead, in the order they are read
        lookahead = check_int(lookahead, "lookahead", 0)
        self._lookahead = (
            Lookahead(pipe, process_index, process_count, steps=lookahead)
            if lookahead and Lookahead.wanted(pipe) and service is None  # a service's actors read for themselves
            else None
        )
        self._live = pipe.stream.wait_timeout()  # a live stream: the consumer's wait for a step's entries
        if self._live is not None and self.step_timeout is not None:
            raise ValueError(
                f"step_timeout={self.step_timeout:g} on a live stream: a step waiting for entries the producer has "
                "not written yet is not stuck; the source's timeout= is how long next() waits for them"
            )
        self._live_run: Any = None  # a live stream: this iterator's run, which its commits carry
        if self._live is not None:  # a resume checked against the live stream's commit record
            self._live_run = cast(Any, pipe.stream).start(pipe, self.step, int(process_index), int(process_count))
        if read_ahead is not None:
            read_ahead = check_int(read_ahead, "read_ahead", 1)
        elif self._live is not None:
            read_ahead = 1  # a step waits for its own entries only, never for later ones
        elif not self.num_workers and service is None:
            c = len(pipe.leaves)  # a mixture reads each component in its own calls: keep them as large
            read_ahead = execute.steps_per_read(hi - lo, THREAD_READ_RECORDS * c, THREAD_READ_STEPS * c)
        self.read_ahead = read_ahead  # with workers, None: chosen by the worker pool
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self._end = pipe.num_steps
        if ledger is not None:
            self._ledger = LedgerWriter(ledger, cast(Any, pipe), self.process_index, self.process_count, self.step)
        self._pending: collections.deque[tuple[int, int, cf.Future[Chunk]]] = collections.deque()
        self._ready: collections.deque[Any] = collections.deque()  # batches of the chunk being consumed
        self._chunk = 1
        self._careful_until = 0  # steps below this are computed one per task (after a failed chunk)
        self._workers: WorkerPool | ServiceFeed | None = None
        self._last_stats: dict[str, Any] = {"workers": 0}
        if self.num_workers:
            self._last_stats = {
                "workers": self.num_workers,
                "delivered_by_worker": [0] * self.num_workers,
                "computed_in_parent": 0,
                "worker_restarts": 0,
                "stages": {},
                "stage_steps": 0,
            }
        self._pool: cf.ThreadPoolExecutor | None = None
        if (service is not None or self.num_workers) and (self._end is None or self.step < self._end):
            shared: dict[str, Any] = {
                "process_index": self.process_index,
                "process_count": self.process_count,
                "prefetch": self.prefetch,
                "read_ahead": self.read_ahead,
                "end": self._end,
                "copy": bool(copy_batches),
                "timed": self.timed,
                "digests": self._ledger is not None,
            }
            try:
                if service is not None:
                    self._workers = ServiceFeed(service, pipe, start=self.step, **shared)
                else:
                    self._workers = WorkerPool(pipe, self.num_workers, **shared)
            except BaseException:
                if self._ledger is not None:
                    self._ledger.forget()
                raise
        elif not self.num_workers and service is None:
            self._pool = cf.ThreadPoolExecutor(self.num_threads, thread_name_prefix="quern-prefetch")
        # the workers' disk-cache counters (kept after they stop)
        self._worker_cache: dict[str, int] = self._workers.cache_counts if isinstance(self._workers, WorkerPool) else {}
        self._closed = False
        _LIVE.add(self)
        LIVE.add(self)  # quern.metrics reports it

    # ------------------------------------------------------------------ protocol

    def __iter__(self) -> PipelineIterator:
        return self

    def __next__(self) -> Any:
        t0 = self.clock.begin()
        batch = self._holding("next()", self._next)
        self.clock.end(t0)
        return batch

    def _holding(self, what: str, fn: Any, wait: bool = False) -> Any:
        """``fn()``, with the iterator taken by this thread.

        Taking it is one atomic step (``dict.setdefault``), so that a Ctrl-C can never
        leave it taken by nobody: at worst, one landing right after it leaves it taken
        by this thread but not inside, which this thread's next call takes over.

        Raises:
            RuntimeError: the iterator belongs to another process, or (unless ``wait``)
                another thread has it, or this thread is already inside it.
        """
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"PipelineIterator.{what}: this iterator belongs to process {self._pid}, which made it; this is "
                f"process {os.getpid()}, a fork of it, where its worker processes and threads are not yours to "
                "use. Make a new iterator in this process (pipe.iterator(start_step=it.step, ...))"
            )
        me = threading.get_ident()
        mine = False
        try:
            owner = self._owner.setdefault("thread", me)
            if owner != me:
                if not wait:
                    raise RuntimeError(
                        f"PipelineIterator.{what} called while another thread is using this iterator (inside "
                        "next() or close()): an iterator serves one thread at a time; give each thread its own "
                        "iterator, or hand the batches over through a queue"
                    )
                self._wait_for_owner(me)
            elif self._inside:
                raise RuntimeError(
                    f"PipelineIterator.{what} called while this thread is inside next() or close() of the same "
                    "iterator (from a signal handler or a transform?)"
                )
            mine = True
            self._inside = True
            return fn()
        finally:
            if mine:
                self._inside = False
                self._owner.pop("thread", None)
                if self._close_after:  # close() was called by a signal handler while this thread was inside
                    self._close_after = False
                    self.close()

    def _wait_for_owner(self, me: int) -> None:
        """Wait until the thread that has the iterator gives it back, and take it.

        A thread that has it but is not inside (left so by a Ctrl-C) loses it after 0.1 s.
        """
        idle_since, delay = None, 0.0005
        while self._owner.setdefault("thread", me) != me:
            if self._inside:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 0.1:
                self._owner["thread"] = me
                return
            time.sleep(delay)
            delay = min(2 * delay, 0.01)

    def _inside_here(self) -> bool:
        """Whether this thread is inside ``next()`` or ``close()`` (this call comes from a signal handler)."""
        return self._inside and self._owner.get("thread") == threading.get_ident()

    def _next(self) -> Any:
        """The next batch; with a ledger, its line kept (and the lines written on an error or the end)."""
        ledger = self._ledger
        if ledger is None:
            return self._next_batch()
        try:
            return self._next_batch()
        except BaseException:
            ledger.flush()  # a no-op once closed
            raise

    def _next_batch(self) -> Any:
        if self._closed:
            raise RuntimeError("iterator is closed")
        if self._failed is not None:
            raise RuntimeError(
                f"this iterator cannot go on: {self._failed.args[0]}\n(close it; to retry, make a new one with "
                f"pipe.iterator(start_step={self.step}, ...))"
            )
        if self._end is not None and self.step >= self._end:
            self._stop_workers()  # the stream is over: free the processes now
            raise StopIteration
        if self._lookahead is not None:
            self._lookahead.advance(self.step)
        if self._workers is not None:
            batch = self._workers.get(self.step, stop=self._waiting(self.step), timeout=self.step_timeout)
            self._adapt(batch)
            if self._ledger is not None:
                self._ledger.add(self.step, self._workers.last_digests)
            self.step += 1
            return batch
        if not self._ready:
            self._fill()
            first, count, fut = self._pending.popleft()
            assert first == self.step

            def stuck(thread: threading.Thread | None, where: str) -> NoReturn:
                self._time_out(first, count, thread, where)

            try:  # wait, but give up if the iterator is closed (by another thread) meanwhile
                batches, spent, seconds = loader_threads.wait(
                    fut,
                    first,
                    stopping=self._waiting(first),
                    step_timeout=self.step_timeout,
                    computing=self._computing,
                    stuck=stuck,
                )
                add(self.timings, spent)
                self._computed += count
                self._load = ema(self._load, seconds / count / self.num_threads)
            except StreamTimeoutError:  # a live stream's entries are not there yet: the chunk goes on being made
                self._pending.appendleft((first, count, fut))
                raise
            except BaseException as e:
                self._drop_pending()  # failed steps are recomputed if next() is called again
                if count == 1 or not isinstance(e, Exception) or self._stop_waiting or e is self._failed:
                    raise
                # the chunk failed at one of its steps: redo them one at a time so that an
                # error surfaces at exactly its own step and the good steps before it are yielded
                self._careful_until = first + count
                batches = execute.batches_at(self.pipe, self.step, 1, self.process_index, self.process_count)
            self._ready.extend(batches)
        self._adapt(self._ready[0])  # before the batch is taken: a Ctrl-C in here loses nothing
        self._fill(taking=1)
        if self._ledger is not None:  # its rows hashed now, as it is yielded (its line made with the next write)
            t0 = time.perf_counter()
            self._ledger.add_batch(self.step, self._ready[0])
            if self.timed:
                add(self.timings, {DIGEST: time.perf_counter() - t0})
        self.step += 1
        return self._ready.popleft()

    def _time_out(self, first: int, count: int, thread: threading.Thread | None, where: str) -> NoReturn:
        """Step ``self.step`` has not come within ``step_timeout``: raise :class:`StepTimeoutError`.

        The iterator stops; the thread that computes the chunk is left running.
        """
        steps = f"step {first}" if count == 1 else f"steps {first}..{first + count - 1}"
        name = f" ({thread.name})" if thread is not None else ""
        self._failed = StepTimeoutError(
            f"step {self.step} (host {self.process_index} of {self.process_count}): no batch within step_timeout="
            f"{self.step_timeout:g} s; the thread computing {steps}{name} is stuck {where}. Python cannot stop a "
            "thread: it is left running (a daemon thread, which does not keep the process from exiting), and this "
            "iterator cannot go on: close it (with num_workers > 0 a stuck worker process is killed and replaced "
            "instead, and the iterator goes on)"
        )
        self._abandon.set()  # the prefetch threads stop waiting for their chunks: close() never waits for it
        raise self._failed

    def _adapt(self, batch: Any) -> None:
        """With ``prefetch=None``: every few steps, update the prefetch window.

        It comes from the step time, the load time and the largest batch measured
        so far (``batch`` is measured).
        """
        if not self.adaptive or (self.step % WINDOW_EVERY and self.window):
            return
        self._batch_bytes = max(self._batch_bytes or 1, batch_nbytes(batch))
        load = self._workers.load if self._workers is not None else self._load
        self.window = prefetch_window(
            self.clock.step_time(), load, batch_bytes=self._batch_bytes, budget=self.prefetch_memory
        )
        if self._workers is not None:
            self._workers.ahead = self.window

    def _fill(self, taking: int = 0) -> None:
        """Keep ``prefetch`` chunks of steps in flight after the ones already computed.

        And more while fewer than the adaptive window's batches are ready or in
        flight (``taking``: of the ready ones, those about to be returned, which do
        not count).
        """
        nxt = self._pending[-1][0] + self._pending[-1][1] if self._pending else self.step + len(self._ready)
        assert self._pool is not None and self.read_ahead is not None
        ahead = len(self._ready) - taking + sum(c for _, c, _ in self._pending)
        while (len(self._pending) < self.prefetch or ahead < self.window) and (self._end is None or nxt < self._end):
            count = 1 if nxt < self._careful_until else self._chunk
            count = count if self._end is None else min(count, self._end - nxt)
            self._chunk = min(self.read_ahead, self._chunk * 2)
            args = (
                self.pipe,
                nxt,
                count,
                self.process_index,
                self.process_count,
                self.timed,
                self._pid,
            )
            with sigint_deferred():  # submitted and recorded, or neither: a Ctrl-C leaves no gap
                if self.step_timeout is None and self._live is None:
                    fut = self._pool.submit(loader_threads.compute, *args)
                else:
                    fut = self._pool.submit(loader_threads.compute_on_own_thread, self._abandon, self._computing, *args)
                self._pending.append((nxt, count, fut))
            nxt += count
            ahead += count

    def _drop_pending(self) -> None:
        for *_, fut in self._pending:
            fut.cancel()
        self._pending.clear()
        self._ready.clear()
        self._chunk = 1

    def state(self) -> dict:
        """A checkpoint: ``pipe.iterator(start_step=state["step"])`` resumes exactly.

        The fingerprint is computed on the first call (once per pipeline object): a
        transform or source it cannot describe stops checkpointing, not iteration.

        With a ledger, the lines of the steps yielded so far are written first, so a
        checkpoint is never ahead of its ledger.

        Returns:
            ``{"step": next step, "fingerprint": pipeline fingerprint}`` (a mixture
            adds what lets a resume accept a schedule edited after that step: see
            ``Pipeline.state_at``); JSON-serialisable.
        """
        if self._ledger is not None:
            self._ledger.flush()
        return self.pipe.state_at(self.step)

    def _stopping(self) -> bool:
        return self._stop_waiting

    def _waiting(self, step: int) -> Callable[[], bool]:
        """What a wait for ``step`` polls: whether close() was called.

        On a live stream it also raises :class:`~quern.pipeline.core.errors.StreamTimeoutError` once the
        wait passed the source's ``timeout``.
        """
        live = self._live
        if live is None:
            return self._stopping
        began = time.monotonic()

        def poll() -> bool:
            if self._stop_waiting:
                return True
            if time.monotonic() - began >= live:
                raise self.pipe.stream.late(self.pipe, step, self.process_index, self.process_count, live)
            return False

        return poll

    def commit(self, step: int) -> None:
        """Record, beside a live stream's log, that every step before ``step`` was trained by this host.

        Call it once the model's state that includes step ``step - 1`` is durable (a
        checkpoint written): a trainer restarted at ``source.committed()`` then gets
        exactly the steps not committed, with the same bytes. See
        :class:`~quern.pipeline.sources.RedisStreamSource` for the delivery guarantee.

        Args:
            step: the step after the last one trained; at most :attr:`step` (the steps before
                it have been yielded).

        Raises:
            ValueError: the pipeline is not over a live stream, or ``step`` was not yielded yet.
            SourceError: the commit cannot be written.
        """
        step = check_int(step, "step", 0)
        if self.pipe.stream.wait_timeout() is None:
            self.pipe.stream.commit(self.pipe, step, self.process_index, self.process_count)  # raises: not live
        if step > self.step:
            raise ValueError(
                f"commit({step}): step {step - 1} was not yielded yet (this iterator yielded the steps before "
                f"{self.step}); commit the step after the last one trained"
            )
        cast(Any, self.pipe.stream).commit(self.pipe, step, self.process_index, self.process_count, self._live_run)

    def wait_for_workers(self, timeout: float | None = None) -> bool:
        """Block until every worker process has started, or ``timeout`` seconds pass first.

        Never needed for correctness: ``next()`` waits for the batch it needs (no
        step is ever computed in this process); useful before timing, say, or to
        see start-up errors early.

        Args:
            timeout: the most seconds to wait (``None``: no limit).

        Returns:
            Whether every worker process has started (True without workers).

        Raises:
            RuntimeError: the iterator is closed, belongs to another process, or
                another thread is using it.
        """
        return bool(self._holding("wait_for_workers()", lambda: self._wait_for_workers(timeout)))

    def _wait_for_workers(self, timeout: float | None) -> bool:
        if self._closed:
            raise RuntimeError("iterator is closed")
        return True if self._workers is None else self._workers.wait_ready(timeout)

    def stats(self) -> dict:
        """Figures since the iterator started (see :mod:`quern.pipeline.iterate.timing`).

        Returns:
            ``steps``, ``first_batch_s``, ``data_wait``, ``step_period``,
            ``bubble_rate``, ``bubble_rate_total`` and ``health`` (the caller's loop);
            ``stages`` and ``stage_steps`` (seconds per stage, empty with
            ``timings=False``); ``host_prefetch`` (``ready``, ``in_flight``, ``depth``,
            ``window``); ``workers`` (and, with workers, ``delivered_by_worker``,
            ``worker_restarts``, ``computed_in_parent``); ``service`` with a service
            (:meth:`quern.pipeline.iterate.service.ServiceFeed.stats`); ``disk_cache`` for sources
            read by URL. Each figure is described in ``docs/design/iterator.md``.
        """
        pool = self._workers
        if pool is None:
            out = dict(self._last_stats)
            if not self.num_workers and self._service is None:
                pending = list(self._pending)  # one C call: safe while next() runs in another thread (a scrape)
                ready, in_flight = len(self._ready), sum(c for _, c, _ in pending)
                depth = max(self.prefetch * (self.read_ahead or 1), self.window)
                out["stages"], out["stage_steps"] = dict(self.timings), self._computed
            else:  # the workers have stopped: their last figures
                ready = in_flight = depth = 0
        elif isinstance(pool, ServiceFeed):
            ready, in_flight = pool.in_flight()
            depth = pool.num_workers * pool.in_flight_limit()
            out = {
                "workers": 0,
                "service": pool.stats(),
                "stages": dict(pool.timings),
                "stage_steps": pool.timed_steps,
            }
        else:
            ready, in_flight = pool.in_flight()
            depth = self.num_workers * pool.in_flight_limit()
            out = {
                "workers": self.num_workers,
                "delivered_by_worker": list(pool.delivered),
                "computed_in_parent": pool.in_parent,
                "worker_restarts": pool.restarts,
                "stages": dict(pool.timings),
                "stage_steps": pool.timed_steps,
            }
        out["host_prefetch"] = {"ready": ready, "in_flight": in_flight, "depth": depth, "window": self.window}
        out.update(self.clock.figures())
        cache = self._lookahead.cache_stats() if self._lookahead is not None else None
        if self._worker_cache:  # the worker processes' reads and fetches
            cache = cache if cache is not None else dict.fromkeys(CACHE_COUNTS, 0)
            for k, v in list(self._worker_cache.items()):
                cache[k] += v
        if cache is not None:
            out["disk_cache"] = cache
        return out

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker processes (empty with ``num_workers=0`` or once closed)."""
        return self._workers.pids if self._workers is not None else []

    def close(self) -> None:
        """Stop the prefetch threads or worker processes and drop computed-ahead batches.

        With workers, when it returns no worker process and no shared memory is
        left. Idempotent; a Ctrl-C is held back until the workers have ended; a
        ``next()`` waiting in another thread gives up (see ``docs/design/iterator.md``);
        in a process forked from the iterator's own, it only drops this copy.
        """
        if os.getpid() != self._pid:
            self._forget()
            return
        if self._inside_here():  # a signal handler, while this thread is inside next() (or close())
            self._stop_waiting = self._close_after = True
            if self._workers is not None:
                self._workers.wake()
            return
        if self._closed and self._workers is None and self._pool is None and self._ledger is None:
            return
        self._stop_waiting = True  # a next() waiting in another thread gives up...
        if self._workers is not None:
            self._workers.wake()
        self._holding("close()", self._close, wait=True)  # ...and returns

    def _close(self) -> None:
        self._closed = True
        LIVE.discard(self)  # no longer reported to quern.metrics
        if self._lookahead is not None:
            self._lookahead.close()  # queued fetches ahead are dropped
        self._drop_pending()
        if self._live is not None:
            self._abandon.set()  # threads waiting for a live stream's entries give up
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._stop_workers()
        if self._ledger is not None:
            ledger, self._ledger = self._ledger, None
            ledger.close()  # the lines of the steps yielded are written

    def _stop_workers(self) -> None:
        """Stop the worker processes (a Ctrl-C waits until they are gone)."""
        with sigint_deferred():
            if self._workers is not None:
                self._last_stats = self.stats()
                self._workers.close()  # resumable: if this is interrupted, the next close() finishes it
                self._workers = None

    def _forget(self) -> None:
        """In a process forked from the iterator's own: drop this copy.

        The threads and worker processes, which belong to the other process, are
        not touched.
        """
        self._closed = True
        self._pending.clear()
        self._ready.clear()
        if self._ledger is not None:  # its lines are the other process's to write
            ledger, self._ledger = self._ledger, None
            ledger.forget()
        self._pool = None  # its threads do not exist in this process
        if self._workers is not None:
            self._last_stats = self.stats()
            workers, self._workers = self._workers, None
            workers.forget()

    def __enter__(self) -> PipelineIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"PipelineIterator(step={self.step}, host={self.process_index}/{self.process_count})"


_LIVE: weakref.WeakSet[PipelineIterator] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit, close the iterators still open (their workers with them).

    Every one of them is closed, even if a Ctrl-C comes meanwhile.
    """
    for it in list(_LIVE):
        try:
            it.close()
        except BaseException:
            pass
