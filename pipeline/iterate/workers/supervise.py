"""The processes of a worker pool: started, watched, and replaced when they die.

A :class:`Supervisor` keeps one fork server and ``num_workers`` workers running
for a pool, counts the deaths that make a worker (or the pool) give up, and
kills a worker that misses its ``step_timeout``. What becomes of the steps of a
worker that died is the pool's (its ``lose`` callback); no step's bytes depend
on which process computed it.
"""

from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable

from ...core.errors import StepTimeoutError, WorkerError
from ...core.timing import STAGE_SIGNAL
from ...sources import reading
from . import shm
from .handles import SERVER_STOP, ServerHandle, WorkerHandle, readable
from .messages import Fatal, Init
from .signals import sigint_deferred

__all__ = ["Supervisor", "MAX_DEATHS", "STAGE_GRACE"]

MAX_DEATHS = 3  # a worker dying this many times in a row without delivering a step is an error
EXIT_GRACE = 1.0  # seconds a worker whose socket closed has to end by itself before it is killed
STAGE_GRACE = 2.0  # step_timeout: seconds a stuck worker has to say where it is before it is killed


class Supervisor:
    """The fork server and workers of one pool.

    Args:
        num_workers: Worker processes to keep running.
        process_index: The host slice they compute (for messages).
        process_count: The number of hosts (for messages).
        selector: The pool's selector: each process's socket is registered there,
            with its handle as the key's data.
        lose: Called with a worker that died (or was stopped), before its socket
            closes: the pool keeps what it delivered and forgets what it had not.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        process_index: int,
        process_count: int,
        selector: selectors.BaseSelector,
        lose: Callable[[WorkerHandle], None],
    ) -> None:
        self.num_workers = num_workers
        self.process_index, self.process_count = process_index, process_count
        self._selector = selector
        self._lose = lose
        self.workers: list[WorkerHandle | None] = [None] * num_workers
        self.server: ServerHandle | None = None
        self.restarts = 0  # workers replaced after dying
        self.fatal: WorkerError | None = None  # the pipeline cannot be loaded: stop for good
        self.broken: dict[int, WorkerError] = {}  # worker index -> why it is not restarted
        self._deaths = [0] * num_workers  # consecutive deaths without a delivered step
        self._server_deaths = 0  # consecutive deaths of the fork server without a delivered step
        self._init: Init | None = None
        self._definition: shm.Buffer | None = None

    def start_server(self) -> None:
        """Start the fork server (it imports numpy... while the parent pickles the pipeline)."""
        self.server = self._new_server()

    def load(self, init: Init, definition: shm.Buffer) -> None:
        """Send the pipeline to the fork server, and to any that replaces it; ask for every worker.

        Args:
            init: The message that describes the pipeline.
            definition: The shared buffer that holds it (it stays the pool's to close).
        """
        assert self.server is not None, "start_server() first"
        init = init._replace(library_threads=reading.threads_help(self.num_workers))
        self._init, self._definition = init, definition
        self.server.send(init, [definition.fd])
        for w in range(self.num_workers):
            self.start(w)

    def _new_server(self) -> ServerHandle:
        server = ServerHandle()
        self._selector.register(server.sock, selectors.EVENT_READ, server)
        return server

    def start(self, w: int) -> None:
        """Ask the fork server for worker ``w``; nothing happens while the server is being replaced.

        Tasks can be sent to the worker at once: they wait in its socket.

        Args:
            w: The worker's index.
        """
        server = self.server
        if server is None or server.dead:
            return
        with sigint_deferred():  # never a worker asked for and not tracked
            worker = WorkerHandle(w, server)
            self.workers[w] = worker
            self._selector.register(worker.sock, selectors.EVENT_READ, worker)

    def delivered(self, w: int) -> None:
        """Worker ``w`` delivered a step: its deaths (and the server's) in a row start again from 0.

        Args:
            w: The worker's index.
        """
        self._deaths[w] = 0
        self._server_deaths = 0

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers the fork server has started so far."""
        return [p for p in (w.pid for w in self.workers if w is not None) if p is not None]

    # ------------------------------------------------------------------ deaths

    def on_death(self, worker: WorkerHandle, *, count: bool = True, restart: bool = True) -> None:
        """Let the pool keep what the dead worker delivered and forget what it had not; start another.

        After :data:`MAX_DEATHS` counted deaths in a row without a delivered step,
        the worker is not restarted: :meth:`raise_failures` raises
        :class:`WorkerError` for it.

        Args:
            worker: The worker that died (or is to be stopped: it is killed if it still runs).
            count: Count the death; ``False`` when the parent itself stopped the worker
                (its message stream was interrupted half-way, by Ctrl-C say, or its
                fork server died), which is not the worker's fault.
            restart: Start another in its place.
        """
        with sigint_deferred():  # never half-replaced
            self._replace(worker, count, restart)

    def _replace(self, worker: WorkerHandle, count: bool, restart: bool) -> None:
        w = worker.index
        if self.workers[w] is worker:
            self.workers[w] = None  # first, so that an interruption below cannot leave it half-replaced
        try:
            self._selector.unregister(worker.sock)
        except (KeyError, ValueError):
            pass
        try:
            self._lose(worker)
        finally:
            worker.close()
        server = worker.server
        if count:  # how it ended, for the error message
            self.await_exit(worker, EXIT_GRACE)
        if worker.exit_code is None:  # still running, or not forked yet: make sure it ends
            server.kill(worker.serial)
            if count:
                self.await_exit(worker, SERVER_STOP)
        if self.fatal is not None or not restart or server.dead:
            return
        self._deaths[w] += count
        if self._deaths[w] >= MAX_DEATHS:
            self.broken[w] = WorkerError(
                f"worker {w} (pid {worker.pid}) {worker.exit_text()}; it died {self._deaths[w]} times in a row "
                f"without delivering a step (host {self.process_index} of {self.process_count}, "
                f"steps in progress: {worker.pending[:8] or 'none'}); see its output above"
            )
            self._deaths[w] = 0  # asking for the step again tries again
            return
        self.restarts += 1
        self.start(w)

    def await_exit(self, worker: WorkerHandle, timeout: float) -> None:
        """Handle the fork server's messages until it says how ``worker`` ended.

        Args:
            worker: The worker.
            timeout: Seconds to wait at most; it also stops when the server is gone.
        """
        server = worker.server
        deadline = time.monotonic() + timeout
        while worker.exit_code is None and not server.dead:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if readable(server.sock, left):
                self.pump(server)

    def reap_exited(self) -> None:
        """Replace the workers that the fork server says have ended.

        Their socket's end of file may never come while a process that a transform
        forked holds a copy of it.
        """
        for worker in list(self.workers):
            if worker is not None and worker.exit_code is not None and self.workers[worker.index] is worker:
                self.on_death(worker)

    def revive(self) -> None:
        """If the fork server has died, account for its workers (gone with it) and start another server and workers.

        A server that dies before it has loaded the pipeline, or :data:`MAX_DEATHS`
        times in a row without a step delivered in between, stops the pool for good
        (:meth:`raise_failures` then raises).
        """
        server = self.server
        if server is None or not server.dead or self.fatal is not None:
            return
        with sigint_deferred():  # never left without a server
            self._replace_server(server)

    def _replace_server(self, server: ServerHandle) -> None:
        for worker in list(self.workers):
            if worker is not None and worker.server is server:
                self.on_death(worker, count=False, restart=False)
        self.server = None
        try:
            self._selector.unregister(server.sock)
        except (KeyError, ValueError):
            pass
        server.close()
        if not server.ready:
            self.fatal = WorkerError(
                f"worker processes could not start: their fork server (pid {server.pid}) {server.exit_text()} "
                "while loading the pipeline; see its output above"
            )
            return
        self._server_deaths += 1
        if self._server_deaths >= MAX_DEATHS:
            self.fatal = WorkerError(
                f"the fork server of the worker processes (pid {server.pid}) {server.exit_text()}; it died "
                f"{self._server_deaths} times in a row without a step delivered in between"
            )
            return
        assert self._definition is not None and self._definition.fd >= 0, "the pool is closed"
        assert self._init is not None
        self.server = self._new_server()
        self.server.send(self._init, [self._definition.fd])
        for w in range(self.num_workers):
            if self.workers[w] is None and w not in self.broken:
                self.restarts += 1
                self.start(w)

    def raise_failures(self, w: int | None = None) -> None:
        """Raise the error that stops worker ``w`` (any worker when ``None``), if there is one.

        Args:
            w: The worker's index, or ``None``.

        Raises:
            WorkerError: The pipeline cannot be loaded, the fork server keeps dying,
                or worker ``w`` died :data:`MAX_DEATHS` times in a row.
        """
        if self.fatal is not None:
            raise WorkerError(*self.fatal.args)
        broken = [v for v in self.broken if w is None or v == w]
        if broken:
            raise self.broken.pop(broken[0])

    def pump(self, server: ServerHandle) -> None:
        """Handle the fork server's messages waiting now (never half of one: Ctrl-C waits).

        A server whose socket is closed is marked dead (:meth:`revive` replaces it).

        Args:
            server: The fork server.
        """
        try:
            while True:
                with sigint_deferred():
                    msg, fds = shm.recv(server.sock)
                    for fd in fds:
                        os.close(fd)
                    if isinstance(msg, Fatal):  # it cannot load the pipeline: neither can any other
                        self.fatal = WorkerError(
                            f"worker processes could not start: their fork server (pid {server.pid}) could not "
                            f"load the pipeline: {msg.text}\n\nits traceback:\n{msg.traceback}"
                        )
                    server.handle(msg)
                if not readable(server.sock):
                    return
        except (EOFError, OSError):
            server.dead = True
            try:
                self._selector.unregister(server.sock)
            except (KeyError, ValueError):
                pass

    # ------------------------------------------------------------------ step_timeout

    def time_out(self, worker: WorkerHandle, step: int, *, timeout: float) -> None:
        """Ask ``worker``, late with ``step``, where it is; kill it and start another in its place.

        Args:
            worker: The worker computing ``step``.
            step: The step that has not come.
            timeout: The step timeout it missed, in seconds (for the message).

        Raises:
            StepTimeoutError: Always, naming the step, host slice, stage and timeout.
        """
        where = self._stage_report(worker)
        pid = worker.pid
        self.on_death(worker, count=False)  # killed through the fork server; its steps are sent again
        self.await_exit(worker, SERVER_STOP)
        if where is None:
            where = (
                f"not answering (it ran no Python code within {STAGE_GRACE:g} s of being asked where it was: "
                "stuck in native code?)"
            )
        else:
            where = f"stuck {where}"
        killed = "killed" if worker.exit_code is not None else "being killed"
        raise StepTimeoutError(
            f"step {step} (host {self.process_index} of {self.process_count}): no batch within step_timeout="
            f"{timeout:g} s; worker {worker.index} (pid {pid}) computing it was {where}; that worker was {killed} "
            "and a new one started in its place: next() again computes the step again (a transform that never "
            "returns will time out again), or close the iterator"
        )

    def _stage_report(self, worker: WorkerHandle) -> str | None:
        """Where ``worker`` is (:func:`quern.pipeline.core.timing.stage_now` of its main thread).

        As it answers :data:`~quern.pipeline.core.timing.STAGE_SIGNAL` within
        :data:`STAGE_GRACE` seconds; ``None`` when it does not.
        """
        server = worker.server
        if not server.dead and readable(server.sock):
            self.pump(server)  # has it ended meanwhile (then its pid may not be its any more)?
        pid = worker.pid
        if pid is None or worker.exit_code is not None or server.dead:
            return None
        try:
            while server.stages.recv(65536):  # answers that came too late for an earlier question
                pass
        except OSError:
            pass
        try:
            os.kill(pid, STAGE_SIGNAL)
        except OSError:
            return None
        deadline = time.monotonic() + STAGE_GRACE
        while (left := deadline - time.monotonic()) > 0 and readable(server.stages, left):
            try:
                answer = server.stages.recv(65536)
            except OSError:
                continue
            who, _, where = answer.partition(b"\0")
            if who == str(pid).encode():
                return where.decode(errors="replace")
        return None

    # ------------------------------------------------------------------ the end

    def close(self) -> None:
        """Stop the workers and the fork server; when this returns, no worker is left. Idempotent.

        The fork server kills and reaps every worker before it exits.
        """
        for i, worker in enumerate(self.workers):
            if worker is not None:
                worker.close()  # end of file: an idle worker exits at once
                self.workers[i] = None
        server = self.server
        if server is not None:
            if not server.dead and not server.ready and readable(server.sock):
                self.pump(server)  # has it loaded the pipeline (and so maybe forked) yet?
            server.close()
            self.server = None

    def forget(self) -> None:
        """Close the descriptors of processes that belong to another process (this one is a fork of it).

        Nothing is sent to those processes: no message, no signal.
        """
        for i, worker in enumerate(self.workers):
            if worker is not None:
                worker.close()
                self.workers[i] = None
        if self.server is not None:
            self.server.forget()
            self.server = None
