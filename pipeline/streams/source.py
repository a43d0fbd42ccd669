"""A source stream and a filtered source stream: the records of one source, epoch after epoch.

Position ``p`` is record ``perm(seed, epoch)(p % N)`` of epoch ``p // N``
(:func:`quern.pipeline.order.index.epoch_record_ids`), ``N`` being the source's
records or, after a filter, its survivors. Every output depends only on the
source's identity, the seed, the shuffle and (after a filter) the survivors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..core.batching import need_batch
from ..identity import samedef
from ..order import Segments
from ..order import index as _index
from ..sources import Source
from .capabilities import InvertedByPositions
from .config_form import batch_config, source_config, stages_config
from .excluded import ExcludedStream
from .protocol import Explanation, Stream, contiguous_positions
from .segments import SegmentStream

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["SourceStream", "FilteredStream", "ShuffleMode"]

ShuffleMode = Literal["global", "block"]


@dataclasses.dataclass(frozen=True)
class SourceStream(InvertedByPositions, SegmentStream):
    """The records of one source, shuffled or not, for ``num_epochs`` epochs (``None``: endless).

    Capabilities: shuffled, filtered, balanced, single-source, inverted (``where``), edited
    (``exclude``), written as a config and as a mixture's component.

    Attributes:
        source: the records.
        seed: a 64-bit seed (the shuffle's and the random transforms').
        num_epochs: epochs of the stream, ``None`` for an endless one.
        shuffle_mode: ``None`` (source order), ``"global"`` or ``"block"``.
        block_size: records per block of a block shuffle.
        window: blocks per window of a block shuffle.
        host_lengths: per record, the length that balances host slices (``balance_hosts``).
        host_lengths_digest: the digest of ``host_lengths`` (what equality and the fingerprint see).
    """

    source: Source  # always set (the base says a stream's may be None)
    seed: int = 0
    num_epochs: int | None = None
    shuffle_mode: ShuffleMode | None = None
    block_size: int = 1
    window: int = 1
    host_lengths: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    host_lengths_digest: str | None = None

    def leaves(self, pipe: Pipeline) -> tuple[Pipeline, ...]:
        """``(pipe,)``: the pipeline reads its own source."""
        return (pipe,)

    def leaf_names(self, pipe: Pipeline) -> tuple[str, ...]:
        """The source's name."""
        return (self.source.name,)

    @property
    def epoch_length(self) -> int:
        """Records in one epoch."""
        return len(self.source)

    def length(self) -> int | None:
        """Records over all epochs, ``None`` when endless."""
        return None if self.num_epochs is None else self.epoch_length * self.num_epochs

    def read_order(self) -> str | None:
        """The shuffle mode."""
        return self.shuffle_mode

    def size_text(self) -> str:
        """``source 'x' (100 records)``."""
        return f"source {self.source.name!r} ({len(self.source)} records)"

    def refusal(self, stage: str) -> str | None:
        """Every stage may follow a source stream, but ``mix`` after ``balance_hosts``."""
        if stage == "mix" and self.host_lengths is not None:
            return "has balance_hosts(), which applies to a whole batch only"
        return None

    def shuffled(self, mode: str, block_size: int | None, window: int, steps: int | None = None) -> SourceStream:
        """This stream with a new permutation each epoch (see :meth:`Pipeline.shuffle`).

        Raises:
            ValueError: ``mode`` is not ``"global"`` or ``"block"`` (``"steps"`` is for live streams).
        """
        if mode == "steps":
            raise ValueError(
                "shuffle('steps') permutes groups of steps of a live stream (a RedisStreamSource); shuffle this "
                "source with 'global' or 'block'"
            )
        if mode == "global":
            return dataclasses.replace(self, shuffle_mode="global", block_size=1, window=1)
        if mode != "block":
            raise ValueError(f"shuffle mode must be 'global' or 'block', got {mode!r}")
        size = self.source.block_size() if block_size is None else _index.check_int(block_size, "block_size", 1)
        window = _index.check_int(window, "window", 1)
        return dataclasses.replace(self, shuffle_mode="block", block_size=max(1, size), window=window)

    def filtered(self, survivors: np.ndarray) -> FilteredStream:
        """This stream over ``survivors`` only (sorted record ids of the source)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(SourceStream)}
        return FilteredStream(**fields, survivors=survivors)

    def balanced(self, lengths: np.ndarray, digest: str) -> SourceStream:
        """This stream with token-balanced host slices (see :meth:`Pipeline.balance_hosts`)."""
        return dataclasses.replace(self, host_lengths=lengths, host_lengths_digest=digest)

    def record_ids(self, positions: np.ndarray) -> np.ndarray:
        """The record id at each position (pure index arithmetic)."""
        n = self.epoch_length
        ids = _index.epoch_record_ids(positions, n, self.seed, self.shuffle_mode, self.block_size, self.window)
        return ids if self.survivors is None else np.asarray(self.survivors[ids], dtype=np.int64)

    def epoch_positions(self, records: np.ndarray, epoch: int) -> np.ndarray:
        """For each record id of the source, its offset in epoch ``epoch``, or ``-1`` where it is not in the stream.

        The inverse of :meth:`record_ids` within one epoch: the ``j`` with
        ``record_ids([epoch * N + j]) == record``, ``N`` being :attr:`epoch_length`. A record
        a filter drops (or an id outside the source) is ``-1``. O(len(records)) work, plus
        a binary search in the survivors per record after a filter.

        Args:
            records: record ids of the source, of any shape.
            epoch: the epoch, ``>= 0``.

        Returns:
            An ``int64`` array of the shape of ``records``, depending only on the stream's
            definition and the arguments.

        Raises:
            TypeError: ``epoch`` is not an integer.
            ValueError: ``epoch`` is negative.

        Example:
            >>> import quern
            >>> s = quern.Pipeline.from_source({"x": np.arange(5)}, seed=1).shuffle().stream
            >>> ids = s.record_ids(np.arange(10, 15))
            >>> s.epoch_positions(ids, 2).tolist()
            [0, 1, 2, 3, 4]
        """
        epoch = _index.check_int(epoch, "epoch", 0)
        return self._offsets(np.asarray(records, dtype=np.int64), np.asarray(epoch, dtype=np.int64))

    def _offsets(self, records: np.ndarray, epochs: np.ndarray) -> np.ndarray:
        """:meth:`epoch_positions` with one epoch per record (``epochs`` broadcast against ``records``)."""
        shape = records.shape
        flat = records.reshape(-1)
        out = np.full(flat.shape, -1, dtype=np.int64)
        if self.survivors is None:
            idx, hit = flat, (flat >= 0) & (flat < len(self.source))
        else:
            survivors = np.asarray(self.survivors)
            idx = np.searchsorted(survivors, flat)
            hit = idx < len(survivors)
            hit[hit] = survivors[idx[hit]] == flat[hit]
        if hit.any():
            e = np.broadcast_to(epochs, shape).reshape(-1)[hit] if epochs.ndim else epochs
            n = self.epoch_length
            out[hit] = _index.epoch_positions(
                idx[hit], n, self.seed, self.shuffle_mode, self.block_size, self.window, epoch=e
            )
        return out.reshape(shape)

    def record_positions(self, record: int, epochs: int) -> np.ndarray:
        """The positions of record ``record`` in the first ``epochs`` epochs (at most the stream's).

        ``e * N + epoch_positions([record], e)`` for each epoch ``e``; none when a filter
        drops the record. O(epochs), reading nothing.

        Args:
            record: a record id of the source.
            epochs: epochs to look in, at least 1.

        Returns:
            Sorted int64 positions, one per epoch the record is in.
        """
        if self.num_epochs is not None:
            epochs = min(epochs, self.num_epochs)
        e = np.arange(epochs, dtype=np.int64)
        j = self._offsets(np.full(epochs, record, dtype=np.int64), e)
        return (e * self.epoch_length + j)[j >= 0]

    def excluded(self, pipe: Pipeline, ids: np.ndarray, position: int, component: str | None) -> Stream:
        """This stream skipping the records ``ids`` from position ``position`` on (:mod:`.excluded`).

        Raises:
            ValueError: ``component`` given, ``balance_hosts`` (its host slices are dealt by length), or
                every record excluded.
        """
        if component is not None:
            raise ValueError(f"exclude(component={component!r}): the pipeline is not a mixture")
        if self.host_lengths is not None:
            raise ValueError("exclude() on a pipeline with balance_hosts() is not supported")
        return ExcludedStream.cut(self, ids, position)

    def explain_rows(self, positions: np.ndarray, names: Sequence[str]) -> Explanation:
        """Per position, the source's name and its record's label (its id; a flat map's output: its record and index)."""
        labels = self.source.record_labels(self.record_ids(np.asarray(positions, dtype=np.int64)))
        return [[(names[0], x)] for x in labels]

    def segments(self, positions: np.ndarray) -> Segments:
        """Per position: leaf 0, its record id and the position itself."""
        positions = np.asarray(positions, dtype=np.int64)
        return Segments(np.zeros(len(positions), dtype=np.int64), self.record_ids(positions), positions)

    def positions(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> np.ndarray:
        """Rows ``[h*B/H, (h+1)*B/H)`` of the step, or this host's balanced share.

        With ``balance_hosts``: this host's share of the rows of every full batch, sorted by
        length and dealt in a snake order.
        """
        b = need_batch(pipe, "positions")
        total = self.length()
        start = step * b
        full = total is None or start + b <= total
        if self.host_lengths is None or process_count == 1 or not full:
            return contiguous_positions(pipe, step, process_index, process_count, total)
        positions = np.arange(start, start + b, dtype=np.int64)
        order = np.argsort(-self.host_lengths[self.record_ids(positions)], kind="stable")
        rank = np.arange(b)
        within, rnd = rank % process_count, rank // process_count
        host = np.where(rnd % 2 == 0, within, process_count - 1 - within)
        return np.sort(positions[order[host == process_index]])

    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        """The source's identity, the seed, epochs, shuffle and ``balance_hosts`` lengths."""
        return {
            "source": samedef.IDENTITY if samedef.active() else self.source.identity(),
            "seed": self.seed,
            "num_epochs": self.num_epochs,
            "shuffle": [self.shuffle_mode, self.block_size, self.window],
            "balance_hosts": self.host_lengths_digest,
        }

    def to_config(self, pipe: Pipeline) -> dict[str, Any]:
        """``source``, ``seed``, ``num_epochs``, ``shuffle``, ``transforms``, ``batch``, ``batch_transforms``."""
        leaf = self.component_config(pipe, "")
        head = {
            "source": leaf["source"],
            "seed": leaf["seed"],
            "num_epochs": self.num_epochs,
            "shuffle": leaf["shuffle"],
            "transforms": leaf["transforms"],
        }
        return {**head, **batch_config(pipe)}

    def component_config(self, pipe: Pipeline, where: str) -> dict[str, Any]:
        """``source``, ``seed``, ``shuffle`` and ``transforms`` of ``pipe`` (``where``: its key path and a dot)."""
        if self.host_lengths is not None:
            raise ValueError("a pipeline with balance_hosts(lengths) has no config form (the lengths are data)")
        shuffle: str | dict[str, Any] | None = None
        if self.shuffle_mode == "global":
            shuffle = "global"
        elif self.shuffle_mode == "block":
            shuffle = {"mode": "block", "block": self.block_size, "window": self.window}
        base, before = self.source.config_base()  # a flat map's outputs: its source, the stages up to it
        return {
            "source": source_config(base, f"{where}source"),
            "seed": self.seed,
            **({"num_epochs": self.num_epochs} if where and self.num_epochs is not None else {}),  # a finite component
            "shuffle": shuffle,
            "transforms": stages_config(before + pipe.record_ops, f"{where}transforms"),
        }

    def text(self) -> str:
        """``Pipeline.from_source(...)`` and the shuffle."""
        out = f"Pipeline.from_source({self.source!r}, seed={self.seed}, num_epochs={self.num_epochs})"
        if self.shuffle_mode == "global":
            out += ".shuffle()"
        elif self.shuffle_mode == "block":
            out += f".shuffle('block', block_size={self.block_size}, window={self.window})"
        return out

    def stage_text(self) -> str:
        """What the stages after the record transforms add to ``repr``."""
        return ".balance_hosts(...)" if self.host_lengths is not None else ""


@dataclasses.dataclass(frozen=True)
class FilteredStream(SourceStream):
    """A source stream over the records a filter keeps (its *survivors*), epoch after epoch.

    Attributes:
        survivors: the sorted record ids kept (memory-mapped from the filter's cache).
    """

    survivors: np.ndarray = dataclasses.field(default=None, compare=False, repr=False)  # type: ignore[arg-type]

    @property
    def epoch_length(self) -> int:
        """The survivors."""
        return len(self.survivors)

    def size_text(self) -> str:
        """``source 'x' (100 records, 50 kept by the filter)``."""
        return f"source {self.source.name!r} ({len(self.source)} records, {len(self.survivors)} kept by the filter)"
