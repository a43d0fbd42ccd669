"""Tests of pipeline/streams/protocol.py, capabilities.py, forwarding.py and segments.py.

A new kind of stream is one module: a round-robin interleave of two pipelines, defined here alone.

It implements only the core of quern's stream protocol (``quern.pipeline.streams.SegmentStream``, a
``Stream`` run by the segment runner: its length, leaves, segments, description and text) and nothing
else changes: ``batch_at``, ``explain``, the iterator with worker processes, the fingerprint and resume
all work through the core. A capability (``where``) is opt-in: without it the one clear error, with it
``Pipeline.where`` uses it, and a wrapper (``skip_steps``) forwards it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import quern
from quern.pipeline.core.errors import CapabilityError
from quern.pipeline.order import Segments
from quern.pipeline.streams import SegmentStream
from quern.pipeline.streams.capabilities import Invertible, has


@dataclasses.dataclass(frozen=True)
class Interleave(SegmentStream):
    """Position ``p`` is position ``p // 2`` of pipeline ``a`` (even ``p``) or of ``b`` (odd ``p``)."""

    a: quern.Pipeline
    b: quern.Pipeline
    seed: int = 0

    def length(self) -> None:
        return None  # endless

    def leaves(self, pipe: quern.Pipeline) -> tuple[quern.Pipeline, ...]:
        return (self.a, self.b)

    def segments(self, positions: np.ndarray) -> Segments:
        comp, within = positions % 2, positions // 2
        ids = np.empty(len(positions), dtype=np.int64)
        for c, part in enumerate((self.a, self.b)):
            ids[comp == c] = part.stream.segments(within[comp == c]).ids
        return Segments(comp, ids, within)

    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        return {"interleave": [self.a.describe(), self.b.describe()]}

    def text(self) -> str:
        return f"Interleave({self.a!r}, {self.b!r})"


@dataclasses.dataclass(frozen=True)
class InvertibleInterleave(Interleave):
    """The interleave with one capability: it says where a record of ``a`` or ``b`` appears."""

    def where(self, pipe: quern.Pipeline, record: int, component: str | None, epochs: int) -> list[tuple[int, int]]:
        c = "ab".index(component or "")
        own = (self.a, self.b)[c].stream.record_positions(record, epochs)
        return [divmod(2 * int(p) + c, pipe.batch_size) for p in own]


def _double(r):
    return {"x": r["x"] * 2}


def _pipe(kind: type[Interleave] = Interleave) -> quern.Pipeline:
    a = quern.Pipeline.from_source(quern.sources.ArraySource({"x": np.arange(10, dtype=np.int64)}, name="a"), seed=1)
    b = quern.Pipeline.from_source(quern.sources.ArraySource({"x": np.arange(1000, 1007)}, name="b"), seed=2)
    return quern.Pipeline(stream=kind(a.shuffle(), b.shuffle())).map(_double).batch(4)


def test_batch_at_and_explain_follow_the_interleave():
    pipe = _pipe()
    for step in range(6):
        rows = pipe.explain(step)
        assert [name for [(name, _)] in rows] == ["a", "b", "a", "b"]
        want = [2 * (i if name == "a" else 1000 + i) for [(name, i)] in rows]
        assert pipe.batch_at(step)["x"].tolist() == want
    # every record of a, once per epoch of a (10 draws), whatever b does
    drawn = [i for s in range(5) for [(name, i)] in pipe.explain(s) if name == "a"]
    assert sorted(drawn) == list(range(10))


def test_host_slices_concatenate_to_the_global_batch():
    pipe = _pipe()
    whole = pipe.batch_at(3)["x"]
    halves = [pipe.batch_at(3, h, 2)["x"] for h in range(2)]
    assert np.concatenate(halves).tolist() == whole.tolist()


def test_iterator_with_two_workers_gives_batch_at():
    pipe = _pipe()
    with pipe.iterator(num_workers=2) as it:
        got = [next(it)["x"].tolist() for _ in range(8)]
    assert got == [pipe.batch_at(s)["x"].tolist() for s in range(8)]


def test_fingerprint_and_resume():
    pipe = _pipe()
    assert pipe.fingerprint() == _pipe().fingerprint()
    other = quern.Pipeline(stream=Interleave(pipe.stream.b, pipe.stream.a)).map(_double).batch(4)
    assert other.fingerprint() != pipe.fingerprint()
    it = pipe.iterator()
    for _ in range(3):
        next(it)
    state = it.state()
    it.close()
    assert state["step"] == 3
    with pipe.resume(state) as again:
        assert next(again)["x"].tolist() == pipe.batch_at(3)["x"].tolist()
    with pytest.raises(ValueError, match="does not match"):
        other.resume(state)


def test_a_missing_capability_is_one_clear_error():
    pipe = _pipe()
    with pytest.raises(CapabilityError, match=r"^shuffle\(\) is not supported on an Interleave: it cannot be shuffled"):
        quern.Pipeline(stream=pipe.stream).shuffle()
    with pytest.raises(CapabilityError, match=r"^where\(\) is not supported on an Interleave: .*Invertible"):
        pipe.where(3, component="a")
    with pytest.raises(TypeError, match="has no Configurable capability"):  # a TypeError and a ValueError both
        pipe.to_config()
    with pytest.raises(ValueError, match="has no Packed capability"):
        pipe.pieces(np.arange(4))


def test_an_opt_in_capability_is_used_and_forwarded_by_a_wrapper():
    plain, pipe = _pipe(), _pipe(InvertibleInterleave)
    assert not has(plain.stream, Invertible) and has(pipe.stream, Invertible)
    assert pipe.fingerprint() == plain.fingerprint()  # described the same: the class is not in it
    assert [pipe.batch_at(s)["x"].tolist() for s in range(3)] == [plain.batch_at(s)["x"].tolist() for s in range(3)]
    found = pipe.where(6, component="a", epochs=2)
    assert len(found) == 2
    for step, row in found:
        assert pipe.explain(step)[row] == [("a", 6)]
    edited = pipe.skip_steps(1, 3)  # an EditedStream: it forwards the capability of the stream it wraps
    assert has(edited.stream, Invertible) and not has(plain.skip_steps(1, 3).stream, Invertible)
    assert edited.where(6, component="a", epochs=2) == [
        (s - 2, r) if s >= 3 else (s, r) for s, r in found if not 1 <= s < 3
    ]
    with pytest.raises(CapabilityError, match="Interleave has no Invertible capability"):
        plain.skip_steps(1, 3).where(6, component="a")
