"""Tests of pipeline/index.py (the inverse permutations), pipeline/streams/*.py and pipeline/addressing.py.

Record lineage (issue 24, point 4): ``pipe.where(record)`` inverts the plan (the keyed
permutation, the filter's survivors, the mixture's blocks, the packing plan) and must
give, for every record of small pipelines of each kind, the ``(step, row)`` pairs found
by scanning ``explain`` over every step of those epochs.
"""

from __future__ import annotations

import numpy as np
import pytest

import quern
from quern.pipeline.order import components as _mixture
from quern.pipeline.order import index as _index

pytestmark = pytest.mark.timeout(120)


def _src(n, seed=0, num_epochs=None):
    return quern.Pipeline.from_source({"x": np.arange(n, dtype=np.int64)}, seed=seed, num_epochs=num_epochs)


# --------------------------------------------------------------------------- the inverse permutations

SIZES = [1, 2, 3, 5, 16, 17, 100, 1023]


@pytest.mark.parametrize("n", SIZES)
def test_unpermute_inverts_permute_with_scalar_and_per_element_keys(n):
    j = np.arange(n, dtype=np.int64)
    key = _index.derive_key(9, 4)
    assert np.array_equal(_index.unpermute(_index.permute(j, n, key), n, key), j)
    keys = _index.derive_key(9, j % 3)  # one key per element
    assert np.array_equal(_index.unpermute(_index.permute(j, n, keys), n, keys), j)
    with pytest.raises(IndexError):
        _index.unpermute(np.array([n]), n, key)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block,window", [(1, 1), (2, 3), (3, 2), (7, 1), (4, 5)])
def test_block_unpermute_inverts_block_permute_with_partial_last_block_and_window(n, block, window):
    j = np.arange(n, dtype=np.int64)
    key = _index.derive_key(2, 1)
    x = _index.block_permute(j, n, key, block, window)
    assert np.array_equal(_index.block_unpermute(x, n, key, block, window), j)
    keys = _index.derive_key(2, j % 2)
    x = _index.block_permute(j, n, keys, block, window)
    assert np.array_equal(_index.block_unpermute(x, n, keys, block, window), j)


@pytest.mark.parametrize("shuffle", [None, "global", "block"])
@pytest.mark.parametrize("n", [1, 7, 64, 101])
def test_epoch_positions_inverts_epoch_record_ids_per_epoch(shuffle, n):
    for epoch in (0, 1, 5):
        pos = np.arange(epoch * n, (epoch + 1) * n, dtype=np.int64)
        ids = _index.epoch_record_ids(pos, n, 3, shuffle, 3, 2)
        got = _index.epoch_positions(ids, n, 3, shuffle, 3, 2, epoch=epoch)
        assert np.array_equal(got, pos - epoch * n), epoch
    pos = np.arange(4 * n, dtype=np.int64)  # one epoch per record
    ids = _index.epoch_record_ids(pos, n, 3, shuffle, 3, 2)
    assert np.array_equal(_index.epoch_positions(ids, n, 3, shuffle, 3, 2, epoch=pos // n), pos % n)


def _streams():
    plain = _src(23, seed=4)
    return {
        "plain": plain.stream,
        "global": plain.shuffle().stream,
        "block": plain.shuffle("block", block_size=4, window=3).stream,
        "block-1x1": _src(1, seed=4).shuffle("block", block_size=3, window=2).stream,
        "global-1": _src(1, seed=4).shuffle().stream,
        "filtered-global": plain.shuffle().stream.filtered(np.array([0, 2, 3, 9, 10, 11, 22])),
        "filtered-block": plain.shuffle("block", block_size=2, window=3).stream.filtered(np.arange(1, 23, 2)),
        "filtered-one": plain.shuffle().stream.filtered(np.array([5])),
    }


@pytest.mark.parametrize("kind", list(_streams()))
def test_source_stream_epoch_positions_inverts_record_ids(kind):
    s = _streams()[kind]
    n, size = s.epoch_length, len(s.source)
    kept = np.arange(size) if s.survivors is None else np.asarray(s.survivors)
    for epoch in (0, 1, 3):
        ids = s.record_ids(np.arange(epoch * n, (epoch + 1) * n, dtype=np.int64))
        assert np.array_equal(s.epoch_positions(ids, epoch), np.arange(n))
        every = s.epoch_positions(np.arange(size), epoch)  # the non-survivors are -1
        assert np.array_equal(np.flatnonzero(every >= 0), kept)
        assert np.array_equal(s.record_ids(epoch * n + every[kept]), kept)
    assert s.epoch_positions(np.array([[size, -1]]), 0).tolist() == [[-1, -1]]  # not in the source


# --------------------------------------------------------------------------- where() against explain()


class Docs:
    """Record ``i`` holds ``LEN(i)`` copies of ``i`` (some longer than a row, one empty)."""

    def __init__(self, n):
        self.n = n
        self.lengths = np.asarray([(i * 7919) % 13 + 1 if i != 3 else 0 for i in range(n)], dtype=np.int64)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": np.full(int(self.lengths[i]), i, dtype=np.int32)}

    def identity(self):
        return {"type": "WhereDocs", "n": self.n}


def _div3(record):
    return record["x"] % 3 != 1


def _packed(n, mode, tmp_path, num_epochs=None, seed=5):
    docs = Docs(n)
    inner = quern.Pipeline.from_source(docs, seed=seed, num_epochs=num_epochs).shuffle()
    return inner.pack(8, mode=mode, key="tokens", lengths=docs.lengths, cache_dir=tmp_path)


def _limit(stream, epochs):
    """Positions in the first ``epochs`` epochs of a stream (of its own, ``None``: all its positions)."""
    rows_before = getattr(stream, "rows_before", None)  # a packed stream's epochs are rows_before apart
    end = rows_before(epochs) if rows_before is not None else epochs * stream.epoch_length
    total = stream.length()
    return end if total is None else min(end, total)


def _scan(pipe, epochs):
    """``{(name, record): [(step, row), ...]}`` by scanning explain() over every step of those epochs."""
    stream = pipe.stream
    b = pipe.batch_size
    found: dict[tuple[str, int], set] = {}

    def note(step, rows, own, limits):
        for r, (pairs, (c, p)) in enumerate(zip(rows, own)):
            if p < limits[c]:
                for name, rid in pairs:
                    found.setdefault((name, rid), set()).add((step, r))

    if hasattr(stream, "components") and hasattr(stream, "names") and hasattr(stream, "batch_sizes"):  # bucketed
        parts = stream.components
        limits = [_limit(p.stream, epochs) for p in parts]
        need = np.asarray([-(-lim // p.batch_size) for lim, p in zip(limits, parts)])
        steps = 1
        while (np.asarray(_mixture.draws_before(stream.stages, stream.seed, 1, stream.block, steps)) < need).any():
            steps *= 2
        comp, k = stream.assign(np.arange(steps))
        for s in range(steps):
            part = parts[int(comp[s])]
            own = [(int(comp[s]), int(p)) for p in part.positions(int(k[s]))]
            note(s, pipe.explain(s), own, limits)
    elif hasattr(stream, "components"):  # a mixture: each component's own epochs
        parts = stream.components
        limits = [_limit(p.stream, epochs) for p in parts]
        live = [c for c in range(len(parts)) if stream.stages[-1].weights[c]]
        steps = 1
        while any(stream.draws(pipe, 0, steps * b)[c] < limits[c] for c in live):
            steps *= 2
        for s in range(steps):
            seg = pipe.segments(pipe.positions(s))
            note(s, pipe.explain(s), zip(seg.component.tolist(), seg.positions.tolist()), limits)
    else:
        limit = _limit(stream, epochs)
        steps = -(-limit // b) if pipe.num_steps is None else pipe.num_steps
        for s in range(steps):
            note(s, pipe.explain(s), [(0, int(p)) for p in pipe.positions(s)], [limit])
    return {key: sorted(v) for key, v in found.items()}


def _check_every_record(pipe, epochs, names=None):
    scanned = _scan(pipe, epochs)
    names = names or [None]
    for name in names:
        src = pipe.source if name is None else pipe.leaves[list(pipe.leaf_names).index(name)].source
        label = src.name if name is None else name
        for rid in range(len(src)):
            got = pipe.where(rid, component=name, epochs=epochs)
            assert got == scanned.get((label, rid), []), (name, rid)
    return scanned


KINDS = {
    "plain-finite": lambda tmp: _src(13, num_epochs=3).batch(4),
    "plain-finite-remainder": lambda tmp: _src(13, num_epochs=2).batch(4, drop_remainder=False),
    "global-endless": lambda tmp: _src(13, seed=2).shuffle().batch(5),
    "global-one-record": lambda tmp: _src(1, seed=2).shuffle().batch(3),
    "block-endless": lambda tmp: _src(23, seed=1).shuffle("block", block_size=4, window=2).batch(6),
    "block-finite": lambda tmp: _src(23, seed=1, num_epochs=3).shuffle("block", block_size=3, window=3).batch(7),
    "filtered-finite": lambda tmp: (
        _src(30, seed=4, num_epochs=2).shuffle().filter(_div3, cache_dir=tmp).batch(4, False)
    ),
    "filtered-endless": lambda tmp: (
        _src(30, seed=4).shuffle("block", block_size=4, window=2).filter(_div3, cache_dir=tmp).batch(6)
    ),
    "balanced-hosts": lambda tmp: (
        _src(13, seed=2, num_epochs=2).shuffle().balance_hosts(np.arange(13) % 5 + 1).batch(4)
    ),
    "packed-best-fit-endless": lambda tmp: _packed(40, "best_fit", tmp).batch(4),
    "packed-concat-endless": lambda tmp: _packed(40, "concat", tmp).batch(3),
    "packed-best-fit-finite": lambda tmp: _packed(30, "best_fit", tmp, num_epochs=3).batch(5, drop_remainder=False),
    "packed-concat-finite": lambda tmp: _packed(30, "concat", tmp, num_epochs=2).batch(4),
}


@pytest.mark.parametrize("epochs", [1, 3])
@pytest.mark.parametrize("kind", list(KINDS))
def test_where_is_what_explain_shows_for_every_record(tmp_path, kind, epochs):
    pipe = KINDS[kind](tmp_path)
    scanned = _check_every_record(pipe, epochs)
    assert scanned  # the scan saw records
    if pipe.num_epochs is not None:  # more epochs than the stream has: its own
        assert [pipe.where(r, epochs=epochs + 5) for r in range(len(pipe.source))] == [
            pipe.where(r, epochs=pipe.num_epochs) for r in range(len(pipe.source))
        ]


def test_where_of_a_packed_stream_lists_every_row_of_a_long_record_and_none_of_an_empty_one(tmp_path):
    for mode in ("best_fit", "concat"):
        pipe = _packed(40, mode, tmp_path).batch(4)
        long = int(np.argmax(Docs(40).lengths))  # 13 tokens: 2 rows of 8, at least
        assert len(pipe.where(long)) >= 2
        assert pipe.where(3) == [] == pipe.where(3, epochs=3)  # record 3 has no token


def test_with_balance_hosts_the_row_is_the_row_of_one_host():
    pipe = KINDS["balanced-hosts"](None)
    for r in range(13):
        for step, row in pipe.where(r, epochs=2):
            assert pipe.explain(step)[row] == [("arrays", r)]  # one host: the stream's order
            two = pipe.explain(step, 0, 2) + pipe.explain(step, 1, 2)  # two hosts: the same rows, reordered
            assert ("arrays", r) in [pair for rows in two for pair in rows]


def test_a_record_the_filter_drops_is_nowhere(tmp_path):
    pipe = KINDS["filtered-endless"](tmp_path)
    assert pipe.where(1, epochs=4) == [] and pipe.where(0, epochs=2) != []


def _mixtures(tmp):
    a = _src(7, seed=1).shuffle()
    b = _src(5, seed=2).shuffle("block", block_size=2, window=2)
    f = _src(11, seed=3).shuffle().filter(_div3, cache_dir=tmp)
    p = _packed(20, "best_fit", tmp, seed=6)
    return {
        # b's weight is zero from step 4 on: its later records are never drawn
        "schedule-with-zero-stage": (
            quern.mix({"a": a, "b": b}, schedule=[(0, {"a": 1, "b": 2}), (4, {"a": 1, "b": 0})], seed=7, block=8)
        ).batch(3),
        "zero-first-then-three": (
            quern.mix({"a": a, "b": b, "f": f}, schedule=[(0, [1, 0, 1]), (2, [1, 3, 2])], seed=1, block=9)
        ).batch(4),
        "packed-component": quern.mix({"p": p, "a": a}, weights=[0.6, 0.4], seed=3, block=8).batch(4),
    }


@pytest.mark.parametrize("epochs", [1, 3])
@pytest.mark.parametrize("kind", ["schedule-with-zero-stage", "zero-first-then-three", "packed-component"])
def test_where_in_a_mixture_is_what_explain_shows_for_every_record_of_every_component(tmp_path, kind, epochs):
    pipe = _mixtures(tmp_path)[kind]
    scanned = _check_every_record(pipe, epochs, names=list(pipe.leaf_names))
    assert {name for name, _ in scanned} == set(pipe.leaf_names)


def test_a_mixture_stage_of_weight_zero_draws_nothing_more(tmp_path):
    pipe = _mixtures(tmp_path)["schedule-with-zero-stage"]
    seen = [p for r in range(5) for p in pipe.where(r, component="b", epochs=50)]
    assert seen and max(s for s, _ in seen) < 4  # b is drawn before step 4 only
    assert len(seen) < 5 * 50


def _bucketed(tmp):
    docs = Docs(40)
    inner = quern.Pipeline.from_source(docs, seed=2).shuffle()
    return inner.bucket([4, 9, 16], [4, 3, 2], key="tokens", lengths=docs.lengths, cache_dir=tmp, block=9)


@pytest.mark.parametrize("epochs", [1, 3])
def test_where_in_a_bucketed_pipeline_is_what_explain_shows(tmp_path, epochs):
    pipe = _bucketed(tmp_path)
    _check_every_record(pipe, epochs)


# --------------------------------------------------------------------------- bad input


def test_bad_records_and_epochs_are_refused_naming_them(tmp_path):
    pipe = _src(13, seed=2).shuffle().batch(5)
    with pytest.raises(IndexError, match=r"record 13 .*source 'arrays'.* 13 records"):
        pipe.where(13)
    with pytest.raises(ValueError, match="record must be >= 0, got -1"):
        pipe.where(-1)
    with pytest.raises(TypeError, match="record must be an integer"):
        pipe.where(1.0)
    with pytest.raises(TypeError, match="record must be an integer"):
        pipe.where(True)
    with pytest.raises(ValueError, match="epochs must be >= 1, got 0"):
        pipe.where(1, epochs=0)
    with pytest.raises(ValueError, match=r"where\(\) needs batch\(\)"):
        _src(13).where(1)
    with pytest.raises(ValueError, match="not a mixture"):
        pipe.where(1, component="arrays")
    assert pipe.where(np.int32(2)) == pipe.where(2)


def test_a_mixture_needs_a_known_component(tmp_path):
    pipe = _mixtures(tmp_path)["schedule-with-zero-stage"]
    with pytest.raises(ValueError, match=r"needs component=NAME; its components are \['a', 'b'\]"):
        pipe.where(0)
    with pytest.raises(ValueError, match=r"has no component 'c'; its components are \['a', 'b'\]"):
        pipe.where(0, component="c")
    with pytest.raises(IndexError, match=r"record 5 .*\(component 'b'\): it has 5 records"):
        pipe.where(5, component="b")
    assert pipe.where(6, component="a") != []  # a has 7 records


def test_a_bucketed_pipeline_has_no_components(tmp_path):
    with pytest.raises(ValueError, match="not a mixture"):
        _bucketed(tmp_path).where(0, component="len<=4")


# --------------------------------------------------------------------------- the mixture's inverse


@pytest.mark.parametrize(
    "names,schedule,rows,block",
    [
        (["a", "b"], [(0, [3, 1])], 1, 16),
        (["a", "b", "c"], [(0, [1, 1, 1]), (5, {"a": 0, "b": 1, "c": 2}), (9, [5, 0, 1])], 7, 9),
        (["a", "b"], [(0, [1, 0]), (3, [0, 1]), (6, [1, 1])], 4, 8),
        (["a", "b", "c"], [(0, [1e-6, 1, 1])], 1, 16),  # a tiny weight: most blocks draw none of it
        (["a", "b", "c", "d"], [(0, [1, 2, 3, 4]), (100, [4, 3, 2, 1])], 5, 1024),
    ],
    ids=["one-stage", "three-stages-zero-last", "zero-first", "tiny-weight", "four-components"],
)
def test_drawn_at_inverts_assign(names, schedule, rows, block):
    stages = _mixture.check_schedule(names, schedule=schedule)
    total = 5000
    a = _mixture.assign(np.arange(total), stages, 3, rows, block)
    for c in range(len(names)):
        at = np.flatnonzero(a.component == c)
        assert np.array_equal(_mixture.drawn_at(c, a.position[at], stages, 3, rows, block), at)
        later = np.asarray([len(at), len(at) + 5])  # draws past the scanned positions: later, or never
        got = _mixture.drawn_at(c, later, stages, 3, rows, block)
        assert ((got == -1) | (got >= total)).all()
        if stages[-1].weights[c]:
            back = _mixture.assign(got, stages, 3, rows, block)
            assert (back.component == c).all() and np.array_equal(back.position, later)
        else:
            assert (got == -1).all()
    for c in range(len(names)):  # beyond the addressable stream (2**62 positions)
        assert _mixture.drawn_at(c, np.asarray([2**62 - 1, 2**61]), stages, 3, rows, block)[0] == -1
    if names == ["a", "b"] and len(stages) == 1:  # b takes a quarter of the positions: its 2**61-th is beyond
        assert _mixture.drawn_at(1, np.asarray([2**61]), stages, 3, rows, block).tolist() == [-1]
