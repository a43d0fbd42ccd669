"""Execution: iterate a pipeline's steps in order, computing ahead on threads.

The iterator holds no data-order state beyond the next step number: what it
yields at step ``s`` is exactly ``pipe.batch_at(s, process_index, process_count)``,
whatever the thread count, prefetch depth or timing.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
from typing import Any

__all__ = ["PipelineIterator"]


class PipelineIterator:
    """Yields the batches of ``pipe`` for steps ``start_step, start_step + 1, ...`` in order.

    ``prefetch`` steps are computed ahead by ``num_threads`` background threads
    (bulk reads release the GIL for part of their time). ``num_workers`` (worker
    processes) must be 0 for now. ``.step`` is the next step to be yielded and
    ``.state()`` a JSON-serialisable checkpoint; ``pipe.iterator(start_step=
    state["step"])`` resumes exactly. Use as a context manager or call
    ``close()``; garbage collection also closes it.
    """

    def __init__(
        self,
        pipe,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        num_workers: int = 0,
        prefetch: int = 4,
        num_threads: int = 1,
    ):
        from .dataset import _check_int
        from .index import host_rows

        self._closed = True
        pipe._need_batch("iterator")
        self.pipe = pipe
        self.step = _check_int(start_step, "start_step", 0)
        num_workers = _check_int(num_workers, "num_workers", 0)
        if num_workers:
            raise NotImplementedError(
                f"num_workers={num_workers}: worker processes are not available yet; use num_workers=0 "
                "(the default), which computes batches on background threads"
            )
        self.prefetch = _check_int(prefetch, "prefetch", 1)
        self.num_threads = _check_int(num_threads, "num_threads", 1)
        host_rows(pipe.batch_size, process_index, process_count)  # validates the host slice now
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        n_steps = pipe.num_steps
        if n_steps is not None and self.step > n_steps:
            raise IndexError(f"start_step {self.step} is past the end of the stream ({n_steps} steps)")
        self._end = n_steps
        self._fingerprint = pipe.fingerprint()
        self._pending: collections.deque[tuple[int, cf.Future]] = collections.deque()
        self._pool = cf.ThreadPoolExecutor(self.num_threads, thread_name_prefix="quern-prefetch")
        self._closed = False

    # ------------------------------------------------------------------ protocol

    def __iter__(self) -> "PipelineIterator":
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise RuntimeError("iterator is closed")
        if self._end is not None and self.step >= self._end:
            raise StopIteration
        self._fill()
        step, fut = self._pending.popleft()
        assert step == self.step
        try:
            batch = fut.result()
        except BaseException:
            self._drop_pending()  # the failed step is recomputed if next() is called again
            raise
        self.step += 1
        self._fill()
        return batch

    def _fill(self) -> None:
        nxt = self._pending[-1][0] + 1 if self._pending else self.step
        while len(self._pending) < self.prefetch and (self._end is None or nxt < self._end):
            fut = self._pool.submit(self.pipe.batch_at, nxt, self.process_index, self.process_count)
            self._pending.append((nxt, fut))
            nxt += 1

    def _drop_pending(self) -> None:
        for _, fut in self._pending:
            fut.cancel()
        self._pending.clear()

    def state(self) -> dict:
        """``{"step": next step, "fingerprint": pipeline fingerprint}``; JSON-serialisable."""
        return {"step": self.step, "fingerprint": self._fingerprint}

    def close(self) -> None:
        """Stop the prefetch threads and drop computed-ahead batches. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._drop_pending()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "PipelineIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"PipelineIterator(step={self.step}, host={self.process_index}/{self.process_count})"
