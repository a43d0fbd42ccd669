"""The program of a worker process: it computes the tasks the parent sends.

For each step of a task (records read in one bulk call for the whole task), the
batch is pickled with its arrays out of band, the arrays are copied into the
shared-memory slot the parent chose, and the parent is told (:class:`Done`); a
step that fails is reported with its traceback (:class:`Failed`) and the worker
goes on. A batch depends only on the pipeline, the step and the host slice. A
worker is forked by the fork server (:mod:`quern.pipeline.iterate.workers.forkserver`)
or started as a fresh interpreter (:func:`main`); it ends (``os._exit``) when the
parent closes its socket or goes away. The design: ``docs/design/workers.md``.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from ... import execute
from ...core.errors import StepError, exit_if_forked
from ...core.timing import SEND, Clock, report_stage_on_signal
from ...identity import samedef
from ...integrity.ledger import DIGEST, step_fields
from ...remote.lookahead import cache_counts
from ...sources import reading, waiting
from . import shm
from .messages import Done, Drop, ErrorReport, Failed, Fatal, Init, Ready, Task

if TYPE_CHECKING:
    from ...definition.dataset import Pipeline

__all__ = ["main", "serve_tasks", "work_then_exit", "setup_process", "flush", "load_pipeline"]


def setup_process() -> None:
    """Set up a process of a worker pool: Ctrl-C ignored, stdout line-buffered.

    The parent handles Ctrl-C and stops the pool; whole lines are written as they
    come, so that what a transform prints is not lost when a worker is killed.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except Exception:
        pass


def flush() -> None:
    """Write out what this process has buffered for stdout and stderr (errors ignored)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def load_pipeline(init: Init, fds: list[int], *, where: str) -> tuple[shm.Buffer, Any]:
    """Load the pipeline the parent sent, checked to be the parent's definition.

    Its pickle is the shared buffer's first span, its large arrays the others; the
    buffer is mapped copy-on-write (its arrays are writable here, and nobody else
    sees the writes).

    Args:
        init: The message that describes the pipeline.
        fds: The descriptors sent with it: the shared buffer's first.
        where: This process, as the error message names it ("the fork server").

    Returns:
        ``(buffer, pipeline)``: the shared buffer (its descriptor kept) and the pipeline.

    Raises:
        FingerprintError: The pipeline loaded here differs from the parent's
            (:func:`quern.pipeline.identity.samedef.check_sent`), naming what differs.
    """
    definition = shm.Buffer(fds[0], init.size, private=True, keep_fd=True)
    (start, n), spans = init.spans[0], init.spans[1:]
    pipe = shm.loads(definition.view(start, n), definition, spans=spans, copy=False)
    samedef.check_sent(pipe, where)
    return definition, pipe


# --------------------------------------------------------------------------- a worker started as a fresh interpreter


def main(fd: int, init_fd: int) -> None:
    """Run a worker started as a fresh interpreter; it ends the process (``os._exit``).

    The process ends when the parent closes the socket or goes away.

    Args:
        fd: The worker's socket to the parent.
        init_fd: A socket on which the fork server has sent it the :class:`Init` message.
    """
    setup_process()
    os.set_inheritable(fd, False)  # a process a transform starts must not hold the parent's socket
    sock = socket.socket(fileno=fd)

    def work() -> None:
        with socket.socket(fileno=init_fd) as from_server:
            init, fds = shm.recv(from_server)
        if not isinstance(init, Init):
            raise RuntimeError(f"expected the Init message first, got {type(init).__name__}")
        try:
            definition, pipe = load_pipeline(init, fds, where="the worker (a fresh interpreter)")
            definition.drop_fd()
        except BaseException as e:
            shm.send(sock, Fatal(f"{type(e).__name__}: {e}", traceback.format_exc()))
            return
        serve_tasks(
            sock,
            pipe,
            process_index=init.process_index,
            process_count=init.process_count,
            library_threads=init.library_threads,
        )

    work_then_exit(work)


def work_then_exit(work: Callable[[], None]) -> NoReturn:
    """Run a worker's ``work``, then end the process (``os._exit``).

    The exit status is 0 when the parent closed the socket or went away, what
    ``sys.exit`` asked for when a transform called it, and 1 (with the traceback
    printed) on any other error.

    Args:
        work: The worker's program.
    """
    status = 0
    try:
        work()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent closed the iterator or exited
    except SystemExit as e:  # a transform called sys.exit: the worker ends as it asked
        status = _exit_status(e)
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        flush()
        os._exit(status)  # not even a non-daemon thread a transform started keeps a worker alive


def _exit_status(e: SystemExit) -> int:
    """The exit status ``sys.exit(code)`` asks for (a message is printed, status 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def serve_tasks(
    sock: socket.socket, pipe: Pipeline, *, process_index: int, process_count: int, library_threads: bool = True
) -> None:
    """Say the worker is ready, then compute the tasks the parent sends, until end of file.

    A step's batch depends only on ``pipe``, the step and the host slice; a step
    that raises is reported (:class:`Failed`) and the worker goes on. A task that
    asks for digests gets each batch's ledger fields computed here, with its batch.

    Args:
        sock: The worker's socket to the parent.
        pipe: The pipeline.
        process_index: The host whose steps are computed.
        process_count: The number of hosts.
        library_threads: Whether reads may use a reading library's own threads; ``False`` where the
            pool's processes fill the cores (:mod:`~quern.pipeline.sources.reading`). No byte depends on it.

    Raises:
        EOFError: The parent closed the socket (the normal end).
    """
    reading.use_library_threads(library_threads)
    with waiting.patient():  # a live stream's entries are waited for here; the parent times out
        _serve(sock, pipe, process_index=process_index, process_count=process_count)


def _serve(sock: socket.socket, pipe: Pipeline, *, process_index: int, process_count: int) -> None:
    me = os.getpid()
    report_stage_on_signal()  # step_timeout: the parent may ask where a stuck step is
    shm.send(sock, Ready(me))
    slots: dict[int, shm.Buffer] = {}
    reported = cache_counts(pipe)  # the disk caches' counters the parent has (its own reads are not ours)
    while True:
        msg, _ = shm.recv(sock)
        if isinstance(msg, Drop):  # slots the parent no longer needs
            for slot in msg.slots:
                if slot in slots:
                    slots.pop(slot).close()
            continue
        if not isinstance(msg, Task):
            raise RuntimeError(f"unexpected message {type(msg).__name__} from the parent")
        timings: dict[str, float] | None = {} if msg.timed else None
        clock = Clock(timings)
        t0 = time.perf_counter()
        results = execute.step_results(pipe, msg.steps, process_index, process_count, timings=timings)
        last = msg.steps[-1]
        for (step, batch, error), slot in zip(results, msg.slots):
            exit_if_forked(me, "worker process")  # a transform's forked child came back here: it must not answer
            clock.t = time.perf_counter()
            fields = ""
            if error is None and msg.digests:
                try:
                    fields = step_fields(pipe, batch, step, process_index, process_count)
                except StepError as e:
                    error = e
                clock.lap(DIGEST)
            if error is None:
                try:
                    data, buffers = shm.dumps(batch, pickler=_pickle_for_parent)
                except Exception as e:
                    error = StepError(
                        f"step {step} (host {process_index} of {process_count}), stage 'send': the batch cannot be pickled "
                        f"to send it to the parent: {type(e).__name__}: {e}"
                    )
                    error.__cause__ = e
            if error is not None:
                shm.send(sock, Failed(step, _error_report(error)))
                continue
            spans, size = shm.layout(buffers)
            fds = []
            if slot not in slots or slots[slot].size < size:
                if slot in slots:
                    slots[slot].close()
                slots[slot] = shm.Buffer.create(size)
                fds = [slots[slot].fd]
            shm.write(slots[slot], buffers, spans=spans)
            clock.lap(SEND)
            if step == last:  # the task's figures travel with its last batch: one small tuple per task
                spent = tuple(timings.items()) if timings is not None else ()
                seconds = time.perf_counter() - t0
                now = cache_counts(pipe)
                grew = tuple((k, v - reported[k]) for k, v in now.items() if v != reported[k])
                reported = now
                done = Done(step, slot, data, spans, slots[slot].size, spent, seconds, len(msg.steps), grew, fields)
                shm.send(sock, done, fds=fds)
            else:
                shm.send(sock, Done(step, slot, data, spans, slots[slot].size, digests=fields), fds=fds)
            slots[slot].drop_fd()  # sent: the mapping is all this process needs


# --------------------------------------------------------------------------- batches and errors for the parent


class _ParentPickler(pickle.Pickler):
    """Pickles classes of ``__main__`` by name, so that the parent rebuilds them with its own class.

    For a batch or an exception whose class the user's script defines: a worker's
    ``__main__`` is not the script (cloudpickle rebuilt those classes by value).
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) and obj.__module__ == "__main__":
            return _from_main, (obj.__qualname__,)
        return NotImplemented


def _from_main(qualname: str) -> Any:
    return functools.reduce(getattr, qualname.split("."), sys.modules["__main__"])


def _pickle_for_parent(obj: Any, protocol: int = 5, buffer_callback: Callable[[Any], Any] | None = None) -> bytes:
    out = io.BytesIO()
    _ParentPickler(out, protocol=protocol, buffer_callback=buffer_callback).dump(obj)
    return out.getvalue()


def _error_report(error: BaseException) -> ErrorReport:
    """(message, traceback text, pickled exception or None) of a failed step."""
    tb = "".join(traceback.format_exception(error))
    try:  # the user's own exception, for ``__cause__`` in the parent
        cause = _pickle_for_parent(error.__cause__ or error)
    except Exception:
        cause = None
    return ErrorReport(str(error), tb, cause)
