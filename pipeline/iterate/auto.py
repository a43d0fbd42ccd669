"""``num_workers="auto"`` and ``num_threads="auto"``: the iterator tries its feeds and keeps the fastest.

Every feed yields ``pipe.batch_at(s)`` at step ``s``, so an iterator may close
one feed at a step boundary and open another from there without a byte of a
batch changing (:class:`~quern.pipeline.iterate.feed.Feed`). :class:`AutoFeed`
uses that to tune itself by measurement: it serves the first steps from
threads at once (the first batch comes as fast as with ``num_workers=0``),
measures the rate at which the caller gets its batches, then tries each other
candidate in turn (more threads; worker processes, started in the background
``warm`` steps ahead so that the threads go on serving while they start) and
keeps the first candidate within :data:`TOLERANCE` of the fastest measured: the
cheaper one when the caller's own step, not the data, sets the pace. What it
tried, measured and chose, and why, is ``it.stats()["tuning"]``.

A rate is steps per second of the caller's wall time over a window of at least
:data:`WINDOW_STEPS` steps and :data:`WINDOW_SECONDS` seconds, counted once the
candidate has served :data:`SETTLE_STEPS` steps and :data:`SETTLE_SECONDS`
seconds (its start is not its pace: a pool's tasks grow from one step). The prefetch
window and the steps per read stay the adaptive ones of each feed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from ..core.errors import WorkerError
from ..integrity.ledger import LedgerWriter
from ..sources.reading import usable_cores
from .feed import Batch, Feed, FeedSettings, FeedStats
from .threads import ThreadFeed
from .workers import WorkerPool

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = [
    "AUTO",
    "TOLERANCE",
    "WINDOW_SECONDS",
    "WINDOW_STEPS",
    "AutoFeed",
    "Candidate",
    "candidates",
    "worker_pool",
]

AUTO: Literal["auto"] = "auto"
TOLERANCE = 0.05  # a cheaper candidate within 5% of the fastest is kept
WINDOW_STEPS = 8  # a rate is measured over at least this many steps...
WINDOW_SECONDS = 0.7  # ...and this many seconds (batches come in bursts of a task or chunk: many in a window)
SETTLE_STEPS = 2  # a candidate's first batches are not counted...
SETTLE_SECONDS = 0.3  # ...nor those of its first 0.3 s (a pool's tasks and reads grow from one step)
WORKER_START_S = 0.6  # about how long worker processes take to deliver their first batch


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way of computing the steps: ``threads`` threads here, or ``workers`` worker processes."""

    threads: int = 1
    workers: int = 0

    @property
    def name(self) -> str:
        """``"num_workers=W"`` or ``"num_threads=T"``."""
        return f"num_workers={self.workers}" if self.workers else f"num_threads={self.threads}"


def worker_pool(pipe: Pipeline, num_workers: int, settings: FeedSettings) -> WorkerPool:
    """A :class:`~quern.pipeline.iterate.workers.WorkerPool` of ``num_workers`` processes, told ``settings``.

    Its first step is the one first asked for, or the one given to
    :meth:`~quern.pipeline.iterate.workers.WorkerPool.prime`.
    """
    s = settings
    return WorkerPool(
        pipe,
        num_workers,
        process_index=s.process_index,
        process_count=s.process_count,
        prefetch=s.prefetch,
        read_ahead=s.read_ahead,
        end=s.end,
        copy=s.copy,
        timed=s.timed,
        digests=s.digests,
    )


def candidates(num_workers: int | str, num_threads: int | str, cpus: int | None = None) -> list[Candidate]:
    """What an iterator with these options tries, cheapest first.

    Args:
        num_workers: an int, or ``"auto"``: also worker processes, one per CPU.
        num_threads: an int, or ``"auto"``: 1 thread, and one per CPU.
        cpus: the CPUs (default: those this process may run on).

    Returns:
        The candidates, cheapest first: threads (fewest first), then workers.

    Example:
        >>> [c.name for c in candidates("auto", "auto", cpus=4)]
        ['num_threads=1', 'num_threads=4', 'num_workers=4']
    """
    if not cpus:
        cpus = usable_cores()
    threads = [1, cpus] if num_threads == AUTO else [int(num_threads)]
    out = [Candidate(threads=t) for t in dict.fromkeys(threads)]
    if num_workers == AUTO:
        out.append(Candidate(workers=max(1, cpus)))
    return out


class AutoFeed(Feed):
    """The feed of ``num_workers="auto"`` or ``num_threads="auto"`` (see the module docstring).

    Args:
        pipe: the pipeline.
        settings: the iterator's settings.
        tries: the candidates, cheapest first (:func:`candidates`).
        watch: as for :class:`~quern.pipeline.iterate.threads.ThreadFeed`.
        clock: the time function (seconds).
    """

    def __init__(
        self,
        pipe: Pipeline,
        settings: FeedSettings,
        tries: list[Candidate],
        *,
        watch: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.pipe, self.settings, self.tries, self._watch, self._clock = pipe, settings, tries, watch, clock
        self._ahead = 0
        self._k = 0  # the candidate serving the steps
        self._feed: Feed = self._open(tries[0], settings.start)
        self._next: Feed | None = None  # a pool started ahead, serving from step self._switch_at
        self._switch_at: int | None = None
        self._served = 0  # steps the current candidate has served
        self._since: float | None = None  # when it served its first step
        self._last: int | None = None  # the step get() returned last
        self._booked: int | None = None  # the step booked last (a step asked again is not booked twice)
        self._t0: float | None = None  # when its measured window began
        self._n = 0  # steps in that window
        self.rates: dict[str, float] = {}
        self.tuning: dict[str, Any] = {
            "tries": [c.name for c in tries],
            "measured": self.rates,
            "chose": None,
            "why": "measuring",
            "at_step": None,
        }
        if len(tries) == 1:
            self._decide(settings.start, "one candidate: nothing to choose")

    # -- the feeds

    def _open(self, c: Candidate, start: int) -> Feed:
        s = dataclasses.replace(self.settings, start=start)
        if c.workers:
            feed: Feed = worker_pool(self.pipe, c.workers, s)
        else:
            feed = ThreadFeed(self.pipe, s, num_threads=c.threads, watch=self._watch)
        feed.ahead = self._ahead
        return feed

    def _use(self, k: int, feed: Feed) -> None:
        """Serve from candidate ``k``'s ``feed`` from now on (the one before it closed)."""
        old, self._feed, self._k = self._feed, feed, k
        self._served, self._t0, self._n, self._since = 0, None, 0, None
        old.close()

    # -- measuring and choosing

    def _left(self, step: int) -> int | None:
        return None if self.settings.end is None else self.settings.end - step

    def _decide(self, step: int, why: str) -> None:
        self.tuning.update(chose=self.tries[self._k].name, why=why, at_step=step)

    @property
    def decided(self) -> bool:
        """Whether the choice is made (the feed no longer switches)."""
        return self.tuning["chose"] is not None

    def _after(self, step: int) -> None:
        """Book the step just served (``step``), and move on to the next candidate or the choice when due."""
        if self.decided:
            return
        now = self._clock()
        self._served += 1
        if self._since is None:
            self._since = now
        if self._t0 is None and self._served >= SETTLE_STEPS and now - self._since >= SETTLE_SECONDS:
            self._t0, self._n = now, 0
        elif self._t0 is not None:
            self._n += 1
        nxt = step + 1
        if self._next is not None:  # a pool warming up: switch when its first step comes
            if self._switch_at == nxt:
                warmed, self._next = self._next, None
                self._use(self._k + 1, warmed)
            return
        if self._t0 is None or self._n < WINDOW_STEPS or now - self._t0 < WINDOW_SECONDS:
            return
        rate = self._n / (now - self._t0)
        self.rates[self.tries[self._k].name] = rate
        if self._k + 1 < len(self.tries):
            c = self.tries[self._k + 1]
            left = self._left(nxt)
            needs = max(SETTLE_STEPS, math.ceil(rate * SETTLE_SECONDS)) + max(
                WINDOW_STEPS, math.ceil(rate * WINDOW_SECONDS)
            )
            if c.workers:
                warm = math.ceil(rate * WORKER_START_S) + 1  # the threads serve these while the pool starts
                if left is not None and left <= warm + needs:
                    self._choose(nxt, "the stream ends before another candidate could be measured")
                    return
                pool: Feed | None = None
                try:
                    pool = self._open(c, nxt + warm)
                    assert isinstance(pool, WorkerPool)
                    pool.prime(nxt + warm)  # its workers start on their first tasks while the threads serve
                except Exception as e:  # not picklable, no shared memory, ...: the threads serve on
                    if pool is not None:
                        pool.close()
                    self.tries = self.tries[: self._k + 1]
                    self._choose(nxt, f"{c.name} cannot run this pipeline ({type(e).__name__}: {str(e)[:200]})")
                    return
                self._next, self._switch_at = pool, nxt + warm
            else:
                if left is not None and left <= needs:
                    self._choose(nxt, "the stream ends before another candidate could be measured")
                    return
                self._use(self._k + 1, self._open(c, nxt))
            return
        self._choose(nxt, None)

    def _choose(self, step: int, why: str | None) -> None:
        """Keep the cheapest candidate within :data:`TOLERANCE` of the fastest measured, from ``step`` on."""
        names = [c.name for c in self.tries]
        measured = {n: r for n, r in self.rates.items() if n in names}
        best = max(measured.values()) if measured else 0.0
        pick = next((i for i, n in enumerate(names) if n in measured and measured[n] >= (1 - TOLERANCE) * best), 0)
        if why is None:
            faster = pick == max(range(len(names)), key=lambda i: measured.get(names[i], -1.0))
            why = (
                f"{names[pick]} was the fastest measured ({measured[names[pick]]:,.1f} steps/s)"
                if faster
                else f"{names[pick]} was within {TOLERANCE:.0%} of the fastest ({best:,.1f} steps/s) and cheaper"
            )
        if pick != self._k:
            self._use(pick, self._open(self.tries[pick], step))
        self._decide(step, why)

    # -- the Feed interface

    @property
    def ahead(self) -> int:
        """The iterator's prefetch window, handed to the feed serving."""
        return self._ahead

    @ahead.setter
    def ahead(self, value: int) -> None:
        self._ahead = value
        self._feed.ahead = value
        if self._next is not None:
            self._next.ahead = value

    @property
    def load(self) -> float | None:
        """The serving feed's."""
        return self._feed.load

    @property
    def local(self) -> bool:
        """Always true: threads and workers read on this machine."""
        return True

    @property
    def pids(self) -> list[int]:
        """The worker processes' (serving or warming up)."""
        return self._feed.pids + (self._next.pids if self._next is not None else [])

    @property
    def cache_counts(self) -> Mapping[str, int]:
        """The serving feed's."""
        return self._feed.cache_counts

    def get(self, step: int, *, stop: Callable[[], bool], timeout: float | None) -> Batch:
        """The batch of ``step``.

        When ``step`` follows the step returned last, that one is booked first (its time
        measured, and the next candidate takes over here when due): a switch happens
        between two ``get`` calls, after the ledger had the batch before.
        """
        if self._last is not None and step == self._last + 1 and self._booked != self._last:
            self._booked = self._last
            self._after(self._last)
        try:
            batch = self._feed.get(step, stop=stop, timeout=timeout)
        except BaseException as e:
            self._t0, self._since, self._served = None, None, 0  # the time of an error is not a pace
            if not (isinstance(e, WorkerError) and not self.decided and self.tries[self._k].workers):
                raise
            # the workers of the trial cannot run it after all: back to the candidate before, at this step
            failed, self.tries = self.tries[self._k].name, self.tries[: self._k]
            self._use(self._k - 1, self._open(self.tries[-1], step))
            self._choose(step, f"{failed} failed ({str(e)[:200]})")
            batch = self._feed.get(step, stop=stop, timeout=timeout)
        self._last = step
        if not self.decided and self._left(step + 1) == 0:  # no get() follows to book it
            self._decide(step + 1, f"the stream ended while {self.tries[self._k].name} was measured")
        return batch

    def add_to_ledger(self, ledger: LedgerWriter, step: int, batch: Batch) -> None:
        """The serving feed's (the one that made ``batch``)."""
        self._feed.add_to_ledger(ledger, step, batch)

    def stats(self) -> FeedStats:
        """The serving feed's figures, and ``tuning``: what was tried, measured and chosen, and why."""
        out = self._feed.stats()
        out["tuning"] = dict(self.tuning, measured={k: round(v, 2) for k, v in self.rates.items()})
        if not self.decided:
            out["tuning"]["why"] = f"measuring {self.tries[self._k].name}"
        return out

    def wait_ready(self, timeout: float | None) -> bool:
        """The serving feed's."""
        return self._feed.wait_ready(timeout)

    def wake(self) -> None:
        """The serving feed's."""
        self._feed.wake()

    def close(self) -> None:
        """Close the serving feed and a pool warming up."""
        if self._next is not None:
            nxt, self._next = self._next, None
            nxt.close()
        self._feed.close()

    def forget(self) -> None:
        """Drop both copies (in a fork)."""
        if self._next is not None:
            self._next.forget()
        self._feed.forget()
