"""Tests of pipeline/protocol.py and pipeline/streams/segments.py.

A new kind of stream is one module: a round-robin interleave of two pipelines, defined here alone.

It implements quern's stream protocol (``quern.pipeline.streams.SegmentStream``, a ``Stream`` run by the segment runner) and nothing else changes:
``batch_at``, ``explain``, the iterator with worker processes, the fingerprint and resume all work
through the protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import quern
from quern.pipeline.order import Segments
from quern.pipeline.streams import SegmentStream


@dataclasses.dataclass(frozen=True)
class Interleave(SegmentStream):
    """Position ``p`` is position ``p // 2`` of pipeline ``a`` (even ``p``) or of ``b`` (odd ``p``)."""

    a: quern.Pipeline
    b: quern.Pipeline
    seed: int = 0

    def leaves(self, pipe: quern.Pipeline) -> tuple[quern.Pipeline, ...]:
        return (self.a, self.b)

    def leaf_names(self, pipe: quern.Pipeline) -> tuple[str, ...]:
        return ("a", "b")

    def length(self) -> None:
        return None

    def refusal(self, stage: str) -> str | None:
        return None if stage in ("batch", "segments") else f"{stage}() does not apply to an interleave"

    def segments(self, positions: np.ndarray) -> Segments:
        positions = np.asarray(positions, dtype=np.int64)
        comp, within = positions % 2, positions // 2
        ids = np.empty(len(positions), dtype=np.int64)
        for c, part in enumerate((self.a, self.b)):
            ids[comp == c] = part.stream.record_ids(within[comp == c])
        return Segments(comp, ids, within)

    def row_ids(self, positions: np.ndarray) -> np.ndarray:
        return self.segments(positions).ids

    def explain_rows(self, positions: np.ndarray, name: str | None = None) -> list[list[tuple[str, int]]]:
        seg = self.segments(positions)
        return [[("ab"[c], i)] for c, i in zip(seg.component.tolist(), seg.ids.tolist())]

    def reads(self, positions: np.ndarray) -> list:
        return []

    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        return {"interleave": [self.a.describe(), self.b.describe()]}

    def to_config(self, pipe: quern.Pipeline) -> dict[str, Any]:
        raise ValueError("an interleave has no config form")

    def text(self) -> str:
        return f"Interleave({self.a!r}, {self.b!r})"


def _double(r):
    return {"x": r["x"] * 2}


def _pipe() -> quern.Pipeline:
    a = quern.Pipeline.from_source({"x": np.arange(10, dtype=np.int64)}, seed=1).shuffle()
    b = quern.Pipeline.from_source({"x": np.arange(1000, 1007, dtype=np.int64)}, seed=2).shuffle()
    return quern.Pipeline(stream=Interleave(a, b)).map(_double).batch(4)


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


def test_its_refusals_are_its_own():
    with pytest.raises(ValueError, match="does not apply to an interleave"):
        quern.Pipeline(stream=_pipe().stream).shuffle()
