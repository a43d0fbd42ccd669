"""An epoch's packing plan grown window by window from the documents it reaches.

A plan whose rows depend only on the documents before them (``first_fit``, ``concat``)
need not measure every document of the epoch before its first row: :class:`Growing`
measures the epoch's documents in stream order a window at a time (windows doubling
from ``first_window`` to ``max_window`` documents) until the rows asked for are
*closed*, that is, final whatever the documents after them. A mode supplies how a
window is placed, when rows close and the plan of the closed rows. So row ``r``
costs the lengths of the documents up to the one that closes it, and no more. Every
output depends only on the lengths of the epoch's documents in stream order and the
mode's settings, never on how far the plan has grown.
"""

from __future__ import annotations

import abc
import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Growing", "PlanArrays", "EpochIds", "serialized"]

_LOCK = threading.RLock()  # growing plans change as they are read: one thread grows them at a time


def serialized(method: Callable) -> Callable:
    """``method`` under one lock when its object's ``lazy`` is set (its plans grow as they are read).

    The iterator's lookahead thread reads a stream's plan beside the thread that computes its steps;
    without the lock both could place the same window.
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "lazy", None) is None:
            return method(self, *args, **kwargs)
        with _LOCK:
            return method(self, *args, **kwargs)

    return wrapper


PlanArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""``(row_ptr, doc, start, length)``: an ``EpochPlan``'s arrays (``doc`` indexes the epoch's ids)."""


EpochIds = np.ndarray | tuple[Callable[[int, int], np.ndarray], int]
"""An epoch's record ids: an array, or ``(ids_of, n)`` (see :class:`Growing`)."""


class Growing(abc.ABC):
    """An epoch's plan built window by window as rows are asked for.

    Subclasses place a window (:meth:`_place`), close the end (:meth:`_finish`), count
    the closed rows (:meth:`closed`) and make the plan of the closed rows (:meth:`_make_plan`).

    Args:
        ids: the epoch's record ids in stream order: an array, or ``(ids_of, n)`` where ``ids_of(lo, hi)``
            gives those of documents ``lo`` to ``hi`` of the ``n`` (so an epoch's order is computed only as
            far as the plan reaches).
        measure: ``measure(ids)``: the lengths of those records, ``(n,)`` or ``(n, c)``.
        first_window: the documents of the first window.
        max_window: the documents of a window at most.

    Attributes:
        n: the documents of the epoch.
        done: documents measured and placed so far.
        complete: every document is placed (the row count is final).
    """

    def __init__(
        self,
        ids: EpochIds,
        measure: Callable[[np.ndarray], np.ndarray],
        first_window: int = 64,
        max_window: int = 8192,
    ) -> None:
        if isinstance(ids, tuple):
            self._ids_of, self.n = ids[0], int(ids[1])
        else:
            whole = np.asarray(ids, dtype=np.int64)
            self._ids_of, self.n = (lambda lo, hi: whole[lo:hi]), len(whole)
        self.measure = measure
        self.window, self.max_window = first_window, max_window
        self.done = 0
        self.complete = not self.n
        self._windows: list[np.ndarray] = []  # the record ids of the windows placed
        self._plan: PlanArrays | None = None  # made again only after the plan grows

    @property
    def ids(self) -> np.ndarray:
        """The record ids of the documents placed so far, in stream order (all of the epoch's once complete)."""
        if len(self._windows) != 1:
            self._windows = [np.concatenate(self._windows) if self._windows else np.zeros(0, dtype=np.int64)]
        return self._windows[0]

    @abc.abstractmethod
    def closed(self) -> int:
        """Rows known so far (all of them once complete)."""

    @abc.abstractmethod
    def _place(self, lengths: np.ndarray) -> None:
        """Place the next window's documents, ``lengths`` ``(n, c)``."""

    @abc.abstractmethod
    def _finish(self) -> None:
        """The last document is placed: close the rows still open."""

    @abc.abstractmethod
    def _make_plan(self) -> PlanArrays:
        """The plan of the closed rows."""

    def extend_to(self, rows: int) -> None:
        """Place documents until ``rows`` rows are closed or the epoch is complete."""
        while not self.complete and self.closed() < rows:
            window = np.asarray(self._ids_of(self.done, min(self.n, self.done + self.window)), dtype=np.int64)
            self._place(np.asarray(self.measure(window), dtype=np.int64).reshape(len(window), -1))
            self._windows.append(window)
            self.done += len(window)
            self.window = min(self.window * 2, self.max_window)
            self._plan = None
            if self.done >= self.n:
                self._finish()
                self.complete = True

    def plan(self) -> PlanArrays:
        """``(row_ptr, doc, start, length)`` of the closed rows, made once per growth."""
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan
