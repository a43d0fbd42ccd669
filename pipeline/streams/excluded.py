"""A source stream with records excluded from some position on (:meth:`Pipeline.exclude`).

The base stream (:class:`~quern.pipeline.streams.source.SourceStream`, filtered
or not) keeps its epochs and permutations. From the base position ``p0`` of a
*cut* on, the records of the cut's set are *holes*: the stream skips them, so
the positions after ``p0`` shift and the stream continues with the remaining
records in their order. Positions before the first cut are the base's own. A
cut's set holds the records of every earlier cut too, so the stream between
two cuts is the base with one set of holes.

Position ``q`` of this stream is base position ``p`` found without a scan: the
base is periodic (every epoch holds each record once), so past a cut's first,
partial epoch each epoch has ``N - k`` positions (``k`` excluded records in the
stream), and within an epoch the ``w``-th position that is not a hole comes
from the sorted holes (the records' offsets in that epoch, inverted from the
keyed permutation: :meth:`SourceStream.epoch_positions`). Every output depends
only on the base stream and the cuts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..order import Segments
from ..sources import Source
from .capabilities import InvertedByPositions
from .segments import SegmentStream

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline
    from .source import SourceStream

__all__ = ["ExcludedStream", "Cut"]


class Cut(NamedTuple):
    """From base position ``base`` (this stream's position ``own``) on, the records ``ids`` are skipped."""

    base: int
    own: int
    ids: np.ndarray  # sorted, distinct int64 record ids; every earlier cut's ids included


def _epoch_length(stream: SourceStream) -> int:
    """The positions of one epoch of a source stream."""
    n = stream.epoch_length
    assert n is not None, "an excluded stream's base has epochs"
    return n


def _select(w: np.ndarray, holes: np.ndarray) -> np.ndarray:
    """The offsets of the ``w``-th slots that are not holes (``holes``: sorted offsets)."""
    adjusted = holes - np.arange(len(holes), dtype=np.int64)
    return w + np.searchsorted(adjusted, w, side="right")


@dataclasses.dataclass(frozen=True)
class ExcludedStream(InvertedByPositions, SegmentStream):
    """The base source stream, skipping the records of each cut from the cut's position on.

    Not a wrapper that forwards (:class:`~quern.pipeline.streams.forwarding.ForwardingStream`):
    its positions are not the base's, so every answer about positions is its own; it hands
    the base only its description, config and text.

    Attributes:
        base: the stream records are excluded from (a source or filtered source stream).
        cuts: the cuts, in increasing order of position.
    """

    base: SourceStream  # a source stream, filtered or not: every epoch holds each record once
    cuts: tuple[Cut, ...] = dataclasses.field(compare=False)
    cuts_key: tuple[tuple[int, int, bytes], ...] = dataclasses.field(default=(), repr=False)
    seed: int = dataclasses.field(init=False)
    num_epochs: int | None = dataclasses.field(init=False)
    source: Source | None = dataclasses.field(init=False, compare=False, repr=False)
    survivors: np.ndarray | None = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("seed", "num_epochs", "source", "survivors"):
            object.__setattr__(self, name, getattr(self.base, name))
        object.__setattr__(self, "cuts_key", tuple((c.base, c.own, c.ids.tobytes()) for c in self.cuts))

    @classmethod
    def cut(cls, stream: SourceStream | ExcludedStream, ids: np.ndarray, own: int) -> ExcludedStream:
        """``stream`` with ``ids`` (sorted, distinct record ids) skipped from its position ``own`` on.

        Args:
            stream: a source stream, or an excluded one (the new cut joins its cuts).
            ids: the records to skip.
            own: the position of ``stream`` from which they are skipped.

        Returns:
            The excluded stream.

        Raises:
            ValueError: ``own`` is before the stream's last cut (make edits in step order), or no
                record of the stream would be left.
        """
        if isinstance(stream, ExcludedStream):
            base, cuts = stream.base, list(stream.cuts)
            p0 = int(stream.base_positions(np.asarray([own], dtype=np.int64))[0])
        else:
            base, cuts, p0 = stream, [], own
        if cuts and own < cuts[-1].own:
            raise ValueError(
                f"exclude() from stream position {own}, before an earlier exclusion's ({cuts[-1].own}): "
                "make the exclusions in step order"
            )
        union = np.union1d(cuts[-1].ids, ids) if cuts else np.asarray(ids, dtype=np.int64)
        if cuts and cuts[-1].own == own:
            cuts.pop()
        if _epoch_length(base) - int(np.count_nonzero(base.epoch_positions(union, 0) >= 0)) < 1:
            raise ValueError(
                f"exclude() would leave no record of {base.size_text()}: it excludes every record in the stream"
            )
        cuts.append(Cut(p0, own, np.asarray(union, dtype=np.int64)))
        return cls(base=base, cuts=tuple(cuts))

    # ------------------------------------------------------------------ holes

    def __getstate__(self) -> dict:
        """The state without the cached holes (recomputed where needed)."""
        return {k: v for k, v in self.__dict__.items() if k != "_holes_cache"}

    def __setstate__(self, state: dict) -> None:
        """Restore :meth:`__getstate__`'s state."""
        self.__dict__.update(state)

    def _holes(self, ids: np.ndarray, epoch: int) -> np.ndarray:
        """The sorted offsets of ``ids`` in the base's epoch ``epoch`` (those in the stream).

        Cached for the last few (set, epoch) pairs: consecutive steps share an epoch, and a
        takedown of many ids would otherwise invert the permutation for all of them each step.
        """
        cache = self.__dict__.setdefault("_holes_cache", {})
        key = (ids.ctypes.data, len(ids), epoch)
        hit = cache.get(key)
        if hit is None:
            j = self.base.epoch_positions(ids, epoch)
            hit = cache[key] = np.sort(j[j >= 0])
            hit.setflags(write=False)
            while len(cache) > 8:
                cache.pop(next(iter(cache)))
        return hit

    def _count(self, ids: np.ndarray, first: int, end: int) -> int:
        """The holes of ``ids`` at the base positions ``[first, end)``."""
        if end <= first:
            return 0
        n = _epoch_length(self.base)
        e0, e1 = first // n, (end - 1) // n
        if e0 == e1:
            h = self._holes(ids, e0) + e0 * n
            return int(np.count_nonzero((h >= first) & (h < end)))
        k = len(self._holes(ids, e0))
        head = self._count(ids, first, (e0 + 1) * n)
        tail = self._count(ids, e1 * n, end)
        return head + tail + k * (e1 - e0 - 1)

    def base_positions(self, positions: np.ndarray) -> np.ndarray:
        """The base position of each of this stream's positions.

        Args:
            positions: positions of this stream (``>= 0``).

        Returns:
            An int64 array of base positions, each holding a record no cut skips there.
        """
        q = np.asarray(positions, dtype=np.int64).reshape(-1)
        out = q.copy()
        if not self.cuts or not q.size:
            return out
        n = _epoch_length(self.base)
        owns = np.asarray([c.own for c in self.cuts], dtype=np.int64)
        which = np.searchsorted(owns, q, side="right") - 1
        for i in np.unique(which[which >= 0]).tolist():
            cut = self.cuts[i]
            sel = np.flatnonzero(which == i)
            offset = q[sel] - cut.own
            e0 = cut.base // n
            holes0 = self._holes(cut.ids, e0) + e0 * n
            holes0 = holes0[holes0 >= cut.base] - cut.base
            first_left = (e0 + 1) * n - cut.base - len(holes0)  # positions left in the cut's first epoch
            head = offset < first_left
            out[sel[head]] = cut.base + _select(offset[head], holes0)
            rest = np.flatnonzero(~head)
            if rest.size:
                per = n - len(self._holes(cut.ids, e0))
                epoch = e0 + 1 + (offset[rest] - first_left) // per
                w = (offset[rest] - first_left) % per
                for e in np.unique(epoch).tolist():
                    at = epoch == e
                    out[sel[rest[at]]] = e * n + _select(w[at], self._holes(cut.ids, e))
        return out

    def own_positions(self, base_positions: np.ndarray) -> np.ndarray:
        """This stream's position of each base position, ``-1`` where a cut skips its record.

        Args:
            base_positions: base positions.

        Returns:
            An int64 array.
        """
        p = np.asarray(base_positions, dtype=np.int64).reshape(-1)
        out = p.copy()
        if not self.cuts:
            return out
        starts = np.asarray([c.base for c in self.cuts], dtype=np.int64)
        which = np.searchsorted(starts, p, side="right") - 1
        ids = self.base.record_ids(p) if p.size else p
        for k in np.flatnonzero(which >= 0).tolist():
            cut = self.cuts[int(which[k])]
            rec = ids[k]
            i = np.searchsorted(cut.ids, rec)
            if i < len(cut.ids) and cut.ids[i] == rec:
                out[k] = -1
            else:
                out[k] = cut.own + (int(p[k]) - cut.base) - self._count(cut.ids, cut.base, int(p[k]))
        return out

    # ------------------------------------------------------------------ the stream

    def leaves(self, pipe: Pipeline) -> tuple[Pipeline, ...]:
        """``(pipe,)``: the pipeline reads its own source."""
        return (pipe,)

    def leaf_names(self, pipe: Pipeline) -> tuple[str, ...]:
        """The source's name."""
        return self.base.leaf_names(pipe)

    def length(self) -> int | None:
        """The base's positions less the holes after the first cut (``None``: endless)."""
        total = self.base.length()
        if total is None:
            return None
        bounds = [min(c.base, total) for c in self.cuts[1:]] + [total]
        return total - sum(self._count(c.ids, c.base, end) for c, end in zip(self.cuts, bounds))

    def read_order(self) -> str | None:
        """The base's shuffle."""
        return self.base.read_order()

    def size_text(self) -> str:
        """The base's, with the records excluded (``source 'x' (100 records), 3 of them excluded from position 8 on``)."""
        n = len(self.cuts[-1].ids)
        return f"{self.base.size_text()}, {n} of them excluded from position {self.cuts[0].own} on"

    def refusal(self, stage: str) -> str | None:
        """Stages that change the records (shuffle, filter, pack, ...) belong before the exclusion."""
        if stage in ("batch", "exclude"):
            return None
        return f"{stage}() after exclude(): put it before the edits"

    def record_ids(self, positions: np.ndarray) -> np.ndarray:
        """The record id at each position."""
        return self.base.record_ids(self.base_positions(positions))

    def segments(self, positions: np.ndarray) -> Segments:
        """Per position: leaf 0, its record id and the position itself (which keys the random transforms)."""
        positions = np.asarray(positions, dtype=np.int64)
        return Segments(np.zeros(len(positions), dtype=np.int64), self.record_ids(positions), positions)

    def record_positions(self, record: int, epochs: int) -> np.ndarray:
        """The positions that hold ``record`` in the base's first ``epochs`` epochs, where no cut skips it."""
        own = self.own_positions(self.base.record_positions(record, epochs))
        return own[own >= 0]

    def excluded(self, pipe: Pipeline, ids: np.ndarray, position: int, component: str | None) -> ExcludedStream:
        """This stream with ``ids`` skipped from its position ``position`` on too."""
        if component is not None:
            raise ValueError(f"component={component!r}: the pipeline is not a mixture (it has no components)")
        return ExcludedStream.cut(self, ids, position)

    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        """The base's description (the edits are described by the pipeline's edited stream)."""
        return self.base.describe(until_step)

    def to_config(self, pipe: Pipeline) -> dict[str, Any]:
        """The base's config (the edits are written by the pipeline's edited stream)."""
        return self.base.to_config(pipe)

    def component_config(self, pipe: Pipeline, where: str) -> dict[str, Any]:
        """The base's config as a component."""
        return self.base.component_config(pipe, where)

    def text(self) -> str:
        """The base's text."""
        return self.base.text()
