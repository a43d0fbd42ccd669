"""The program of a worker process (see :mod:`quern.pipeline.workers` for the parent's side).

A worker receives the pipeline through shared memory, then computes the tasks
the parent sends over its socket: for each step of a task (records read in one
bulk call for the whole task), the batch is pickled with its arrays out of band,
the arrays are copied into the shared-memory slot the parent chose, and the
parent is told. A step that fails is reported with its traceback; the worker
goes on with the next one.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

from . import execute, shm
from .errors import StepError
from .messages import Done, Drop, ErrorReport, Failed, Fatal, Init, Ready, Task

__all__ = ["main"]


def main(fd: int) -> None:
    """Entry point of a worker process; ``fd`` is its socket to the parent. Ends the
    process (``os._exit``) when the parent closes the socket or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # whole lines as they come, so that what a transform prints is not lost when the worker is killed
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except Exception:
        pass
    os.set_inheritable(fd, False)  # a process a transform starts must not hold the parent's socket
    sock = socket.socket(fileno=fd)
    status = 0
    try:
        _serve(sock)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent closed the iterator or exited
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)  # not even a non-daemon thread a transform started keeps a worker alive


def _serve(sock: socket.socket) -> None:
    """Load the pipeline, then compute the tasks the parent sends, until end of file."""
    init, fds = shm.recv(sock)
    if not isinstance(init, Init):
        raise RuntimeError(f"expected the Init message first, got {type(init).__name__}")
    spans, size, index, count = init.spans, init.size, init.process_index, init.process_count
    try:  # the pickled pipeline is the first span of the shared buffer, its large arrays the others
        definition = shm.Buffer(fds[0], size, private=True)  # copy-on-write: arrays are writable here
        (start, n), spans = spans[0], spans[1:]
        pipe = shm.loads(definition.view(start, n), definition, spans, copy=False)
    except BaseException as e:
        shm.send(sock, Fatal(f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    shm.send(sock, Ready(os.getpid()))
    slots: dict[int, shm.Buffer] = {}
    while True:
        msg, _ = shm.recv(sock)
        if isinstance(msg, Drop):  # slots the parent no longer needs
            for slot in msg.slots:
                if slot in slots:
                    slots.pop(slot).close()
            continue
        if not isinstance(msg, Task):
            raise RuntimeError(f"unexpected message {type(msg).__name__} from the parent")
        for (step, batch, error), slot in zip(execute.step_results(pipe, msg.steps, index, count), msg.slots):
            if error is None:
                try:
                    data, buffers = shm.dumps(batch, _pickle_for_parent)
                except Exception as e:
                    error = StepError(
                        f"step {step} (host {index} of {count}), stage 'send': the batch cannot be pickled "
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
            shm.write(slots[slot], buffers, spans)
            shm.send(sock, Done(step, slot, data, spans, slots[slot].size), fds)
            slots[slot].drop_fd()  # sent: the mapping is all this process needs


class _ParentPickler(pickle.Pickler):
    """Pickles classes of ``__main__`` by name, so that a batch or an exception whose
    class the user's script defines is rebuilt in the parent with the parent's class
    (a worker's ``__main__`` is not the script; cloudpickle rebuilt those classes by value)."""

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
