"""pipeline/identity.py: a pipeline's description and fingerprint, the state a checkpoint saves,
the checks of a state on resume, and the config form (the ``Identified`` methods of ``Pipeline``).
Source identities are tested in test_source_identity.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import assert_batches_equal

import quern


def shift(r):
    return {"x": r["x"] + 1}


def _pipe(seed=1, batch=5, drop_remainder=True, fn=shift, num_epochs=None):
    src = quern.Pipeline.from_source({"x": np.arange(50)}, seed=seed, num_epochs=num_epochs)
    return src.shuffle().map(fn).batch(batch, drop_remainder)


def _mixed(schedule):
    a = quern.Pipeline.from_source({"x": np.arange(10)}, seed=1).shuffle()
    b = quern.Pipeline.from_source({"x": np.arange(100, 110)}, seed=2).shuffle()
    return quern.mix({"a": a, "b": b}, schedule=schedule, seed=0, block=16).batch(4)


def test_the_description_is_plain_data_of_every_part_and_a_copy():
    pipe = _pipe()
    d = pipe.describe()
    assert json.loads(json.dumps(d)) == d
    assert d["batch"] == [5, True] and d["batch_ops"] == [] and d["seed"] == 1
    assert [kind for kind, _ in d["record_ops"]] == ["map"]
    d["seed"] = 99
    assert pipe.describe()["seed"] == 1


def test_the_fingerprint_is_the_same_for_the_same_definition_and_changes_with_any_part():
    fp = _pipe().fingerprint()
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert _pipe().fingerprint() == fp  # built again
    others = [_pipe(seed=2), _pipe(batch=10), _pipe(drop_remainder=False), _pipe(fn=lambda r: {"x": r["x"] + 2})]
    assert len({fp, *(p.fingerprint() for p in others)}) == 1 + len(others)


def test_the_state_of_a_plain_pipeline_is_its_step_and_fingerprint():
    pipe = _pipe()
    state = pipe.state_at(3)
    assert sorted(state) == ["description", "fingerprint", "step"] and state["step"] == 3
    assert state["fingerprint"] == pipe.fingerprint() and json.loads(json.dumps(state)) == state
    assert (
        state["description"]["seed"] == 1
        and state["description"]["batch.0"] == 5
        and all(len(json.dumps(v)) <= 64 for v in state["description"].values())
    )
    with pipe.iterator(2) as it:
        next(it)
        assert it.state() == pipe.state_at(3)


def test_a_scheduled_mixture_also_saves_its_past():
    pipe = _mixed([(0, {"a": 1, "b": 1}), (8, {"a": 1, "b": 3})])
    state = pipe.state_at(3)
    assert state["fingerprint"] == pipe.fingerprint() and len(state["past"]) == 32
    assert "mixture schedule" in state["parts"] and json.loads(json.dumps(state)) == state


def test_resume_gives_the_batches_from_the_saved_step():
    pipe = _pipe(num_epochs=1)
    with pipe.resume(pipe.state_at(4)) as it:
        for s in range(4, pipe.num_steps):
            assert_batches_equal(next(it), pipe.batch_at(s), f"step {s}")
        assert list(it) == []


def test_a_state_at_the_end_resumes_to_nothing_and_one_past_it_is_refused():
    pipe = _pipe(num_epochs=1)
    assert pipe.check_state(pipe.state_at(pipe.num_steps)) == pipe.num_steps
    with pipe.resume(pipe.state_at(pipe.num_steps)) as it:
        assert list(it) == []
    with pytest.raises(IndexError, match=r"state\['step'\] 11 is past the end"):
        pipe.check_state({"step": pipe.num_steps + 1, "fingerprint": pipe.fingerprint()})


@pytest.mark.parametrize("state", [None, [], {"fingerprint": "x"}], ids=["none", "list", "no-step"])
def test_a_state_that_is_not_one_is_refused_even_forced(state):
    with pytest.raises(ValueError, match="state must be a dict with a 'step' key"):
        _pipe().check_state(state, force=True)


def test_a_state_of_another_definition_or_without_a_fingerprint_needs_force():
    pipe, other = _pipe(), _pipe(seed=2)
    with pytest.raises(ValueError, match="state has no fingerprint"):
        pipe.check_state({"step": 2})
    with pytest.raises(ValueError, match=f"state fingerprint {other.fingerprint()} does not match this pipeline's"):
        pipe.check_state(other.state_at(2))
    assert pipe.check_state({"step": 2}, force=True) == 2
    assert pipe.check_state(other.state_at(2), force=True) == 2


def test_a_schedule_edited_from_the_saved_step_on_is_accepted_and_before_it_refused():
    saved = _mixed([(0, {"a": 1, "b": 1}), (8, {"a": 1, "b": 3})]).state_at(6)
    later = _mixed([(0, {"a": 1, "b": 1}), (6, {"a": 3, "b": 1})])  # other weights from step 6 on
    assert later.fingerprint() != saved["fingerprint"] and later.check_state(saved) == 6
    earlier = _mixed([(0, {"a": 1, "b": 1}), (5, {"a": 1, "b": 3})])
    with pytest.raises(ValueError, match="what changed for the steps before 6: mixture schedule"):
        earlier.check_state(saved)


def test_a_pipeline_of_an_in_memory_source_has_no_config_form():
    with pytest.raises(ValueError, match="source 'arrays' .* has no config form"):
        _pipe().to_config()
