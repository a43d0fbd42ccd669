"""pipeline/loader.py and pipeline/loader_threads.py: the iterator: ``pipe.batch_at(s)`` for
``s = start_step, ...`` in order, whatever its options; its state, its checks of the options, and
closing. (Worker processes: test_workers.py; forks, threads and Ctrl-C: test_iterator_safety.py;
deadlines: test_step_timeout.py, which also checks its option.)"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_batches_equal, assert_iterator_gives_batch_at

import quern

N, B = 40, 4


def _pipe(num_epochs=1):
    return quern.Pipeline.from_source({"x": np.arange(N)}, seed=1, num_epochs=num_epochs).shuffle().batch(B)


@pytest.mark.parametrize(
    "options",
    [{}, {"num_threads": 3, "read_ahead": 1}, {"prefetch": 1, "read_ahead": 3}, {"prefetch": 6}, {"timings": False}],
    ids=["defaults", "threads", "prefetch-1", "prefetch-6", "untimed"],
)
def test_it_yields_batch_at_from_its_start_step_to_the_end(options):
    assert_iterator_gives_batch_at(_pipe(), 3, **options)


def test_a_host_slice_yields_that_hosts_rows():
    pipe = _pipe(num_epochs=None)
    with pipe.iterator(5, process_index=1, process_count=2) as it:
        for s in range(5, 12):
            assert_batches_equal(next(it), pipe.batch_at(s, 1, 2), f"step {s}")


def test_its_step_and_state_follow_what_it_yielded():
    pipe = _pipe()
    with pipe.iterator(3) as it:
        assert it.step == 3 and it.state() == pipe.state_at(3)
        next(it)
        next(it)
        assert it.step == 5 and it.state() == pipe.state_at(5) and it.stats()["steps"] == 2
        assert repr(it) == "PipelineIterator(step=5, host=0/1)"


def test_a_start_step_at_the_end_yields_nothing_and_past_it_is_refused():
    pipe = _pipe()
    assert list(pipe.iterator(pipe.num_steps)) == []
    with pytest.raises(IndexError, match=r"start_step 11 is past the end of the stream: 10 steps"):
        pipe.iterator(pipe.num_steps + 1)


BAD_OPTIONS = [
    ({"num_workers": -1}, ValueError, "num_workers must be >= 0, got -1"),
    ({"prefetch": 0}, ValueError, "prefetch must be >= 1, got 0"),
    ({"read_ahead": 0}, ValueError, "read_ahead must be >= 1, got 0"),
    ({"num_threads": 0}, ValueError, "num_threads must be >= 1, got 0"),
    ({"num_threads": 2, "num_workers": 1}, ValueError, "num_threads=2 applies to num_workers=0 only"),
    ({"lookahead": -1}, ValueError, "lookahead must be >= 0, got -1"),
    ({"process_index": 2, "process_count": 2}, ValueError, r"process_index must be in \[0, 2\), got 2"),
    ({"process_count": 3}, ValueError, "batch size 4 is not divisible by the host count"),
]


@pytest.mark.parametrize(
    "options,error,said", BAD_OPTIONS, ids=[",".join(f"{k}={v!r}" for k, v in o.items()) for o, _, _ in BAD_OPTIONS]
)
def test_bad_options_are_refused_before_any_step(options, error, said):
    with pytest.raises(error, match=said):
        _pipe().iterator(**options)


def test_a_closed_iterator_yields_nothing_more_and_closes_again_quietly():
    it = _pipe().iterator()
    next(it)
    it.close()
    it.close()
    with pytest.raises(RuntimeError, match="iterator is closed"):
        next(it)
    with _pipe().iterator() as it:
        next(it)
    with pytest.raises(RuntimeError, match="iterator is closed"):
        next(it)
