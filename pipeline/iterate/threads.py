"""The iterator's thread side (``num_workers=0``): chunks of steps computed on prefetch threads.

:class:`ThreadFeed` is the :class:`~quern.pipeline.iterate.feed.Feed` of
threads in this process: :func:`compute` runs a chunk of consecutive steps on
a prefetch thread; with ``step_timeout``, :func:`compute_on_own_thread` runs
it on a daemon thread of its own, whose stage :func:`wait` watches while the
caller waits. What a chunk holds is exactly ``pipe.batch_at(s, ...)`` for each
of its steps. With a ledger, the prefetch thread also digests each batch of the
chunk as it finishes the chunk (the batches are still in the CPU's cache then),
and the iterator hands the ledger those digests as it yields each batch. The
design is in ``docs/design/iterator.md``.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import math
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from .. import execute
from ..core.errors import StepTimeoutError, StreamTimeoutError, exit_if_forked
from ..core.timing import add, batch_nbytes, ema, stage_now
from ..integrity.digesting import Made, made_of
from ..integrity.ledger import DIGEST, LedgerWriter
from ..order.index import host_rows
from ..sources import waiting
from .feed import Batch, Feed, FeedSettings, FeedStats
from .workers.signals import sigint_deferred

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = [
    "Chunk",
    "THREAD_READ_RECORDS",
    "THREAD_CHUNK_BYTES",
    "THREAD_READ_STEPS",
    "ThreadFeed",
    "check_step_timeout",
    "compute",
    "compute_on_own_thread",
    "wait",
]

THREAD_READ_RECORDS = 4096  # about this many records per bulk read...
THREAD_READ_STEPS = 16  # ...but at most this many steps...
THREAD_CHUNK_BYTES = 16 << 20  # ...and, once a batch's size is known, about this many bytes of batches per chunk


class Chunk(NamedTuple):
    """What a prefetch thread computed for consecutive steps."""

    batches: list[Batch]  # one per step, in order
    seconds: dict[str, float]  # per stage; empty when not timed
    wall: float  # wall seconds of the whole chunk
    digests: list[Made | None]  # per batch, its ledger digests (None: made as it is yielded); empty: none asked for


def compute(
    pipe: Pipeline,
    first: int,
    count: int,
    index: int,
    hosts: int,
    timed: bool,
    owner: int,
    digests: bool = False,
) -> Chunk:
    """On a prefetch thread: the batches of ``count`` steps from ``first``.

    In a process that a transform forked from ``owner`` (the iterator's process)
    and that came back here, it ends that process instead
    (:func:`~quern.pipeline.core.errors.exit_if_forked`): a copy with none of the
    other threads would wait for them forever.

    Args:
        pipe: the pipeline.
        first: the first step.
        count: how many steps.
        index: this host.
        hosts: the number of hosts.
        timed: whether to measure the seconds per stage.
        owner: the process id of the iterator's process.
        digests: also digest the batches for the ledger once all are made, while the chunk is in
            the CPU's cache (:func:`~quern.pipeline.integrity.digesting.made_of`; a batch that cannot
            be digested gets ``None``, and raises where it is yielded).

    Returns:
        ``(batches, seconds per stage, wall seconds, digests)``; the seconds per stage are empty
        when not ``timed`` (with ``digests`` and ``timed`` they include the digests' seconds, as
        ``"digest"``), the digests empty without ``digests``.

    Raises:
        StepError: a step failed.
    """
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    batches = execute.batches_at(pipe, first, count, index, hosts, timings if timed else None)
    exit_if_forked(owner, "the iterator's process")
    made: list[Made | None] = []
    if digests:
        t1 = time.perf_counter()
        made = made_of(batches)
        if timed:
            add(timings, {DIGEST: time.perf_counter() - t1})
    return Chunk(batches, timings, time.perf_counter() - t0, made)


def compute_on_own_thread(
    abandon: threading.Event,
    computing: dict[int, threading.Thread],
    pipe: Pipeline,
    first: int,
    count: int,
    index: int,
    hosts: int,
    timed: bool,
    owner: int,
    digests: bool = False,
) -> Chunk:
    """On a prefetch thread, with ``step_timeout``: :func:`compute` on a daemon thread of its own.

    The daemon thread is recorded in ``computing`` while it runs, so the
    iterator can see its stage. It is waited for here until it ends or
    ``abandon`` is set (a step timed out): then this prefetch thread is free
    (``close()`` and interpreter exit can join it) and the daemon thread is left
    running.

    Args:
        abandon: set when the iterator gives up on its chunks.
        computing: first step -> the thread computing it (entries added and removed here).
        pipe: the pipeline.
        first: the first step.
        count: how many steps.
        index: this host.
        hosts: the number of hosts.
        timed: whether to measure the seconds per stage.
        owner: the process id of the iterator's process.
        digests: digest each batch for the ledger (see :func:`compute`).

    Returns:
        What :func:`compute` returns.

    Raises:
        RuntimeError: ``abandon`` was set before the chunk was done.
    """
    out: list[Chunk | BaseException] = []

    def run() -> None:
        try:
            with waiting.patient(abandon.is_set):  # a live stream's entries: waited for until abandoned
                out.append(compute(pipe, first, count, index, hosts, timed, owner, digests))
        except BaseException as e:
            out.append(e)

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
    value = out[0]
    if isinstance(value, BaseException):
        raise value
    return value


def wait(
    fut: cf.Future[Chunk],
    first: int,
    *,
    stopping: Callable[[], bool],
    step_timeout: float | None,
    computing: dict[int, threading.Thread],
    stuck: Callable[[threading.Thread | None, str], NoReturn],
) -> Chunk:
    """Wait for the chunk from step ``first``, giving up when the iterator is closed or the chunk is stuck.

    With ``step_timeout``, the stage of the thread computing the chunk is read
    every 0.1 s; the clock starts again whenever it moves on to another step.

    Args:
        fut: the chunk being computed.
        first: its first step.
        stopping: whether the iterator was closed meanwhile (by another thread).
        step_timeout: the seconds the thread may stay at one step (``None``: no deadline).
        computing: first step -> the thread computing it (see :func:`compute_on_own_thread`).
        stuck: called with that thread and its stage when the deadline passes; it raises.

    Returns:
        The chunk.

    Raises:
        RuntimeError: ``stopping()`` became true.
        Exception: what computing the chunk raised, or what ``stuck`` raises.
    """
    moved: object = None  # with step_timeout: the step the chunk's thread was last seen in...
    since = time.monotonic()  # ...since then
    while True:
        try:
            return fut.result(timeout=0.1)
        except TimeoutError:
            if fut.done():
                raise
            if stopping():
                raise RuntimeError("iterator closed while next() was waiting for its batch") from None
        if step_timeout is not None:
            thread = computing.get(first)
            now = stage_now(_frame_of(thread))
            if now.where != moved:  # it moved on to another step: the clock starts again
                moved, since = now.where, time.monotonic()
            elif time.monotonic() - since >= step_timeout:
                stuck(thread, str(now))


def _frame_of(thread: threading.Thread | None) -> FrameType | None:
    """The innermost frame of ``thread`` (``None`` when it is not running)."""
    ident = thread.ident if thread is not None else None
    return sys._current_frames().get(ident) if ident is not None else None


def check_step_timeout(value: object) -> float | None:
    """The ``step_timeout`` option, checked.

    Args:
        value: ``None`` or a number of seconds.

    Returns:
        ``None``, or the seconds as a float.

    Raises:
        TypeError: ``value`` is not a number (a bool is not).
        ValueError: it is not finite, or not above 0.

    Example:
        >>> check_step_timeout(30)
        30.0
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"step_timeout must be a number of seconds or None, got {value!r} ({type(value).__name__})")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"step_timeout must be a finite number of seconds above 0, or None; got {value!r}")
    return seconds


class ThreadFeed(Feed):
    """The :class:`~quern.pipeline.iterate.feed.Feed` of ``num_workers=0``: chunks of steps computed on threads here.

    Chunks of up to ``read_ahead`` consecutive steps (1, 2, 4, ... at first, for a
    quick first batch) are computed ahead on ``num_threads`` prefetch threads,
    ``prefetch`` chunks at least and more while fewer than :attr:`ahead` batches are
    ready or in flight. A chunk that fails at one of its steps is computed again
    one step at a time, so that the error surfaces at exactly its own step. Asked
    for another step than the next one (one asked for again after a Ctrl-C lost
    its batch), it drops what it computed ahead and goes on from that step.

    With ``step_timeout`` (or a live stream) each chunk runs on a daemon thread of
    its own (:func:`compute_on_own_thread`); a chunk stuck past the deadline is
    left running and the feed cannot go on (Python cannot stop a thread).

    With ``settings.digests`` (a ledger), the thread that computes a chunk of
    ``read_ahead`` steps (the prefetch thread, or its own thread when watched) digests
    its batches once it has made them all, while they are still in the CPU's cache
    (about 40 µs for a 513 KiB batch on the project's machine, against about 60 µs
    once the batch has left it, and less of the memory traffic the other threads
    wait on); :meth:`add_to_ledger` hands those digests over as the batch is
    yielded. Chunks of fewer steps (the first ones, while the chunk size grows; the
    last one of a stream) are not digested there: the iterator is waiting for the
    first ones, so their batches are hashed as they are yielded, while the prefetch
    thread goes on to the next chunk.

    Args:
        pipe: the pipeline.
        settings: the iterator's settings (``read_ahead=None``: about
            :data:`THREAD_READ_RECORDS` records, at most :data:`THREAD_READ_STEPS`
            steps, times the number of components of a mixture; and once the first
            batch is made, at most :data:`THREAD_CHUNK_BYTES` of batches).
        num_threads: prefetch threads.
        watch: run each chunk on a thread of its own, which can be watched and left
            behind (with ``step_timeout``, or on a live stream).

    Attributes:
        digesting: whether the chunks submitted from now on digest their batches
            (``settings.digests`` at first).
    """

    def __init__(self, pipe: Pipeline, settings: FeedSettings, *, num_threads: int, watch: bool) -> None:
        self.pipe, self.settings, self.num_threads = pipe, settings, num_threads
        read_ahead = settings.read_ahead
        if read_ahead is None:
            lo, hi = host_rows(pipe.batch_size or 0, settings.process_index, settings.process_count)
            c = len(pipe.leaves)  # a mixture reads each component in its own calls: keep them as large
            read_ahead = execute.steps_per_read(hi - lo, THREAD_READ_RECORDS * c, THREAD_READ_STEPS * c)
        self.read_ahead: int = read_ahead
        self.ahead = 0
        self.timings: dict[str, float] = {}  # seconds per stage, over the threads' chunks
        self._computed = 0  # steps computed (whose stage times are in timings)
        self._load: float | None = None
        self._watch = watch
        self._owner = os.getpid()
        self._at = settings.start  # the step of the first ready batch (or the next one asked for)
        self._pending: collections.deque[tuple[int, int, cf.Future[Chunk]]] = collections.deque()
        self._ready: collections.deque[tuple[Batch, Made | None]] = collections.deque()  # the chunk being taken
        self._last: tuple[int, Made | None] = (-1, None)  # the step get() returned last, its ledger digests
        self.digesting = settings.digests
        self._chunk = 1
        self._careful_until = 0  # steps below this are computed one per chunk (after a failed chunk)
        self._failed: StepTimeoutError | None = None  # a step timed out, its thread left running
        self._abandon = threading.Event()  # ...and the prefetch threads stop waiting for the stuck chunk
        self._computing: dict[int, threading.Thread] = {}  # watched: first step -> the thread computing it
        self._closed = False
        self._executor: cf.ThreadPoolExecutor | None = cf.ThreadPoolExecutor(
            num_threads, thread_name_prefix="quern-prefetch"
        )

    @property
    def load(self) -> float | None:
        """The threads' seconds per batch over their number (a moving average)."""
        return self._load

    @property
    def local(self) -> bool:
        """Whether the records are read here, which they always are (in this process)."""
        return True

    @property
    def pids(self) -> list[int]:
        """An empty list, the steps being computed in this process."""
        return []

    @property
    def cache_counts(self) -> Mapping[str, int]:
        """An empty mapping, the reads of this process being counted by its own disk caches."""
        return {}

    def get(self, step: int, *, stop: Callable[[], bool], timeout: float | None) -> Batch:
        """The batch of ``step``: see :meth:`Feed.get <quern.pipeline.iterate.feed.Feed.get>`.

        Args:
            step: the step.
            stop: polled every 0.1 s while waiting.
            timeout: the seconds the thread computing the step may stay at one step
                (the clock starts again when it moves on); ``None``: no deadline.

        Returns:
            The batch.

        Raises:
            StepError: the step raised.
            StepTimeoutError: the deadline passed; the thread is left running and the
                feed cannot go on.
            StreamTimeoutError: a live stream's entries did not come in time (the chunk
                goes on being computed).
            RuntimeError: ``stop()`` became true, the feed is closed, or a step timed out before.
        """
        if self._failed is not None:
            raise RuntimeError(
                f"this iterator cannot go on: {self._failed.args[0]}\n(close it; to retry, make a new one with "
                f"pipe.iterator(start_step={step}, ...))"
            )
        if self._closed:
            raise RuntimeError("iterator is closed")
        if step != self._at:  # not the next step: what was computed ahead is not what is asked for
            self._drop_pending()
            self._at = step
        if not self._ready:
            self._fill()
            first, count, fut = self._pending.popleft()
            assert first == step

            def stuck(thread: threading.Thread | None, where: str) -> NoReturn:
                self._time_out(step, first, count, thread, where, timeout)

            try:  # wait, but give up if the iterator is closed (by another thread) meanwhile
                batches, spent, seconds, made = wait(
                    fut, first, stopping=stop, step_timeout=timeout, computing=self._computing, stuck=stuck
                )
                add(self.timings, spent)
                self._computed += count
                self._load = ema(self._load, seconds / count / self.num_threads)
            except StreamTimeoutError:  # a live stream's entries are not there yet: the chunk goes on being made
                self._pending.appendleft((first, count, fut))
                raise
            except BaseException as e:
                self._drop_pending()  # failed steps are recomputed if asked for again
                if count == 1 or not isinstance(e, Exception) or e is self._failed or _stopping(stop):
                    raise
                # the chunk failed at one of its steps: redo them one at a time so that an
                # error surfaces at exactly its own step and the good steps before it are yielded
                self._careful_until = first + count
                s = self.settings
                batches = execute.batches_at(self.pipe, step, 1, s.process_index, s.process_count)
                made = []
            self._ready.extend(zip(batches, made or [None] * len(batches), strict=True))
            if batches and self.settings.read_ahead is None:  # large batches (images): smaller chunks
                cap = max(1, THREAD_CHUNK_BYTES // max(1, batch_nbytes(batches[0])))
                self.read_ahead = min(self.read_ahead, cap)
                self._chunk = min(self._chunk, self.read_ahead)
        self._fill(taking=1)  # before the batch is taken: a Ctrl-C in here loses nothing
        self._at = step + 1  # first, so that a Ctrl-C after it makes a step asked for again be recomputed
        batch, digests = self._ready.popleft()
        self._last = step, digests
        return batch

    def _time_out(
        self, step: int, first: int, count: int, thread: threading.Thread | None, where: str, timeout: float | None
    ) -> NoReturn:
        """Step ``step`` has not come within ``timeout``: raise :class:`StepTimeoutError`.

        The feed stops; the thread that computes the chunk is left running.
        """
        steps = f"step {first}" if count == 1 else f"steps {first}..{first + count - 1}"
        name = f" ({thread.name})" if thread is not None else ""
        s = self.settings
        self._failed = StepTimeoutError(
            f"step {step} (host {s.process_index} of {s.process_count}): no batch within step_timeout="
            f"{timeout:g} s; the thread computing {steps}{name} is stuck {where}. Python cannot stop a "
            "thread: it is left running (a daemon thread, which does not keep the process from exiting), and this "
            "iterator cannot go on: close it (with num_workers > 0 a stuck worker process is killed and replaced "
            "instead, and the iterator goes on)"
        )
        self._abandon.set()  # the prefetch threads stop waiting for their chunks: close() never waits for it
        raise self._failed

    def _fill(self, taking: int = 0) -> None:
        """Keep ``prefetch`` chunks of steps in flight after the ones already computed.

        And more while fewer than :attr:`ahead` batches are ready or in flight
        (``taking``: of the ready ones, those about to be returned, which do not count).
        """
        s, executor = self.settings, self._executor
        assert executor is not None
        nxt = self._pending[-1][0] + self._pending[-1][1] if self._pending else self._at + len(self._ready)
        queued = len(self._ready) - taking + sum(c for _, c, _ in self._pending)
        while (len(self._pending) < s.prefetch or queued < self.ahead) and (s.end is None or nxt < s.end):
            count = 1 if nxt < self._careful_until else self._chunk
            count = count if s.end is None else min(count, s.end - nxt)
            self._chunk = min(self.read_ahead, self._chunk * 2)
            digests = self.digesting and count >= self.read_ahead  # not the first, small chunks (see the class)
            args = (self.pipe, nxt, count, s.process_index, s.process_count, s.timed, self._owner, digests)
            with sigint_deferred():  # submitted and recorded, or neither: a Ctrl-C leaves no gap
                if self._watch:
                    fut = executor.submit(compute_on_own_thread, self._abandon, self._computing, *args)
                else:
                    fut = executor.submit(compute, *args)
                self._pending.append((nxt, count, fut))
            nxt += count
            queued += count

    def _drop_pending(self) -> None:
        for *_, fut in self._pending:
            fut.cancel()
        self._pending.clear()
        self._ready.clear()
        self._chunk = 1

    def add_to_ledger(self, ledger: LedgerWriter, step: int, batch: Batch) -> None:
        """Give ``ledger`` the digests the prefetch thread made of ``batch``, or hash it here (its line is made with the ledger's next write).

        Args:
            ledger: the iterator's ledger.
            step: the step.
            batch: its batch, the one :meth:`get` returned last (hashed here where its chunk did
                not digest it: a chunk of fewer than ``read_ahead`` steps, one step at a time
                after a failed chunk, one started while :attr:`digesting` was false, or a batch
                whose digests raised, which raises again here, naming the step).
        """
        t0 = time.perf_counter()
        (last, made), self._last = self._last, (-1, None)
        if made is None or last != step:  # not the digests of this step's batch: hashed here
            ledger.add_batch(step, batch)
        else:
            ledger.add_made(step, made)
        if self.settings.timed:
            add(self.timings, {DIGEST: time.perf_counter() - t0})

    def stats(self) -> FeedStats:
        """``workers`` (0), ``stages``, ``stage_steps`` and ``host_prefetch``."""
        pending = list(self._pending)  # one C call: safe while get() runs in another thread (a scrape)
        ready, in_flight = len(self._ready), sum(c for _, c, _ in pending)
        depth = 0 if self._closed else max(self.settings.prefetch * self.read_ahead, self.ahead)
        return {
            "workers": 0,
            "stages": dict(self.timings),
            "stage_steps": self._computed,
            "host_prefetch": {"ready": ready, "in_flight": in_flight, "depth": depth},
        }

    def wait_ready(self, timeout: float | None) -> bool:
        """Return true, threads starting at once."""
        return True

    def wake(self) -> None:
        """Nothing to do: a waiting :meth:`get` looks at its ``stop`` every 0.1 s."""

    def close(self) -> None:
        """Drop the chunks computed ahead and wait for the prefetch threads (not a thread left behind)."""
        self._closed = True
        self._drop_pending()
        if self.settings.live:
            self._abandon.set()  # threads waiting for a live stream's entries give up
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def forget(self) -> None:
        """In a fork: drop this copy (the threads do not exist in this process)."""
        self._closed = True
        self._pending.clear()
        self._ready.clear()
        self._executor = None


def _stopping(stop: Callable[[], bool]) -> bool:
    """Whether ``stop()`` says to give up (a ``stop`` that raises does not)."""
    try:
        return bool(stop())
    except Exception:
        return False
