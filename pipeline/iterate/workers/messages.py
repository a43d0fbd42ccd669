"""The messages between the parent's worker pool, its fork server and the workers.

Each is a NamedTuple sent pickled over a Unix socket
(:func:`quern.pipeline.iterate.workers.shm.send`), with file descriptors alongside where noted.

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

import pickle
from typing import NamedTuple

from ...core.errors import StepError

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
    """The pipeline to load, and the host slice whose steps the workers compute.

    The pipeline is in a shared buffer whose descriptor travels with the message.

    Attributes:
        spans: Where the pickle (the first span) and its large arrays (the others) lie in the buffer.
        size: The buffer's size in bytes.
        process_index: The host whose steps are computed.
        process_count: The number of hosts.
        preload: Modules the fork server imports before loading the pipeline.
        library_threads: Whether the workers' reads may use a reading library's own threads
            (:func:`~quern.pipeline.sources.reading.threads_help`).
    """

    spans: list[Span]
    size: int
    process_index: int
    process_count: int
    preload: tuple[str, ...] = ()
    library_threads: bool = True


class Fork(NamedTuple):
    """Start a worker on the socket whose descriptor travels with the message.

    Attributes:
        worker: The worker's index in the pool.
        serial: The number of workers asked of this fork server so far, this one included.
    """

    worker: int
    serial: int


class Forked(NamedTuple):
    """The ``serial``-th worker runs as process ``pid``.

    Attributes:
        serial: The worker's serial number (:class:`Fork`).
        pid: Its process id.
    """

    serial: int
    pid: int


class Kill(NamedTuple):
    """SIGKILL worker process ``pid`` (if it is still running).

    Attributes:
        pid: The worker's process id.
    """

    pid: int


class Exited(NamedTuple):
    """Worker process ``pid`` ended.

    Attributes:
        pid: The worker's process id.
        code: How it ended, as ``Popen.returncode`` gives it: the exit status, or
            minus the number of the signal that killed it.
    """

    pid: int
    code: int


class Task(NamedTuple):
    """Compute ``steps`` (records read in one bulk call) into the slots ``slots``.

    Attributes:
        steps: The steps, in order.
        slots: The shared-memory slot of each step.
        timed: Send the task's stage timings with its last :class:`Done`.
        digests: Send each batch's ledger fields (its digests) with its :class:`Done`.
    """

    steps: list[int]
    slots: list[int]
    timed: bool = True
    digests: bool = False


class Drop(NamedTuple):
    """The parent no longer needs these slots: unmap them.

    Attributes:
        slots: The slot ids.
    """

    slots: list[int]


class Ready(NamedTuple):
    """The fork server (or a worker) has loaded the pipeline.

    Attributes:
        pid: The process id of the one that says so.
    """

    pid: int


class Fatal(NamedTuple):
    """The fork server (or a worker) could not load the pipeline: the iterator fails for good.

    No other process could load it either.

    Attributes:
        text: The error's message.
        traceback: Its traceback, as text.
    """

    text: str
    traceback: str


class Done(NamedTuple):
    """``step``'s batch is in slot ``slot``.

    A new shared buffer of ``size`` bytes travels with the message when the slot
    is new or grew. ``timings``, ``seconds``, ``task_steps`` and ``cache`` are set
    on the last step of a task only.

    Attributes:
        step: The step.
        slot: The slot its arrays were written to.
        data: The batch's pickle (its arrays out of band).
        spans: Where its arrays lie in the slot.
        size: The slot's size in bytes.
        timings: Seconds per stage of the whole task.
        seconds: The wall time the worker spent on the task.
        task_steps: The task's number of steps (0 on its other steps).
        cache: The disk caches' counters that grew since the worker's last report.
        digests: The batch's ledger fields (:func:`quern.pipeline.integrity.ledger.step_fields`),
            when the task asked for them; else empty.
    """

    step: int
    slot: int
    data: bytes
    spans: list[Span]
    size: int
    timings: tuple[tuple[str, float], ...] = ()
    seconds: float = 0.0
    task_steps: int = 0
    cache: tuple[tuple[str, int], ...] = ()
    digests: str = ""


class ErrorReport(NamedTuple):
    """A failed step, as the parent shows it.

    Attributes:
        text: The error's message.
        traceback: The worker's traceback, as text.
        cause: The original exception, pickled (``None`` when it cannot be).
    """

    text: str
    traceback: str
    cause: bytes | None

    def error(self, where: str) -> StepError:
        """The :class:`~quern.StepError` to raise in the parent: the message, then ``where`` and the traceback.

        Args:
            where: which process computed the step (``worker 0 (pid 12)``).

        Returns:
            The error, with the original exception as ``__cause__`` when it could be unpickled.
        """
        error = StepError(f"{self.text}\n\n{where} traceback:\n{self.traceback}")
        if self.cause is not None:
            try:
                error.__cause__ = pickle.loads(self.cause)
            except Exception:
                pass
        return error


class Failed(NamedTuple):
    """``step`` raised; nothing was written to its slot.

    Attributes:
        step: The step.
        report: What it raised.
    """

    step: int
    report: ErrorReport
