"""The messages between the parent's worker pool, its fork server and the workers.

Each is a NamedTuple sent pickled over a Unix socket
(:func:`quern.pipeline.workers.shm.send`), with file descriptors alongside where noted.

- Parent -> fork server: :class:`Init` (the pipeline), :class:`Fork` (start a
  worker on the socket that travels with it), :class:`Kill`. Fork server ->
  parent: :class:`Ready` (the pipeline is loaded) or :class:`Fatal`,
  :class:`Forked`, :class:`Exited`.
- Parent -> worker: :class:`Task`, :class:`Drop`. Worker -> parent:
  :class:`Ready`, :class:`Done`, :class:`Failed` (and :class:`Fatal` from a
  worker started as a fresh interpreter, which is first sent :class:`Init` by
  the fork server).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "Span",
    "Init",
    "Fork",
    "Forked",
    "Kill",
    "Exited",
    "Task",
    "Drop",
    "Ready",
    "Fatal",
    "Done",
    "ErrorReport",
    "Failed",
]

Span = tuple[int, int]  # (offset, length) of one out-of-band buffer inside a shared buffer


class Init(NamedTuple):
    """The pipeline to load: a shared buffer (its descriptor travels with the message)
    of ``size`` bytes holding the pickle (first span) and its large arrays (the
    other spans); the host slice whose steps the worker computes."""

    spans: list[Span]
    size: int
    process_index: int
    process_count: int
    preload: tuple[str, ...] = ()  # modules the fork server imports before loading the pipeline


class Fork(NamedTuple):
    """Start worker number ``worker`` (the ``serial``-th worker asked of this fork server)
    on the socket whose descriptor travels with the message."""

    worker: int
    serial: int


class Forked(NamedTuple):
    """The ``serial``-th worker runs as process ``pid``."""

    serial: int
    pid: int


class Kill(NamedTuple):
    """SIGKILL worker process ``pid`` (if it is still running)."""

    pid: int


class Exited(NamedTuple):
    """Worker process ``pid`` ended: ``code`` as ``Popen.returncode`` gives it
    (the exit status, or minus the number of the signal that killed it)."""

    pid: int
    code: int


class Task(NamedTuple):
    """Compute ``steps`` (records read in one bulk call) into the slots ``slots``."""

    steps: list[int]
    slots: list[int]
    timed: bool = True  # send the task's stage timings with its last Done


class Drop(NamedTuple):
    """The parent no longer needs these slots: unmap them."""

    slots: list[int]


class Ready(NamedTuple):
    """The fork server (or a worker) has loaded the pipeline."""

    pid: int


class Fatal(NamedTuple):
    """The fork server (or a worker) could not load the pipeline, nor could any other
    process: the iterator fails for good."""

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
    timings: tuple[tuple[str, float], ...] = ()  # the last step of a task: seconds per stage of the whole task
    seconds: float = 0.0  # and the wall time the worker spent on the task
    task_steps: int = 0  # and its number of steps (0 on the other steps of the task)
    cache: tuple[tuple[str, int], ...] = ()  # and the disk caches' counters that grew since the worker's last report


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
