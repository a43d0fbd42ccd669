"""Where the time goes: stage timings, the training side's data wait, the host prefetch depth.

Small pieces over figures measured elsewhere (no
figure here ever changes a byte of a batch):

- :class:`Clock` adds the seconds between its laps to a dict of stages
  (``read``, each transform by its label, ``collate``, ``send``, ``handover``,
  ``device_put``); the step runner and the iterators use it.
- :class:`StepClock` sits in an iterator's ``next()``: the **data wait** of a
  step is the time the caller was blocked in ``next()``, the **step period** the
  time between the returns of two consecutive ``next()`` calls, and the
  **bubble rate** their ratio (the share of the period the training loop waited
  for data). The **health** compares the data wait with the step time (the period
  less the wait: the training's own work), by the thresholds of the monitoring
  guide this project grew from: under :data:`HEALTHY` (50%) healthy, above
  :data:`ALARM` (80%) alarm, warning between.
- :func:`prefetch_window` is the rule of thumb for the host prefetch depth,
  ``max(2 x step time / load time, 5)`` batches, within a memory budget.
- :func:`stage_now` says which step and stage a thread is in, from its frames
  (the iterators' ``step_timeout``): the step runner declares its stage functions
  with :meth:`Clock.stage` (:data:`STAGE_FUNCTIONS`, by code object, so a renamed
  one is still found); :func:`report_stage_on_signal` makes a worker process
  answer that question when the parent signals it.

:data:`LIVE` holds the iterators of this process, for :mod:`quern.metrics`.
"""

from __future__ import annotations

import collections
import math
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable
from types import CodeType, FrameType, FunctionType
from typing import Any, Literal, NamedTuple, TypeVar, cast

import numpy as np

from .tree import leaves

__all__ = [
    "ALARM",
    "DEVICE_PUT",
    "HANDOVER",
    "HEALTHY",
    "MAX_WINDOW",
    "SEND",
    "LIVE",
    "WINDOW",
    "Clock",
    "batch_nbytes",
    "ema",
    "StepClock",
    "health",
    "prefetch_window",
    "STAGE_FD_ENV",
    "STAGE_FUNCTIONS",
    "STAGE_SIGNAL",
    "StageKind",
    "StageNow",
    "report_stage_on_signal",
    "stage_now",
]

HEALTHY = 0.5  # data wait under this fraction of the step time: healthy
ALARM = 0.8  # above this fraction: alarm (between the two: warning)
WINDOW = 100  # steps the recent figures are taken over
MIN_WINDOW = 5  # the rule's least prefetch depth, in batches
MAX_WINDOW = 1024  # and the most, whatever the rule and the budget say

SEND = "send"  # a worker pickles a batch into shared memory
HANDOVER = "handover"  # the parent takes a batch from a worker (or from a prefetch thread)
DEVICE_PUT = "device_put"  # a global batch is handed to jax (transfers start)

LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # iterators reporting to quern.metrics (those with .stats())

StageKind = Literal["read", "record", "collate", "batch", "pack"]  # the stages a stage function may run
STAGE_FUNCTIONS: dict[CodeType, StageKind] = {}  # the step runner's functions, by code object (Clock.stage)
_F = TypeVar("_F", bound=Callable[..., object])


class Clock:
    """Adds the seconds since the last :meth:`lap` to ``timings[stage]``.

    Args:
        timings: the dict of seconds per stage to add to; ``None``: the clock does
            nothing (it does not even read the time).
    """

    __slots__ = ("timings", "t")

    def __init__(self, timings: dict[str, float] | None) -> None:
        self.timings = timings
        self.t = time.perf_counter() if timings is not None else 0.0

    def lap(self, stage: str) -> None:
        """Add the seconds since the last lap (or the start) to ``timings[stage]``.

        Args:
            stage: the stage the time went to (``read``, ``map[0] decode``, ``collate``...).
        """
        if self.timings is not None:
            now = time.perf_counter()
            self.timings[stage] = self.timings.get(stage, 0.0) + now - self.t
            self.t = now

    @staticmethod
    def stage(kind: StageKind) -> Callable[[_F], _F]:
        """Declare the decorated function the step runner's function for stage ``kind``.

        :func:`stage_now` reports a thread whose stack holds that function's frame as
        being in stage ``kind`` of the step named by its ``where`` argument. The
        function is found by its code object, so it is reported whatever it is
        called: renaming it changes nothing.

        Args:
            kind: the stage the function runs: ``"read"`` (local ``src``: the source),
                ``"record"`` (a record transform: locals ``op`` and ``k``, or ``stage``; with
                ``i``, ``names`` and ``positions`` while it runs one record at a time),
                ``"collate"``, ``"batch"`` (a batch transform: ``op`` and ``k``) or ``"pack"``.

        Returns:
            A decorator that registers the function and returns it unchanged.

        Raises:
            ValueError: ``kind`` is not one of those.
        """
        if kind not in _DESCRIBE:
            raise ValueError(f"Clock.stage: unknown stage kind {kind!r}; one of {sorted(_DESCRIBE)}")

        def register(fn: _F) -> _F:
            STAGE_FUNCTIONS[cast(FunctionType, fn).__code__] = kind
            return fn

        return register


def add(into: dict[str, float], timings: dict[str, float] | Any) -> None:
    """Add stage seconds to ``into``.

    Args:
        into: seconds per stage, updated in place.
        timings: seconds per stage to add: a dict, or ``(stage, seconds)`` pairs.
    """
    for stage, seconds in timings.items() if isinstance(timings, dict) else timings:
        into[stage] = into.get(stage, 0.0) + seconds


def ema(average: float | None, value: float, *, weight: float = 0.2) -> float:
    """An exponential moving average, updated with one value.

    Args:
        average: the average so far; ``None``: none yet.
        value: the new value.
        weight: the new value's share of the result.

    Returns:
        ``value`` when there is no average yet, else ``average`` moved ``weight``
        of the way to ``value``.

    Example:
        >>> ema(None, 2.0), ema(1.0, 2.0, weight=0.5)
        (2.0, 1.5)
    """
    return value if average is None else average + weight * (value - average)


def batch_nbytes(batch: Any, sample: int = 64) -> int:
    """About the bytes a batch holds.

    Args:
        batch: a tree of arrays and other leaves.
        sample: how many elements of an array of objects are measured.

    Returns:
        The sum over its leaves of: ``nbytes`` of an array (for an array of objects
        such as strings, plus the sizes of up to ``sample`` elements scaled to all
        of them); ``len`` of bytes and str; ``sys.getsizeof`` of anything else.
        At least 1.
    """
    total = 0
    for _, x in leaves(batch):
        if isinstance(x, np.ndarray) and x.dtype == object and x.size:
            flat = x.reshape(-1)
            some = flat[: min(sample, flat.size)]
            total += x.nbytes + sum(sys.getsizeof(v) for v in some) * flat.size // len(some)
        elif hasattr(x, "nbytes"):
            total += int(x.nbytes)
        elif isinstance(x, (bytes, str)):
            total += len(x)
        else:
            total += sys.getsizeof(x)
    return max(total, 1)


def health(wait: float, period: float) -> str:
    """How healthy a data wait is, against the training's own step time ``period - wait``.

    Args:
        wait: the data wait, in seconds.
        period: the step period (wait included), in seconds.

    Returns:
        ``"healthy"`` when the wait is under :data:`HEALTHY` of the step time,
        ``"alarm"`` above :data:`ALARM` (and for a step with no time of its own),
        ``"warning"`` between; ``"unknown"`` for no period.

    Example:
        >>> health(0.01, 0.11), health(0.04, 0.10), health(0.1, 0.11)
        ('healthy', 'warning', 'alarm')
    """
    if period <= 0:
        return "unknown"
    if wait <= 0:
        return "healthy"
    step = period - wait
    if step <= 0:
        return "alarm"
    ratio = wait / step
    return "healthy" if ratio < HEALTHY else "warning" if ratio <= ALARM else "alarm"


class StepClock:
    """The training side of an iterator, measured in its ``next()``.

    Call :meth:`begin` on entering ``next()`` and :meth:`end` with its result when a
    batch is returned. The first batch's wait is ``first_batch_s`` (start-up:
    processes, first reads) and is left out of the other figures; from the second
    on, each step adds its data wait and period. :meth:`figures` gives them over
    the last ``window`` steps and since the start.

    Args:
        window: how many recent steps the windowed figures are taken over.
    """

    def __init__(self, window: int = WINDOW) -> None:
        self.recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self.steps = 0  # batches returned
        self.first_batch_s: float | None = None
        self.wait_total = 0.0  # from the second batch on
        self.period_total = 0.0
        self.last_wait = 0.0
        self.last_period = 0.0
        self._last_end: float | None = None

    @staticmethod
    def begin() -> float:
        """Mark the caller entering ``next()``.

        Returns:
            The time now, to give to :meth:`end`.
        """
        return time.perf_counter()

    def end(self, t0: float) -> None:
        """Count one batch returned by ``next()``.

        Args:
            t0: what :meth:`begin` returned on entering this ``next()``.
        """
        now = time.perf_counter()
        wait = now - t0
        self.steps += 1
        if self._last_end is None:
            self.first_batch_s = wait
        else:
            period = max(now - self._last_end, wait)
            self.recent.append((wait, period))
            self.wait_total += wait
            self.period_total += period
            self.last_wait, self.last_period = wait, period
        self._last_end = now

    def step_time(self) -> float | None:
        """The training's own time per step: mean seconds outside ``next()`` over the window.

        Returns:
            The seconds, or ``None`` before the second batch.
        """
        recent = list(self.recent)
        if not recent:
            return None
        return max(sum(p - w for w, p in recent) / len(recent), 0.0)

    def figures(self) -> dict[str, Any]:
        """The training side's figures so far.

        Safe to call from another thread while :meth:`end` runs (a scrape during training).

        Returns:
            ``steps``, ``first_batch_s``; ``data_wait`` (``last``, ``mean``, ``max``
            over the window, ``total`` since the second batch; seconds),
            ``step_period`` (``last``, ``mean``), ``bubble_rate`` (wait / period over
            the window), ``bubble_rate_total`` and ``health`` (over the window).
        """
        recent = list(self.recent)  # one C call: safe while another thread's next() appends
        n = len(recent)
        wait = sum(w for w, _ in recent)
        period = sum(p for _, p in recent)
        return {
            "steps": self.steps,
            "first_batch_s": self.first_batch_s,
            "data_wait": {
                "last": self.last_wait,
                "mean": wait / n if n else 0.0,
                "max": max((w for w, _ in recent), default=0.0),
                "total": self.wait_total,
            },
            "step_period": {"last": self.last_period, "mean": period / n if n else 0.0},
            "bubble_rate": wait / period if period > 0 else 0.0,
            "bubble_rate_total": self.wait_total / self.period_total if self.period_total > 0 else 0.0,
            "health": health(wait, period) if n else "unknown",
        }


def prefetch_window(step_s: float | None, load_s: float | None, *, batch_bytes: int | None, budget: int) -> int:
    """The host prefetch depth, in batches: the rule of thumb ``max(ceil(2 * step_s / load_s), 5)``.

    Args:
        step_s: the training's time per step, in seconds (``None``: unknown).
        load_s: the time the loader takes per batch, with its parallelism, in
            seconds (``None``: unknown; 0: free).
        batch_bytes: the bytes of a batch (``None``: unknown).
        budget: the bytes the prefetched batches may hold.

    Returns:
        The rule's depth, at most ``budget // batch_bytes`` (at least 1) and
        :data:`MAX_WINDOW`; unknown figures give the least depth, 5, and a free
        loader the cap.

    Example:
        >>> prefetch_window(0.100, 0.010, batch_bytes=1 << 20, budget=1 << 30)  # a fast loader: 20 cover the bursts
        20
        >>> prefetch_window(0.010, 0.050, batch_bytes=1 << 20, budget=1 << 30)  # a slow one: the least, 5
        5
        >>> prefetch_window(0.100, 0.001, batch_bytes=64 << 20, budget=1 << 30)  # 200 wanted, 16 of 64 MiB fit 1 GiB
        16
    """
    if step_s is None or load_s is None:
        want = MIN_WINDOW
    elif load_s <= 0:
        want = MAX_WINDOW
    else:
        want = max(math.ceil(2 * step_s / load_s - 1e-9), MIN_WINDOW)
    fit = budget // batch_bytes if batch_bytes else MAX_WINDOW
    return max(1, min(want, fit, MAX_WINDOW))


# --------------------------------------------------------------------------- where a step is now

STAGE_SIGNAL = signal.SIGUSR1  # the parent asks a worker where it is (step_timeout)
STAGE_FD_ENV = "QUERN_STAGE_FD"  # in a worker pool's processes: the datagram socket the answers go to


class StageNow(NamedTuple):
    """Where a thread computing steps is.

    Attributes:
        where: the step(s) and host slice (``""`` when it is in no stage).
        stage: the stage (and row).
        at: the innermost Python function and line it is running.
    """

    where: str
    stage: str
    at: str

    def __str__(self) -> str:
        if not self.where:
            return f"in no stage of a step, {self.at}"
        return f"in {self.where}, {self.stage}, {self.at}"


def stage_now(frame: FrameType | None) -> StageNow:
    """Where the thread whose innermost frame is ``frame`` is, in the step runner.

    The innermost frame of a function registered with :meth:`Clock.stage` (the
    step runner's stage functions, :mod:`quern.pipeline.execute`) names the step
    and the stage (``read``, ``map[k] NAME`` with its row, ``collate``, a batch
    transform, ``pack``), from its local variables. Reads the frames only (safe on
    another thread's frames, or in a signal handler); never raises.

    Args:
        frame: the thread's innermost frame (``None``: unknown).

    Returns:
        A :class:`StageNow`; its ``where`` is ``""`` outside every stage.
    """
    at = "at an unknown place"
    try:
        if frame is not None:
            code = frame.f_code
            at = f"at {code.co_qualname} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
        f = frame
        while f is not None:
            kind = STAGE_FUNCTIONS.get(f.f_code)
            if kind is not None:
                return StageNow(str(f.f_locals.get("where", "a step")), _stage_text(kind, f), at)
            f = f.f_back
    except Exception:
        pass
    return StageNow("", "", at)


def _stage_text(kind: StageKind, f: FrameType) -> str:
    """The stage that the frame ``f`` of a stage function of ``kind`` runs (see :func:`stage_now`)."""
    try:
        return _DESCRIBE[kind](f)
    except Exception:
        return f"stage unknown ({f.f_code.co_name})"


def _read_text(f: FrameType) -> str:
    return f"stage 'read' of source {f.f_locals['src'].name!r}"


def _record_text(f: FrameType) -> str:
    local = f.f_locals
    text = f"stage {local.get('stage') or local['op'].label(local['k'])}"
    if "i" in local and local.get("many") is None:  # one record at a time: its row
        i, names = local["i"], local["names"]
        text += f", row {names.step_row(i)} = {names.row(i)} (position {int(local['positions'][i])})"
    return text


def _batch_text(f: FrameType) -> str:
    local = f.f_locals
    return f"stage {local['op'].label(local['k'])}"


# what a stage function of each kind runs, read from its frame's local variables
_DESCRIBE: dict[StageKind, Callable[[FrameType], str]] = {
    "read": _read_text,
    "record": _record_text,
    "collate": lambda f: "stage 'collate'",
    "batch": _batch_text,
    "pack": lambda f: "stage 'pack'",
}


def report_stage_on_signal() -> None:
    r"""Make this worker process answer :data:`STAGE_SIGNAL` with where its main thread is.

    For a worker of a pool made with ``step_timeout``: the answer is one datagram,
    ``b"<pid>\0<where>"`` (:func:`stage_now` of the main thread), on the socket
    whose descriptor is in the environment (:data:`STAGE_FD_ENV`). Does nothing
    without one. The handler only reads and sends; it never disturbs the step
    being computed.
    """
    try:
        fd = int(os.environ.get(STAGE_FD_ENV, ""))
        os.fstat(fd)
    except (ValueError, OSError):
        return

    def answer(signum: int, frame: FrameType | None) -> None:
        try:
            os.write(fd, f"{os.getpid()}\0{stage_now(frame)}".encode(errors="replace")[:8192])
        except Exception:
            pass  # nobody listens any more, or the socket is full: the parent says "no answer"

    signal.signal(STAGE_SIGNAL, answer)
