"""Tests of pipeline/loader.py and pipeline/workers/ (step_timeout).

``pipe.iterator(step_timeout=...)``: a transform that never returns ends in a
``StepTimeoutError`` naming the step, host slice, stage and timeout, instead of a hang.

With workers the stuck worker process is killed and replaced (psutil looks at the
real processes) and the iterator goes on; in-process the thread is left running
and the iterator refuses to go on. No test asserts on timing: the hangs are
real (a 1000 s sleep, or an event only the test sets), the deadlines short.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import numpy as np
import psutil
import pytest

import quern
from quern import StepError, StepTimeoutError

pytestmark = pytest.mark.timeout(120)

N, B = 64, 4
STUCK = 9  # record 9: row 1 of step 2 (no shuffle)
RELEASE = threading.Event()  # in-process hangs end when the test sets it (their threads are left running)


# --------------------------------------------------------------------------- transforms (module level: workers import them)


def hang_in_worker(x):
    """Never returns on record 9 in a worker (the worker is killed); returns at once in this
    process (batch_at, for the expected batches). With QUERN_TEST_MARKER set, hangs only the
    first time, in whichever worker gets there first."""
    if int(x) == STUCK and os.environ.get("QUERN_TEST_PARENT") != str(os.getpid()):
        marker = os.environ.get("QUERN_TEST_MARKER")
        if marker is None or not os.path.exists(marker):
            if marker is not None:
                open(marker, "w").close()
            time.sleep(1000)
    return x


def hang_deaf(x):
    """Never returns on record 9 in a worker, and ignores the parent's question (as native
    code that holds the GIL would: no Python code runs to answer it)."""
    if int(x) == STUCK and os.environ.get("QUERN_TEST_PARENT") != str(os.getpid()):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        time.sleep(1000)
    return x


def hang_here(x):
    if int(x) == STUCK:
        RELEASE.wait(60)
    return x


def hang_batch(batch):
    if STUCK in batch.tolist():
        RELEASE.wait(60)
    return batch


def slow(x):
    if int(x) == STUCK:
        time.sleep(0.5)
    return x


def _pipe(fn, batch_fn=None):
    pipe = quern.Pipeline.from_source(quern.sources.ArraySource(np.arange(N, dtype=np.int64)), seed=0).map(fn)
    pipe = pipe.batch(B)
    return pipe.map_batch(batch_fn) if batch_fn is not None else pipe


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def parent(monkeypatch):
    monkeypatch.setenv("QUERN_TEST_PARENT", str(os.getpid()))


@pytest.fixture
def release():
    RELEASE.clear()
    yield
    RELEASE.set()  # the threads left running end


def _times_out_at_step_2(it, stage: str) -> str:
    """Steps 0 and 1 come, step 2 (record ``STUCK``, in ``stage``) times out: the message."""
    assert next(it).tolist() == [0, 1, 2, 3]
    assert next(it).tolist() == [4, 5, 6, 7]
    with pytest.raises(StepTimeoutError) as info:
        next(it)
    e = info.value
    assert isinstance(e, StepError) and isinstance(e, TimeoutError)
    text = str(e)
    assert "step 2 (host 0 of 1)" in text and "step_timeout=1 s" in text
    assert f"stage {stage}" in text and f"record {STUCK}" in text
    return text


# --------------------------------------------------------------------------- in-process (threads)


def test_in_process_names_step_and_stage_and_stops_the_iterator(release):
    it = _pipe(hang_here).iterator(step_timeout=1, read_ahead=1)
    try:
        text = _times_out_at_step_2(it, "map[0] hang_here")
        assert "left running" in text
        with pytest.raises(RuntimeError, match="cannot go on"):
            next(it)  # the stuck thread still has the step: no second try on this iterator
        assert it.step == 2
    finally:
        it.close()  # returns although the thread is still stuck


def test_in_process_batch_stage_is_named(release):
    with _pipe(slow, hang_batch).iterator(step_timeout=1, read_ahead=1) as it:
        with pytest.raises(StepTimeoutError, match=r"stage map_batch\[0\] hang_batch") as info:
            for _ in range(N // B):
                next(it)
        assert "step 2 (host 0 of 1)" in str(info.value)


# --------------------------------------------------------------------------- worker processes


def test_workers_stuck_worker_is_killed_and_replaced(parent):
    children = _children()
    it = _pipe(hang_in_worker).iterator(num_workers=2, step_timeout=1)
    try:
        text = _times_out_at_step_2(it, "map[0] hang_in_worker")
        stuck = int(re.search(r"worker 0 \(pid (\d+)\)", text).group(1))
        assert _gone(stuck)  # killed, and reaped by the fork server
        assert it.wait_for_workers(timeout=30)  # the new worker 0's pid comes from the fork server later
        assert stuck not in it.worker_pids and len(it.worker_pids) == 2  # a new worker 0
        with pytest.raises(StepTimeoutError) as again:  # next() again computes step 2 again: on the new worker
            next(it)
        second = int(re.search(r"worker 0 \(pid (\d+)\)", str(again.value)).group(1))
        assert second != stuck and _gone(second)
    finally:
        it.close()
    assert _children() == children  # no worker, fork server or stuck process left


def test_workers_worker_that_does_not_answer_is_killed_all_the_same(parent):
    children = _children()
    with _pipe(hang_deaf).iterator(num_workers=2, step_timeout=1) as it:
        with pytest.raises(StepTimeoutError, match="not answering") as info:
            for _ in range(N // B):
                next(it)
        text = str(info.value)
        assert "step 2 (host 0 of 1)" in text
        stuck = int(re.search(r"worker 0 \(pid (\d+)\)", text).group(1))
        assert _gone(stuck) and stuck not in it.worker_pids
    assert _children() == children


def test_workers_iterator_goes_on_after_a_timeout(parent, tmp_path, monkeypatch):
    monkeypatch.setenv("QUERN_TEST_MARKER", str(tmp_path / "hung-once"))
    pipe = _pipe(hang_in_worker)
    got = []
    with pipe.iterator(num_workers=2, step_timeout=1) as it:
        while len(got) < N // B:
            try:
                got.append(next(it))
            except StepTimeoutError as e:
                assert "step 2 " in str(e) and len(got) == 2
    assert (tmp_path / "hung-once").exists()
    for s, batch in enumerate(got):
        np.testing.assert_array_equal(batch, pipe.batch_at(s))


# --------------------------------------------------------------------------- no deadline, or a generous one


@pytest.mark.parametrize("workers", [0, 2])
def test_slow_step_within_a_generous_deadline_is_not_timed_out(workers, parent):
    pipe = _pipe(slow)
    with pipe.iterator(num_workers=workers, step_timeout=60) as it:
        got = [next(it) for _ in range(N // B)]
    for s, batch in enumerate(got):
        np.testing.assert_array_equal(batch, pipe.batch_at(s))


def test_default_is_no_deadline():
    with _pipe(slow).iterator() as it:
        assert it.step_timeout is None
        assert next(it).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "value, error",
    [
        (True, TypeError),
        ("1", TypeError),
        ([1], TypeError),
        (0, ValueError),
        (-1.5, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
    ],
    ids=["bool", "str", "list", "zero", "negative", "nan", "inf"],
)
def test_bad_step_timeout_is_refused_by_name(value, error):
    with pytest.raises(error, match="step_timeout"):
        _pipe(slow).iterator(step_timeout=value)
