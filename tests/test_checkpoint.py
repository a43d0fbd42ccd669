"""Tests of sharding/checkpoint.py.

Orbax round trip of the iterator state next to model state, and the fingerprint refusal."""

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import quern
from quern.sharding.checkpoint import QuernRestore, QuernSave


def _pipe(seed=0):
    return quern.Pipeline.from_source({"x": np.arange(1000)}, seed=seed).shuffle().batch(10)


def test_round_trip_with_model_state(tmp_path):
    pipe = _pipe()
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    it = pipe.iterator()
    for _ in range(7):
        next(it)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(7, args=ocp.args.Composite(model=ocp.args.StandardSave(params), data=QuernSave(it)))
        mngr.wait_until_finished()
    it.close()
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        restored = mngr.restore(
            mngr.latest_step(),
            args=ocp.args.Composite(model=ocp.args.StandardRestore(params), data=QuernRestore(_pipe())),
        )
    assert (restored.data["step"], restored.data["fingerprint"]) == (7, pipe.fingerprint())
    assert restored.data == pipe.state_at(7)  # with the description's leaves, which name what changed
    np.testing.assert_array_equal(restored.model["w"], params["w"])
    with _pipe().iterator(start_step=restored.data["step"]) as resumed:
        np.testing.assert_array_equal(next(resumed)["x"], pipe.batch_at(7)["x"])


def test_restore_against_another_pipeline_is_refused_unless_forced(tmp_path):
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(3, args=ocp.args.Composite(data=QuernSave({"step": 3, "fingerprint": _pipe().fingerprint()})))
        mngr.wait_until_finished()
    other = _pipe(seed=1)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        with pytest.raises(ValueError, match="does not match this pipeline's"):
            mngr.restore(3, args=ocp.args.Composite(data=QuernRestore(other)))
        forced = mngr.restore(3, args=ocp.args.Composite(data=QuernRestore(other, force=True)))
    assert forced.data["step"] == 3
