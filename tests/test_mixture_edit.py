"""Tests of pipeline/streams/mixture.py.

quern.mix: resuming on a mixture with a component added that is zero before the saved
step (issue 21, point 12).

A component whose weight is zero in every stage starting before step ``k`` takes no
slot of those stages' blocks, so the batches before ``k`` are bit-identical with or
without it (wherever it is among the components, whatever its transforms) as long as
the block size stays the same; a state saved at ``k`` resumes on the edited mixture.
An edit that raises the block size (at least the number of components squared) or gives
the component a weight before ``k`` changes those batches and is refused, naming what
changed. Each claim about batches is checked here on the batches themselves.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from helpers import batches_equal

import quern

pytestmark = pytest.mark.timeout(120)

K = 30  # the saved step
W0 = {"a": 0.7, "b": 0.3}
W1 = {"a": 0.2, "b": 0.8}


def _comp(lo, n, seed):
    return quern.Pipeline.from_source({"x": np.arange(lo, lo + n, dtype=np.int64)}, seed=seed).shuffle()


def add_five(rec):
    return {"x": rec["x"] + 5}


def _old(block=1024):
    comps = {"a": _comp(0, 100, 1), "b": _comp(1000, 10, 2)}
    return quern.mix(comps, schedule=[(0, W0), (20, W1)], seed=3, block=block).batch(8)


def _new(at="end", new_from=K, before=0.0, block=1024, transformed=False):
    """The old mixture plus component ``new`` (weight ``before`` in the stages before
    ``new_from``, 0.4 from the stage starting at ``new_from``)."""
    new = _comp(5000, 13, 9)
    if transformed:
        new = new.map(add_five)
    items = [("a", _comp(0, 100, 1)), ("b", _comp(1000, 10, 2))]
    items.insert({"first": 0, "middle": 1, "end": 2}[at], ("new", new))
    schedule = [
        (0, {**W0, "new": before}),
        (20, {**W1, "new": before}),
        (new_from, {"a": 0.3, "b": 0.3, "new": 0.4}),
    ]
    return quern.mix(items, schedule=schedule, seed=3, block=block).batch(8)


def _state(pipe, k=K):
    with pipe.iterator() as it:
        for _ in range(k):
            next(it)
        state = it.state()
    return json.loads(json.dumps(state))  # as saved and read back


def _changed(message):
    m = re.search(r"what changed for the steps before \d+: (.*?); pass force=True", message)
    assert m, message
    return m.group(1).split(", ")


@pytest.mark.parametrize("at", ["first", "middle", "end"])
@pytest.mark.parametrize("transformed", [False, True], ids=["same-transforms", "own-transforms"])
def test_a_component_zero_before_the_saved_step_is_accepted_on_resume(at, transformed):
    old = _old()
    state = _state(old)
    new = _new(at=at, transformed=transformed)
    assert new.fingerprint() != old.fingerprint()  # the full fingerprint names every component
    assert "new" in new.describe()["mixture"]["names"]
    for s in range(K):  # the batches already taken are bit-identical
        assert batches_equal(new.batch_at(s), old.batch_at(s)), s
    assert new.describe_until(K) == old.describe_until(K)
    with new.resume(state) as it:
        assert it.step == K
        got = [next(it) for _ in range(10)]
    for s, batch in zip(range(K, K + 10), got):
        assert batches_equal(batch, new.batch_at(s)), s
    drawn = {name for s in range(K, K + 10) for row in new.explain(s) for name, _ in row}
    assert "new" in drawn  # and it is drawn from step K on


def test_a_component_added_for_a_later_stage_and_one_dropped_are_accepted():
    state = _state(_old())
    later = _new(new_from=K + 7)
    with later.resume(state) as it:
        assert it.step == K
        assert batches_equal(next(it), later.batch_at(K))
    # the other way: a state of the mixture with the component, resumed without it
    state = _state(_new(new_from=K + 7), K)
    old = _old()
    with old.resume(state) as it:
        assert batches_equal(next(it), old.batch_at(K))


def test_an_edit_that_raises_the_block_size_is_refused():
    old = _old(block=4)  # two components: blocks of 4; three: of 9 (the number squared)
    state = _state(old)
    new = _new(block=4)
    assert new.stream.block == 9 and old.stream.block == 4
    assert any(not batches_equal(new.batch_at(s), old.batch_at(s)) for s in range(K))  # the past does change
    with pytest.raises(ValueError) as e:
        new.resume(state)
    assert _changed(str(e.value)) == ["mixture block"]
    with new.resume(state, force=True) as it:
        assert it.step == K


def test_a_component_with_a_weight_before_the_saved_step_is_refused():
    old = _old()
    state = _state(old)
    new = _new(before=0.1)
    assert any(not batches_equal(new.batch_at(s), old.batch_at(s)) for s in range(K))
    with pytest.raises(ValueError) as e:
        new.resume(state)
    changed = _changed(str(e.value))
    assert "component 'new'" in changed and "mixture schedule" in changed and "mixture names" in changed


def test_the_past_of_a_mixture_without_zero_components_is_as_before():
    """``describe_until`` leaves out only components zero in every stage before the step: a
    mixture whose components all have a weight there describes its past as it did."""
    old = _old()
    past = old.describe_until(K)["mixture"]
    assert past["names"] == ["a", "b"]
    assert [w for _, w in past["schedule"]] == [list(st.weights) for st in old.stream.stages]
    assert old.describe_until(K) == {**old.describe(), "mixture": {**old.describe()["mixture"], **past}}
    assert old.describe_until(None) == old.describe()
    new = _new()
    assert new.describe_until(None)["mixture"]["names"] == ["a", "b", "new"]
    assert len(new.describe_until(None)["mixture"]["schedule"]) == 3
