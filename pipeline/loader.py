"""Execution: iterate a pipeline's steps in order, computing ahead on threads or
in worker processes (:mod:`quern.pipeline.workers`).

The iterator holds no data-order state beyond the next step number: what it
yields at step ``s`` is exactly ``pipe.batch_at(s, process_index, process_count)``,
whatever the worker count, thread count, prefetch depth or timing.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import math
import numbers
import os
import sys
import threading
import time
import weakref
from typing import Any, TypedDict

from . import execute
from .errors import StepTimeoutError, exit_if_forked
from .index import check_int, host_rows
from .lookahead import CACHE_COUNTS, LOOKAHEAD, Lookahead
from .timing import LIVE, StepClock, add, batch_nbytes, ema, prefetch_window, stage_now
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
    """The keyword-only options of :class:`PipelineIterator` (their defaults are its signature's),
    as ``Pipeline.iterator(start_step, **options)`` and ``Pipeline.resume(state, **options)`` take them."""

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


class PipelineIterator:
    """Yields the batches of ``pipe`` for steps ``start_step, start_step + 1, ...`` in order.

    Work is done in chunks of up to ``read_ahead`` consecutive steps (default:
    about 4096 records' worth, at most 16 steps, times the number of components
    of a mixture, whose components are read in calls of their own; the first chunks are smaller,
    for a quick first batch): the records of a whole chunk are read in one bulk
    call per file, which is several times faster than one call per step.
    ``prefetch`` chunks are computed ahead by ``num_threads`` background threads
    (bulk reads release the GIL for part of their time).

    ``prefetch=None`` (the default) adapts the depth: 2 chunks (or tasks per
    worker) always, and more while fewer than the prefetch window are ready or in
    flight, the window being ``max(2 x step time / load time, 5)`` batches
    (:func:`quern.pipeline.timing.prefetch_window`; step time: the caller's time
    between ``next()`` calls, load time: the loader's time per batch over its
    threads or workers, a moving average), at most ``prefetch_memory`` bytes of
    batches (default 2 GiB; a batch's size is that of the largest measured, every
    few steps: :func:`quern.pipeline.timing.batch_nbytes`). The 2 chunks or tasks
    always in flight are not counted against it. An int fixes the depth at that
    many chunks or tasks per worker. The depth changes no byte of any batch.

    With ``num_workers=W > 0``, W worker processes compute the steps instead
    (step ``s`` on worker ``s % W``), in tasks of ``read_ahead`` of their steps
    whose records are read in one bulk call (default: about 16384 records, at
    most 64 steps, fewer if the slots below would pass 256 MiB), with
    ``prefetch`` tasks per worker in flight. Batches come back through shared
    memory without a copy: their arrays are views into a worker's slot, lent to
    you until no array of the batch is alive, so a batch you hold is never
    overwritten (copy what you keep for long: one kept array keeps its whole
    batch's slot). Shared memory: at most ``W * prefetch * read_ahead`` batches
    in flight (with ``prefetch=None``, more while the adaptive window below asks
    for more: within ``prefetch_memory`` and half the file descriptors this
    process has free), plus the ones you hold. The stream's
    end frees the workers; see :mod:`quern.pipeline.workers` for start-up,
    faults and shutdown.

    ``copy_batches=True`` (with workers) copies each batch out of shared memory
    instead of lending the slot: one more copy per batch, but a batch you keep
    for long then holds no slot (``benchmarks/handover.py`` measures the cost).

    ``lookahead`` (steps, default 64; 0: off): for sources read by URL through the
    disk cache, the shards that the next ``lookahead`` steps read are fetched
    ahead in that order, and the cache evicts the one needed furthest ahead
    (see :mod:`quern.pipeline.lookahead`). It changes no byte of a batch.

    ``step_timeout`` (seconds, default ``None``: no deadline): when ``next()`` has
    waited that long for its step's batch, it raises :class:`quern.StepTimeoutError`
    (a ``StepError`` and a ``TimeoutError``) naming the step, host slice, stage and
    timeout. What is measured: from the moment ``next()`` begins waiting for step
    ``s`` (so a step computed ahead has had longer), not counting the time a worker
    process spends starting; with the threads, the clock starts again whenever the
    thread computing the chunk moves on to another step. The wait can include the
    bulk read of the records of the steps computed together with ``s`` (a chunk or
    task of up to ``read_ahead`` steps, or a remote shard's fetch): allow for that,
    or pass a smaller ``read_ahead``. With workers, the worker computing ``s`` is
    asked which stage it is in, killed, and a new one started in its place; the
    iterator stays usable: ``next()`` again computes step ``s`` again. With
    ``num_workers=0`` the thread computing it cannot be stopped (Python cannot kill a
    thread): it is left running (each chunk then runs on a daemon thread of its own,
    so a stuck one never keeps the process from exiting, nor ``close()`` from
    returning), and the iterator cannot go on: ``next()`` raises ``RuntimeError``
    saying so; close it, and make a new one to retry. The deadline never changes a
    byte of a batch.

    ``timings=True`` (the default) measures the seconds per stage (read, each
    transform, collate, send, handover) in the threads or workers; ``stats()``
    gives them, with the data wait and bubble rate of the caller's loop (see
    :meth:`stats`). ``timings=False`` skips the stage clock (the data wait is
    always measured: two clock reads per ``next()``).

    ``.step`` is the next step to be yielded (the step of the batch the next
    ``next()`` returns; after ``next()`` returned the batch of step ``s``, it is
    ``s + 1``), and
    ``.state()`` a JSON-serialisable checkpoint; ``pipe.iterator(start_step=
    state["step"])`` resumes exactly. Use as a context manager or call
    ``close()``; garbage collection also closes it.

    Processes and threads: an iterator belongs to the process that made it. In a
    process forked from that one, ``next()`` and ``wait_for_workers()`` raise
    ``RuntimeError`` (make a new iterator there, e.g. ``pipe.iterator(start_step=
    it.step)``); ``close()`` (and garbage collection, and exit) there only drops
    the copy, never touching the threads or worker processes, which stay the
    maker's (whose iterator stays usable). One thread at a time may use an
    iterator: ``next()`` while another thread is inside ``next()`` or ``close()``
    raises ``RuntimeError`` at once. ``close()`` may be called from any thread at
    any time: a ``next()`` that is waiting for a batch in another thread stops
    waiting and raises ``RuntimeError``, and ``close()`` returns once that
    ``next()`` has returned (a ``next()`` with the threads, or one computing a
    failed chunk's steps, finishes the step it is computing first). Called from a
    signal handler while ``next()`` runs in the same thread, ``close()`` takes
    effect when that ``next()`` returns. A Ctrl-C cannot stop ``close()`` half-way:
    it is held back until every worker process has ended, then raised.
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
    ) -> None:
        self._closed = True
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
        self.step_timeout = _check_step_timeout(step_timeout)
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
        execute.check_hosts(pipe, process_count)  # every bucket's batch size, before the first step
        lo, hi = host_rows(pipe.batch_size or 0, process_index, process_count)  # validates the host slice now
        # remote sources: fetch the files of the next steps ahead, in the order they are read
        lookahead = check_int(lookahead, "lookahead", 0)
        self._lookahead = (
            Lookahead(pipe, process_index, process_count, lookahead) if lookahead and Lookahead.wanted(pipe) else None
        )
        if read_ahead is not None:
            read_ahead = check_int(read_ahead, "read_ahead", 1)
        elif not self.num_workers:
            c = len(pipe.leaves)  # a mixture reads each component in its own calls: keep them as large
            read_ahead = execute.steps_per_read(hi - lo, THREAD_READ_RECORDS * c, THREAD_READ_STEPS * c)
        self.read_ahead = read_ahead  # with workers, None: chosen by the worker pool
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self._end = pipe.num_steps
        self._pending: collections.deque[tuple[int, int, cf.Future[_Chunk]]] = collections.deque()
        self._ready: collections.deque[Any] = collections.deque()  # batches of the chunk being consumed
        self._chunk = 1
        self._careful_until = 0  # steps below this are computed one per task (after a failed chunk)
        self._workers: WorkerPool | None = None
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
        if self.num_workers and (self._end is None or self.step < self._end):
            self._workers = WorkerPool(
                pipe,
                self.num_workers,
                self.process_index,
                self.process_count,
                self.prefetch,
                self.read_ahead,
                self._end,
                copy=bool(copy_batches),
                timed=self.timed,
            )
        elif not self.num_workers:
            self._pool = cf.ThreadPoolExecutor(self.num_threads, thread_name_prefix="quern-prefetch")
        # the workers' disk-cache counters (kept after they stop)
        self._worker_cache: dict[str, int] = self._workers.cache_counts if self._workers is not None else {}
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
        """``fn()`` with the iterator taken by this thread: a ``RuntimeError`` saying why
        when it belongs to another process, or (unless ``wait``) another thread has it.

        Taking it is one atomic step (``dict.setdefault``), so that a Ctrl-C can never
        leave it taken by nobody: at worst, one landing right after it leaves it taken
        by this thread but not inside, which this thread's next call takes over."""
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
        """Wait until the thread that has the iterator gives it back, and take it; one
        that has it but is not inside (left so by a Ctrl-C) loses it after 0.1 s."""
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
            batch = self._workers.get(self.step, stop=self._stopping, timeout=self.step_timeout)
            self._adapt(batch)
            self.step += 1
            return batch
        if not self._ready:
            self._fill()
            first, count, fut = self._pending.popleft()
            assert first == self.step
            moved: object = None  # with step_timeout: the step the chunk's thread was last seen in...
            since = time.monotonic()  # ...since then
            try:
                while True:  # wait, but give up if the iterator is closed (by another thread) meanwhile
                    try:
                        batches, spent, seconds = fut.result(timeout=0.1)
                        add(self.timings, spent)
                        self._computed += count
                        self._load = ema(self._load, seconds / count / self.num_threads)
                        break
                    except TimeoutError:
                        if fut.done():
                            raise
                        if self._stop_waiting:
                            raise RuntimeError("iterator closed while next() was waiting for its batch") from None
                    if self.step_timeout is not None:
                        thread = self._computing.get(first)
                        now = stage_now(_frame_of(thread))
                        if now.where != moved:  # it moved on to another step: the clock starts again
                            moved, since = now.where, time.monotonic()
                        elif time.monotonic() - since >= self.step_timeout:
                            self._time_out(first, count, thread, str(now))
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
        self.step += 1
        return self._ready.popleft()

    def _time_out(self, first: int, count: int, thread: threading.Thread | None, where: str) -> None:
        """Step ``self.step`` has not come within ``step_timeout``: raise :class:`StepTimeoutError`
        and stop the iterator, leaving the thread that computes the chunk running."""
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
        """With ``prefetch=None``: every few steps, the prefetch window from the step
        time, the load time and the largest batch measured so far (``batch`` is measured)."""
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
        """Keep ``prefetch`` chunks of steps in flight after the ones already computed,
        and more while fewer than the adaptive window's batches are ready or in flight
        (``taking``: of the ready ones, those about to be returned, which do not count)."""
        nxt = self._pending[-1][0] + self._pending[-1][1] if self._pending else self.step + len(self._ready)
        assert self._pool is not None and self.read_ahead is not None
        ahead = len(self._ready) - taking + sum(c for _, c, _ in self._pending)
        while (len(self._pending) < self.prefetch or ahead < self.window) and (self._end is None or nxt < self._end):
            count = 1 if nxt < self._careful_until else self._chunk
            count = count if self._end is None else min(count, self._end - nxt)
            self._chunk = min(self.read_ahead, self._chunk * 2)
            args = (self.pipe, nxt, count, self.process_index, self.process_count, self.timed, self._pid)
            with sigint_deferred():  # submitted and recorded, or neither: a Ctrl-C leaves no gap
                if self.step_timeout is None:
                    fut = self._pool.submit(_compute, *args)
                else:
                    fut = self._pool.submit(_compute_on_own_thread, self._abandon, self._computing, *args)
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
        """``{"step": next step, "fingerprint": pipeline fingerprint}`` (a mixture adds
        what lets a resume accept a schedule edited after that step: see
        ``Pipeline.state_at``); JSON-serialisable.

        The fingerprint is computed on the first call (once per pipeline object): a
        transform or source it cannot describe stops checkpointing, not iteration."""
        return self.pipe.state_at(self.step)

    def _stopping(self) -> bool:
        return self._stop_waiting

    def wait_for_workers(self, timeout: float | None = None) -> bool:
        """Block until every worker process has started (True), or ``timeout`` seconds
        pass first (False). Never needed for correctness: ``next()`` waits for the
        batch it needs (no step is ever computed in this process); useful before
        timing, say, or to see start-up errors early."""
        return bool(self._holding("wait_for_workers()", lambda: self._wait_for_workers(timeout)))

    def _wait_for_workers(self, timeout: float | None) -> bool:
        if self._closed:
            raise RuntimeError("iterator is closed")
        return True if self._workers is None else self._workers.wait_ready(timeout)

    def stats(self) -> dict:
        """Figures since the iterator started (see :mod:`quern.pipeline.timing`):

        - the caller's loop: ``steps`` (batches returned), ``first_batch_s``;
          ``data_wait`` (seconds blocked in ``next()``: ``last``, ``mean`` and ``max``
          over the last 100 steps, ``total``), ``step_period`` (seconds between the
          returns of two ``next()`` calls: ``last``, ``mean``), ``bubble_rate`` (wait /
          period over the last 100 steps), ``bubble_rate_total``, and ``health``
          (``healthy``, ``warning``, ``alarm``: the data wait against the step time,
          under 50% / above 80%; ``unknown`` before the second step). The first
          batch is only in ``first_batch_s``.
        - ``stages``: seconds per stage (``read`` (``read: NAME`` per component of a
          mixture), each transform by its label, ``collate``; with workers ``send``
          (a worker writing a batch to shared memory) and ``handover`` (this process
          taking it)), summed over the threads or workers, for the ``stage_steps``
          steps computed so far (steps computed ahead included); empty with
          ``timings=False``.
        - ``host_prefetch``: ``ready`` (batches computed, not yet returned),
          ``in_flight`` (steps being computed; with workers, sent and not yet
          delivered), ``depth`` (the most steps kept ahead now), ``window`` (the
          adaptive prefetch window in batches; 0 with a fixed ``prefetch``).
        - with workers: ``"workers": W``, ``delivered_by_worker``, ``worker_restarts``
          and ``computed_in_parent`` (always 0: no step is ever computed in this
          process when there are workers; kept for compatibility); the counts are
          kept after the workers stop. ``{"workers": 0}`` without.
        - ``disk_cache`` for sources read by URL: the counts of their disk caches
          (``hits``, ``misses``, ``bytes_fetched``, ``evictions``, ``retries``) in
          this process and, with workers, in the worker processes (each reports with
          the last batch of a task), and, with ``lookahead``, the bytes the cache
          folders hold, their ``capacity`` and the files being fetched ahead."""
        pool = self._workers
        if pool is None:
            out = dict(self._last_stats)
            if not self.num_workers:
                pending = list(self._pending)  # one C call: safe while next() runs in another thread (a scrape)
                ready, in_flight = len(self._ready), sum(c for _, c, _ in pending)
                depth = max(self.prefetch * (self.read_ahead or 1), self.window)
                out["stages"], out["stage_steps"] = dict(self.timings), self._computed
            else:  # the workers have stopped: their last figures
                ready = in_flight = depth = 0
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
        """Stop the prefetch threads or worker processes and drop computed-ahead
        batches; with workers, when it returns no worker process and no shared memory
        is left. Idempotent; a Ctrl-C is held back until the workers have ended; a
        ``next()`` waiting in another thread gives up (see the class docstring); in a
        process forked from the iterator's own, it only drops this copy."""
        if os.getpid() != self._pid:
            self._forget()
            return
        if self._inside_here():  # a signal handler, while this thread is inside next() (or close())
            self._stop_waiting = self._close_after = True
            if self._workers is not None:
                self._workers.wake()
            return
        if self._closed and self._workers is None and self._pool is None:
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
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._stop_workers()

    def _stop_workers(self) -> None:
        """Stop the worker processes (a Ctrl-C waits until they are gone)."""
        with sigint_deferred():
            if self._workers is not None:
                self._last_stats = self.stats()
                self._workers.close()  # resumable: if this is interrupted, the next close() finishes it
                self._workers = None

    def _forget(self) -> None:
        """In a process forked from the iterator's own: drop this copy without touching
        the threads and worker processes, which belong to the other process."""
        self._closed = True
        self._pending.clear()
        self._ready.clear()
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


_Chunk = tuple[list[Any], dict[str, float], float]


def _compute(
    pipe: execute.Definition, first: int, count: int, index: int, hosts: int, timed: bool, owner: int
) -> _Chunk:
    """On a prefetch thread: the batches of ``count`` steps from ``first``, the seconds
    per stage they took (empty when not ``timed``) and the wall time. In a process
    that a transform forked from ``owner`` (the iterator's process) and that came back
    here, it ends that process instead (:func:`~quern.pipeline.errors.exit_if_forked`):
    a copy with none of the other threads would wait for them forever."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    batches = execute.batches_at(pipe, first, count, index, hosts, timings if timed else None)
    exit_if_forked(owner, "the iterator's process")
    return batches, timings, time.perf_counter() - t0


def _compute_on_own_thread(
    abandon: threading.Event, computing: dict[int, threading.Thread], pipe: execute.Definition, first: int, *args: Any
) -> _Chunk:
    """On a prefetch thread, with ``step_timeout``: :func:`_compute` on a daemon thread of
    its own (recorded in ``computing`` while it runs, so the iterator can see its stage),
    waited for here until it ends or ``abandon`` is set (a step timed out): then this
    prefetch thread is free (``close()`` and interpreter exit can join it) and the
    daemon thread is left running."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, _compute(pipe, first, *args)))
        except BaseException as e:
            out.append((False, e))

    thread = threading.Thread(target=run, name=f"quern-step-{first}", daemon=True)
    computing[first] = thread
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if abandon.is_set() and thread.is_alive():
                raise RuntimeError(f"the iterator gave up on steps from {first} (step_timeout)")
    finally:
        computing.pop(first, None)
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _frame_of(thread: threading.Thread | None) -> Any:
    """The innermost frame of ``thread`` (``None`` when it is not running)."""
    ident = thread.ident if thread is not None else None
    return sys._current_frames().get(ident) if ident is not None else None


def _check_step_timeout(value: object) -> float | None:
    """``step_timeout``: ``None`` or a finite number of seconds above 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"step_timeout must be a number of seconds or None, got {value!r} ({type(value).__name__})")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"step_timeout must be a finite number of seconds above 0, or None; got {value!r}")
    return seconds


_LIVE: weakref.WeakSet[PipelineIterator] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit, close the iterators still open (their workers with them),
    every one of them even if a Ctrl-C comes meanwhile."""
    for it in list(_LIVE):
        try:
            it.close()
        except BaseException:
            pass
