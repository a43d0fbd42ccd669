"""The iterator's thread side (``num_workers=0``): chunks of steps computed on prefetch threads.

:func:`compute` runs a chunk of consecutive steps on a prefetch thread;
with ``step_timeout``, :func:`compute_on_own_thread` runs it on a daemon
thread of its own, whose stage :func:`wait` watches while the caller waits.
What a chunk holds is exactly ``pipe.batch_at(s, ...)`` for each of its steps.
The design is in ``docs/design/iterator.md``.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import numbers
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from .. import execute
from ..core.errors import exit_if_forked
from ..sources import waiting
from .timing import stage_now

__all__ = ["Chunk", "check_step_timeout", "compute", "compute_on_own_thread", "wait"]

# (batches, seconds per stage, wall seconds)
Chunk = tuple[list[Any], dict[str, float], float]


def compute(
    pipe: execute.Definition,
    first: int,
    count: int,
    index: int,
    hosts: int,
    timed: bool,
    owner: int,
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

    Returns:
        ``(batches, seconds per stage, wall seconds)``; the seconds per stage are empty when
        not ``timed``.

    Raises:
        StepError: a step failed.
    """
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    batches = execute.batches_at(pipe, first, count, index, hosts, timings if timed else None)
    exit_if_forked(owner, "the iterator's process")
    return batches, timings, time.perf_counter() - t0


def compute_on_own_thread(
    abandon: threading.Event, computing: dict[int, threading.Thread], pipe: execute.Definition, first: int, *args: Any
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
        *args: the rest of :func:`compute`'s arguments.

    Returns:
        What :func:`compute` returns.

    Raises:
        RuntimeError: ``abandon`` was set before the chunk was done.
    """
    out: list[Any] = []

    def run() -> None:
        try:
            with waiting.patient(abandon.is_set):  # a live stream's entries: waited for until abandoned
                out.append((True, compute(pipe, first, *args)))
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


def _frame_of(thread: threading.Thread | None) -> Any:
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
