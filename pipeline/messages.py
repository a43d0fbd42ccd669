"""The messages between the parent's worker pool and a worker process.

Each is a NamedTuple sent pickled over the worker's Unix socket
(:func:`quern.pipeline.shm.send`), with file descriptors of shared memory
alongside where noted. Parent -> worker: :class:`Init`, :class:`Task`,
:class:`Drop`. Worker -> parent: :class:`Ready`, :class:`Fatal`, :class:`Done`,
:class:`Failed`.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Span", "Init", "Task", "Drop", "Ready", "Fatal", "Done", "ErrorReport", "Failed"]

Span = tuple[int, int]  # (offset, length) of one out-of-band buffer inside a shared buffer


class Init(NamedTuple):
    """The pipeline to load: a shared buffer (its descriptor travels with the message)
    of ``size`` bytes holding the pickle (first span) and its large arrays (the
    other spans); the host slice whose steps the worker computes."""

    spans: list[Span]
    size: int
    process_index: int
    process_count: int


class Task(NamedTuple):
    """Compute ``steps`` (records read in one bulk call) into the slots ``slots``."""

    steps: list[int]
    slots: list[int]


class Drop(NamedTuple):
    """The parent no longer needs these slots: unmap them."""

    slots: list[int]


class Ready(NamedTuple):
    """The worker has loaded the pipeline."""

    pid: int


class Fatal(NamedTuple):
    """The worker could not load the pipeline (nor could any other): the iterator fails for good."""

    text: str
    traceback: str


class Done(NamedTuple):
    """``step``'s batch is in slot ``slot`` (a new shared buffer of ``size`` bytes travels
    with the message when the slot is new or grew): ``data`` is the pickle, ``spans``
    where its arrays lie in the slot."""

    step: int
    slot: int
    data: bytes
    spans: list[Span]
    size: int


class ErrorReport(NamedTuple):
    """A failed step, as the parent shows it: message, the worker's traceback, and the
    original exception pickled (``None`` when it cannot be)."""

    text: str
    traceback: str
    cause: bytes | None


class Failed(NamedTuple):
    """``step`` raised; nothing was written to its slot."""

    step: int
    report: ErrorReport
