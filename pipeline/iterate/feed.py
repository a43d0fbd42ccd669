"""Where an iterator's batches come from: the :class:`Feed` interface.

A feed computes the steps of one host slice, somewhere, and hands them to a
:class:`~quern.PipelineIterator` in step order. Three feeds implement it:

- :class:`~quern.pipeline.iterate.threads.ThreadFeed`: threads of this process
  (``num_workers=0``);
- :class:`~quern.pipeline.iterate.workers.WorkerPool`: worker processes
  (``num_workers > 0``);
- :class:`~quern.pipeline.iterate.service.ServiceFeed`: a
  :class:`~quern.RayService`'s actors (``service=``).

:func:`quern.pipeline.iterate.backends.open_feed` chooses one; the iterator
holds the order, the deadline, the ledger, the checkpoint and closing, the
same whichever feed it has. The design is in ``docs/design/iterator.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

from ..integrity.ledger import LedgerWriter

__all__ = ["Batch", "Feed", "FeedSettings", "FeedStats", "HostPrefetch", "Stopped", "worker_figures"]

Batch = Any  # a step's batch: whatever the pipeline's collate and batch transforms make (user data)


class HostPrefetch(TypedDict):
    """The steps a feed holds ahead of the iterator (``stats()["host_prefetch"]``, less the window)."""

    ready: int  # computed, not yet taken
    in_flight: int  # being computed (with workers: sent, not yet delivered)
    depth: int  # the most steps kept ahead now


class FeedStats(TypedDict, total=False):
    """A feed's figures, the part of ``PipelineIterator.stats()`` that depends on where steps are computed.

    See ``docs/design/iterator.md`` for each one.
    """

    workers: int  # worker processes (0: threads, or a service)
    delivered_by_worker: list[int]  # workers: steps each delivered
    computed_in_parent: int  # workers: always 0
    worker_restarts: int  # workers: workers replaced after dying
    service: dict[str, object]  # a service: its figures
    stages: dict[str, float]  # seconds per stage, summed over threads, workers or actors
    stage_steps: int  # the steps those seconds are for
    host_prefetch: HostPrefetch
    tuning: dict[str, object]  # num_workers="auto": what was tried, measured and chosen, and why


@dataclass(frozen=True)
class FeedSettings:
    """What every feed is told, from the iterator's options (checked).

    Attributes:
        start: the first step the iterator asks for.
        end: the step where the stream ends (``None``: endless).
        process_index: this host.
        process_count: the number of hosts.
        prefetch: chunks, tasks or units (per worker or actor) kept in flight at least.
        read_ahead: steps per chunk, task or unit (``None``: the feed chooses).
        timed: measure the seconds per stage.
        digests: compute each batch's ledger fields where it is made, when the feed can.
        copy: hand over batches the caller may keep without holding a feed's memory.
        live: the stream is live (a step may wait for entries not written yet).
    """

    start: int
    end: int | None
    process_index: int
    process_count: int
    prefetch: int
    read_ahead: int | None
    timed: bool
    digests: bool
    copy: bool
    live: bool


class Feed(Protocol):
    """The batches of one host slice, computed ahead, handed over in step order.

    What a feed guarantees: :meth:`get` returns the batches of consecutive steps in
    step order, each bit-identical to ``pipe.batch_at(step, process_index,
    process_count)``, whatever computed it (a thread, a worker process, an actor)
    and whenever. A feed holds no data-order state an iterator needs back: the
    iterator's step is the whole position, so an iterator may close its feed at a
    step boundary (between two ``get`` calls) and open another (another backend,
    other sizes) from that step, and yield the same bytes. A feed belongs to the
    process that made it (:meth:`forget` in a fork of it).

    Attributes:
        ahead: set by the iterator: the batches it wants in flight (its adaptive
            prefetch window); 0: the feed's own ``prefetch`` only.
    """

    ahead: int

    @property
    def load(self) -> float | None:
        """Seconds per batch over the feed's parallelism (a moving average; ``None``: none measured yet)."""
        ...

    @property
    def local(self) -> bool:
        """Whether the steps read their records on this machine (where fetching remote files ahead helps)."""
        ...

    @property
    def pids(self) -> list[int]:
        """Process ids of this machine's processes computing steps (empty for none, or once closed)."""
        ...

    @property
    def cache_counts(self) -> Mapping[str, int]:
        """Disk-cache counters of reads made outside this process, added up (kept after :meth:`close`)."""
        ...

    def get(self, step: int, *, stop: Callable[[], bool], timeout: float | None) -> Batch:
        """The batch of ``step``, waiting for it.

        Args:
            step: the step after the one returned last, the first step, or a step asked
                for again after it raised.
            stop: polled while waiting: give up when it returns true (it may raise, e.g.
                a live stream's wait that ran out).
            timeout: the most seconds to wait for this step (``None``: no deadline).

        Returns:
            The batch.

        Raises:
            StepError: the step raised where it was computed.
            StepTimeoutError: ``timeout`` passed.
            RuntimeError: ``stop()`` became true, or the feed cannot go on.
        """
        ...

    def add_to_ledger(self, ledger: LedgerWriter, step: int, batch: Batch) -> None:
        """Give ``ledger`` the line of ``step``, whose batch :meth:`get` returned last.

        Args:
            ledger: the iterator's ledger.
            step: the step.
            batch: its batch (hashed here when the feed did not hash it where it was made).
        """
        ...

    def stats(self) -> FeedStats:
        """The feed's figures so far; also once closed (then nothing is in flight).

        Safe to call from another thread while :meth:`get` runs.
        """
        ...

    def wait_ready(self, timeout: float | None) -> bool:
        """Block until whatever computes the steps has started, or ``timeout`` seconds pass.

        Returns:
            Whether it has started.
        """
        ...

    def wake(self) -> None:
        """Make a :meth:`get` waiting in another thread look at its ``stop`` soon; thread-safe."""
        ...

    def close(self) -> None:
        """Stop computing and drop the steps computed ahead. Idempotent; safe to call again if interrupted."""
        ...

    def forget(self) -> None:
        """In a process forked from the feed's own: drop this copy without touching the maker's threads or processes."""
        ...


def worker_figures(num_workers: int, delivered: list[int], restarts: int) -> FeedStats:
    """The figures of a feed of worker processes (with no stage timed yet).

    Args:
        num_workers: the worker processes.
        delivered: the steps each delivered.
        restarts: workers replaced after dying.

    Returns:
        ``workers``, ``delivered_by_worker``, ``computed_in_parent`` (always 0: no
        step is computed in the iterator's process), ``worker_restarts``, ``stages``
        and ``stage_steps``.
    """
    return {
        "workers": num_workers,
        "delivered_by_worker": list(delivered),
        "computed_in_parent": 0,
        "worker_restarts": restarts,
        "stages": {},
        "stage_steps": 0,
    }


class Stopped(Feed):
    """The feed of an iterator whose steps are no longer computed: its last figures.

    An iterator holds one from the start when it starts at the end of its stream
    (nothing is started), and in place of its feed once that is closed.

    Args:
        figures: what :meth:`stats` reports (with nothing in flight).
        local: whether the feed it stands for read on this machine.
        cache_counts: that feed's disk-cache counters (kept after it stopped).
    """

    def __init__(self, figures: FeedStats, *, local: bool, cache_counts: Mapping[str, int] | None = None) -> None:
        self.ahead = 0
        self._figures = figures
        self._local = local
        self._cache_counts: Mapping[str, int] = cache_counts if cache_counts is not None else {}

    @property
    def load(self) -> float | None:
        """``None``, nothing being computed."""
        return None

    @property
    def local(self) -> bool:
        """The value given."""
        return self._local

    @property
    def pids(self) -> list[int]:
        """An empty list, no process being started."""
        return []

    @property
    def cache_counts(self) -> Mapping[str, int]:
        """The value given."""
        return self._cache_counts

    def get(self, step: int, *, stop: Callable[[], bool], timeout: float | None) -> Batch:
        """Never called: the iterator stops first.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError(f"step {step}: this feed has stopped; no step is computed")

    def add_to_ledger(self, ledger: LedgerWriter, step: int, batch: Batch) -> None:
        """Never called (no batch)."""

    def stats(self) -> FeedStats:
        """The figures given, nothing in flight."""
        return {**self._figures, "host_prefetch": {"ready": 0, "in_flight": 0, "depth": 0}}

    def wait_ready(self, timeout: float | None) -> bool:
        """Return true, there being nothing to start."""
        return True

    def wake(self) -> None:
        """Nothing waits."""

    def close(self) -> None:
        """Nothing to stop."""

    def forget(self) -> None:
        """Nothing to drop."""
