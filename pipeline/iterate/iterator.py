"""The iterator: a pipeline's steps in order, computed ahead on threads, in worker processes or by a service.

The iterator holds no data-order state beyond the next step number: what it
yields at step ``s`` is exactly ``pipe.batch_at(s, process_index, process_count)``,
whatever the worker count, thread count, prefetch depth or timing. Where the
steps are computed is its :class:`~quern.pipeline.iterate.feed.Feed`, chosen by
:func:`~quern.pipeline.iterate.backends.open_feed`: threads
(:mod:`quern.pipeline.iterate.threads`), worker processes
(:mod:`quern.pipeline.iterate.workers`) or a service
(:mod:`quern.pipeline.iterate.service`); the order, the deadline, the ledger, the
checkpoint and closing are here, the same for all. The design is in
``docs/design/iterator.md``.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, TypedDict, TypeVar

from .. import execute
from ..core.timing import LIVE, StepClock, batch_nbytes, prefetch_window
from ..integrity.ledger import LedgerWriter
from ..order.index import check_int, host_rows
from ..remote.lookahead import CACHE_COUNTS, LOOKAHEAD, Lookahead
from ..sources.live_commits import Run
from ..streams.capabilities import Live, require
from .backends import auto_or_int, check_backend, open_feed
from .feed import Batch, Feed, FeedSettings, Stopped
from .service.ray_service import RayService
from .threads import THREAD_READ_RECORDS, THREAD_READ_STEPS, check_step_timeout

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = [
    "PipelineIterator",
    "IteratorOptions",
    "PREFETCH",
    "PREFETCH_MEMORY",
    "THREAD_READ_RECORDS",
    "THREAD_READ_STEPS",
]

PREFETCH = 2  # chunks (threads) or tasks per worker always in flight
PREFETCH_MEMORY = 2 << 30  # bytes of batches the adaptive prefetch window may hold
WINDOW_EVERY = 8  # steps between updates of the adaptive prefetch window
_T = TypeVar("_T")


class IteratorOptions(TypedDict, total=False):
    """The keyword-only options of :class:`PipelineIterator`, typed.

    Their defaults are its signature's; ``Pipeline.iterator(start_step, **options)``
    and ``Pipeline.resume(state, **options)`` take them.
    """

    process_index: int
    process_count: int
    num_workers: int | Literal["auto"]
    prefetch: int | None
    num_threads: int | Literal["auto"]
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
        num_workers: worker processes computing the steps (0: threads in this process;
            ``"auto"``: the iterator measures threads and one worker per CPU on its first
            steps and keeps the faster, or the cheaper when they are within 5%: see
            :mod:`quern.pipeline.iterate.auto` and ``stats()["tuning"]``).
        prefetch: chunks (threads) or tasks per worker kept in flight (``None``:
            adaptive, at least :data:`PREFETCH`).
        num_threads: threads computing chunks (``num_workers=0`` or ``"auto"``; ``"auto"``:
            1 and one per CPU are measured, as ``num_workers="auto"`` does).
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
        pipe: Pipeline,
        start_step: int = 0,
        *,
        process_index: int = 0,
        process_count: int = 1,
        num_workers: int | Literal["auto"] = 0,
        prefetch: int | None = None,
        num_threads: int | Literal["auto"] = 1,
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
        self._feed: Feed = Stopped({"workers": 0}, local=False)  # where the steps are computed
        self._feed_open = False  # it has to be closed
        self._lookahead: Lookahead | None = None
        self._pid = os.getpid()  # the process it belongs to
        self._owner: dict[str, int] = {}  # "thread": the ident of the thread that has the iterator
        self._inside = False  # that thread is inside next() or close()
        self._stop_waiting = False  # close() was called: a waiting next() gives up
        self._close_after = False  # close() was called from inside next() (a signal handler): close on return
        self.pipe = pipe
        self.step = pipe.check_step(start_step, name="start_step", end_ok=True)
        self.num_workers: int | Literal["auto"] = auto_or_int(num_workers, "num_workers", 0)
        self.adaptive = prefetch is None
        self.prefetch = PREFETCH if prefetch is None else check_int(prefetch, "prefetch", 1)
        self.prefetch_memory = check_int(prefetch_memory, "prefetch_memory", 1)
        self.timed = bool(timings)
        self.step_timeout = check_step_timeout(step_timeout)
        self.clock = StepClock()  # the caller's side: data wait, step period
        self._batch_bytes: int | None = None  # the largest batch measured: what the window's budget counts
        self.window = 0  # the adaptive prefetch window, batches (0: not adaptive)
        self.num_threads: int | Literal["auto"] = auto_or_int(num_threads, "num_threads", 1)
        service = check_backend(self.num_workers, self.num_threads, service)
        execute.check_hosts(pipe, process_count)  # every bucket's batch size, before the first step
        host_rows(pipe.batch_size or 0, process_index, process_count)  # validates the host slice now
        lookahead = check_int(lookahead, "lookahead", 0)
        self._live = pipe.stream.wait_timeout()  # a live stream: the consumer's wait for a step's entries
        if self._live is not None and self.step_timeout is not None:
            raise ValueError(
                f"step_timeout={self.step_timeout:g} on a live stream: a step waiting for entries the producer has "
                "not written yet is not stuck; the source's timeout= is how long next() waits for them"
            )
        self._live_run: Run | None = None  # a live stream: this iterator's run, which its commits carry
        if self._live is not None:  # a resume checked against the live stream's commit record
            self._live_run = require(pipe.stream, Live, "iterator").start(
                pipe, self.step, int(process_index), int(process_count)
            )
        if read_ahead is not None:
            read_ahead = check_int(read_ahead, "read_ahead", 1)
        elif self._live is not None:
            read_ahead = 1  # a step waits for its own entries only, never for later ones
        self.read_ahead = read_ahead  # None: chosen by the feed
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self._end = pipe.num_steps
        if ledger is not None:
            self._ledger = LedgerWriter(ledger, pipe, self.process_index, self.process_count, self.step)
        settings = FeedSettings(
            start=self.step,
            end=self._end,
            process_index=self.process_index,
            process_count=self.process_count,
            prefetch=self.prefetch,
            read_ahead=read_ahead,
            timed=self.timed,
            digests=self._ledger is not None,
            copy=bool(copy_batches),
            live=self._live is not None,
        )
        watch = self.step_timeout is not None or self._live is not None
        try:
            self._use_feed(
                open_feed(
                    pipe,
                    settings,
                    num_workers=self.num_workers,
                    num_threads=self.num_threads,
                    service=service,
                    watch=watch,
                )
            )
            # remote sources: fetch the files of the next steps ahead, in the order they are read
            if lookahead and self._feed.local and Lookahead.wanted(pipe):
                self._lookahead = Lookahead(pipe, self.process_index, self.process_count, steps=lookahead)
        except BaseException:
            self._stop_feed()
            if self._ledger is not None:
                self._ledger.forget()
            raise
        self._closed = False
        _LIVE.add(self)
        LIVE.add(self)  # quern.metrics reports it

    def _use_feed(self, feed: Feed) -> None:
        """Take the steps from ``self.step`` on from ``feed`` (the one before it stopped first).

        Called at a step boundary (not while ``next()`` runs). The batches do not change:
        every feed yields ``pipe.batch_at(s, ...)`` at step ``s``.
        """
        self._stop_feed()
        self._feed, self._feed_open = feed, True
        feed.ahead = self.window

    # ------------------------------------------------------------------ protocol

    def __iter__(self) -> PipelineIterator:
        return self

    def __next__(self) -> Batch:
        t0 = self.clock.begin()
        batch = self._holding("next()", self._next)
        self.clock.end(t0)
        return batch

    def _holding(self, what: str, fn: Callable[[], _T], wait: bool = False) -> _T:
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

    def _next(self) -> Batch:
        """The next batch; with a ledger, its line kept (and the lines written on an error or the end)."""
        ledger = self._ledger
        if ledger is None:
            return self._next_batch()
        try:
            return self._next_batch()
        except BaseException:
            ledger.flush()  # a no-op once closed
            raise

    def _next_batch(self) -> Batch:
        if self._closed:
            raise RuntimeError("iterator is closed")
        if self._end is not None and self.step >= self._end:
            self._stop_feed()  # the stream is over: free the threads or processes now
            raise StopIteration
        if self._lookahead is not None:
            self._lookahead.advance(self.step)
        batch = self._feed.get(self.step, stop=self._waiting(self.step), timeout=self.step_timeout)
        self._adapt(batch)
        if self._ledger is not None:  # its line made with the ledger's next write
            self._feed.add_to_ledger(self._ledger, self.step, batch)
        self.step += 1
        return batch

    def _adapt(self, batch: Batch) -> None:
        """With ``prefetch=None``: every few steps, update the prefetch window.

        It comes from the step time, the feed's load time and the largest batch
        measured so far (``batch`` is measured); the feed keeps that many batches
        in flight.
        """
        if not self.adaptive or (self.step % WINDOW_EVERY and self.window):
            return
        self._batch_bytes = max(self._batch_bytes or 1, batch_nbytes(batch))
        self.window = prefetch_window(
            self.clock.step_time(), self._feed.load, batch_bytes=self._batch_bytes, budget=self.prefetch_memory
        )
        self._feed.ahead = self.window

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
                stream = require(self.pipe.stream, Live, "a wait for entries")
                raise stream.late(self.pipe, step, self.process_index, self.process_count, live)
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
        stream = require(self.pipe.stream, Live, "commit")  # raises: not live
        if step > self.step:
            raise ValueError(
                f"commit({step}): step {step - 1} was not yielded yet (this iterator yielded the steps before "
                f"{self.step}); commit the step after the last one trained"
            )
        stream.commit(self.pipe, step, self.process_index, self.process_count, self._live_run)

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
        return self._feed.wait_ready(timeout)

    def stats(self) -> dict:
        """Figures since the iterator started (see :mod:`quern.pipeline.core.timing`).

        Returns:
            ``steps``, ``first_batch_s``, ``data_wait``, ``step_period``,
            ``bubble_rate``, ``bubble_rate_total`` and ``health`` (the caller's loop);
            ``stages`` and ``stage_steps`` (seconds per stage, empty with
            ``timings=False``); ``host_prefetch`` (``ready``, ``in_flight``, ``depth``,
            ``window``); ``workers`` (and, with workers, ``delivered_by_worker``,
            ``worker_restarts``, ``computed_in_parent``); ``service`` with a service
            (:meth:`quern.pipeline.iterate.service.ServiceFeed.service_stats`); ``disk_cache`` for sources
            read by URL. Each figure is described in ``docs/design/iterator.md``.
        """
        figures = self._feed.stats()
        out: dict[str, object] = dict(figures)
        out["host_prefetch"] = {**figures["host_prefetch"], "window": self.window}
        out.update(self.clock.figures())
        cache = self._lookahead.cache_stats() if self._lookahead is not None else None
        feed_cache = self._feed.cache_counts
        if feed_cache:  # the reads and fetches of the feed's other processes
            cache = cache if cache is not None else dict.fromkeys(CACHE_COUNTS, 0)
            for k, v in list(feed_cache.items()):
                cache[k] += v
        if cache is not None:
            out["disk_cache"] = cache
        return out

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker processes (empty with ``num_workers=0`` or once closed)."""
        return self._feed.pids

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
            self._feed.wake()
            return
        if self._closed and not self._feed_open and self._ledger is None:
            return
        self._stop_waiting = True  # a next() waiting in another thread gives up...
        self._feed.wake()
        self._holding("close()", self._close, wait=True)  # ...and returns

    def _close(self) -> None:
        self._closed = True
        LIVE.discard(self)  # no longer reported to quern.metrics
        if self._lookahead is not None:
            self._lookahead.close()  # queued fetches ahead are dropped
        self._stop_feed()
        if self._ledger is not None:
            ledger, self._ledger = self._ledger, None
            ledger.close()  # the lines of the steps yielded are written

    def _stop_feed(self, *, forget: bool = False) -> None:
        """Close the feed (``forget``: in a fork, drop its copy), keeping its last figures for :meth:`stats`.

        Each feed's ``close`` is idempotent: if a Ctrl-C cuts this short, the next
        call finishes it (a worker pool's holds the Ctrl-C back until its processes
        are gone).
        """
        if self._feed_open:
            feed = self._feed
            last = Stopped(feed.stats(), local=feed.local, cache_counts=feed.cache_counts)
            if forget:
                feed.forget()
            else:
                feed.close()
            self._feed, self._feed_open = last, False

    def _forget(self) -> None:
        """In a process forked from the iterator's own: drop this copy.

        The threads and worker processes, which belong to the other process, are
        not touched.
        """
        self._closed = True
        if self._ledger is not None:  # its lines are the other process's to write
            ledger, self._ledger = self._ledger, None
            ledger.forget()
        self._stop_feed(forget=True)

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
