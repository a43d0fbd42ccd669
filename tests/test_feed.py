"""Tests of pipeline/iterate/feed.py, backends.py and threads.py: one feed interface under the iterator.

Threads, worker processes and a service are three :class:`Feed` implementations;
the iterator holds no branch on which it has, and may change its feed at a step
boundary without a byte of a batch changing.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
from helpers import assert_batches_equal

import quern
from quern.pipeline.iterate import iterator as iterator_module
from quern.pipeline.iterate.backends import open_feed
from quern.pipeline.iterate.feed import Feed, FeedSettings, Stopped
from quern.pipeline.iterate.service import ServiceFeed
from quern.pipeline.iterate.threads import ThreadFeed
from quern.pipeline.iterate.workers import WorkerPool

pytestmark = pytest.mark.timeout(120)


def _pipe(n: int = 600, batch: int = 8) -> quern.Pipeline:
    def plus(r):
        return {"x": r * 2 + 1}

    return (
        quern.Pipeline.from_source(quern.sources.ArraySource(np.arange(n, dtype=np.int64)), seed=3, num_epochs=1)
        .map(plus)
        .batch(batch)
    )


def _settings(pipe: quern.Pipeline, start: int, **kw) -> FeedSettings:
    base = dict(
        start=start,
        end=pipe.num_steps,
        process_index=0,
        process_count=1,
        prefetch=2,
        read_ahead=None,
        timed=True,
        digests=False,
        copy=False,
        live=False,
    )
    return FeedSettings(**{**base, **kw})


def test_the_three_backends_implement_the_feed_interface():
    members = [n for n, v in vars(Feed).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))]
    assert {"get", "close", "forget", "stats", "add_to_ledger", "pids"} <= set(members), members
    for cls in (ThreadFeed, WorkerPool, ServiceFeed, Stopped):
        assert Feed in cls.__mro__, cls  # declared, so that mypy checks each against the interface
        # a Protocol's "..." bodies are not abstract: a member left out would silently return None
        missing = [n for n in members if getattr(cls, n) is getattr(Feed, n)]
        assert missing == [], (cls, missing)


def test_the_iterator_knows_no_backend():
    """The iterator module imports the interface and the chooser, never a feed's module."""
    tree = ast.parse(pathlib.Path(iterator_module.__file__).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not names & {"WorkerPool", "ServiceFeed", "ThreadFeed", "workers", "service"}, names
    assert not {m for m in modules if m and (m.startswith("workers") or m.startswith("service."))} - {
        "service.ray_service"  # the type of the service= option
    }
    assert "isinstance" not in pathlib.Path(iterator_module.__file__).read_text()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_running_iterator_can_change_its_feed_at_a_step_boundary(workers):
    pipe = _pipe()
    got = []
    with pipe.iterator(read_ahead=3) as it:
        got += [next(it) for _ in range(5)]
        it._use_feed(
            open_feed(pipe, _settings(pipe, it.step), num_workers=workers, num_threads=2, service=None, watch=False)
        )
        got += [next(it) for _ in range(7)]
        it._use_feed(
            open_feed(
                pipe, _settings(pipe, it.step, read_ahead=1), num_workers=0, num_threads=1, service=None, watch=True
            )
        )
        got += list(it)
        assert it.worker_pids == []
    assert len(got) == pipe.num_steps
    for s, batch in enumerate(got):
        assert_batches_equal(batch, pipe.batch_at(s), f"step {s}")


def test_the_thread_feed_computes_a_step_asked_for_again():
    """A step whose batch was lost on the way (a Ctrl-C after get returned) is computed again, the same bytes."""
    pipe = _pipe()
    feed = ThreadFeed(pipe, _settings(pipe, 0, read_ahead=4), num_threads=1, watch=False)
    try:
        never = lambda: False  # noqa: E731
        first = [feed.get(s, stop=never, timeout=None) for s in range(3)]
        again = feed.get(2, stop=never, timeout=None)  # asked again: what was computed ahead is dropped
        later = feed.get(3, stop=never, timeout=None)
        jump = feed.get(40, stop=never, timeout=None)
    finally:
        feed.close()
    for s, batch in [(0, first[0]), (1, first[1]), (2, first[2]), (2, again), (3, later), (40, jump)]:
        assert_batches_equal(batch, pipe.batch_at(s), f"step {s}")
    assert feed.stats()["host_prefetch"] == {"ready": 0, "in_flight": 0, "depth": 0}  # closed
    with pytest.raises(RuntimeError, match="closed"):
        feed.get(41, stop=never, timeout=None)


def test_an_iterator_at_the_end_starts_nothing_and_reports_its_backend():
    pipe = _pipe(n=64)
    with pipe.iterator(start_step=pipe.num_steps, num_workers=2) as it:
        assert list(it) == []
        stats = it.stats()
        assert it.worker_pids == []
    assert stats["workers"] == 2 and stats["delivered_by_worker"] == [0, 0] and stats["stage_steps"] == 0
    assert stats["host_prefetch"] == {"ready": 0, "in_flight": 0, "depth": 0, "window": 0}


def test_stats_after_close_are_the_last_figures_with_nothing_in_flight():
    pipe = _pipe()
    it = pipe.iterator(read_ahead=2)
    for _ in range(6):
        next(it)
    before = it.stats()
    it.close()
    after = it.stats()
    assert after["stage_steps"] == before["stage_steps"] >= 6 and after["stages"] == before["stages"]
    assert after["host_prefetch"]["ready"] == after["host_prefetch"]["in_flight"] == 0
    assert after["steps"] == 6 and after["workers"] == 0


def test_the_thread_feed_reads_fewer_steps_ahead_when_batches_are_large():
    """Chunks of about THREAD_CHUNK_BYTES of batches (image batches: a step or two), not THREAD_READ_STEPS."""
    from quern.pipeline.iterate.threads import THREAD_CHUNK_BYTES, THREAD_READ_STEPS

    rows = 4
    big = np.arange(8 * (THREAD_CHUNK_BYTES // rows // 8 + 1), dtype=np.float64).reshape(8, -1)  # a batch > budget
    small = np.arange(64 * 256, dtype=np.int32).reshape(64, 256)
    for data, want in ((big, 1), (small, THREAD_READ_STEPS)):
        pipe = quern.Pipeline.from_source(data, seed=0).shuffle().batch(rows)
        with pipe.iterator(prefetch=2) as it:
            for step in range(5):
                assert np.array_equal(next(it), pipe.batch_at(step))  # the same batches, whatever the chunks
            assert it.stats()["host_prefetch"]["depth"] == 2 * want
