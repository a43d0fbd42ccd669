"""Every entry point checks its arguments and names the one that is wrong."""

from __future__ import annotations

import re

import numpy as np
import pytest

import quern

BAD_STEPS = [
    (np.uint64(2**64 - 1), IndexError, "beyond the addressable stream"),
    (2**70, IndexError, "beyond the addressable stream"),
    ("3", TypeError, "must be an integer, got '3'"),
    (1.5, TypeError, "must be an integer, got 1.5"),
    (np.float64(2.0), TypeError, "must be an integer"),
    (True, TypeError, "must be an integer, got True"),
    (np.True_, TypeError, "must be an integer"),
    (None, TypeError, "must be an integer, got None"),
    (-1, ValueError, "must be >= 0, got -1"),
]


def _pipe(num_epochs=None):
    return quern.Pipeline.from_source({"x": np.arange(20)}, seed=0, num_epochs=num_epochs).shuffle().batch(4)


ENTRY_POINTS = {
    "step": [
        lambda p, s: p.batch_at(s),
        lambda p, s: p.explain(s),
        lambda p, s: p.positions(s),
        lambda p, s: p.batches_at(s, 2),
    ],
    "start_step": [lambda p, s: p.iterator(start_step=s).close()],
    "state['step']": [lambda p, s: p.check_state({"step": s, "fingerprint": p.fingerprint()})],
}


@pytest.mark.parametrize("value,error,message", BAD_STEPS, ids=lambda v: re.sub(r" at 0x[0-9a-f]+", "", repr(v))[:30])
@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_bad_steps_are_refused_naming_the_argument(name, value, error, message):
    for call in ENTRY_POINTS[name]:
        with pytest.raises(error, match=rf"^{re.escape(name)} .*{re.escape(message)}"):
            call(_pipe(), value)


def test_numpy_integer_steps_are_accepted_and_mean_the_same_step():
    pipe = _pipe()
    for s in (np.int64(3), np.uint8(3), np.int32(3)):
        np.testing.assert_array_equal(pipe.batch_at(s)["x"], pipe.batch_at(3)["x"])


def test_a_step_past_the_end_of_a_finite_stream_is_an_index_error_naming_it():
    pipe = _pipe(num_epochs=1)  # 5 steps
    with pytest.raises(IndexError, match=r"^step 5 is past the end of the stream: 5 steps"):
        pipe.batch_at(5)
    with pytest.raises(IndexError, match=r"^start_step 6 is past the end"):
        pipe.iterator(start_step=6)
    with pipe.iterator(start_step=5) as it:  # the end itself: an empty iterator
        assert list(it) == []


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda p: p.batch_at(0, process_index="0"), TypeError, "process_index must be an integer"),
        (lambda p: p.batch_at(0, process_count=np.float64(2)), TypeError, "process_count must be an integer"),
        (lambda p: p.batch_at(0, 2, 2), ValueError, r"process_index must be in \[0, 2\)"),
        (lambda p: p.batches_at(0, 0), ValueError, "count must be >= 1"),
        (lambda p: p.iterator(num_workers=-1), ValueError, "num_workers must be >= 0"),
        (lambda p: p.iterator(prefetch=True), TypeError, "prefetch must be an integer"),
        (lambda p: p.iterator(read_ahead=0), ValueError, "read_ahead must be >= 1"),
    ],
)
def test_host_and_iterator_arguments_are_checked(call, error, message):
    with pytest.raises(error, match=message):
        call(_pipe())
