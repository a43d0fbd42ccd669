"""What a stream may do beyond its core: one small protocol per capability, and the one check of it.

A kind of stream implements the core of :class:`~quern.pipeline.streams.protocol.Stream`
(its length, its leaves, positions to segments, its description, its step runner, its
text) and, for each capability here it has, that capability's methods. Code that
needs a capability asks :func:`require` once: a stream without it is refused with one
:class:`~quern.pipeline.core.errors.CapabilityError` naming the call, the kind of
stream and the capability. A wrapper (a
:class:`~quern.pipeline.streams.forwarding.ForwardingStream`) has a capability when
the stream it wraps has it, or when it adds it (:func:`has`); every capability registered here is forwarded by the wrapper base,
so one added later needs no change to any wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, cast, runtime_checkable

import numpy as np

from ..core.batching import need_batch
from ..core.errors import CapabilityError
from ..order import Pieces

if TYPE_CHECKING:
    from ..core.timing import Clock
    from ..definition.dataset import Pipeline
    from ..sources.live_commits import Run, StepMap
    from .protocol import Stream

__all__ = [
    "PackedRows",
    "BucketOfStep",
    "Shuffleable",
    "Filterable",
    "Balanceable",
    "SingleSource",
    "RecordPositions",
    "Invertible",
    "Editable",
    "Live",
    "Reportable",
    "Configurable",
    "Component",
    "Packed",
    "RowMaking",
    "CAPABILITIES",
    "NEUTRAL",
    "has",
    "require",
    "report",
    "InvertedByPositions",
    "NeutralReports",
]


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


@runtime_checkable
class Shuffleable(Protocol):
    """A stream whose records may be shuffled (``Pipeline.shuffle``)."""

    def shuffled(self, mode: str, block_size: int | None, window: int, steps: int | None = None) -> Stream:
        """This stream shuffled (see :meth:`quern.Pipeline.shuffle` for the arguments)."""
        ...


@runtime_checkable
class Filterable(Protocol):
    """A stream of one source's records that a filter may narrow (``Pipeline.filter``)."""

    def filtered(self, survivors: np.ndarray) -> Stream:
        """This stream over ``survivors`` only (sorted record ids of its source)."""
        ...


@runtime_checkable
class Balanceable(Protocol):
    """A stream whose host slices may be balanced by tokens (``Pipeline.balance_hosts``)."""

    def balanced(self, lengths: np.ndarray, digest: str) -> Stream:
        """This stream with token-balanced host slices (``lengths``: one per record of its source)."""
        ...


@runtime_checkable
class SingleSource(Protocol):
    """A stream whose every row is one record of one source (its ``source``)."""

    def record_ids(self, positions: np.ndarray) -> np.ndarray:
        """The record id of the source at each position (pure index arithmetic)."""
        ...


@runtime_checkable
class RecordPositions(Protocol):
    """A stream that can say which of its positions hold a record of its source."""

    def record_positions(self, record: int, epochs: int) -> np.ndarray:
        """The sorted, distinct positions whose rows hold ``record``, in the first ``epochs`` epochs."""
        ...


@runtime_checkable
class Invertible(Protocol):
    """A stream that can say where a record appears (``Pipeline.where``)."""

    def where(self, pipe: Pipeline, record: int, component: str | None, epochs: int) -> list[tuple[int, int]]:
        """The ``(step, row)`` pairs of ``pipe`` (which holds this stream) whose rows hold ``record``."""
        ...


@runtime_checkable
class Editable(Protocol):
    """A stream whose records may be excluded from a position on (``Pipeline.exclude``, ``skip_steps``)."""

    def excluded(self, pipe: Pipeline, ids: np.ndarray, position: int, component: str | None) -> Stream:
        """This stream with the records ``ids`` skipped from its position ``position`` on."""
        ...


@runtime_checkable
class Live(Protocol):
    """A stream over a log that grows: a consumer waits for its entries and commits what it trained."""

    def start(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> Run:
        """Check a resume at ``step`` against the commit record; the iterator's run."""
        ...

    def commit(self, pipe: Pipeline, step: int, process_index: int, process_count: int, run: Run | None = None) -> None:
        """Record that this host trained every step before ``step``."""
        ...

    def late(self, pipe: Pipeline, step: int, process_index: int, process_count: int, waited: float) -> Exception:
        """The error of a consumer that waited ``waited`` seconds in vain for ``step``."""
        ...

    def step_map(self, pipe: Pipeline) -> StepMap:
        """How ``pipe`` maps steps to positions, for the commit record."""
        ...


@runtime_checkable
class Reportable(Protocol):
    """A stream with figures of its own for reports (``quern explain``, ``quern bench``)."""

    def row_noun(self) -> str:
        """What a row is called: ``records``, or ``rows`` when a row holds several records."""
        ...

    def draws(self, pipe: Pipeline, first: int, end: int) -> np.ndarray | None:
        """Rows per leaf at the positions ``[first, end)`` (``None``: one leaf)."""
        ...

    def packed_rows(self, positions: np.ndarray) -> PackedRows | None:
        """The pieces of the rows at ``positions`` when they are packed rows, else ``None``."""
        ...

    def bucket_of(self, step: int, process_index: int, process_count: int) -> BucketOfStep | None:
        """The bucket of a step when the stream is bucketed, else ``None``."""
        ...


@runtime_checkable
class Configurable(Protocol):
    """A stream whose pipeline has a config form (``Pipeline.to_config``)."""

    def to_config(self, pipe: Pipeline) -> dict[str, object]:
        """The config of ``pipe`` (which holds this stream), for :func:`quern.load_config`."""
        ...


@runtime_checkable
class Component(Protocol):
    """A stream whose pipeline may be written as a mixture's component."""

    def component_config(self, pipe: Pipeline, where: str) -> dict[str, object]:
        """The config of ``pipe`` as a mixture's component (``where``: its key path and a dot)."""
        ...


@runtime_checkable
class Packed(Protocol):
    """A stream of packed rows: each row holds pieces of several documents."""

    def pieces(self, positions: np.ndarray) -> Pieces:
        """The documents in the rows at these positions."""
        ...


@runtime_checkable
class RowMaking(Protocol):
    """A stream that makes its rows itself instead of having its records read (packed rows)."""

    def rows(
        self, pipe: Pipeline, positions: np.ndarray, where: object, clock: Clock | None = None, prefix: str = ""
    ) -> Sequence[Any]:
        """The rows (user data) of ``pipe`` (which holds this stream) at ``positions``, after its record transforms."""
        ...


class InvertedByPositions:
    """The :class:`Invertible` capability of a stream with :class:`RecordPositions`: ``where`` from its positions.

    The positions of :meth:`RecordPositions.record_positions`, cut at the stream's end, as
    ``divmod(position, batch size)``.
    """

    def where(self, pipe: Pipeline, record: int, component: str | None, epochs: int) -> list[tuple[int, int]]:
        """The ``(step, row)`` pairs of ``pipe`` (which holds this stream) whose rows hold ``record``.

        Args:
            pipe: the batched pipeline that holds this stream.
            record: a record id of the source, checked.
            component: must be ``None`` (a mixture's component name).
            epochs: epochs to look in.

        Returns:
            The pairs in increasing order; ``row`` indexes the global batch.

        Raises:
            ValueError: ``component`` given (the stream is not a mixture's).
        """
        if component is not None:
            raise ValueError(f"component={component!r}: the pipeline is not a mixture (it has no components)")
        b = need_batch(pipe, "where")
        pos = cast(RecordPositions, self).record_positions(record, epochs)
        total = pipe.num_steps
        if total is not None:
            pos = pos[pos < total * b]
        return [(int(p) // b, int(p) % b) for p in pos.tolist()]


class NeutralReports:
    """:class:`Reportable`'s neutral answers: of a stream without figures of its own, or a mixin that gives them."""

    def row_noun(self) -> str:
        """``records``: a row is one record."""
        return "records"

    def draws(self, pipe: Pipeline, first: int, end: int) -> np.ndarray | None:
        """``None``: one leaf."""
        return None

    def packed_rows(self, positions: np.ndarray) -> PackedRows | None:
        """``None``: not packed."""
        return None

    def bucket_of(self, step: int, process_index: int, process_count: int) -> BucketOfStep | None:
        """``None``: not bucketed."""
        return None


NEUTRAL: dict[type, object] = {Reportable: NeutralReports()}
"""The capabilities with a neutral answer for a stream without them, and that answer's object."""

_CANNOT: dict[type, str] = {
    Shuffleable: "cannot be shuffled",
    Filterable: "cannot be filtered",
    Balanceable: "cannot balance host slices",
    SingleSource: "does not hold one source's records, one per row",
    RecordPositions: "cannot say where a record appears",
    Invertible: "cannot be inverted",
    Editable: "cannot exclude records",
    Live: "is not a live stream: it keeps no commits (resume it from it.state() instead)",
    Reportable: "has no figures for reports",
    Configurable: "has no config form (define it in code)",
    Component: "cannot be written as a mixture's component",
    Packed: "does not hold packed rows",
    RowMaking: "does not make rows (its rows are records, read by the step runner)",
}

CAPABILITIES: tuple[type, ...] = tuple(_CANNOT)
"""Every capability a stream may have; the wrapper base forwards each of them."""

C = TypeVar("C")


def members(capability: type) -> tuple[str, ...]:
    """The method names of ``capability`` (one of :data:`CAPABILITIES`).

    Args:
        capability: the protocol.

    Returns:
        Its public methods' names, in definition order.
    """
    return tuple(name for name, value in vars(capability).items() if callable(value) and not name.startswith("_"))


@runtime_checkable
class Wrapper(Protocol):
    """A stream over another one (a :class:`~quern.pipeline.streams.forwarding.ForwardingStream`)."""

    adds: tuple[type, ...]
    """The capabilities it has whatever its parent has."""

    @property
    def parent(self) -> Stream:
        """The stream it wraps, which answers for every other capability."""
        ...


def _holder(stream: object, capability: type) -> object:
    """The stream that answers for ``capability`` of ``stream``: itself, or the innermost parent a wrapper defers to."""
    while isinstance(stream, Wrapper) and capability not in stream.adds:
        stream = stream.parent
    return stream


def has(stream: object, capability: type) -> bool:
    """Whether ``stream`` has ``capability``: it implements it, or it is a wrapper whose parent has it (or that adds it).

    Args:
        stream: a stream.
        capability: one of :data:`CAPABILITIES`.

    Returns:
        ``True`` when the capability's methods may be called on ``stream``.
    """
    return isinstance(_holder(stream, capability), capability)


def require(stream: Stream, capability: Callable[..., C], what: str) -> C:
    """``stream`` as having ``capability``, or the one error that says it lacks it.

    Args:
        stream: a stream.
        capability: one of :data:`CAPABILITIES`.
        what: the call that needs it, for the message (``where``, ``exclude``).

    Returns:
        ``stream`` itself, typed as the capability.

    Raises:
        CapabilityError: ``stream`` lacks it, naming ``what``, the kind of stream (a wrapper's and
            the wrapped one's) and the capability
            (``where() is not supported on a BucketedStream: it cannot be inverted (...)``).
    """
    cap = cast(type, capability)  # a protocol class (typed as a callable: mypy takes no protocol for type[C])
    holder = _holder(stream, cap)
    if not isinstance(holder, cap):
        kind, inner = type(stream).__name__, type(holder).__name__
        shown = _a(kind) if holder is stream else f"{_a(kind)} of {_a(inner)}"
        raise CapabilityError(
            f"{what}() is not supported on {shown}: it {_CANNOT[cap]} ({_a(inner)} has no {cap.__name__} capability)"
        )
    return cast(C, stream)


def _a(kind: str) -> str:
    """``a Kind`` or ``an Kind``."""
    return f"an {kind}" if kind[:1] in "AEIOU" else f"a {kind}"


def report(stream: Stream) -> Reportable:
    """``stream``'s figures for reports: its own when it is :class:`Reportable`, else the neutral ones.

    Args:
        stream: a stream.

    Returns:
        An object with :class:`Reportable`'s methods.
    """
    return cast(Reportable, stream if has(stream, Reportable) else NEUTRAL[Reportable])
