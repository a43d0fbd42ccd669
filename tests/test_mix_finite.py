"""Finite mixtures (pipeline/definition/mix.py, pipeline/streams/mixture.py): components with
num_epochs; stop="first" ends with the first component to run out (grain's mix), stop="last"
goes on with the others at renormalised weights. Still step addressable."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import yaml
from helpers import (
    assert_batches_equal,
    assert_host_slices_make_the_batch,
    assert_iterator_gives_batch_at,
    parquet_folder,
)

import quern


def _comp(lo, n, seed, epochs=1):
    return quern.Pipeline.from_source({"x": np.arange(lo, lo + n)}, seed=seed, num_epochs=epochs).shuffle()


def _rows(pipe):
    return [name_id for s in range(pipe.num_steps) for [name_id] in pipe.explain(s)]


def test_stop_first_ends_at_the_first_position_whose_component_has_no_record_left():
    pipe = quern.mix({"a": _comp(0, 100, 1), "b": _comp(1000, 30, 2)}, weights=[1, 1], seed=3).batch(
        4, drop_remainder=False
    )
    rows = _rows(pipe)
    counts = collections.Counter(name for name, _ in rows)
    assert counts["b"] == 30 and counts["a"] < 100  # b ran out: the mixture ends there
    assert len(set(rows)) == len(rows)  # no record twice within its one epoch
    endless = quern.mix({"a": _comp(0, 100, 1), "b": _comp(1000, 30, 2, epochs=None)}, weights=[1, 1], seed=3)
    drawn = endless.stream.assign(np.arange(1000))  # unbatched: the endless one never ends the mixture
    ends_a = int(np.flatnonzero((drawn.component == 0) & (drawn.position == 99))[0]) + 1
    assert endless.batch(1, drop_remainder=False).num_steps == ends_a  # ... the finite one does
    whole = quern.mix({"a": _comp(0, 100, 1), "b": _comp(1000, 30, 2)}, weights=[1, 1], seed=3)
    plain = whole.stream.assign(np.arange(pipe.stream.length()))
    assert np.array_equal(plain.component, np.asarray([0 if n == "a" else 1 for n, _ in rows]))  # the same draws


def test_stop_last_gives_each_record_once_and_goes_on_with_the_others():
    pipe = quern.mix(
        {"a": _comp(0, 100, 1), "b": _comp(1000, 30, 2), "c": _comp(5000, 60, 3)},
        weights=[1, 1, 1],
        seed=5,
        stop="last",
    ).batch(8, drop_remainder=False)
    rows = _rows(pipe)
    assert sorted(rows) == sorted(
        [("a", i) for i in range(100)] + [("b", i) for i in range(30)] + [("c", i) for i in range(60)]
    )
    first = quern.mix(
        {"a": _comp(0, 100, 1), "b": _comp(1000, 30, 2), "c": _comp(5000, 60, 3)}, weights=[1, 1, 1], seed=5
    ).batch(8, drop_remainder=False)
    n = first.stream.length()
    assert _rows(first) == rows[:n]  # the same positions until the first component ends
    assert collections.Counter(name for name, _ in rows[:n])["b"] == 30  # b, the shortest, ended first
    assert "b" not in [name for name, _ in rows[n:]] and {"a", "c"} <= {name for name, _ in rows[n:]}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop", ["first", "last"])
def test_a_finite_mixture_is_step_addressable(stop, num_workers):
    pipe = (
        quern.mix(
            {"a": _comp(0, 50, 1, epochs=2), "b": _comp(1000, 40, 2)},
            schedule=[(0, {"a": 1, "b": 1}), (3, {"a": 1, "b": 3})],
            seed=7,
            stop=stop,
        )
        .map(lambda r: {"x": r["x"] * 2})
        .batch(6, drop_remainder=False)
    )
    assert_iterator_gives_batch_at(pipe, num_workers=num_workers)
    assert_iterator_gives_batch_at(pipe, start_step=5, num_workers=num_workers)
    assert_host_slices_make_the_batch(pipe, (0, pipe.num_steps - 2))
    found = pipe.where(3, component="b")  # where() stops at the end of the mixture too
    assert all(s < pipe.num_steps for s, _ in found)


def test_bad_finite_mixtures_are_clear_errors():
    with pytest.raises(ValueError, match=r"components \['b'\] are endless, so the mixture would never end"):
        quern.mix({"a": _comp(0, 10, 1), "b": _comp(100, 10, 2, epochs=None)}, weights=[1, 1], stop="last")
    with pytest.raises(ValueError, match="stop must be 'first' or 'last'"):
        quern.mix({"a": _comp(0, 10, 1)}, weights=[1], stop="never")
    assert (
        quern.mix({"a": _comp(0, 10, 1)}, weights=[1]).fingerprint()
        != quern.mix({"a": _comp(0, 10, 1)}, weights=[1], stop="last").fingerprint()
    )


def test_the_config_form_loads_back(tmp_path):
    folder = parquet_folder(tmp_path)
    src = {"type": "parquet", "paths": "d.parquet"}
    cfg = {
        "mix": {
            "components": {
                "a": {"source": src, "num_epochs": 1, "seed": 1, "shuffle": "global"},
                "b": {"source": src, "num_epochs": 2, "seed": 2},
            },
            "weights": {"a": 1, "b": 3},
            "stop": "last",
        },
        "batch": {"size": 4, "drop_remainder": False},
    }
    path = folder / "mix.yaml"
    path.write_text(yaml.safe_dump(cfg))
    pipe = quern.load_config(path)
    assert pipe.num_steps == (40 + 80) // 4
    again = folder / "again.yaml"
    again.write_text(yaml.safe_dump(pipe.to_config()))
    back = quern.load_config(again)
    assert back.fingerprint() == pipe.fingerprint()
    for s in (0, pipe.num_steps - 1):
        assert_batches_equal(back.batch_at(s), pipe.batch_at(s), f"step {s}")
