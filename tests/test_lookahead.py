"""pipeline/lookahead.py: the records the next steps read, in order, handed to the sources that
fetch ahead (remote ones); the expected reads are computed here from ``positions`` and
``record_ids`` (or ``segments`` for a mixture)."""

from __future__ import annotations

import numpy as np
import pytest

import quern
from quern.pipeline.remote.lookahead import Lookahead, cache_counts, records_of_steps
from quern.pipeline.sources import Source

N, B = 40, 4


class Remote(Source):
    """A source that says it fetches ahead, and records what it is handed."""

    fetches_ahead = True

    def __init__(self, name="remote", n=N):
        self.name, self.n = name, n
        self.handed: list[tuple[np.ndarray, np.ndarray]] = []
        self.stopped = 0
        self.now = None

    def __len__(self):
        return self.n

    def read_many(self, ids):
        return [{"x": np.int64(i)} for i in ids]

    def identity(self):
        return {"type": "Remote", "name": self.name, "n": self.n}

    def prefetch(self, ids, at):
        self.handed.append((np.asarray(ids).copy(), np.asarray(at).copy()))

    def stop_prefetch(self):
        self.stopped += 1


def _pipe(src=None, num_epochs=None):
    return quern.Pipeline.from_source(src or Remote(), seed=5, num_epochs=num_epochs).shuffle().batch(B)


def _expected(pipe, steps, process_index=0, process_count=1):
    ids = [pipe.record_ids(pipe.positions(s, process_index, process_count)) for s in steps]
    return np.concatenate(ids), np.repeat(np.asarray(steps), [len(i) for i in ids])


@pytest.mark.parametrize("hosts", [1, 2])
def test_the_reads_of_steps_are_each_steps_records_in_step_order(hosts):
    pipe = _pipe()
    for h in range(hosts):
        [(src, ids, at)] = records_of_steps(pipe, range(8, 14), h, hosts)  # steps 10.. cross an epoch
        want_ids, want_at = _expected(pipe, range(8, 14), h, hosts)
        assert src is pipe.source
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(at, want_at)


def test_steps_past_the_end_of_a_finite_pipeline_read_nothing():
    pipe = _pipe(num_epochs=1)  # 10 steps
    [(_, ids, at)] = records_of_steps(pipe, range(8, 20))
    np.testing.assert_array_equal(at, np.repeat([8, 9], B))
    assert records_of_steps(pipe, range(10, 20)) == [] and records_of_steps(pipe, range(3, 3)) == []


def test_a_mixture_reads_each_component_source():
    a, b = Remote("a"), Remote("b", 7)
    pa, pb = (quern.Pipeline.from_source(s, seed=i).shuffle() for i, s in enumerate((a, b)))
    pipe = quern.mix({"a": pa, "b": pb}, {"a": 1, "b": 1}, seed=0).batch(B)
    reads = records_of_steps(pipe, range(0, 6))
    seg = pipe.segments(np.concatenate([pipe.positions(s) for s in range(6)]))
    assert {src.name for src, _, _ in reads} == {"a", "b"}
    for src, ids, at in reads:
        mine = seg.component == (0 if src is a else 1)
        np.testing.assert_array_equal(np.sort(ids), np.sort(seg.ids[mine]))
        assert np.all(np.diff(at) >= 0) and set(at.tolist()) <= set(range(6))


def test_only_sources_that_fetch_ahead_are_handed_reads():
    local = quern.Pipeline.from_source({"x": np.arange(N)}).batch(B)
    assert not Lookahead.wanted(local) and Lookahead(local).sources == []
    assert Lookahead.wanted(_pipe())


def test_the_reads_are_handed_over_every_quarter_window():
    pipe = _pipe()
    src = pipe.source
    look = Lookahead(pipe, steps=8)
    look.advance(0)
    look.close()  # waits for the hand-over
    assert len(src.handed) == 1 and src.now == 0 and src.stopped == 1
    np.testing.assert_array_equal(src.handed[0][0], _expected(pipe, range(0, 8))[0])
    np.testing.assert_array_equal(src.handed[0][1], _expected(pipe, range(0, 8))[1])
    look.advance(1)  # within a quarter of the window (2 steps): nothing new
    look.close()
    assert len(src.handed) == 1 and src.now == 1
    look.advance(2)
    look.close()
    assert len(src.handed) == 2 and src.now == 2 and src.stopped == 3
    np.testing.assert_array_equal(src.handed[1][0], _expected(pipe, range(2, 10))[0])


def test_cache_counts_of_sources_without_a_cache_are_zero():
    assert set(cache_counts(_pipe()).values()) == {0}
