"""Tests of pipeline/loader.py and pipeline/workers/.

An iterator across processes and threads, and under Ctrl-C storms.

- fork: an iterator belongs to the process that made it. In a forked child,
  ``next()`` and ``wait_for_workers()`` raise a clear ``RuntimeError`` at once
  (they used to hang the child, and the parent with it, whose worker messages
  the child read); the child's ``close()`` and exit leave the parent's workers
  alone, and the parent's iterator goes on as if nothing happened.
- threads: ``next()`` while another thread is inside ``next()`` raises a clear
  ``RuntimeError`` (not an ``AssertionError`` or a bad file descriptor);
  ``close()`` from another thread, or from a signal handler, makes a waiting
  ``next()`` give up with a ``RuntimeError``, and leaves no worker behind.
- Ctrl-C storms: with SIGINT every 0.5-20 ms and the ``KeyboardInterrupt``
  caught, no worker process (nor the fork server) outlives ``close()``.

Every wait has a deadline (a hang fails the test instead of hanging the run);
nothing here asserts a duration.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import psutil
import pytest
from helpers import TESTS, alive, assert_batches_equal

import quern
from quern.pipeline.iterate import iterator as loader

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]


class Gate:
    """A batch transform that waits (in whatever process computes it) until the file
    ``path`` exists, so that a ``next()`` can be caught waiting for its batch."""

    def __init__(self, path):
        self.path = str(path)

    def __call__(self, batch):
        deadline = time.monotonic() + 60  # never stuck for good
        while not os.path.exists(self.path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return batch


def _pipe():
    return quern.Pipeline.from_source({"x": np.arange(4000, dtype=np.int64)}, seed=0).shuffle().batch(16)


def _next_on_another_thread(it) -> tuple[threading.Thread, dict]:
    """A started thread calling ``next(it)``, and the dict that gets its ``"batch"`` or ``"error"``."""
    result: dict = {}

    def consume():
        try:
            result["batch"] = next(it)
        except BaseException as e:
            result["error"] = e

    other = threading.Thread(target=consume)
    other.start()
    return other, result


def _descendants(before, n, timeout=60):
    """The processes this one has started since ``before`` (a set of pids), once
    there are at least ``n``."""
    deadline = time.monotonic() + timeout
    while True:
        pids = sorted({p.pid for p in psutil.Process().children(recursive=True)} - before)
        if len(pids) >= n:
            return pids
        assert time.monotonic() < deadline, f"only {pids} started"
        time.sleep(0.01)


def _inside(it, timeout=30):
    """Wait until some thread is inside ``next()`` (or ``close()``) of ``it``."""
    deadline = time.monotonic() + timeout
    while not it._inside:
        assert time.monotonic() < deadline, "no thread entered next()"
        time.sleep(0.005)


def _in_a_fork(child, timeout=30):
    """Run ``child()`` in a forked process; its exit status: 0 when it returned True,
    2 when False, 1 when it raised (the traceback is printed). A child that does not
    end within ``timeout`` seconds is killed and fails the test."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if child() else 2
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.01)


# --------------------------------------------------------------------------- fork


@pytest.mark.filterwarnings("ignore:os.fork")  # JAX's warning, if another test started it
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Python >= 3.12: fork with threads
@pytest.mark.parametrize("workers", [0, 2])
def test_next_in_a_forked_child_raises_and_the_parent_goes_on(workers):
    pipe = _pipe()
    with pipe.iterator(num_workers=workers) as it:
        got = [next(it) for _ in range(5)]
        pids = sorted(it.worker_pids)
        assert len(pids) == workers

        def child():
            for call in (lambda: next(it), lambda: it.wait_for_workers(1)):
                try:
                    call()
                    return False
                except RuntimeError as e:
                    msg = str(e)
                    if f"belongs to process {os.getppid()}" not in msg or "new iterator in this process" not in msg:
                        print(msg)
                        return False
            if it.state()["step"] != 5:  # reading is fine
                return False
            it.close()  # drops this copy only
            loader._close_all()  # as the child's exit does
            return True

        assert _in_a_fork(child) == 0
        assert sorted(it.worker_pids) == pids and alive(pids) == pids
        got += [next(it) for _ in range(30)]
        if workers:
            assert it.stats()["worker_restarts"] == 0
    for s, g in enumerate(got):
        assert_batches_equal(g, pipe.batch_at(s), f"step {s}")
    assert alive(pids) == []


# --------------------------------------------------------------------------- threads


@pytest.mark.parametrize("workers", [0, 2])
def test_two_threads_at_once_is_a_clear_error(tmp_path, workers):
    gate = tmp_path / "gate"
    pipe = _pipe().map_batch(Gate(gate))
    with pipe.iterator(num_workers=workers) as it:
        other, result = _next_on_another_thread(it)
        try:
            _inside(it)
            for call in (lambda: next(it), lambda: it.wait_for_workers(0)):
                with pytest.raises(RuntimeError, match="another thread is using this iterator"):
                    call()
        finally:
            gate.touch()
            other.join(60)
        assert not other.is_alive() and "error" not in result, result
        assert_batches_equal(result["batch"], pipe.batch_at(0), "step 0")
        for s in range(1, 5):  # and this thread may use it now
            assert_batches_equal(next(it), pipe.batch_at(s), f"step {s}")


@pytest.mark.parametrize("workers", [0, 2])
def test_close_from_another_thread_while_next_waits(tmp_path, workers):
    gate = tmp_path / "gate"
    pipe = _pipe().map_batch(Gate(gate))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    it = pipe.iterator(num_workers=workers)
    other, result = _next_on_another_thread(it)
    # with threads, close() waits for the step being computed: let it finish a moment later
    opener = threading.Timer(0.5, gate.touch) if not workers else None
    try:
        _inside(it)
        pids = _descendants(before, 1 + workers if workers else 0)  # the fork server and the workers
        if opener is not None:
            opener.start()
        it.close()
        assert alive(pids) == []  # the workers are gone as close() returns
        other.join(60)
        assert not other.is_alive()
        assert isinstance(result.get("error"), RuntimeError), result
        assert "closed while next() was waiting" in str(result["error"])
        with pytest.raises(RuntimeError, match="iterator is closed"):
            next(it)
    finally:
        gate.touch()
        if opener is not None:
            opener.cancel()
        it.close()


def test_close_from_a_signal_handler_inside_next(tmp_path):
    gate = tmp_path / "gate"
    pipe = _pipe().map_batch(Gate(gate))
    it = pipe.iterator(num_workers=2)
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: it.close())
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        assert it.wait_for_workers(60)
        pids = it.worker_pids
        timer.start()
        with pytest.raises(RuntimeError, match="closed while next"):
            next(it)  # the handler's close() takes effect as next() returns
        assert alive(pids) == [] and it.worker_pids == []
        with pytest.raises(RuntimeError, match="iterator is closed"):
            next(it)
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR1, old)
        gate.touch()
        it.close()


# --------------------------------------------------------------------------- Ctrl-C storms

_STORM = textwrap.dedent(
    """
    import os, random, signal, sys, threading, time
    import numpy as np, psutil, quern
    sys.path.insert(0, {tests!r})
    from helpers import alive

    ROOT = os.path.dirname(quern.__file__)
    QUERN = tuple(os.path.join(ROOT, d) + os.sep for d in ("pipeline", "transforms", "sharding"))

    def ctrl_c(signum, frame):
        # KeyboardInterrupt, as the default handler raises it, but only where quern's code
        # runs (or what it calls): this script's own lines are never interrupted
        while frame is not None:
            if frame.f_code.co_filename.startswith(QUERN):
                raise KeyboardInterrupt
            frame = frame.f_back

    signal.signal(signal.SIGINT, ctrl_c)
    pipe = quern.Pipeline.from_source({{"x": np.arange(100_000)}}, seed=0).shuffle().batch(64)
    me, rng = psutil.Process(), random.Random(0)
    for run in range({runs}):
        it = pipe.iterator(num_workers=2)
        it.wait_for_workers(60)
        stop = threading.Event()

        def storm():
            while not stop.is_set():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(rng.uniform(0.0005, 0.02))

        sender = threading.Thread(target=storm, daemon=True)
        sender.start()
        steps = interrupts = closes = 0
        end = time.monotonic() + {seconds}
        while time.monotonic() < end:
            try:
                batch = next(it)
                steps += 1
                assert np.array_equal(batch["x"], pipe.batch_at(it.step - 1)["x"]), it.step - 1
            except KeyboardInterrupt:
                interrupts += 1
        del batch
        procs = [p.pid for p in me.children(recursive=True)]  # the fork server and the workers
        while True:  # the storm goes on
            closes += 1
            try:
                it.close()
                break
            except KeyboardInterrupt:
                interrupts += 1
        # right after close() returned, still in the storm: none of them, and no process at all
        left = sorted(set(alive(procs)) | set(alive(p.pid for p in me.children(recursive=True))))
        stop.set()
        sender.join()
        print(run, steps, interrupts, closes, len(procs), left, flush=True)
    """
)


@pytest.mark.timeout(180)
def test_ctrl_c_storms_leave_no_process_behind(tmp_path):
    runs = 10
    script = tmp_path / "storm.py"
    script.write_text(_STORM.format(runs=runs, seconds=0.3, tests=TESTS))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=170, check=False, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line.split(maxsplit=5) for line in out.stdout.strip().splitlines()]
    assert len(lines) == runs, out.stdout + out.stderr
    for run, _steps, _interrupts, _closes, procs, left in lines:
        assert left == "[]", f"run {run}: {left} outlived close()\n{out.stdout}"
        assert int(procs) >= 2, out.stdout  # the server and its workers were there to stop
    assert sum(int(x[2]) for x in lines) > runs, out.stdout  # the storms did interrupt
    assert all(int(x[1]) > 0 for x in lines), out.stdout  # and batches still came


def test_a_lease_cut_short_by_ctrl_c_does_not_break_the_next_steps():
    """A Ctrl-C between a lent batch's weakref and the record of its lease (found by the Ctrl-C storm test)
    leaves a dead weakref with no lease among the returned ones: the next reclaim skips it, and the steps go
    on with the same batches (it was a KeyError)."""
    import weakref

    pipe = _pipe()
    with pipe.iterator(num_workers=1) as it:
        assert_batches_equal(next(it), pipe.batch_at(0))
        pool = it._feed

        class Owner:
            pass

        owner = Owner()
        pool._returned.append(weakref.ref(owner))  # as the weakref's callback does when its batch dies
        del owner
        for s in range(1, 6):
            assert_batches_equal(next(it), pipe.batch_at(s), f"step {s}")
