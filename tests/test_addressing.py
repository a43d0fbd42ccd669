"""pipeline/addressing.py: a pipeline's steps, a step's stream positions and records, and the checks
of a step (the ``Addressed`` methods of ``Pipeline``); every expectation is computed here from the
definition (``B`` rows a step, host ``h`` of ``H`` owns rows ``[h*B/H, (h+1)*B/H)``)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_batches_equal

import quern

N, B = 100, 16


def _pipe(num_epochs=1, drop_remainder=True, shuffle=False):
    pipe = quern.Pipeline.from_source({"x": np.arange(N, dtype=np.int64)}, seed=3, num_epochs=num_epochs)
    return (pipe.shuffle() if shuffle else pipe).batch(B, drop_remainder=drop_remainder)


@pytest.mark.parametrize(
    "num_epochs,drop_remainder,steps",
    [(1, True, N // B), (1, False, -(-N // B)), (3, True, 3 * N // B), (None, True, None)],
)
def test_num_steps_counts_whole_or_partial_batches_and_none_when_endless(num_epochs, drop_remainder, steps):
    assert _pipe(num_epochs, drop_remainder).num_steps == steps


def test_a_pipeline_without_batch_has_no_steps():
    pipe = quern.Pipeline.from_source({"x": np.arange(N)})
    for call in (lambda: pipe.num_steps, lambda: pipe.batch_at(0), lambda: pipe.explain(0)):
        with pytest.raises(ValueError, match=r"needs batch\(\) first"):
            call()


def test_an_unshuffled_step_is_its_run_of_positions_and_records():
    pipe = _pipe()
    for s in range(pipe.num_steps):
        want = np.arange(s * B, (s + 1) * B)
        np.testing.assert_array_equal(pipe.positions(s), want)
        np.testing.assert_array_equal(pipe.record_ids(pipe.positions(s)), want % N)
        np.testing.assert_array_equal(pipe.batch_at(s)["x"], want % N)


def test_the_record_ids_of_a_shuffled_step_are_the_records_of_its_batch():
    pipe = _pipe(num_epochs=None, shuffle=True)
    for s in [0, 5, 6, 7, 40]:  # steps 6 and 7 cross the end of the first epoch
        ids = pipe.record_ids(pipe.positions(s))
        np.testing.assert_array_equal(pipe.batch_at(s)["x"], ids)
        assert pipe.explain(s) == [[("arrays", int(i))] for i in ids]
        seg = pipe.segments(pipe.positions(s))
        np.testing.assert_array_equal(seg.ids, ids)
        assert not seg.component.any()


@pytest.mark.parametrize("hosts", [2, 4, 8])
def test_host_positions_are_consecutive_slices_of_the_step(hosts):
    pipe = _pipe(num_epochs=None, shuffle=True)
    for s in [0, 3, 11]:
        parts = [pipe.positions(s, h, hosts) for h in range(hosts)]
        assert [len(p) for p in parts] == [B // hosts] * hosts
        np.testing.assert_array_equal(np.concatenate(parts), pipe.positions(s))
        batch = np.concatenate([pipe.batch_at(s, h, hosts)["x"] for h in range(hosts)])
        np.testing.assert_array_equal(batch, pipe.batch_at(s)["x"])


def test_batches_at_gives_each_steps_batch_at():
    pipe = _pipe(num_epochs=2, drop_remainder=False, shuffle=True)
    got = pipe.batches_at(9, 4)  # 9 .. 12: the last one partial
    assert len(got) == 4 and len(got[-1]["x"]) == 2 * N % B
    for k, batch in enumerate(got):
        assert_batches_equal(batch, pipe.batch_at(9 + k), f"step {9 + k}")


@pytest.mark.parametrize(
    "step,error,match",
    [
        (1.5, TypeError, "step must be an integer"),
        (True, TypeError, "step must be an integer"),
        (-1, ValueError, "step must be >= 0"),
        (N // B, IndexError, f"step {N // B} is past the end of the stream: {N // B} steps"),
        (2**62, IndexError, "past the end"),
    ],
)
def test_a_bad_step_is_refused_by_every_entry_point(step, error, match):
    pipe = _pipe()
    for call in (pipe.batch_at, pipe.explain, pipe.positions):
        with pytest.raises(error, match=match):
            call(step)


def test_an_endless_stream_refuses_steps_beyond_the_addressable_positions():
    pipe = _pipe(num_epochs=None)
    assert len(pipe.positions(2**62 // B - 1)) == B
    with pytest.raises(IndexError, match=r"beyond the addressable stream \(positions must stay below 2\*\*62\)"):
        pipe.positions(2**62 // B)


def test_a_numpy_integer_step_is_the_same_step():
    pipe = _pipe(shuffle=True)
    assert_batches_equal(pipe.batch_at(np.int32(3)), pipe.batch_at(3))
    assert pipe.explain(np.uint8(3)) == pipe.explain(3)


def test_what_it_reads_is_the_streams():
    pipe = _pipe(num_epochs=2)
    assert pipe.seed == 3 and pipe.num_epochs == 2 and pipe.stream_len == N
    assert pipe.leaf_names == ("arrays",) and pipe.sources == (pipe.source,) and pipe.survivors is None
    kept = quern.Pipeline.from_source({"x": np.arange(N)}).filter(lambda r: int(r["x"]) % 3 == 0)
    np.testing.assert_array_equal(kept.survivors, np.arange(0, N, 3))


def test_the_calls_of_another_kind_of_stream_are_refused():
    a = quern.Pipeline.from_source({"x": np.arange(10)}, seed=1).shuffle()
    b = quern.Pipeline.from_source({"x": np.arange(100, 110)}, seed=2).shuffle()
    mixed = quern.mix({"a": a, "b": b}, {"a": 1, "b": 1}, seed=0).batch(4)
    with pytest.raises(TypeError):
        mixed.record_ids(mixed.positions(0))  # rows of two sources: segments() says which
    seg = mixed.segments(mixed.positions(0))
    assert mixed.explain(0) == [[("ab"[c], int(i))] for c, i in zip(seg.component, seg.ids)]
    with pytest.raises(TypeError):
        _pipe().pieces(np.arange(4))  # not packed
