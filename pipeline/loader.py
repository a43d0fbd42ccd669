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
import weakref
from typing import Any

from . import execute
from .index import check_int, host_rows
from .workers import WorkerPool

__all__ = ["PipelineIterator", "THREAD_READ_RECORDS", "THREAD_READ_STEPS"]

THREAD_READ_RECORDS = 4096  # num_workers=0: about this many records per bulk read...
THREAD_READ_STEPS = 16  # ...but at most this many steps


class PipelineIterator:
    """Yields the batches of ``pipe`` for steps ``start_step, start_step + 1, ...`` in order.

    Work is done in chunks of up to ``read_ahead`` consecutive steps (default:
    about 4096 records' worth, at most 16 steps; the first chunks are smaller,
    for a quick first batch): the records of a whole chunk are read in one bulk
    call per file, which is several times faster than one call per step.
    ``prefetch`` chunks are computed ahead by ``num_threads`` background threads
    (bulk reads release the GIL for part of their time).

    With ``num_workers=W > 0``, W worker processes compute the steps instead
    (step ``s`` on worker ``s % W``), in tasks of ``read_ahead`` of their steps
    whose records are read in one bulk call (default: about 16384 records, at
    most 64 steps, fewer if the slots below would pass 256 MiB), with
    ``prefetch`` tasks per worker in flight. Batches come back through shared
    memory without a copy: their arrays are views into a worker's slot, lent to
    you until no array of the batch is alive, so a batch you hold is never
    overwritten (copy what you keep for long: one kept array keeps its whole
    batch's slot). Shared memory: at most ``W * prefetch * read_ahead`` batches
    in flight, plus the ones you hold. The stream's
    end frees the workers; see :mod:`quern.pipeline.workers` for start-up,
    faults and shutdown.

    ``copy_batches=True`` (with workers) copies each batch out of shared memory
    instead of lending the slot: one more copy per batch, but a batch you keep
    for long then holds no slot (``benchmarks/handover.py`` measures the cost).

    ``.step`` is the next step to be yielded (the step of the batch the next
    ``next()`` returns; after ``next()`` returned the batch of step ``s``, it is
    ``s + 1``), and
    ``.state()`` a JSON-serialisable checkpoint; ``pipe.iterator(start_step=
    state["step"])`` resumes exactly. Use as a context manager or call
    ``close()``; garbage collection also closes it.
    """

    def __init__(
        self,
        pipe: execute.Definition,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        num_workers: int = 0,
        prefetch: int = 2,
        num_threads: int = 1,
        read_ahead: int | None = None,
        copy_batches: bool = False,
    ) -> None:
        self._closed = True
        self.pipe = pipe
        self.step = pipe.check_step(start_step, "start_step", end_ok=True)
        self.num_workers = check_int(num_workers, "num_workers", 0)
        self.prefetch = check_int(prefetch, "prefetch", 1)
        self.num_threads = check_int(num_threads, "num_threads", 1)
        if self.num_workers and self.num_threads != 1:
            raise ValueError(
                f"num_threads={num_threads} applies to num_workers=0 only; with num_workers={num_workers} "
                "each worker process computes its steps on one thread"
            )
        lo, hi = host_rows(pipe.batch_size or 0, process_index, process_count)  # validates the host slice now
        if read_ahead is not None:
            read_ahead = check_int(read_ahead, "read_ahead", 1)
        elif not self.num_workers:
            read_ahead = execute.steps_per_read(hi - lo, THREAD_READ_RECORDS, THREAD_READ_STEPS)
        self.read_ahead = read_ahead  # with workers, None: chosen by the worker pool
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self._end = pipe.num_steps
        self._pending: collections.deque[tuple[int, int, cf.Future[list[Any]]]] = collections.deque()
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
            )
        elif not self.num_workers:
            self._pool = cf.ThreadPoolExecutor(self.num_threads, thread_name_prefix="quern-prefetch")
        self._closed = False
        _LIVE.add(self)

    # ------------------------------------------------------------------ protocol

    def __iter__(self) -> PipelineIterator:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise RuntimeError("iterator is closed")
        if self._end is not None and self.step >= self._end:
            self._stop_workers()  # the stream is over: free the processes now
            raise StopIteration
        if self._workers is not None:
            batch = self._workers.get(self.step)
            self.step += 1
            return batch
        if not self._ready:
            self._fill()
            first, count, fut = self._pending.popleft()
            assert first == self.step
            try:
                batches = fut.result()
            except BaseException as e:
                self._drop_pending()  # failed steps are recomputed if next() is called again
                if count == 1 or not isinstance(e, Exception):
                    raise
                # the chunk failed at one of its steps: redo them one at a time so that an
                # error surfaces at exactly its own step and the good steps before it are yielded
                self._careful_until = first + count
                batches = execute.batches_at(self.pipe, self.step, 1, self.process_index, self.process_count)
            self._ready.extend(batches)
            self._fill()
        self.step += 1
        return self._ready.popleft()

    def _fill(self) -> None:
        """Keep ``prefetch`` chunks of steps in flight after the ones already computed."""
        nxt = self._pending[-1][0] + self._pending[-1][1] if self._pending else self.step + len(self._ready)
        assert self._pool is not None and self.read_ahead is not None
        while len(self._pending) < self.prefetch and (self._end is None or nxt < self._end):
            count = 1 if nxt < self._careful_until else self._chunk
            count = count if self._end is None else min(count, self._end - nxt)
            self._chunk = min(self.read_ahead, self._chunk * 2)
            fut = self._pool.submit(execute.batches_at, self.pipe, nxt, count, self.process_index, self.process_count)
            self._pending.append((nxt, count, fut))
            nxt += count

    def _drop_pending(self) -> None:
        for *_, fut in self._pending:
            fut.cancel()
        self._pending.clear()
        self._ready.clear()
        self._chunk = 1

    def state(self) -> dict:
        """``{"step": next step, "fingerprint": pipeline fingerprint}``; JSON-serialisable.

        The fingerprint is computed on the first call (once per pipeline object): a
        transform or source it cannot describe stops checkpointing, not iteration."""
        return {"step": self.step, "fingerprint": self.pipe.fingerprint()}

    def wait_for_workers(self, timeout: float | None = None) -> bool:
        """Block until every worker process has started and loaded the pipeline; True
        when they have, False if ``timeout`` seconds passed first. Until then the
        iterator computes a starting worker's steps in this process, so waiting is
        never needed for correctness; it is useful before timing, say."""
        if self._closed:
            raise RuntimeError("iterator is closed")
        return True if self._workers is None else self._workers.wait_ready(timeout)

    def stats(self) -> dict:
        """Where the steps came from: ``{"workers": W, "delivered_by_worker": [...],
        "computed_in_parent": n, "worker_restarts": k}`` (with workers; counts since the
        iterator started; kept after the workers stop), or ``{"workers": 0}``."""
        if self._workers is None:
            return dict(self._last_stats)
        return {
            "workers": self.num_workers,
            "delivered_by_worker": list(self._workers.delivered),
            "computed_in_parent": self._workers.in_parent,
            "worker_restarts": self._workers.restarts,
        }

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker processes (empty with ``num_workers=0`` or once closed)."""
        return self._workers.pids if self._workers is not None else []

    def close(self) -> None:
        """Stop the prefetch threads or worker processes and drop computed-ahead
        batches; with workers, no process and no shared memory is left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self._workers is not None:
            self._last_stats = self.stats()
            workers, self._workers = self._workers, None
            workers.close()

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
    """At interpreter exit, close the iterators still open (their workers with them)."""
    for it in list(_LIVE):
        try:
            it.close()
        except Exception:
            pass
