"""Tests of sharding/global_arrays.py.

global_iterator in one process: values, prefetch, state, errors at their own step."""

import threading

import jax
import numpy as np
import pytest

import quern


def fail_at_seven(batch):
    if int(batch["x"].max()) >= 70:
        raise ValueError("step seven")
    return batch


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()), ("data",))


def _pipe(**kw):
    return quern.Pipeline.from_source({"x": np.arange(100, dtype=np.int64)}, **kw).batch(10)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_batches_state_and_end(prefetch):
    pipe = _pipe(seed=3, num_epochs=1)
    with quern.sharding.global_iterator(pipe, _mesh(), start_step=4, device_prefetch=prefetch) as it:
        first = next(it)
        assert isinstance(first["x"], jax.Array) and first["x"].shape == (10,)
        np.testing.assert_array_equal(np.asarray(first["x"]), pipe.batch_at(4)["x"])
        assert it.state()["step"] == 5 and it.state()["fingerprint"] == pipe.fingerprint()
        rest = list(it)
    assert [np.asarray(b["x"]).tolist() for b in rest] == [pipe.batch_at(s)["x"].tolist() for s in range(5, 10)]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_error_surfaces_at_its_own_step_after_the_good_ones(prefetch):
    pipe = _pipe().map_batch(fail_at_seven)  # unshuffled: step 7 holds 70..79
    with quern.sharding.global_iterator(pipe, _mesh(), device_prefetch=prefetch) as it:
        got = [next(it) for _ in range(7)]
        with pytest.raises(quern.StepError, match="step 7"):
            next(it)
        assert it.step == 7
    assert [int(np.asarray(b["x"])[0]) for b in got] == [0, 10, 20, 30, 40, 50, 60]


def test_leaves_that_are_not_row_arrays_get_a_clear_error():
    pipe = _pipe().map_batch(lambda b: {**b, "name": np.array(["a"] * 10)})
    with (
        quern.sharding.global_iterator(pipe, _mesh()) as it,
        pytest.raises(ValueError, match="every leaf of a batch must be a numeric array"),
    ):
        next(it)


def _strings_at_thirty(batch):
    """Step 3's batch (records 30..39, unshuffled) gets a leaf jax cannot take."""
    return {**batch, "name": np.array(["a"] * 10)} if int(batch["x"][0]) == 30 else batch


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_batch_jax_refuses_is_not_skipped_when_asked_again(prefetch):
    pipe = _pipe().map_batch(_strings_at_thirty)
    with quern.sharding.global_iterator(pipe, _mesh(), device_prefetch=prefetch) as it:
        got = [int(np.asarray(next(it)["x"])[0]) for _ in range(3)]
        for _ in range(2):  # the same step each time, never the one after it
            with pytest.raises(ValueError, match="every leaf of a batch must be a numeric array"):
                next(it)
            assert it.step == 3
    assert got == [0, 10, 20]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_stats_show_the_device_and_host_buffers(prefetch):
    pipe = _pipe(seed=3, num_epochs=1)
    with quern.sharding.global_iterator(pipe, _mesh(), device_prefetch=prefetch) as it:
        next(it)
        stats = it.stats()
    assert stats["device_prefetch"] == {"ready": prefetch, "depth": prefetch}  # the batches after the one taken
    assert set(stats["host_prefetch"]) == {"ready", "in_flight", "depth", "window"} and stats["workers"] == 0


_RELEASE = threading.Event()  # the stuck step's thread ends when the test is over


def stall_at_three(batch):
    if int(batch["x"].min()) == 30:
        _RELEASE.wait(60)
    return batch


def test_step_timeout_reaches_the_host_iterator():
    """``global_iterator(step_timeout=)``: a stalled step is a ``StepTimeoutError`` naming it, after the good ones."""
    pipe = _pipe().map_batch(stall_at_three)  # unshuffled: step 3 holds 30..39
    try:
        with quern.sharding.global_iterator(pipe, _mesh(), device_prefetch=0, step_timeout=1.0) as it:
            got = [int(np.asarray(next(it)["x"])[0]) for _ in range(3)]
            with pytest.raises(quern.StepTimeoutError, match="step 3"):
                next(it)
    finally:
        _RELEASE.set()
    assert got == [0, 10, 20]
