"""The stream protocol: what every kind of stream answers for itself, and what it sees of a pipeline.

A :class:`~quern.pipeline.definition.dataset.Pipeline` holds exactly one stream plus its
record stages, batch size and batch stages; :class:`Definition` is that pipeline
as the streams and the step runner see it (the pipeline module, above them,
implements it). The stream says how long it is,
which records (or pieces of records) make each stream position, which sources it
reads, how it is described (for the fingerprint and for resume), how it is
explained and written as a config, which stages may follow it, and how the
rows of a list of steps are computed (:meth:`Stream.results`). Nothing outside
a stream's own module asks which kind a stream is: a new kind of stream is one
new module with one subclass of :class:`Stream` (of
:class:`~quern.pipeline.streams.segments.SegmentStream` when its rows are
segments of other pipelines' streams).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

from ..core.ops import Op
from ..core.steps import LengthCheck, StepResult
from ..identity.fingerprint import fingerprint_of
from ..iterate.timing import Clock
from ..order import Pieces, Segments
from ..order.index import host_rows
from ..sources import Source

__all__ = ["Definition", "Stream", "PackedRows", "BucketOfStep", "contiguous_positions", "locate_inner"]


class PackedRows(NamedTuple):
    """What packed rows hold, for reports: the row length, the pieces and the documents' whole lengths."""

    seq_len: int
    pieces: Pieces
    lengths: np.ndarray  # tokens of each record of the source


class BucketOfStep(NamedTuple):
    """A bucketed step's bucket, for reports."""

    bucket: int  # its index among the buckets that hold records
    name: str  # len<=BOUND
    bound: int  # the padded length
    real_tokens: int | None  # the rows' unpadded tokens, from the length index (None: not kept)


class Definition(Protocol):
    """A pipeline as the streams and the step runner see it (:class:`~quern.pipeline.definition.dataset.Pipeline`)."""

    @property
    def stream(self) -> Stream:
        """The stream."""

    @property
    def record_ops(self) -> tuple[Op, ...]:
        """The record transforms."""

    @property
    def batch_ops(self) -> tuple[Op, ...]:
        """The batch transforms."""

    @property
    def batch_size(self) -> int | None:
        """The global batch size (``None`` before ``batch()``)."""

    @property
    def drop_remainder(self) -> bool:
        """Whether a finite stream's last partial batch is dropped."""

    @property
    def filter_descriptions(self) -> tuple[Any, ...]:
        """Per record op, a filter's description frozen when its survivors were found."""

    @property
    def seed(self) -> int:
        """The stream's seed."""

    @property
    def num_epochs(self) -> int | None:
        """The stream's epochs."""

    @property
    def source(self) -> Source | None:
        """The stream's source."""

    @property
    def leaves(self) -> tuple[Definition, ...]:
        """The single-source pipelines rows are read from."""

    @property
    def leaf_names(self) -> tuple[str, ...]:
        """Their names."""

    @property
    def sources(self) -> tuple[Source, ...]:
        """Their sources."""

    def positions(self, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """This host's stream positions at ``step``."""

    def segments(self, positions: np.ndarray) -> Segments:
        """The plan of these positions."""

    def check_step(self, step: object, *, name: str = "step", end_ok: bool = False) -> int:
        """``step``, checked."""

    def need_batch(self, what: str) -> int:
        """The batch size, or a ``ValueError`` naming ``what``."""

    def need_no_batch(self, what: str, instead: str) -> None:
        """A ``ValueError`` after ``batch()``."""

    def explain(self, step: int, process_index: int = 0, process_count: int = 1) -> list[list[tuple[str, int | str]]]:
        """The records of each row of ``step``."""

    def describe(self) -> dict[str, Any]:
        """The whole description."""

    def describe_until(self, step: int | None) -> dict[str, Any]:
        """The description as it applies to the steps before ``step`` (``None``: all)."""

    def fingerprint(self) -> str:
        """The fingerprint."""

    def length_index(
        self, key: str | None = None, *, lengths: Any = None, cache_dir: Any = None, num_workers: int | None = None
    ) -> np.ndarray:
        """Tokens per record of the source."""

    def map(self, fn: Callable[[Any], Any]) -> Definition:
        """The pipeline with a record transform appended."""

    def batch(self, global_batch_size: int, drop_remainder: bool = True) -> Definition:
        """The batched pipeline."""

    def replace_stream(self, stream: Stream) -> Definition:
        """This pipeline, its stages kept, over another stream."""

    @property
    def num_steps(self) -> int | None:
        """Steps in the stream (``None``: endless)."""

    def state_at(self, step: int) -> dict[str, Any]:
        """The checkpoint of an iterator whose next step is ``step``."""

    def records_key(self, ops: list[list[Any]] | None = None, **extra: Any) -> str:
        """The fingerprint of what the records are, plus ``extra``."""


class Stream(abc.ABC):
    """One kind of stream: the positions ``0, 1, 2, ...`` a pipeline's steps are cut from.

    Subclasses are immutable and picklable (they travel to worker processes inside the
    pipeline). Every method's output depends only on the stream's definition and its
    arguments.
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
    """Whether each row is one record of :attr:`source` (read in bulk by whoever runs the
    step); ``False``: the stream makes its rows itself (:meth:`rows`), as packed rows are."""

    # ------------------------------------------------------------------ what it is

    @abc.abstractmethod
    def leaves(self, pipe: Definition) -> tuple[Definition, ...]:
        """The single-source pipelines rows are read from.

        Args:
            pipe: the pipeline that holds this stream.

        Returns:
            ``pipe`` itself for a source stream, else the pipelines this stream is made of.
        """

    def leaf_names(self, pipe: Definition) -> tuple[str, ...]:
        """The names of :meth:`leaves`: their sources' names (a mixture: its component keys)."""
        return tuple(name for leaf in self.leaves(pipe) for name in leaf.stream.leaf_names(leaf))

    @abc.abstractmethod
    def length(self) -> int | None:
        """Positions in the whole stream, or ``None`` when it is endless."""

    @property
    def epoch_length(self) -> int | None:
        """Positions in one epoch, or ``None`` when the stream has no epochs of its own."""
        return None

    def read_order(self) -> str | None:
        """The shuffle of the records this stream reads (``"global"``, ``"block"``; ``None``: in order)."""
        return None

    def stages_before(self) -> list[str]:
        """The stage labels a step runs before the pipeline's own record transforms (after ``read``)."""
        return []

    def size_text(self) -> str:
        """What the stream holds, as a noun phrase for messages (``source 'x' (100 records)``)."""
        return f"the stream of {type(self).__name__}"

    # ------------------------------------------------------------------ which stages may follow

    def refusal(self, stage: str) -> str | None:
        """Why ``stage`` may not follow this stream, or ``None`` when it may.

        Args:
            stage: a :class:`~quern.pipeline.definition.dataset.Pipeline` method name: ``shuffle``,
                ``filter``, ``length_index``, ``pack``, ``bucket``, ``balance_hosts``,
                ``batch``, ``mix`` (being a component of a mixture), ``segments``.

        Returns:
            The message of the ``ValueError`` that refuses it, or ``None``.
        """
        return f"{stage}() does not apply to a {type(self).__name__}"

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

    def shuffled(self, mode: str, block_size: int | None, window: int, steps: int | None = None) -> Stream:
        """This stream shuffled (a source's records); refused for the other kinds.

        Raises:
            ValueError: this stream cannot be shuffled.
        """
        self.check("shuffle")
        raise AssertionError("a stream that may be shuffled overrides shuffled()")  # pragma: no cover

    def wait_timeout(self) -> float | None:
        """The seconds a consumer waits for a step of a live stream, whose entries may not exist yet (``None``: not live)."""
        return None

    def begin(self, pipe: Definition, step: int, process_index: int, process_count: int) -> None:
        """An iterator of a live stream starts at ``step``: the stream checks the resume (nothing elsewhere)."""
        return None

    def commit(self, pipe: Definition, step: int, process_index: int, process_count: int) -> None:
        """Record that host ``process_index`` of ``process_count`` trained every step before ``step`` (a live stream).

        Raises:
            ValueError: this stream is not live: it keeps no commits.
        """
        raise ValueError(
            f"commit() is for live streams (a pipeline over a RedisStreamSource); this pipeline's "
            f"{type(self).__name__} keeps no commits: resume it from it.state() instead"
        )

    def late(self, pipe: Definition, step: int, process_index: int, process_count: int, waited: float) -> Exception:
        """The error of a consumer that waited ``waited`` seconds in vain for ``step`` of a live stream."""
        raise AssertionError("only a live stream is waited for")  # pragma: no cover

    def filtered(self, survivors: np.ndarray) -> Stream:
        """This stream over ``survivors`` only (sorted record ids of :attr:`source`).

        Raises:
            ValueError: this stream cannot be filtered.
        """
        self.check("filter")
        raise AssertionError("a stream that may be filtered overrides filtered()")  # pragma: no cover

    def balanced(self, lengths: np.ndarray, digest: str) -> Stream:
        """This stream with token-balanced host slices (``lengths``: one per record of :attr:`source`).

        Raises:
            ValueError: this stream's host slices cannot be balanced.
        """
        self.check("balance_hosts")
        raise AssertionError("a stream that may be balanced overrides balanced()")  # pragma: no cover

    def batched(self, batch_size: int) -> Stream:
        """This stream under a pipeline with ``batch_size`` rows per step (a schedule needs it)."""
        return self

    def check_hosts(self, process_count: int) -> None:
        """Check, before the first step, that every step splits over ``process_count`` hosts.

        Raises:
            ValueError: a step of this stream cannot be split over that many hosts.
        """
        return None  # one batch size, checked with the host slice

    # ------------------------------------------------------------------ the plan

    def segments(self, positions: np.ndarray) -> Segments:
        """Per position.

        The leaf it comes from, the record id in that leaf's source and the position in that leaf's stream. Pure index
        arithmetic.

        Raises:
            TypeError: this stream's rows are not single records (use :meth:`pieces`).
        """
        raise TypeError(self.refusal("segments") or f"a {type(self).__name__} has no segments")

    def record_ids(self, positions: np.ndarray) -> np.ndarray:
        """The record id at each position of a single-source stream.

        Raises:
            TypeError: the stream's rows come from several sources or records.
        """
        raise TypeError(f"a {type(self).__name__}'s rows come from several sources: use segments(positions)")

    def row_ids(self, positions: np.ndarray) -> np.ndarray:
        """The record id of each row, ``-1`` where a row is not one record (a packed row)."""
        return self.record_ids(positions)

    def pieces(self, positions: np.ndarray) -> Pieces:
        """The documents in the packed rows at these positions.

        Raises:
            TypeError: the stream's rows are not packed.
        """
        raise TypeError("pieces() is for packed pipelines; use segments()")

    def positions(self, pipe: Definition, step: int, process_index: int, process_count: int) -> np.ndarray:
        """This host's stream positions of ``step`` (checked): by default, rows ``[h*B/H, (h+1)*B/H)`` of it.

        Args:
            pipe: the pipeline that holds this stream (its batch size).
            step: a step checked by :meth:`~quern.pipeline.definition.dataset.Pipeline.check_step`.
            process_index: this host.
            process_count: the number of hosts.

        Returns:
            An int64 array of positions.
        """
        return contiguous_positions(pipe, step, process_index, process_count, self.length())

    def reads(self, positions: np.ndarray) -> list[tuple[Source, np.ndarray, np.ndarray]]:
        """The records these positions read.

        ``[(source, ids, row)]``, ``row[i]`` being the index into ``positions`` whose row reads ``ids[i]`` (for the
        look-ahead of remote sources).
        """
        if not self.reads_records:
            return []
        src = self.source
        return [] if src is None else [(src, self.record_ids(positions), np.arange(len(positions)))]

    def explain_rows(self, positions: np.ndarray, name: str | None = None) -> list[list[tuple[str, int | str]]]:
        """Per position, the ``(name, record id)`` pairs its row is made of.

        Args:
            positions: stream positions.
            name: the name to give the rows' records (default: the source's name).
        """
        src = self.source
        label = name if name is not None else (src.name if src is not None else "?")
        return [[(label, int(i))] for i in self.record_ids(positions).tolist()]

    def explain(
        self, pipe: Definition, step: int, process_index: int, process_count: int
    ) -> list[list[tuple[str, int | str]]]:
        """For each row of this host's batch at ``step``: the ``(name, record id)`` pairs it was made from."""
        return self.explain_rows(pipe.positions(step, process_index, process_count))

    # ------------------------------------------------------------------ lineage

    def epoch_positions(self, records: np.ndarray, epoch: int) -> np.ndarray:
        """For each record id of :attr:`source`, its offset in epoch ``epoch`` of this stream (``-1``: not in it).

        The inverse of :meth:`record_ids` within one epoch, for a stream whose every epoch
        holds each of its records once.

        Raises:
            TypeError: this kind of stream has no such epochs (named).
        """
        raise TypeError(f"a {type(self).__name__} has no epochs of single records to invert")

    def record_positions(self, record: int, epochs: int) -> np.ndarray:
        """The positions of this stream whose rows hold source record ``record``, in its first ``epochs`` epochs.

        Inverts the plan (a keyed permutation, a filter's survivors, a packing plan) instead of
        scanning positions.

        Args:
            record: a record id of :attr:`source` (checked by the caller).
            epochs: epochs of this stream (of its source's records) to look in, at least 1.

        Returns:
            Sorted, distinct int64 positions.

        Raises:
            TypeError: this kind of stream cannot answer it (named).
        """
        raise TypeError(f"a {type(self).__name__} cannot say where a record appears (where() is not supported)")

    def where(self, pipe: Definition, record: int, component: str | None, epochs: int) -> list[tuple[int, int]]:
        """The ``(step, row)`` pairs of ``pipe`` (which holds this stream) whose rows hold ``record``.

        By default the positions of :meth:`record_positions`, cut at the stream's end, as
        ``divmod(position, batch size)``; a mixture looks in component ``component``'s stream.

        Args:
            pipe: the batched pipeline that holds this stream.
            record: a record id of the source (of ``component``'s source for a mixture), checked.
            component: a mixture's component name (``None`` otherwise).
            epochs: epochs to look in (of the component's own stream for a mixture).

        Returns:
            The pairs in increasing order; ``row`` indexes the global batch.

        Raises:
            ValueError: ``component`` given for a stream that is not a mixture.
            TypeError: this kind of stream cannot answer it (named).
        """
        if component is not None:
            raise ValueError(f"component={component!r}: the pipeline is not a mixture (it has no components)")
        b = pipe.need_batch("where")
        pos = self.record_positions(record, epochs)
        total = pipe.num_steps
        if total is not None:
            pos = pos[pos < total * b]
        return [(int(p) // b, int(p) % b) for p in pos.tolist()]

    def excluded(self, pipe: Definition, ids: np.ndarray, position: int, component: str | None) -> Stream:
        """This stream with the records ``ids`` skipped from its position ``position`` on (:meth:`Pipeline.exclude`).

        Args:
            pipe: the pipeline that holds this stream.
            ids: sorted, distinct record ids of the source (of ``component``'s source), checked.
            position: the first position of this stream that no longer holds them.
            component: a mixture's component name (``None`` otherwise).

        Returns:
            The stream: the positions before ``position`` are unchanged.

        Raises:
            ValueError: this kind of stream cannot exclude records (named), or a bad ``component``.
        """
        raise ValueError(f"exclude() is not supported on a {type(self).__name__}")

    def edits_before(self, step: int) -> list[str]:
        """The edits that change steps before ``step``: each call, and the first step it changes.

        For messages (a resume at ``step`` refused); none for a stream without edits.
        """
        return []

    def change_steps(self) -> tuple[int, ...]:
        """The steps from which :meth:`describe` of the past changes, increasing.

        A schedule's stage starts and the edits' first steps: ``describe(until_step=s + 1)`` is the
        same for every ``s`` between two of them. Empty when the past never depends on part of the
        definition (:attr:`describes_past` false).
        """
        return ()

    # ------------------------------------------------------------------ computing

    @abc.abstractmethod
    def results(
        self,
        pipe: Definition,
        steps: list[int],
        process_index: int,
        process_count: int,
        timings: dict[str, float] | None,
        check: LengthCheck | None,
    ) -> Iterator[StepResult]:
        """A :class:`~quern.pipeline.core.steps.StepResult` per step, in order: the step runner.

        Args:
            pipe: the pipeline that holds this stream.
            steps: checked step numbers.
            process_index: this host.
            process_count: the number of hosts.
            timings: seconds per stage are added to it.
            check: the records are checked against a length index (a bucket's).

        Yields:
            One result per step: its batch, bit-identical to ``pipe.batch_at(step)``, or its error.
        """

    def rows(
        self, pipe: Definition, positions: np.ndarray, where: object, clock: Clock | None = None, prefix: str = ""
    ) -> Sequence[Any]:
        """The rows of ``pipe`` (which holds this stream) at ``positions``, after its record transforms.

        For a stream whose rows are not records (:attr:`reads_records` false).

        Args:
            pipe: the pipeline that holds this stream (a mixture's component).
            positions: positions in this stream.
            where: the step and host slice, for messages.
            clock: laps the time spent, under stage names that start with ``prefix``.
            prefix: the start of the stage names (``"web: "``).

        Raises:
            TypeError: this stream's rows are records, read by the caller.
        """
        raise TypeError(f"a {type(self).__name__}'s rows are records: read them with execute.stages.read")

    # ------------------------------------------------------------------ identity

    @abc.abstractmethod
    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        """The stream's part of the pipeline's description (JSON-able).

        Args:
            until_step: describe only what the steps before it depend on (``None``: all).

        Returns:
            A dict merged into :meth:`~quern.pipeline.definition.dataset.Pipeline.describe`.
        """

    def locate(self, path: tuple) -> tuple[str, Definition, tuple] | None:
        """Where a path into this stream's part of a description leads: a pipeline it is made of.

        Args:
            path: keys and indices from the top of a pipeline's description.

        Returns:
            ``(label, pipeline, the rest of the path in that pipeline's description)``,
            the label naming the pipeline in messages (``component 'web':``); ``None``
            when the path leads into no pipeline.
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

    # ------------------------------------------------------------------ figures for reports

    def row_noun(self) -> str:
        """What a row is called in reports: ``records``, or ``rows`` when a row holds several records."""
        return "records"

    def draws(self, pipe: Definition, first: int, end: int) -> np.ndarray | None:
        """Rows per leaf at the stream positions ``[first, end)``, from the plan.

        Returns:
            One count per leaf, or ``None`` for a stream of one leaf.
        """
        return None

    def packed_rows(self, positions: np.ndarray) -> PackedRows | None:
        """The pieces of the rows at ``positions`` when they are packed rows, else ``None``."""
        return None

    def bucket_of(self, step: int, process_index: int, process_count: int) -> BucketOfStep | None:
        """The bucket of a step when the stream is bucketed, else ``None``."""
        return None

    # ------------------------------------------------------------------ config and text

    @abc.abstractmethod
    def to_config(self, pipe: Definition) -> dict[str, Any]:
        """The config of ``pipe`` (which holds this stream), for :func:`quern.load_config`.

        Raises:
            ValueError: a part has no config form (an in-memory source, a lambda), naming its key path.
        """

    def component_config(self, pipe: Definition, where: str) -> dict[str, Any]:
        """The config of ``pipe`` as a mixture's component (``where``: its key path and a dot).

        Raises:
            ValueError: it has no config form as a component.
        """
        raise ValueError(f"{where.rstrip('.')}: a {type(self).__name__} cannot be a mixture's component")

    @abc.abstractmethod
    def text(self) -> str:
        """The Python expression that builds this stream's pipeline before its stages (for ``repr``)."""

    def stage_text(self) -> str:
        """What ``repr`` adds after the pipeline's stages (``.balance_hosts(...)``)."""
        return ""


def locate_inner(path: tuple, key: str, label: str, inner: Definition) -> tuple[str, Definition, tuple] | None:
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
    pipe: Definition, step: int, process_index: int, process_count: int, total: int | None
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
    b = pipe.need_batch("positions")
    lo, hi = host_rows(b, process_index, process_count)
    start = step * b
    end = start + hi
    if total is not None:
        end = min(end, total)
    return np.arange(start + lo, max(start + lo, end), dtype=np.int64)
