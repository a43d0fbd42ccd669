"""Where ``quern prepare`` writes its shards: spawned worker processes, or Ray tasks.

Every process writes any shard to the same bytes (:func:`quern.prepare.shards.write_shard`);
how the processes end with their parent: ``docs/design/prepare.md``.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ..pipeline.core.errors import PrepareError
from . import shards as _shards

__all__ = ["Progress", "in_processes", "on_ray"]

Progress = Callable[[int, int], None]  # called with (input bytes, records) done

_JOB: _shards.Job | None = None
_QUEUE: Any = None
_PR_SET_PDEATHSIG = 1  # prctl option: the signal a process gets when its parent dies


def _die_with(parent: int) -> None:
    """End this process when ``parent`` (the prepare that started it) dies, even by SIGKILL.

    Linux sends it SIGKILL then (``PR_SET_PDEATHSIG``); elsewhere a daemon
    thread looks every second. Once the workers are gone, the pool's resource
    tracker (whose pipe they and the parent held) sees its end of file and exits too.
    """
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl (not Linux): look for the parent instead

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="quern-prepare-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


def _pool_init(job_bytes: bytes, q: Any, parent: int) -> None:
    import pickle

    _die_with(parent)
    global _JOB, _QUEUE
    _JOB, _QUEUE = pickle.loads(job_bytes), q


class _Batched:
    """Progress sent to the parent at most every ``interval`` seconds.

    One queue message per file would cost as much as preparing the file.
    """

    def __init__(self, q: Any, interval: float = 0.25) -> None:
        self.q, self.interval = q, interval
        self.nbytes = self.records = 0
        self.last = time.monotonic()

    def __call__(self, nbytes: int, records: int) -> None:
        self.nbytes += nbytes
        self.records += records
        if time.monotonic() - self.last >= self.interval:
            self.flush()

    def flush(self) -> None:
        if self.nbytes or self.records:
            self.q.put((self.nbytes, self.records))
        self.nbytes = self.records = 0
        self.last = time.monotonic()


def _pool_task(index: int) -> dict[str, Any]:
    assert _JOB is not None
    _shards.check_map(_JOB, "a quern prepare worker process")
    report = _Batched(_QUEUE)
    try:
        return _shards.write_shard(_JOB, index, report=report)
    finally:
        report.flush()


def in_processes(job: _shards.Job, todo: list[int], *, num_workers: int, progress: Progress) -> list[dict[str, Any]]:
    """Write the shards ``todo`` of ``job`` in spawned worker processes.

    Args:
        job: the job.
        todo: the indices of the shards to write.
        num_workers: the most processes (at most one per shard).
        progress: called with ``(input_bytes, records)`` as the workers report.

    Returns:
        The shards' sidecars, in the order they were finished.

    Raises:
        PrepareError: a worker process died (the finished shards are kept), or
            what a worker raised.
    """
    workers = num_workers
    import concurrent.futures
    import multiprocessing

    import cloudpickle

    ctx = multiprocessing.get_context("spawn")  # never a fork of a process that may hold threads (jax)
    q = ctx.Queue()
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            try:
                progress(*q.get(timeout=0.1))
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    out: list[dict[str, Any]] = []
    try:
        with concurrent.futures.ProcessPoolExecutor(
            max_workers=min(workers, len(todo)),
            mp_context=ctx,
            initializer=_pool_init,
            initargs=(cloudpickle.dumps(job), q, os.getpid()),
        ) as pool:
            futures = [pool.submit(_pool_task, i) for i in todo]
            try:
                for f in concurrent.futures.as_completed(futures):
                    out.append(f.result())
            except concurrent.futures.process.BrokenProcessPool as e:
                for f in futures:
                    f.cancel()
                lost = [job.names[i] for i, f in zip(todo, futures) if not f.done() or f.exception() is not None]
                raise PrepareError(
                    f"prepare: a worker process died (killed, or its map ended the process) while writing one of "
                    f"{lost[:3]}{'...' if len(lost) > 3 else ''}; the finished shards are kept: run the same "
                    "prepare again to complete it"
                ) from e
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    finally:
        stop.set()
        t.join()
        while True:
            try:
                progress(*q.get_nowait())
            except (queue.Empty, EOFError, OSError):
                break
        q.close()
    return out


def _ray_task(job: _shards.Job, index: int) -> dict[str, Any]:
    _shards.check_map(job, "a quern prepare Ray task")
    return _shards.write_shard(job, index)


def on_ray(
    job: _shards.Job, todo: list[int], *, address: str | None, num_workers: int | None, progress: Progress
) -> list[dict[str, Any]]:
    """Write the shards ``todo`` of ``job`` as Ray tasks.

    A bounded number of tasks is in flight and none is ever cancelled: on a
    task's error no new task starts, those running finish (their shards are
    kept, as in a local run), then the first error is raised.

    Args:
        job: the job.
        todo: the indices of the shards to write.
        address: the Ray cluster (``None``: a new local cluster of ``num_workers``
            CPUs, default the CPU count; ignored when Ray is already initialised).
        num_workers: the CPUs of a new local cluster.
        progress: called with ``(input_bytes, records)`` as shards finish.

    Returns:
        The shards' sidecars, in the order they were finished.

    Raises:
        ValueError: Ray is not installed.
        PrepareError: a task failed (its own error's message).
    """
    workers = num_workers
    try:
        import ray
    except ImportError as e:
        raise ValueError("--ray needs Ray: pip install 'quern[ray]'") from e
    started = not ray.is_initialized()
    if started:
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address is None:  # a new local cluster, never one a previous `ray start` left
            kw.update(address="local", num_cpus=workers or os.cpu_count(), object_store_memory=128 << 20)
        else:
            kw.update(address=address)
        ray.init(**kw)
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(_ray_task)
        job_ref = ray.put(job)
        # A bounded number of tasks in flight, and never ray.cancel: cancelling a task as it completes crashes the
        # driver in Ray's core worker ("Tried to complete task that was not pending", ray-project/ray#54846). On a
        # task's error no new task starts, those running finish (their shards are kept, as in a local run), then
        # the first error is raised.
        limit = max(2 * int(ray.cluster_resources().get("CPU", 1)), 2)
        waiting = list(reversed(todo))
        pending: dict[Any, int] = {}
        out: list[dict[str, Any]] = []
        error: BaseException | None = None
        while waiting or pending:
            while waiting and error is None and len(pending) < limit:
                i = waiting.pop()
                pending[task.remote(job_ref, i)] = i
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1)
            del pending[done[0]]
            try:
                side = ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                error = error or e
                continue
            a, b = job.shards[job.names.index(side["file"])]
            progress(sum(it.size for it in job.items[a:b]), side["records"])
            out.append(side)
        if error is not None:
            cause = getattr(error, "cause", None)  # the task's own exception, without Ray's traceback text
            if isinstance(cause, PrepareError):
                raise PrepareError(str(cause)) from error
            raise PrepareError(f"prepare on Ray: {type(cause).__name__}: {cause}") from error
        return out
    finally:
        if started:
            ray.shutdown()
