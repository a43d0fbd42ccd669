"""The parent's handles on the processes of a pool: its fork server and each worker.

A :class:`ServerHandle` starts the fork server (a fresh interpreter running
:func:`quern.pipeline.iterate.workers.forkserver.serve`) and keeps what it has said: the
pid of each worker it forked and how each one ended. A :class:`WorkerHandle` is
one worker's socket, its shared-memory slots and the steps it has in flight.
Neither computes or changes a batch.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

from ...core.timing import STAGE_FD_ENV
from . import shm
from .messages import Exited, Fork, Forked, Kill, Ready
from .signals import sigint_deferred

if TYPE_CHECKING:
    from ...definition.dataset import Pipeline

__all__ = ["ServerHandle", "WorkerHandle", "SERVER_STOP", "READERS", "how_it_ended", "preloads", "readable"]

SERVER_STOP = 10.0  # seconds the fork server has to stop its workers and exit before it is killed
# The module each kind of source imports when it first reads: the fork server imports those of
# the pipeline's sources before it loads the pipeline, so that no forked worker pays for them.
READERS = {
    "ArrayRecordSource": "array_record.python.array_record_module",
    "ParquetSource": "pyarrow.parquet",
    "TensorStoreSource": "tensorstore",
    "TFRecordSource": "crc32c",
}


def how_it_ended(code: int | None) -> str:
    """How a process ended, in words.

    Args:
        code: As ``Popen.returncode``: ``None`` while it runs, the exit status, or
            minus the signal that killed it.

    Returns:
        A phrase to follow the process's name.

    Example:
        >>> how_it_ended(-9), how_it_ended(3)
        ('was killed by SIGKILL', 'exited with status 3')
    """
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def readable(sock: socket.socket, timeout: float = 0.0) -> bool:
    """Whether ``sock`` has data (or end of file) waiting, within ``timeout`` seconds.

    Args:
        sock: The socket.
        timeout: Seconds to wait (0: only what is there now).

    Returns:
        ``True`` when a read would not block.
    """
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(int(timeout * 1000)))


def preloads(pipe: Pipeline) -> tuple[str, ...]:
    """The reader modules (:data:`READERS`) of the pipeline's sources.

    The fork server imports them once, before it forks the workers, whether or not this
    process has (a TFRecord source read through a cached index has not imported ``crc32c``);
    one that fails to import is left to the source. A source made of others (a mixture's,
    say) counts its parts' readers.

    Args:
        pipe: The pipeline.

    Returns:
        The module names, sorted.
    """
    found: set[str] = set()
    todo: list = list(pipe.sources)
    seen: set[int] = set()
    while todo:
        src = todo.pop()
        if id(src) in seen:
            continue
        seen.add(id(src))
        found.update(READERS[c.__name__] for c in type(src).__mro__ if c.__name__ in READERS)
        for attr in ("sources", "components"):  # a source made of others (a mixture, say)
            parts = getattr(src, attr, None)
            if isinstance(parts, dict):
                todo.extend(parts.values())
            elif isinstance(parts, (list, tuple)):
                todo.extend(parts)
    return tuple(sorted(found))


class ServerHandle:
    """The parent's handle on a fork server (see :mod:`quern.pipeline.iterate.workers.forkserver`).

    Making one starts the fork server, in its own process group, with
    ``JAX_PLATFORMS=cpu``; it waits for the pipeline (:class:`Init`, sent with :meth:`send`).

    Raises:
        OSError: The process cannot be started.
    """

    def __init__(self) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # where a stuck worker says it is (step_timeout): datagrams, which never mix, from any worker
        stages, their_stages = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        stages.setblocking(False)
        their_stages.setblocking(False)  # a worker's answer never blocks it (the flag is shared with its copies)
        code = (
            f"import sys; sys.path[:] = {sys.path!r}; "
            f"from quern.pipeline.iterate.workers.forkserver import serve; serve({child_sock.fileno()})"
        )
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env[STAGE_FD_ENV] = str(their_stages.fileno())
        try:  # its own process group (which its workers share): a Ctrl-C at the terminal goes to the parent only
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code],
                pass_fds=[child_sock.fileno(), their_stages.fileno()],
                env=env,
                process_group=0,
            )
        except BaseException:
            parent_sock.close()
            stages.close()
            raise
        finally:
            child_sock.close()
            their_stages.close()
        self.sock = parent_sock
        self.stages = stages
        self.ready = False  # it has loaded the pipeline
        self.dead = False  # its socket reached end of file
        self.serial = 0  # workers asked of it
        self.pids: dict[int, int] = {}  # serial -> pid of that worker
        self.exits: dict[int, int] = {}  # pid -> how that worker ended (Popen.returncode)
        self.orphans: set[int] = set()  # serials of workers given up on before their pid was known

    @property
    def pid(self) -> int:
        """The fork server's process id."""
        return self.proc.pid

    def send(self, msg: object, fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send ``msg``, never half of it (Ctrl-C waits); a dead server is marked dead.

        Args:
            msg: The message (:mod:`quern.pipeline.iterate.workers.messages`).
            fds: File descriptors sent with it.
        """
        if self.dead:
            return
        try:
            with sigint_deferred():
                shm.send(self.sock, msg, fds=fds)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.dead = True

    def fork(self, index: int, fd: int) -> int:
        """Ask the fork server for worker ``index`` on the socket ``fd``.

        Args:
            index: The worker's index in the pool.
            fd: Its end of its socket to the parent (sent along; the caller closes its copy).

        Returns:
            The worker's serial number: this server's ``pids`` has its pid once it is known.
        """
        self.serial += 1
        self.send(Fork(index, self.serial), [fd])
        return self.serial

    def kill(self, serial: int) -> None:
        """SIGKILL the ``serial``-th worker (as soon as its pid is known).

        Args:
            serial: The worker's serial number (:meth:`fork`).
        """
        pid = self.pids.get(serial)
        if pid is None:
            self.orphans.add(serial)
        elif pid not in self.exits:
            self.send(Kill(pid))

    def handle(self, msg: object) -> None:
        """Keep what a message of the fork server says: it is ready, a worker's pid, how a worker ended.

        Args:
            msg: The message (:class:`Ready`, :class:`Forked` or :class:`Exited`; others are ignored).
        """
        if isinstance(msg, Ready):
            self.ready = True
        elif isinstance(msg, Forked):
            self.pids[msg.serial] = msg.pid
            self.exits.pop(msg.pid, None)  # an earlier worker's pid, now reused: that one was reaped before
            if msg.serial in self.orphans:
                self.orphans.discard(msg.serial)
                self.send(Kill(msg.pid))
        elif isinstance(msg, Exited):
            self.exits[msg.pid] = msg.code

    def exit_text(self) -> str:
        """How the fork server ended, in words.

        Returns:
            :func:`how_it_ended` of its exit status (``is still running`` while it runs).
        """
        return how_it_ended(self.proc.poll())

    def close(self) -> None:
        """Stop the server, which first kills and reaps its workers. Idempotent."""
        self.sock.close()
        self.stages.close()
        if self.proc.returncode is not None:
            return
        if not self.ready:  # still loading the pipeline, so no worker forked yet: no need to wait for it
            self.proc.kill()
        try:
            self.proc.wait(SERVER_STOP)
        except subprocess.TimeoutExpired:  # pragma: no cover - a server that does not answer
            self.proc.kill()  # its forked workers die with it (PR_SET_PDEATHSIG)
            self.proc.wait()

    def forget(self) -> None:
        """This copy, in a forked child of the parent: close its descriptors, nothing else."""
        self.sock.close()
        self.stages.close()
        self.proc.returncode = 0  # not this process's child: never waited for (nor warned about) here


class WorkerHandle:
    """The parent's handle on one worker process (forked by the fork server).

    Making one asks ``server`` for the worker; tasks sent on :attr:`sock` wait there until it runs.

    Args:
        index: The worker's index in the pool.
        server: The fork server that starts it.
    """

    def __init__(self, index: int, server: ServerHandle):
        self.index = index
        self.server = server
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.serial = server.fork(index, child_sock.fileno())
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()  # the server has it now (or will never: then this end reads end of file)
        self.sock = parent_sock
        self.ready = False
        self.ready_at = 0.0  # when it said it was ready (time.monotonic()): a step's deadline runs from then
        self.slots: dict[int, shm.Buffer] = {}  # slot id -> this process's mapping of it
        self.slot_of: dict[int, int] = {}  # step -> slot, for steps sent and not yet taken
        self.free: list[int] = []  # slot ids not in use
        self.next_slot = 0  # slot ids ever made
        self.pending: list[int] = []  # steps sent and not yet delivered, in order
        self.tasks = 0  # tasks sent to it: its next task has 1, 2, 4, 8, ... steps, up to read_ahead

    @property
    def pid(self) -> int | None:
        """Its process id, once the fork server has said."""
        return self.server.pids.get(self.serial)

    @property
    def exit_code(self) -> int | None:
        """How it ended, as ``Popen.returncode`` (``None`` while it runs, or before the server says)."""
        pid = self.pid
        return None if pid is None else self.server.exits.get(pid)

    def exit_text(self) -> str:
        """How the worker ended, in words.

        Returns:
            :func:`how_it_ended` of its exit status, or that it ended with its fork server
            (when the server died before saying).
        """
        if self.exit_code is None and self.server.dead:
            return f"ended with its fork server, which {self.server.exit_text()}"
        return how_it_ended(self.exit_code)

    def assign(self, step: int) -> int:
        """Reserve a slot for ``step``.

        Args:
            step: A step about to be sent to this worker.

        Returns:
            A free slot id (a new one when none is free).
        """
        if self.free:
            slot = self.free.pop()
        else:
            slot, self.next_slot = self.next_slot, self.next_slot + 1
        self.slot_of[step] = slot
        return slot

    def release(self, step: int) -> None:
        """Free the slot of ``step``, which has been copied out (or failed).

        Args:
            step: The step.
        """
        slot = self.slot_of.pop(step, None)
        if slot is not None:
            self.free.append(slot)

    def close(self) -> None:
        """Close the socket (the worker reads end of file and exits) and unmap its slots. Idempotent."""
        try:
            self.sock.close()
        finally:
            for buf in self.slots.values():
                buf.close()
            self.slots.clear()
