"""A transform that forks (``os.fork``) and whose child keeps running.

A child that comes back from the transform into quern's code is ended at once
with a message naming both processes (it used to answer in its worker's place,
which gave ``ValueError: list.remove`` in the parent, or, in-process, it stayed
alive forever waiting for threads it does not have); a child that keeps running
holding the worker's descriptors does not stop the parent from replacing that
worker when it dies. Batches stay right. Every forked process the tests make is
recorded and killed at the end.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import psutil
import pytest

import quern

pytestmark = pytest.mark.timeout(60)

N, B = 64, 4
STEPS = 8


# --------------------------------------------------------------------------- transforms (module level: workers import them)


def _record(pid: int) -> None:
    with open(os.environ["QUERN_TEST_FORKED"], "a") as f:
        f.write(f"{pid}\n")


def fork_and_come_back(x):
    """Record 5: fork; the child returns from the transform like the parent does."""
    if int(x) == 5:
        pid = os.fork()
        if pid == 0:
            _record(os.getpid())
    return x


def fork_sleeper_then_die(x):
    """In a worker: record 1 forks a child that sleeps (holding the worker's descriptors);
    record 9 then kills the worker, the first time only."""
    if os.environ.get("QUERN_TEST_PARENT") == str(os.getpid()):
        return x
    if int(x) == 1:
        pid = os.fork()
        if pid == 0:
            _record(os.getpid())
            time.sleep(120)
            os._exit(0)
    if int(x) == 9 and not os.path.exists(os.environ["QUERN_TEST_MARKER"]):
        open(os.environ["QUERN_TEST_MARKER"], "w").close()
        os._exit(1)
    return x


def _pipe(fn):
    src = quern.sources.ArraySource(np.arange(N, dtype=np.int64))
    return quern.Pipeline.from_source(src, seed=0).map(fn).batch(B)


def _forked(path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _forked_soon(path, timeout: float = 20.0) -> list[int]:
    """The recorded children, waiting for the first: a child writes its pid when it is scheduled, which on a
    loaded machine may be after the parent has finished its steps."""
    deadline = time.monotonic() + timeout
    while not _forked(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _forked(path)


def _ended(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def forked(tmp_path, monkeypatch):
    path = tmp_path / "forked-pids"
    monkeypatch.setenv("QUERN_TEST_FORKED", str(path))
    monkeypatch.setenv("QUERN_TEST_PARENT", str(os.getpid()))
    monkeypatch.setenv("QUERN_TEST_MARKER", str(tmp_path / "died-once"))
    yield path
    for pid in _forked(path):  # none may outlive the test
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it when it is this process's child
        except ChildProcessError:
            pass


def _expected(s: int) -> list[int]:
    return list(range(s * B, (s + 1) * B))


@pytest.mark.parametrize("workers", [0, 2])
def test_child_that_comes_back_is_ended_and_batches_are_right(workers, forked, capfd):
    with _pipe(fork_and_come_back).iterator(num_workers=workers) as it:
        got = [next(it).tolist() for _ in range(STEPS)]
    assert got == [_expected(s) for s in range(STEPS)]
    children = _forked_soon(forked)
    assert children, "the transform did not fork"
    assert all(_ended(pid) for pid in children)  # none left computing (or waiting forever) in a copy of us
    err = capfd.readouterr().err
    role = "worker process" if workers else "the iterator's process"
    assert f"quern: process {children[0]} was forked (os.fork) by a transform in {role}" in err
    assert "os._exit()" in err


def test_worker_dying_while_its_forked_child_holds_its_socket_is_replaced(forked):
    pipe = _pipe(fork_sleeper_then_die)
    with pipe.iterator(num_workers=2) as it:
        got = [next(it) for _ in range(STEPS)]
        assert it.stats()["worker_restarts"] >= 1
    assert (forked.parent / "died-once").exists()
    assert _forked_soon(forked), "the transform did not fork"
    for s, batch in enumerate(got):
        np.testing.assert_array_equal(batch, pipe.batch_at(s))
