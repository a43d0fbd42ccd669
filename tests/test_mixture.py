"""Tests of pipeline/mix.py, pipeline/streams/mixture.py and pipeline/plan/mixture.py.

quern.mix: exact counts per block, each component's own stream, zero weights, schedules,
resume across a schedule edited after the saved step, explain, workers and hosts, errors, golden order.

Bounds and expected counts are computed here from the weights (and the
documented block arithmetic), never from the code under test; the golden
values at the end are literals.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from helpers import assert_batches_equal

import quern
from quern.pipeline.order import components as plan
from quern.pipeline.sources import Source

pytestmark = pytest.mark.timeout(120)

Q = 2**32


# --------------------------------------------------------------------------- helpers


def _comp(lo, n, seed, dtype=np.int64):
    """An endless, shuffled component whose record values are ``lo .. lo + n - 1``."""
    return quern.Pipeline.from_source({"x": np.arange(lo, lo + n, dtype=dtype)}, seed=seed).shuffle()


def _abc():
    return {"a": _comp(0, 100, 1), "b": _comp(1000, 10, 2), "c": _comp(2000, 7, 3)}


W0 = {"a": 0.5, "b": 0.3, "c": 0.2}
W1 = {"a": 0.1, "b": 0.1, "c": 0.8}
BASE = {"a": 0, "b": 1000, "c": 2000}  # the first value of each component's source


def _value(name, rid):
    return BASE[name] + rid


def _counts(component, C):
    return np.bincount(component, minlength=C)


def add_ten(rec):
    return {"x": rec["x"] + 10}


def times_two(rec):
    return {"x": rec["x"] * 2}


class Never(Source):
    """A source that fails on any read (even of no record): a component that must never be read."""

    name = "never"

    def __len__(self):
        return 50

    def read_many(self, ids):
        raise AssertionError(f"a component with weight 0 was read: ids {list(ids)[:5]}")

    def identity(self):
        return {"type": "Never", "len": 50}


class NeverSequence:
    """grain's protocol (``__len__``/``__getitem__``), failing on any read."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        raise AssertionError(f"a component with weight 0 was read: record {i}")

    def fingerprint(self):
        return "never-sequence-v1"


# --------------------------------------------------------------------------- 1. exact counts


@pytest.mark.parametrize(
    "weights",
    [
        [0.5, 0.3, 0.2],
        [0.4, 0.4, 0.2],  # a tie for the largest weight: the lower index absorbs
        [0.37, 0.01, 0.22, 0.4, 0.0],
        [1.0, 3.0],  # relative weights
    ],
)
def test_counts_over_whole_blocks_are_exact(weights):
    C = len(weights)
    comps = {f"c{i}": _comp(1000 * i, 50 + i, i) for i in range(C)}
    pipe = quern.mix(comps, weights=weights, seed=11)
    K = pipe.stream.block
    assert K == 1024
    w = np.asarray(weights, dtype=float) / sum(weights)
    absorbing = min(range(C), key=lambda c: (-weights[c], c))
    m = 24
    comp = pipe.segments(np.arange(m * K)).component
    per_block = np.stack([_counts(comp[b * K : (b + 1) * K], C) for b in range(m)])
    assert np.all(per_block.sum(axis=1) == K)
    eps = 1e-6  # the weights are quantized to 2**-32: a deviation of ~1e-5 positions at most here
    for c in range(C):
        bound = (C - 1 if c == absorbing else 1) + eps
        for b in range(m):  # each block, and each prefix of b + 1 whole blocks
            assert abs(per_block[b, c] - w[c] * K) < bound, (c, b, per_block[b, c])
            prefix = per_block[: b + 1, c].sum()
            assert abs(prefix - w[c] * K * (b + 1)) < bound, (c, b, prefix)
        for lo, hi in [(3, 7), (5, 24), (10, 11)]:  # windows of whole blocks
            assert abs(per_block[lo:hi, c].sum() - w[c] * K * (hi - lo)) < bound
        if w[c] == 0:
            assert per_block[:, c].sum() == 0
    # the slots of a block are permuted, not laid out component after component
    assert np.any(np.diff(comp[:K]) < 0)
    assert not np.array_equal(comp[:K], comp[K : 2 * K])


@pytest.mark.parametrize(
    "weights,block,blocks",
    [([0.5, 0.3, 0.2], 1024, 24), ([0.5, 0.3, 0.2], 9, 1000), ([0.37, 0.01, 0.22, 0.4, 0.0], 25, 500)],
)
def test_counts_over_any_window_are_within_the_stated_bound(weights, block, blocks):
    """plan/mixture.py: over any window of positions of one stage, |count_c - w_c * length| <
    K / 2 + 3 (K / 2 + 3 C for the absorbing component). Checked over every window at once: with
    D[p] = count_c(positions < p) - w_c * p, the largest deviation of any window is max D - min D."""
    C = len(weights)
    comps = {f"c{i}": _comp(100 * i, 5 + i, i) for i in range(C)}
    pipe = quern.mix(comps, weights=weights, seed=3, block=block)
    K = pipe.stream.block
    total = blocks * K
    comp = pipe.segments(np.arange(total)).component
    w = np.asarray(weights, dtype=float) / sum(weights)
    absorbing = min(range(C), key=lambda c: (-weights[c], c))
    for c in range(C):
        D = np.concatenate([[0], np.cumsum(comp == c)]) - w[c] * np.arange(total + 1)
        worst = D.max() - D.min()
        bound = K / 2 + (3 * C if c == absorbing else 3)
        assert worst < bound + 1e-6, (c, worst, bound)
        if w[c] > 0.1:
            assert worst > 2  # windows cutting blocks do deviate: the check is not vacuous
    rng = np.random.default_rng(0)  # and a few windows counted directly
    for lo, n in zip(rng.integers(0, total, 200), rng.integers(1, total, 200)):
        hi = min(int(lo) + int(n), total)
        counts = _counts(comp[lo:hi], C)
        for c in range(C):
            assert abs(counts[c] - w[c] * (hi - lo)) < K / 2 + 3 * C


def test_block_is_raised_to_the_number_of_components_squared():
    comps = {f"c{i}": _comp(0, 5, i) for i in range(5)}
    assert quern.mix(comps, weights=[1] * 5, block=1).stream.block == 25
    assert quern.mix(comps, weights=[1] * 5, block=30).stream.block == 30
    assert quern.mix(_abc(), weights=W0, block=4).stream.block == 9


def test_weights_are_matched_by_name_and_schedule_forms_agree():
    comps = _abc()
    ref = quern.mix(comps, weights=W0, seed=3).batch(32)
    reordered = quern.mix(comps, weights={"c": 0.2, "a": 0.5, "b": 0.3}, seed=3).batch(32)
    as_list = quern.mix(comps, weights=[5, 3, 2], seed=3).batch(32)  # relative: the same proportions
    as_schedule = quern.mix(comps, schedule=[{"start_step": 0, "weights": W0}], seed=3).batch(32)
    for other in (reordered, as_list, as_schedule):
        assert other.fingerprint() == ref.fingerprint()
        for s in (0, 40):
            assert_batches_equal(other.batch_at(s), ref.batch_at(s), f"step {s}")


# --------------------------------------------------------------------------- 2. each component's own stream


def test_the_kth_draw_of_a_component_is_position_k_of_its_stream():
    comps = _abc()
    pipe = quern.mix(comps, weights=W0, seed=4)
    n = 3 * pipe.stream.block + 100
    seg = pipe.segments(np.arange(n))
    for c, (name, comp) in enumerate(comps.items()):
        sel = seg.component == c
        k = int(sel.sum())
        assert k > 0
        np.testing.assert_array_equal(seg.positions[sel], np.arange(k), err_msg=name)
        np.testing.assert_array_equal(seg.ids[sel], comp.record_ids(np.arange(k)), err_msg=name)


def test_a_small_component_repeats_and_reshuffles_on_its_own_epochs():
    pipe = quern.mix(_abc(), weights=W0, seed=4).batch(50)
    draws = {"a": [], "b": [], "c": []}
    for s in range(24):
        xs = pipe.batch_at(s)["x"].tolist()
        for [(name, rid)], x in zip(pipe.explain(s), xs):
            assert x == _value(name, rid)
            draws[name].append(x)
    for name, n in [("a", 100), ("b", 10), ("c", 7)]:
        d = np.asarray(draws[name])
        epochs = len(d) // n
        assert epochs >= 2, name
        groups = d[: epochs * n].reshape(epochs, n)
        for e in range(epochs):  # each epoch of the component: each of its records once
            np.testing.assert_array_equal(np.sort(groups[e]), BASE[name] + np.arange(n), err_msg=f"{name} epoch {e}")
        assert len({tuple(g) for g in groups}) > 1, name  # and in a new order
    assert not np.array_equal(draws["c"][:7], draws["c"][7:14])


# --------------------------------------------------------------------------- 3. zero weights


@pytest.mark.parametrize("never", [Never, NeverSequence])
def test_a_component_with_weight_zero_everywhere_is_never_read(never):
    comps = {"a": _comp(0, 100, 1), "z": quern.Pipeline.from_source(never()), "b": _comp(1000, 10, 2)}
    pipe = quern.mix(comps, schedule=[(0, {"a": 1, "z": 0, "b": 1}), (5, {"a": 1, "z": 0.0, "b": 3})]).batch(16)
    for s in range(12):
        batch = pipe.batch_at(s)
        names = [name for [(name, _)] in pipe.explain(s)]
        assert "z" not in names
        assert len(batch["x"]) == 16
    with pipe.iterator() as it:
        for _ in range(12):
            next(it)
        json.dumps(it.state())
    assert not np.any(pipe.segments(np.arange(20 * 16)).component == 1)


def test_a_component_can_go_to_zero_in_one_stage_and_come_back():
    comps = _abc()
    B = 32
    pipe = quern.mix(comps, schedule=[(0, W0), (10, {"a": 1, "b": 1, "c": 0}), (20, W0)], seed=2).batch(B)
    seg = pipe.segments(np.arange(40 * B))
    comp = seg.component
    assert np.all(comp[10 * B : 20 * B] != 2)  # no 'c' in stage 1
    assert np.any(comp[: 10 * B] == 2) and np.any(comp[20 * B :] == 2)
    for c in range(3):  # each component's stream goes on where it stopped
        sel = comp == c
        np.testing.assert_array_equal(seg.positions[sel], np.arange(int(sel.sum())))


# --------------------------------------------------------------------------- 4. schedules


def test_stages_start_at_steps_and_follow_their_weights():
    comps = _abc()
    s = 37
    for B in [48, 64]:
        pipe = quern.mix(comps, schedule=[(0, W0), (s, W1)], seed=9).batch(B)
        K = pipe.stream.block
        start = s * B  # stage 1 starts at this position
        comp = pipe.segments(np.arange(start + 8 * K)).component
        c0 = _counts(comp[:K], 3)  # the first whole block of stage 0
        c1 = _counts(comp[start : start + 8 * K], 3)  # 8 whole blocks of stage 1, counted from its start
        for c, name in enumerate("abc"):
            assert abs(c0[c] - W0[name] * K) < 2 + 1e-6
            assert abs(c1[c] - W1[name] * 8 * K) < 2 + 1e-6
        # stage 1 counts its blocks from its own start: its first block is exact too
        first = _counts(comp[start : start + K], 3)
        for c, name in enumerate("abc"):
            assert abs(first[c] - W1[name] * K) < 2 + 1e-6


def test_batches_before_a_stage_do_not_depend_on_it():
    comps = _abc()
    B, s = 48, 37  # the stage starts mid-block: 37 * 48 = 1776 = 1024 + 752
    without = quern.mix(comps, schedule=[(0, W0)], seed=9).batch(B)
    with_stage = quern.mix(comps, schedule=[(0, W0), (s, W1)], seed=9).batch(B)
    two_stages = quern.mix(comps, schedule=[(0, W0), (s, W1), (s + 3, W0)], seed=9).batch(B)
    for step in range(s):
        assert_batches_equal(with_stage.batch_at(step), without.batch_at(step), f"step {step}")
        assert with_stage.explain(step) == without.explain(step)
    for step in range(s + 3):
        assert_batches_equal(two_stages.batch_at(step), with_stage.batch_at(step), f"step {step}")
    after = [step for step in range(s, s + 6) if with_stage.explain(step) != without.explain(step)]
    assert s in after and len(after) == 6


# --------------------------------------------------------------------------- 5. resume across an edited schedule


def _mixed(schedule=None, seed=5, comps=None, batch=16, maps=()):
    comps = _abc() if comps is None else comps
    pipe = quern.mix(comps, schedule=schedule or [(0, W0)], seed=seed)
    for fn in maps:
        pipe = pipe.map(fn)
    return pipe.batch(batch)


def _saved_state(k=10):
    pipe = _mixed()
    with pipe.iterator() as it:
        for _ in range(k):
            next(it)
        state = it.state()
    return json.loads(json.dumps(state))  # JSON-serialisable, and used as read back


@pytest.mark.parametrize("start", [10, 11, 25])
def test_resume_accepts_a_stage_added_at_or_after_the_saved_step(start):
    k = 10
    state = _saved_state(k)
    assert state["step"] == k
    other = _mixed(schedule=[(0, W0), (start, W1)])
    assert other.fingerprint() != _mixed().fingerprint()
    with other.resume(state) as it:
        assert it.step == k
        for s in range(k, k + 20):  # across the new stage
            assert_batches_equal(next(it), other.batch_at(s), f"step {s}")
    for s in range(k):  # the batches already taken are the same in both
        assert_batches_equal(other.batch_at(s), _mixed().batch_at(s), f"step {s}")


def test_resume_accepts_a_future_stage_removed():
    pipe = _mixed(schedule=[(0, W0), (30, W1)])
    with pipe.iterator(start_step=12) as it:
        next(it)
        state = json.loads(json.dumps(it.state()))
    other = _mixed()
    with other.resume(state) as it:
        assert it.step == 13
        assert_batches_equal(next(it), other.batch_at(13))


def _changed(message):
    m = re.search(r"what changed for the steps before \d+: (.*?); pass force=True", message)
    assert m, message
    return m.group(1).split(", ")


@pytest.mark.parametrize(
    "make,changed",
    [
        (lambda: _mixed(schedule=[(0, W0), (9, W1)]), ["mixture schedule"]),
        (lambda: _mixed(schedule=[(0, W0), (1, W1)]), ["mixture schedule"]),
        (lambda: _mixed(schedule=[(0, {"a": 0.5, "b": 0.2, "c": 0.3})]), ["mixture schedule"]),
        (lambda: _mixed(seed=6), ["mixture seed"]),
        (lambda: _mixed(comps={**_abc(), "a": _comp(0, 100, 99)}), ["component 'a'"]),
        (lambda: _mixed(comps={**_abc(), "b": _comp(1000, 10, 2).map(add_ten)}), ["component 'b'"]),
        (lambda: _mixed(maps=(times_two,)), ["record_ops"]),
    ],
    ids=["stage-before-k", "stage-at-1", "stage-0-weights", "mixture-seed", "component-seed", "component-map", "map"],
)
def test_resume_refuses_a_change_before_the_saved_step_and_names_it(make, changed):
    k = 10
    state = _saved_state(k)
    other = make()
    assert any(not np.array_equal(other.batch_at(s)["x"], _mixed().batch_at(s)["x"]) for s in range(k))
    with pytest.raises(ValueError) as e:
        other.resume(state)
    assert _changed(str(e.value)) == changed
    with other.resume(state, force=True) as it:  # force overrides
        assert it.step == k
        assert_batches_equal(next(it), other.batch_at(k))


# --------------------------------------------------------------------------- 6. explain


def test_explain_names_the_component_and_its_record():
    pipe = quern.mix(
        {"a": _comp(0, 100, 1), "b": _comp(1000, 10, 2)}, schedule=[(0, [0.7, 0.3]), (4, [0.2, 0.8])], seed=1
    ).batch(24)
    seen = set()
    for s in range(10):
        rows = pipe.explain(s)
        xs = pipe.batch_at(s)["x"].tolist()
        assert len(rows) == len(xs) == 24
        for [(name, rid)], x in zip(rows, xs):
            assert name in ("a", "b")
            assert 0 <= rid < (100 if name == "a" else 10)
            assert x == _value(name, rid)
            seen.add(name)
        halves = [r for h in range(2) for r in pipe.explain(s, h, 2)]
        assert halves == rows
    assert seen == {"a", "b"}


def test_a_filtered_component(tmp_path):
    a = _comp(0, 100, 1).filter(lambda rec: rec["x"] % 5 == 0, cache_dir=tmp_path)
    pipe = quern.mix({"a": a, "b": _comp(1000, 10, 2)}, weights=[0.5, 0.5], seed=3).batch(20)
    got = []
    for s in range(10):
        xs = pipe.batch_at(s)["x"].tolist()
        for [(name, rid)], x in zip(pipe.explain(s), xs):
            assert x == _value(name, rid)
            if name == "a":
                assert rid % 5 == 0
                got.append(rid)
    assert len(got) >= 40
    np.testing.assert_array_equal(np.sort(got[:20]), np.arange(0, 100, 5))  # an epoch of the survivors


# --------------------------------------------------------------------------- 7. workers and hosts


def test_worker_count_and_host_count_do_not_change_batches():
    pipe = quern.mix(_abc(), schedule=[(0, W0), (3, W1)], seed=8).map(add_ten).batch(48)
    want = [pipe.batch_at(s) for s in range(8)]
    with pipe.iterator(num_workers=2) as it:
        assert it.wait_for_workers(60), "workers did not start"
        got = [{k: np.array(v) for k, v in next(it).items()} for _ in range(8)]
    for s, (g, w) in enumerate(zip(got, want)):
        assert_batches_equal(g, w, f"num_workers=2 step {s}")
    with pipe.iterator(num_workers=0) as it:
        for s in range(8):
            assert_batches_equal(next(it), want[s], f"num_workers=0 step {s}")
    for hosts in [2, 3]:
        for s in [0, 2, 3, 7]:
            parts = [pipe.batch_at(s, h, hosts)["x"] for h in range(hosts)]
            np.testing.assert_array_equal(np.concatenate(parts), want[s]["x"])


# --------------------------------------------------------------------------- 8. components that disagree


@pytest.mark.parametrize(
    "b", [_comp(1000, 10, 2, dtype=np.float64), quern.Pipeline.from_source({"y": np.arange(10)}, seed=2)]
)
def test_components_with_different_structures_are_a_step_error_naming_both(b):
    pipe = quern.mix({"a": _comp(0, 100, 1), "b": b}, weights=[0.5, 0.5], seed=1).batch(2)
    mixed = []
    for s in range(12):
        names = {name for [(name, _)] in pipe.explain(s)}
        if len(names) == 2:
            mixed.append(s)
            with pytest.raises(quern.StepError) as e:
                pipe.batch_at(s)
            msg = str(e.value)
            assert f"step {s}" in msg and "'a'" in msg and "'b'" in msg
        else:
            pipe.batch_at(s)  # one component only: fine
    assert mixed and len(mixed) < 12
    with pipe.iterator() as it:
        for _ in range(mixed[0]):
            next(it)
        with pytest.raises(quern.StepError, match=f"step {mixed[0]}"):
            next(it)


# --------------------------------------------------------------------------- 9. bad input


def _two():
    return {"a": _comp(0, 10, 1), "b": _comp(100, 10, 2)}


OK = {"a": 1, "b": 1}


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(weights={"a": -1, "b": 1}), ValueError, ["weights", "'a'", ">= 0"]),
        (dict(schedule=[(0, OK), (10, {"a": 1, "b": -0.5})]), ValueError, ["schedule stage 1", "'b'", ">= 0"]),
        (dict(schedule=[(0, OK), (10, {"a": math.nan, "b": 1})]), ValueError, ["schedule stage 1", "'a'", "finite"]),
        (dict(schedule=[(0, {"a": 1, "b": math.inf})]), ValueError, ["schedule stage 0", "'b'", "finite"]),
        (dict(schedule=[(0, OK), (5, {"a": 0, "b": 0})]), ValueError, ["schedule stage 1", "every weight is zero"]),
        (dict(weights=[0, 0]), ValueError, ["weights", "every weight is zero"]),
        (dict(schedule=[(0, OK), (5, {"a": 1})]), ValueError, ["schedule stage 1", "missing ['b']"]),
        (dict(schedule=[(0, OK), (5, {"a": 1, "b": 1, "q": 1})]), ValueError, ["schedule stage 1", "unknown ['q']"]),
        (dict(weights=[1, 2, 3]), ValueError, ["weights", "3 weights for 2 components"]),
        (dict(schedule=[(0, OK), (10, OK), (5, OK)]), ValueError, ["schedule stage 2", "increasing"]),
        (dict(schedule=[(0, OK), (10, OK), (10, OK)]), ValueError, ["schedule stage 2", "increasing"]),
        (dict(schedule=[(3, OK)]), ValueError, ["schedule stage 0", "step 0"]),
        (dict(schedule=[]), ValueError, ["schedule"]),
        (dict(schedule=[(0, OK, 1)]), ValueError, ["schedule stage 0"]),
        (dict(weights=OK, schedule=[(0, OK)]), ValueError, ["exactly one"]),
        (dict(), ValueError, ["exactly one"]),
        (dict(weights={"a": True, "b": 1}), TypeError, ["'a'", "number"]),
        (dict(weights={"a": "1", "b": 1}), TypeError, ["'a'", "number"]),
    ],
)
def test_bad_weights_and_schedules_name_the_stage_and_key(kwargs, error, words):
    with pytest.raises(error) as e:
        quern.mix(_two(), **kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize(
    "components,error,words",
    [
        (lambda: {"a": _comp(0, 10, 1).batch(2), "b": _comp(100, 10, 2)}, ValueError, ["'a'", "batch"]),
        (lambda: {"a": _comp(0, 10, 1), "b": {"x": np.arange(5)}}, TypeError, ["'b'", "Pipeline"]),
        (lambda: [("a", _comp(0, 10, 1)), ("a", _comp(100, 10, 2))], ValueError, ["'a'", "twice"]),
        (lambda: {"a": _comp(0, 10, 1), "b": quern.mix(_two(), weights=OK)}, ValueError, ["'b'", "mixture"]),
        (lambda: {}, ValueError, ["at least one"]),
        (lambda: {"": _comp(0, 10, 1)}, TypeError, ["names"]),
    ],
    ids=["batch", "not-a-pipeline", "duplicate", "nested", "empty", "empty-name"],
)
def test_bad_components_are_named(components, error, words):
    comps = components()
    names = [n for n, _ in (comps.items() if isinstance(comps, dict) else comps)]
    with pytest.raises(error) as e:
        quern.mix(comps, weights=[1] * len(names) if names else [1])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_stage_beyond_the_addressable_stream_is_refused_or_harmless():
    """A stage from step 2**62 at batch 64 starts at position 2**68: it can never be reached. Either
    the definition is refused naming the stage, or the batches before it are computed as without it;
    never a bare OverflowError at step 0."""
    comps = _abc()
    try:
        pipe = quern.mix(comps, schedule=[(0, W0), (2**62, W1)], seed=1).batch(64)
    except ValueError as e:
        assert "schedule stage 1" in str(e)
        return
    want = quern.mix(comps, schedule=[(0, W0)], seed=1).batch(64)
    assert_batches_equal(pipe.batch_at(0), want.batch_at(0))


# --------------------------------------------------------------------------- 10. golden values


def test_quantize_golden():
    # Computed by hand: 0.5 * 2**32 = 2147483648 exactly; 0.3 * 2**32 = 1288490188.8 and
    # 0.2 * 2**32 = 858993459.2 floor to a sum one short of 2**32, and the largest remainder (0.8)
    # takes the 1. Checked against this implementation on 2026-11-30.
    assert plan.quantize([0.5, 0.3, 0.2]) == (2147483648, 1288490189, 858993459)
    assert sum(plan.quantize([0.5, 0.3, 0.2])) == Q
    # Ties of the remainder go to the lower index (1/3 each: remainders 2/3, so 1 extra to index 0).
    assert plan.quantize([1, 1, 1]) == (1431655766, 1431655765, 1431655765)
    assert plan.QUANTUM == Q and plan.MIX_SALT == 3 and plan.BLOCK == 1024


# The published mixture order (the components' assignment is part of the data order, like
# tests/test_golden.py's index literals): computed by this implementation on 2026-11-30
# (INDEX_FORMAT_VERSION 1, numpy 2.4) with
#   quern.mix({"a": A, "b": B, "c": C}, weights=[0.5, 0.3, 0.2], seed=7, block=9).segments(np.arange(40))
# for the tiny sources below. A change of any literal changes which records a run sees at a
# step: it must be a deliberate, versioned event (bump INDEX_FORMAT_VERSION, recompute).
# Hand-checked parts: block 0 holds a, b, c = 6, 2, 1 times (floor(0.3 * 9) = 2, floor(0.2 * 9) = 1,
# the absorbing 'a' the rest), blocks 0-1 hold 10, 5, 3; component positions count each
# component's draws.
GOLDEN_COMPONENTS = [1, 0, 0, 0, 2, 0, 0, 0, 1, 0, 2, 1, 0, 1, 2, 1, 0, 0, 0, 2,
                     0, 0, 0, 1, 2, 1, 1, 2, 0, 0, 0, 2, 0, 1, 0, 1, 0, 0, 2, 0]  # fmt: skip
GOLDEN_POSITIONS = [0, 0, 1, 2, 0, 3, 4, 5, 1, 6, 1, 2, 7, 3, 2, 4, 8, 9, 10, 3,
                    11, 12, 13, 5, 4, 6, 7, 5, 14, 15, 16, 6, 17, 8, 18, 9, 19, 20, 7, 21]  # fmt: skip
# .batch(8).batch_at(s)["x"] for s = 0, 1, 2 (same computation and date).
GOLDEN_VALUES = [
    [10, 2, 1, 0, 20, 3, 4, 3],
    [12, 2, 21, 11, 0, 12, 21, 11],
    [4, 1, 4, 20, 2, 3, 0, 10],
]


# With a second stage from step 3 at batch 5 (position 15, inside the second block of 9):
#   quern.mix(..., schedule=[(0, [0.5, 0.3, 0.2]), (3, [0.2, 0.2, 0.6])], seed=7, block=9).batch(5)
#   .segments(np.arange(40)), same sources, computed by this implementation on 2026-11-30. Its blocks
# are keyed by the stage's start. Hand-checked: the first 15 equal GOLDEN_COMPONENTS[:15]; stage 1's
# first block holds a, b, c = 1, 1, 7 (floor(0.2 * 9) = 1 each, the absorbing 'c' the rest).
GOLDEN_STAGED_COMPONENTS = [1, 0, 0, 0, 2, 0, 0, 0, 1, 0, 2, 1, 0, 1, 2, 2, 2, 2, 2, 0,
                            2, 1, 2, 2, 2, 2, 2, 1, 2, 1, 0, 0, 2, 1, 2, 2, 0, 2, 1, 2]  # fmt: skip
GOLDEN_STAGED_POSITIONS = [0, 0, 1, 2, 0, 3, 4, 5, 1, 6, 1, 2, 7, 3, 2, 3, 4, 5, 6, 8,
                           7, 4, 8, 9, 10, 11, 12, 5, 13, 6, 9, 10, 14, 7, 15, 16, 11, 17, 8, 18]  # fmt: skip


def _golden_mix():
    A = quern.Pipeline.from_source({"x": np.arange(5)}, seed=1).shuffle()
    B = quern.Pipeline.from_source({"x": np.arange(10, 13)}, seed=2).shuffle()
    C = quern.Pipeline.from_source({"x": np.arange(20, 22)}, seed=3).shuffle()
    return quern.mix({"a": A, "b": B, "c": C}, weights=[0.5, 0.3, 0.2], seed=7, block=9)


def test_mixture_order_golden():
    pipe = _golden_mix()
    assert pipe.stream.block == 9
    seg = pipe.segments(np.arange(40))
    assert seg.component.tolist() == GOLDEN_COMPONENTS
    assert seg.positions.tolist() == GOLDEN_POSITIONS
    batched = pipe.batch(8)
    assert [batched.batch_at(s)["x"].tolist() for s in range(3)] == GOLDEN_VALUES
    # the hand-checked parts, from the literals themselves
    comp = np.asarray(GOLDEN_COMPONENTS)
    assert _counts(comp[:9], 3).tolist() == [6, 2, 1]
    assert _counts(comp[:18], 3).tolist() == [10, 5, 3]
    for c in range(3):
        assert np.asarray(GOLDEN_POSITIONS)[comp == c].tolist() == list(range(int((comp == c).sum())))


def test_staged_mixture_order_golden():
    A, B, C = _golden_mix().stream.components
    pipe = quern.mix(
        {"a": A, "b": B, "c": C}, schedule=[(0, [0.5, 0.3, 0.2]), (3, [0.2, 0.2, 0.6])], seed=7, block=9
    ).batch(5)
    seg = pipe.segments(np.arange(40))
    assert seg.component.tolist() == GOLDEN_STAGED_COMPONENTS
    assert seg.positions.tolist() == GOLDEN_STAGED_POSITIONS
    assert GOLDEN_STAGED_COMPONENTS[:15] == GOLDEN_COMPONENTS[:15]
    assert _counts(np.asarray(GOLDEN_STAGED_COMPONENTS[15:24]), 3).tolist() == [1, 1, 7]


def test_a_shared_transform_failing_on_other_structures_names_both_components():
    """Components with the same transforms go through them together; when those fail
    because the components' records differ (other keys), the error names both
    components and keeps the transform's error as its cause."""
    pad = quern.transforms.pad(8, key="tokens")
    a = quern.Pipeline.from_source({"tokens": np.zeros((100, 5), np.int32)}, seed=1).shuffle().map(pad)
    b = quern.Pipeline.from_source({"text": np.zeros((10, 5), np.int32)}, seed=2).shuffle().map(pad)
    pipe = quern.mix({"a": a, "b": b}, weights=[0.5, 0.5]).batch(16)
    with pytest.raises(quern.StepError, match=r"step 0 .*components '[ab]' and '[ab]' give records of different") as e:
        pipe.batch_at(0)
    assert "'text'" in str(e.value) and "'tokens'" in str(e.value)
    assert isinstance(e.value.__cause__, quern.StepError) and "pad" in str(e.value.__cause__)


def double(r):
    return {"x": r["x"] * 2}


def plus_1000(r):
    return {"x": r["x"] + 1000}


def as_float(r):
    return {"x": r["x"].astype(np.float32)}


def test_components_with_their_own_transforms_are_batched_apart_and_merged_in_row_order():
    """Components whose transforms differ run them on their own rows; the batch holds
    each row at its place, transformed by its own component's transforms."""
    a = _comp(0, 100, 1).map(double)
    c = _comp(10, 10, 2).map(plus_1000)
    pipe = quern.mix({"a": a, "c": c}, weights=[0.5, 0.5], seed=3).batch(16)
    for s in range(6):
        want = [2 * i if name == "a" else 10 + i + 1000 for [(name, i)] in pipe.explain(s)]
        assert pipe.batch_at(s)["x"].tolist() == want, s
    assert {name for s in range(6) for [(name, _)] in pipe.explain(s)} == {"a", "c"}
    b = _comp(0, 10, 2).map(as_float)
    bad = quern.mix({"a": a, "b": b}, weights=[0.5, 0.5], seed=3).batch(16)
    with pytest.raises(quern.StepError, match=r"components '[ab]' and '[ab]' give records of different") as e:
        bad.batch_at(0)
    assert "int64" in str(e.value) and "float32" in str(e.value)
