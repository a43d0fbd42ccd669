"""Addressing a pipeline: its steps, a step's stream positions and records, and computing steps.

Pure index arithmetic over the definition: step ``s`` of a global batch of ``B``
covers stream positions ``[s*B, (s+1)*B)``, host ``h`` of ``H`` owns rows
``[h*B/H, (h+1)*B/H)`` of it (:func:`quern.pipeline.order.index.host_rows`), and the
stream says which records a position is (:mod:`quern.pipeline.streams`).
:class:`Addressed` holds these methods of :class:`~quern.pipeline.definition.dataset.Pipeline`.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from .. import execute
from ..order import Pieces, Segments
from ..order import index as _index
from ..sources import Source
from ..streams.capabilities import Invertible, Packed, SingleSource, require
from ..streams.protocol import Definition, Stream

__all__ = ["Addressed"]


class Addressed:
    """The addressing methods of a pipeline (a mixin of :class:`~quern.pipeline.definition.dataset.Pipeline`)."""

    stream: Stream
    batch_size: int | None
    drop_remainder: bool

    def _me(self) -> Definition:
        return cast(Definition, self)

    def need_batch(self, what: str) -> int:
        """The global batch size.

        Args:
            what: the call that needs it, for the message.

        Returns:
            The batch size.

        Raises:
            ValueError: before ``batch()``, naming ``what``.
        """
        if self.batch_size is None:
            raise ValueError(f"{what}() needs batch() first: a step is a batch")
        return self.batch_size

    def need_no_batch(self, what: str, instead: str) -> None:
        """Check that ``batch()`` was not called yet (``what`` is a record-level stage).

        Args:
            what: the call, for the message.
            instead: what to use after ``batch()``.

        Raises:
            ValueError: after ``batch()``.
        """
        if self.batch_size is not None:
            raise ValueError(
                f"{what}() after batch(): {what}() is a record-level stage; use {instead} "
                "for a batch-level transform, or move it before batch()"
            )

    # ------------------------------------------------------------------ what it reads

    @property
    def seed(self) -> int:
        """The stream's seed (keys the random transforms)."""
        return self.stream.seed

    @property
    def num_epochs(self) -> int | None:
        """The stream's epochs, ``None`` when it is endless or has none of its own."""
        return self.stream.num_epochs

    @property
    def source(self) -> Source | None:
        """The source whose records the stream's rows are (``None``: several)."""
        return self.stream.source

    @property
    def survivors(self) -> np.ndarray | None:
        """The record ids of the source a filter keeps (``None``: all, or not a single source's stream)."""
        return self.stream.survivors

    @property
    def stream_len(self) -> int | None:
        """Positions in one epoch of the stream; ``None`` for a stream without epochs of its own."""
        return self.stream.epoch_length

    @property
    def leaves(self) -> tuple[Definition, ...]:
        """The single-source pipelines rows are read from: this one, or a mixture's components."""
        return self.stream.leaves(self._me())

    @property
    def leaf_names(self) -> tuple[str, ...]:
        """Names of :attr:`leaves`: the source's name, or the mixture's component keys."""
        return self.stream.leaf_names(self._me())

    @property
    def sources(self) -> tuple[Source, ...]:
        """The source of each of :attr:`leaves`."""
        out = tuple(leaf.stream.source for leaf in self.leaves)
        assert all(src is not None for src in out)
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ addressing

    @property
    def num_steps(self) -> int | None:
        """Number of steps in the stream, or ``None`` when it is endless.

        ``total // B`` (``ceil`` with ``drop_remainder=False``), ``total`` being the stream's positions.

        Raises:
            ValueError: the pipeline has no batch.
        """
        b = self.need_batch("num_steps")
        total = self.stream.length()
        if total is None:
            return None
        return total // b if self.drop_remainder else -(-total // b)

    def check_step(self, step: object, *, name: str = "step", end_ok: bool = False) -> int:
        """``step`` as an int, checked: the one end-of-stream check of every entry point.

        Args:
            step: the step.
            name: how messages name it (``start_step``, ``state['step']``).
            end_ok: allow the step just past the last (a start step at the end yields nothing).

        Returns:
            The step.

        Raises:
            TypeError: not an integer.
            ValueError: negative, or the pipeline has no batch.
            IndexError: past the end of the stream or of the addressable positions (``2**62``).
        """
        b = self.need_batch("a step")
        step = _index.check_int(step, name, 0)
        n_steps = self.num_steps
        if n_steps is not None and (step > n_steps or (step == n_steps and not end_ok)):
            raise IndexError(
                f"{name} {step} is past the end of the stream: {n_steps} steps "
                f"({self.stream.size_text()} x {self.num_epochs} epochs, batch {self.batch_size})"
            )
        if (step + 1) * b > _index.MAX_RECORDS:
            raise IndexError(f"{name} {step} is beyond the addressable stream (positions must stay below 2**62)")
        return step

    def positions(self, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Stream positions of this host's rows at ``step`` (for a bucketed pipeline, in its bucket's stream).

        Args:
            step: the step.
            process_index: this host.
            process_count: the number of hosts.

        Returns:
            An int64 array.
        """
        return self.stream.positions(self._me(), self.check_step(step), process_index, process_count)

    def record_ids(self, positions: np.ndarray) -> np.ndarray:
        """Record id at each stream position of a single-source pipeline (pure index arithmetic).

        Raises:
            TypeError: the rows come from several sources (use :meth:`segments`).
        """
        return require(self.stream, SingleSource, "record_ids").record_ids(positions)

    def segments(self, positions: np.ndarray) -> Segments:
        """The plan of these stream positions: per row, its leaf, record id and position in the leaf's stream.

        Raises:
            TypeError: the rows are not single records (packed: :meth:`pieces`; bucketed: :meth:`explain`).
        """
        return self.stream.segments(np.asarray(positions, dtype=np.int64))

    def explain(self, step: int, process_index: int = 0, process_count: int = 1) -> list[list[tuple[str, int | str]]]:
        """For each row of this host's batch at ``step``: the ``(name, record_index)`` pairs it was made from.

        ``name`` is the source's name or, in a mixture, the component's key; a packed
        row lists every document in it. O(batch) time; reads nothing.

        Args:
            step: the step.
            process_index: this host.
            process_count: the number of hosts.

        Returns:
            One list of pairs per row.
        """
        return self.stream.explain(self._me(), self.check_step(step), process_index, process_count)

    def where(self, record: int, *, component: str | None = None, epochs: int = 1) -> list[tuple[int, int]]:
        """The ``(step, row)`` pairs where source record ``record`` appears, in increasing order.

        In the first ``epochs`` epochs of the stream (of component ``component``'s own stream
        for a mixture, whose components each have their own epochs; of the bucket's stream
        for a bucketed pipeline); for a packed stream, every row that holds a piece of the
        record; none for a record a filter drops. It inverts the plan (the keyed
        permutation, the filter's survivors, the mixture's blocks, the packing plan)
        instead of scanning steps: O(epochs x log N) for a plain or filtered stream, and
        reads no record. ``row`` indexes the global batch in the stream's order: with
        ``balance_hosts`` a batch's rows are ordered by the host count, and ``row`` is the
        row of one host (``process_count=1``) there. Each pair is a row of
        ``explain(step)`` that names the record; a finite stream's steps past its end
        are left out.

        Args:
            record: a record id of the source (of ``component``'s source for a mixture).
            component: the mixture component's key (required for a mixture, else ``None``).
            epochs: epochs to look in, at least 1 (a finite stream's own epochs at most).

        Returns:
            The ``(step, row)`` pairs.

        Raises:
            TypeError: ``record`` or ``epochs`` is not an integer, or this kind of stream
                cannot answer it (named).
            ValueError: no ``batch()``, ``epochs`` below 1, a negative ``record``, a mixture
                without ``component=`` or with an unknown one (the components are listed),
                or ``component`` given for a pipeline that is not a mixture.
            IndexError: ``record`` is not a record of the source (naming its size).

        Example:
            >>> import numpy as np, quern
            >>> pipe = quern.Pipeline.from_source({"x": np.arange(10)}, seed=0, num_epochs=2).batch(4)
            >>> pipe.where(6, epochs=2)
            [(1, 2), (4, 0)]
            >>> pipe.explain(1)[2], pipe.explain(4)[0]
            ([('arrays', 6)], [('arrays', 6)])
        """
        self.need_batch("where")
        record = _index.check_int(record, "where(): record", 0)
        epochs = _index.check_int(epochs, "where(): epochs", 1)
        src = self.stream.source if component is None else None
        if component is not None and component in self.leaf_names:
            src = self.leaves[self.leaf_names.index(component)].stream.source
        if src is not None and self.stream.wait_timeout() is None and record >= len(src):  # live: no length
            of = "" if component is None else f" (component {component!r})"
            raise IndexError(
                f"where(): record {record} is not a record of source {src.name!r}{of}: it has {len(src)} "
                f"records, ids 0..{len(src) - 1}"
            )
        return require(self.stream, Invertible, "where").where(self._me(), record, component, epochs)

    # ------------------------------------------------------------------ computing

    def batch_at(self, step: int, process_index: int = 0, process_count: int = 1) -> Any:
        """This host's rows of the global batch at ``step``, collated.

        Depends only on the pipeline definition, ``step`` and the host slice; the slices
        of all hosts concatenated give the global batch.

        Args:
            step: the step.
            process_index: this host.
            process_count: the number of hosts.

        Returns:
            The batch.

        Raises:
            StepError: a stage failed, naming the step, host slice, stage and records.
        """
        return execute.batches_at(self._me(), step, 1, process_index, process_count)[0]

    def batches_at(self, step: int, count: int, process_index: int = 0, process_count: int = 1) -> list[Any]:
        """``[batch_at(s) for s in range(step, step + count)]``, with the records read in one bulk call.

        Args:
            step: the first step.
            count: the number of steps.
            process_index: this host.
            process_count: the number of hosts.

        Returns:
            The batches, each bit-identical to ``batch_at(s)``.

        Raises:
            StepError: the first step that fails.
        """
        return execute.batches_at(self._me(), step, count, process_index, process_count)

    def pieces(self, positions: np.ndarray) -> Pieces:
        """The documents in the packed rows at these stream positions (reads nothing).

        Args:
            positions: stream positions.

        Returns:
            The pieces, row by row.

        Raises:
            TypeError: the pipeline is not packed.
        """
        return require(self.stream, Packed, "pieces").pieces(positions)
