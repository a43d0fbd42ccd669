"""The stream protocol: the core every kind of stream implements, and the defaults that follow from it.

A :class:`~quern.pipeline.definition.dataset.Pipeline` holds exactly one stream plus its
record stages, batch size and batch stages. A kind of stream implements the core of
:class:`Stream`, six methods: how long it is (:meth:`~Stream.length`), which
pipelines its rows are read from (:meth:`~Stream.leaves`), which record of which leaf
each position is (:meth:`~Stream.segments`), how it is described, whole and as the
steps before some step see it (:meth:`~Stream.describe`), how the rows of a list of
steps are computed (:meth:`~Stream.results`, given one
:class:`~quern.pipeline.core.steps.StepRequest`) and how it is written in Python
(:meth:`~Stream.text`). Everything else a stream may do is a capability of its own
(:mod:`.capabilities`: shuffled, filtered, inverted by ``where``, edited, live,
reported, written as a config, ...), checked where it is needed; the other methods
here are neutral defaults that follow from the core ("no stages before", "not
live", "no refusal of its own"). Nothing outside a stream's own module asks which
kind a stream is: a new kind of stream is one new module with one subclass of
:class:`Stream` (of :class:`~quern.pipeline.streams.segments.SegmentStream` when its
rows are records of its leaves, read by the segment runner).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..core.batching import need_batch
from ..core.steps import StepRequest, StepResult
from ..identity.fingerprint import fingerprint_of
from ..order import Segments
from ..order.index import host_rows
from ..sources import Source
from .capabilities import BucketOfStep, PackedRows

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["Stream", "PackedRows", "BucketOfStep", "contiguous_positions", "locate_inner"]

Explanation = list[list[tuple[str, int | str]]]
"""Per row, the ``(name, record id)`` pairs it is made of (a live entry's ID in place of a record id)."""


class Stream(abc.ABC):
    """One kind of stream: the positions ``0, 1, 2, ...`` a pipeline's steps are cut from.

    A subclass implements the six abstract methods (its core) and the capabilities of
    :mod:`~quern.pipeline.streams.capabilities` it has. Subclasses are immutable and
    picklable (they travel to worker processes inside the pipeline). Every method's
    output depends only on the stream's definition and its arguments.
    """

    describes_past: ClassVar[bool] = False
    """Whether the steps before some step ``k`` depend on only a part of the definition
    (a schedule's stages before ``k``): then a saved state records that part
    (:meth:`~quern.pipeline.definition.dataset.Pipeline.state_at`), and a resume accepts edits of the rest."""

    seed: int
    """The seed that keys the random record transforms after this stream."""

    num_epochs: int | None = None
    """Epochs of the stream, or ``None`` when it is endless or has no epochs of its own."""

    source: Source | None = None
    """The source whose records this stream's rows are made of (``None``: several)."""

    survivors: np.ndarray | None = None
    """The record ids of :attr:`source` the stream ranges over (a filter's survivors; ``None``: all)."""

    reads_records: ClassVar[bool] = True
    """Whether each row is one record of a leaf, read in bulk by the step runner; ``False``:
    the stream makes its rows itself (the :class:`~quern.pipeline.streams.capabilities.RowMaking`
    capability), as packed rows are."""

    # ------------------------------------------------------------------ the core

    @abc.abstractmethod
    def length(self) -> int | None:
        """Positions in the whole stream, or ``None`` when it is endless."""

    @abc.abstractmethod
    def leaves(self, pipe: Pipeline) -> tuple[Pipeline, ...]:
        """The single-source pipelines rows are read from.

        Args:
            pipe: the pipeline that holds this stream.

        Returns:
            ``pipe`` itself for a source stream, else the pipelines this stream is made of.
        """

    @abc.abstractmethod
    def segments(self, positions: np.ndarray) -> Segments:
        """Per position: the leaf it comes from, the record id in that leaf's source and the position in that leaf's stream.

        Pure index arithmetic.

        Args:
            positions: int64 stream positions.

        Returns:
            The segments, one per position.

        Raises:
            TypeError: this stream's rows are not single records (a kind says why, and what to use).
        """

    @abc.abstractmethod
    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        """The stream's part of the pipeline's description (JSON-able).

        Args:
            until_step: describe only what the steps before it depend on (``None``: all).

        Returns:
            A dict merged into :meth:`~quern.pipeline.definition.dataset.Pipeline.describe`.
        """

    @abc.abstractmethod
    def results(self, pipe: Pipeline, request: StepRequest) -> Iterator[StepResult]:
        """A :class:`~quern.pipeline.core.steps.StepResult` per requested step, in order: the step runner.

        Args:
            pipe: the pipeline that holds this stream.
            request: the steps (checked), the host slice, the timings and the length check.

        Yields:
            One result per step: its batch, bit-identical to ``pipe.batch_at(step)``, or its error.
        """

    @abc.abstractmethod
    def text(self) -> str:
        """The Python expression that builds this stream's pipeline before its stages (for ``repr``)."""

    # ------------------------------------------------------------------ neutral defaults: what it is

    def leaf_names(self, pipe: Pipeline) -> tuple[str, ...]:
        """The names of :meth:`leaves`: their sources' names (a mixture: its component keys)."""
        return tuple(name for leaf in self.leaves(pipe) for name in leaf.stream.leaf_names(leaf))

    @property
    def epoch_length(self) -> int | None:
        """Positions in one epoch, or ``None`` when the stream has no epochs of its own."""
        return None

    def read_order(self) -> str | None:
        """The shuffle of the records this stream reads (``"global"``, ``"block"``; ``None``: in order)."""
        return None

    def stages_before(self) -> list[str]:
        """The stage labels a step runs before the pipeline's own record transforms (after ``read``): none."""
        return []

    def size_text(self) -> str:
        """What the stream holds, as a noun phrase for messages (``source 'x' (100 records)``)."""
        return f"the stream of {type(self).__name__}"

    def wait_timeout(self) -> float | None:
        """The seconds a consumer waits for a step's entries: ``None``, not live (a :class:`~.capabilities.Live` stream's own)."""
        return None

    # ------------------------------------------------------------------ which stages may follow

    def refusal(self, stage: str) -> str | None:
        """Why ``stage`` may not follow this stream, beyond the capabilities it lacks: by default, no reason.

        Args:
            stage: a :class:`~quern.pipeline.definition.dataset.Pipeline` method name: ``shuffle``,
                ``filter``, ``length_index``, ``pack``, ``bucket``, ``balance_hosts``,
                ``batch``, ``mix`` (being a component of a mixture), ``skip_steps``, ``exclude``.

        Returns:
            The message of the ``ValueError`` that refuses it, or ``None``.
        """
        return None

    def check(self, stage: str) -> None:
        """Raise the ``ValueError`` of :meth:`refusal` when ``stage`` may not follow.

        Args:
            stage: as for :meth:`refusal`.

        Raises:
            ValueError: ``stage`` may not follow this stream.
        """
        why = self.refusal(stage)
        if why is not None:
            raise ValueError(why)

    def batched(self, batch_size: int) -> Stream:
        """This stream under a pipeline with ``batch_size`` rows per step: itself (a schedule needs the size)."""
        return self

    def check_hosts(self, process_count: int) -> None:
        """Check, before the first step, that every step splits over ``process_count`` hosts: one batch size does.

        Raises:
            ValueError: a step of this stream cannot be split over that many hosts.
        """
        return None  # one batch size, checked with the host slice

    # ------------------------------------------------------------------ neutral defaults: the plan

    def row_ids(self, positions: np.ndarray) -> np.ndarray:
        """The record id of each row, ``-1`` where a row is not one record (a packed row): the segments' ids."""
        return self.segments(np.asarray(positions, dtype=np.int64)).ids

    def positions(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> np.ndarray:
        """This host's stream positions of ``step`` (checked): by default, rows ``[h*B/H, (h+1)*B/H)`` of it.

        Args:
            pipe: the pipeline that holds this stream (its batch size).
            step: a checked step.
            process_index: this host.
            process_count: the number of hosts.

        Returns:
            An int64 array of positions.
        """
        return contiguous_positions(pipe, step, process_index, process_count, self.length())

    def reads(self, positions: np.ndarray) -> list[tuple[Source, np.ndarray, np.ndarray]]:
        """The records these positions read, for the look-ahead of remote sources.

        ``[(source, ids, row)]``, ``row[i]`` being the index into ``positions`` whose row reads
        ``ids[i]``: the segments' ids of a stream of one source's records, else none (nothing is
        fetched ahead).
        """
        src = self.source
        if not self.reads_records or src is None:
            return []
        return [(src, self.row_ids(positions), np.arange(len(positions)))]

    def explain_rows(self, positions: np.ndarray, names: Sequence[str]) -> Explanation:
        """Per position, the ``(name, record id)`` pairs its row is made of.

        Args:
            positions: stream positions.
            names: the name of each leaf (:meth:`leaf_names`; a mixture's component: its key).

        Returns:
            One list of pairs per position: by default its segment's leaf name and record id.
        """
        seg = self.segments(np.asarray(positions, dtype=np.int64))
        return [[(names[c], i)] for c, i in zip(seg.component.tolist(), seg.ids.tolist())]

    def explain(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> Explanation:
        """For each row of this host's batch at ``step``: the ``(name, record id)`` pairs it was made from."""
        return self.explain_rows(self.positions(pipe, step, process_index, process_count), self.leaf_names(pipe))

    # ------------------------------------------------------------------ neutral defaults: identity

    def edits_before(self, step: int) -> list[str]:
        """The edits that change steps before ``step``, each call and its first step: none without edits."""
        return []

    def change_steps(self) -> tuple[int, ...]:
        """The steps from which :meth:`describe` of the past changes, increasing.

        A schedule's stage starts and the edits' first steps: ``describe(until_step=s + 1)`` is the
        same for every ``s`` between two of them. Empty when the past never depends on part of the
        definition (:attr:`describes_past` false).
        """
        return ()

    def locate(self, path: tuple) -> tuple[str, Pipeline, tuple] | None:
        """Where a path into this stream's part of a description leads: a pipeline it is made of.

        Args:
            path: keys and indices from the top of a pipeline's description.

        Returns:
            ``(label, pipeline, the rest of the path in that pipeline's description)``,
            the label naming the pipeline in messages (``component 'web':``); ``None``
            when the path leads into no pipeline (the default).
        """
        return None

    def parts(self, description: dict[str, Any]) -> dict[str, str]:
        """A digest of each part of a pipeline description, to name what differs between two.

        Args:
            description: a whole pipeline description (:meth:`describe` merged with the stages').

        Returns:
            ``{part name: digest}``; by default one part per top-level key.
        """
        return {key: fingerprint_of(value) for key, value in description.items()}

    def stage_text(self) -> str:
        """What ``repr`` adds after the pipeline's stages: nothing by default (``.balance_hosts(...)``)."""
        return ""


def locate_inner(path: tuple, key: str, label: str, inner: Pipeline) -> tuple[str, Pipeline, tuple] | None:
    """:meth:`Stream.locate` of a stream made of one pipeline, described under ``key`` as ``{"inner": ...}``.

    Args:
        path: the path into a description.
        key: the stream's key in the description (``packing``).
        label: how messages name the inner pipeline (``the packed pipeline's``).
        inner: the inner pipeline.

    Returns:
        ``(label, inner, the rest of the path)`` when ``path`` leads into ``inner``, else ``None``.
    """
    if len(path) >= 2 and path[0] == key and path[1] == "inner":
        return label, inner, path[2:]
    return None


def contiguous_positions(
    pipe: Pipeline, step: int, process_index: int, process_count: int, total: int | None
) -> np.ndarray:
    """Rows ``[h*B/H, (h+1)*B/H)`` of ``step``'s positions ``[step*B, (step+1)*B)``, cut at ``total``.

    Args:
        pipe: the pipeline (its batch size ``B``).
        step: the step.
        process_index: the host ``h``.
        process_count: the hosts ``H``.
        total: positions in the stream (``None``: endless).

    Returns:
        An int64 array of this host's positions (empty when the partial last batch has none for it).
    """
    b = need_batch(pipe, "positions")
    lo, hi = host_rows(b, process_index, process_count)
    start = step * b
    end = start + hi
    if total is not None:
        end = min(end, total)
    return np.arange(start + lo, max(start + lo, end), dtype=np.int64)
