"""Exact lookahead: fetch the remote shards that the next steps read, before they read them.

Every step's records are known from the plan (pure index arithmetic), so an
iterator at step ``s`` knows which files steps ``s .. s + K`` read, in the
order they read them. :class:`Lookahead` hands that order to each source that
can fetch ahead (a source with ``prefetch(ids)``, such as an ``ArrayRecordSource``
of a URL): the source fetches the files into its disk cache on background
threads, and tells the cache when each file is next needed, so the cache
evicts the file needed furthest in the future (Belady's rule) instead of the
least recently used one. Nothing here changes a byte of a batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["CACHE_COUNTS", "LOOKAHEAD", "Lookahead", "cache_counts", "records_of_steps"]

LOOKAHEAD = 64  # steps
CACHE_COUNTS = ("hits", "misses", "bytes_fetched", "evictions", "retries")  # a disk cache's counters


def _caches(sources: Any) -> list[Any]:
    """The distinct disk caches of ``sources`` (several sources may share one)."""
    found = {id(c): c for c in (getattr(src, "cache", None) for src in sources) if c is not None}
    return list(found.values())


def cache_counts(pipe: Pipeline) -> dict[str, int]:
    """This process's counters of the disk caches of ``pipe``'s sources, added up.

    A worker process reports them to the parent. A cache shared by several
    sources is counted once.

    Args:
        pipe: a pipeline (its ``sources`` are read).

    Returns:
        ``{name: count}`` for each name of :data:`CACHE_COUNTS`.
    """
    caches = _caches(pipe.sources)
    return {k: sum(c.stats.get(k, 0) for c in caches) for k in CACHE_COUNTS}


def records_of_steps(
    pipe: Pipeline, steps: range, process_index: int = 0, process_count: int = 1
) -> list[tuple[Any, np.ndarray, np.ndarray]]:
    """The records this host's rows of ``steps`` read, per source, in step order.

    The reads are those the pipeline's stream plans (``pipe.stream.reads``);
    steps past a finite pipeline's end are left out.

    Args:
        pipe: the pipeline.
        steps: the steps, consecutive.
        process_index: this host.
        process_count: the number of hosts.

    Returns:
        ``[(source, ids, steps)]``: per source read, the record ids in read order
        (they may repeat) and, for each, the step that reads it.
    """
    if not len(steps):
        return []
    end = getattr(pipe, "num_steps", None)
    if end is not None:
        steps = range(steps.start, min(steps.stop, end))
        if not len(steps):
            return []
    per = [pipe.positions(s, process_index, process_count) for s in steps]
    positions = np.concatenate(per)
    if not positions.size:
        return []
    step_of = np.repeat(np.asarray(steps, dtype=np.int64), [len(p) for p in per])
    return [(src, ids, step_of[rows]) for src, ids, rows in pipe.stream.reads(positions)]


class Lookahead:
    """Keeps the sources' fetches ``steps`` steps ahead of an iterator (see the module docstring).

    Args:
        pipe: the pipeline the iterator runs.
        process_index: this host.
        process_count: the number of hosts.
        steps: how many steps ahead the reads are handed to the sources.

    Attributes:
        sources: the sources of ``pipe`` that fetch ahead.
        last: the step of the last hand-over, or ``None``.
    """

    def __init__(
        self, pipe: Pipeline, process_index: int = 0, process_count: int = 1, *, steps: int = LOOKAHEAD
    ) -> None:
        self.pipe, self.process_index, self.process_count, self.steps = pipe, process_index, process_count, steps
        self.last: int | None = None  # the step of the last hand-over
        self._thread: Any = None  # the one thread that computes the window's reads
        self._running: Any = None
        self.sources: list[Any] = [
            src for src in pipe.sources if getattr(src, "fetches_ahead", False)
        ]  # prefetching ones

    @staticmethod
    def wanted(pipe: Pipeline) -> bool:
        """Whether ``pipe`` reads a source that fetches ahead (a remote one).

        Args:
            pipe: the pipeline.

        Returns:
            Whether a :class:`Lookahead` of it would do anything.
        """
        return any(getattr(src, "fetches_ahead", False) for src in pipe.sources)

    def advance(self, step: int) -> None:
        """Tell the sources that the iterator is at ``step``; hand them the next reads when due.

        Every quarter of the window, the reads of steps ``step .. step + steps``
        are handed over (each source fetches what fits its cache, in order). The
        plan of the window is computed on a background thread, not in the
        caller's ``next()``, one at a time (a hand-over still running is not
        queued again).

        Args:
            step: the step the iterator is at.
        """
        for src in self.sources:
            src.now = step  # what was read before this step is not needed any more
        if self.last is not None and self.last <= step < self.last + max(1, self.steps // 4):
            return
        if self._running is not None and not self._running.done():
            return
        if self._thread is None:
            import concurrent.futures

            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="quern-lookahead")
        self.last = step
        self._running = self._thread.submit(self._hand_over, step)

    def _hand_over(self, step: int) -> None:
        window = range(step, step + self.steps)
        for src, ids, at in records_of_steps(self.pipe, window, self.process_index, self.process_count):
            src.prefetch(ids, at)

    def close(self) -> None:
        """Stop: the hand-over thread ends, and the sources drop their queued fetches."""
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread = None
        for src in self.sources:
            src.stop_prefetch()

    def cache_stats(self) -> dict[str, Any]:
        """The disk caches of the sources fetching ahead, added up (see ``PipelineIterator.stats``).

        Returns:
            The counters of :data:`CACHE_COUNTS`, ``bytes_held``, ``capacity`` (``None``
            when a cache has no cap) and ``fetching`` (files being fetched now).
        """
        caches = _caches(self.sources)
        out: dict[str, Any] = {k: sum(c.stats.get(k, 0) for c in caches) for k in CACHE_COUNTS}
        out["bytes_held"] = sum(c.size() for c in caches)
        caps = [c.capacity for c in caches]
        out["capacity"] = None if not caps or None in caps else sum(caps)
        out["fetching"] = sum(len(getattr(src, "_fetching", ())) for src in self.sources)
        return out
