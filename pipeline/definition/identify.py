"""A pipeline's identity: its description, fingerprint, checkpoint state, resume and config.

The description holds everything that changes the bytes of a batch: the
index-format version, the stream's part (:meth:`~quern.pipeline.streams.protocol.Stream.describe`:
the source's identity, seed, epochs and shuffle, or a mixture's components and
schedule, ...), the record transforms, the batch and the batch transforms. The
fingerprint is its hash; a state saved at step ``k`` is accepted by a pipeline
whose description as it applies to the steps before ``k`` is the same.
:class:`Identified` holds these methods of :class:`~quern.pipeline.definition.dataset.Pipeline`.
"""

from __future__ import annotations

import copy
from typing import Any, Unpack, cast

from ..core.ops import Op
from ..identity import samedef
from ..identity.fingerprint import describe_callable, fingerprint_of
from ..iterate.iterator import IteratorOptions, PipelineIterator
from ..order import index as _index
from ..streams.capabilities import Configurable, require
from ..streams.protocol import Definition, Stream

__all__ = ["Identified", "record_ops_description"]


def record_ops_description(pipe: Definition) -> list[list[Any]]:
    """``[[kind, description]]`` of the record transforms; a filter's as it was when its survivors were found."""
    out = []
    for k, op in enumerate(pipe.record_ops):
        frozen = pipe.filter_descriptions[k] if k < len(pipe.filter_descriptions) else None
        if frozen is not None:
            out.append([op.kind.value, copy.deepcopy(frozen)])
        else:
            out.append([op.kind.value, describe_callable(op.fn, op.label(k), shown=samedef.active())])
    return out


class Identified:
    """The identity methods of a pipeline (a mixin of :class:`~quern.pipeline.definition.dataset.Pipeline`)."""

    stream: Stream
    batch_size: int | None
    drop_remainder: bool
    batch_ops: tuple[Op, ...]

    def _me(self) -> Definition:
        return cast(Definition, self)

    # ------------------------------------------------------------------ identity and iteration

    def describe(self) -> dict[str, Any]:
        """JSON-able description of everything that changes the bytes of a batch.

        The index-format version, the stream's part (the source's identity, seed,
        epochs, shuffle; a mixture's components and schedule; ...), every transform
        (by its code, arguments and the values it reads; quern's own by name,
        version and arguments: :mod:`quern.pipeline.identity.fingerprint`), the batch. A filter
        is described as it was when its survivors were found. Computed once per
        pipeline object.

        Returns:
            The description (a copy).

        Raises:
            FingerprintError: a value it cannot describe, named.
        """
        if samedef.active():  # the definition to compare (see quern.pipeline.identity.samedef): afresh, no identity
            return self.describe_until(None)
        d = self.__dict__.get("_description")
        if d is None:
            d = self.describe_until(None)
            object.__setattr__(self, "_description", d)
        return copy.deepcopy(d)

    def describe_until(self, step: int | None) -> dict[str, Any]:
        """:meth:`describe` as it applies to the steps before ``step`` (``None``: all).

        Args:
            step: the first step not covered.

        Returns:
            The description.
        """
        active = samedef.active()
        return {
            "index_format": _index.INDEX_FORMAT_VERSION,
            **self.stream.describe(step),
            "record_ops": record_ops_description(self._me()),
            "batch": [self.batch_size, self.drop_remainder],
            "batch_ops": [
                [op.kind.value, describe_callable(op.fn, op.label(k), shown=active)]
                for k, op in enumerate(self.batch_ops)
            ],
        }

    def fingerprint(self) -> str:
        """Stable hash (32 hex digits) of :meth:`describe`.

        The same in every process and session, and for a script run as ``__main__``
        or imported. Computed once per pipeline object: build the pipeline again to
        see data that changed since.

        Returns:
            The fingerprint.
        """
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            fp = fingerprint_of(self.describe())
            object.__setattr__(self, "_fingerprint", fp)
        return fp

    def state_at(self, step: int) -> dict[str, Any]:
        """The checkpoint of an iterator whose next step is ``step``.

        Args:
            step: the next step.

        Returns:
            ``{"step", "fingerprint"}``, and for a stream whose past depends on part of its
            definition (a schedule) also ``"past"`` (the fingerprint of the description until
            ``step``) and ``"parts"`` (a digest of each part of it); JSON-serialisable.
        """
        state: dict[str, Any] = {"step": step, "fingerprint": self.fingerprint()}
        if self.stream.describes_past:
            past = self.describe_until(step)
            state["past"] = fingerprint_of(past)
            state["parts"] = self.stream.parts(past)
        return state

    def iterator(self, start_step: int = 0, **options: Unpack[IteratorOptions]) -> PipelineIterator:
        """An iterator yielding ``batch_at(s)`` for ``s = start_step, start_step+1, ...``.

        Args:
            start_step: the first step.
            **options: the iterator's options, keyword-only (see
                :class:`quern.pipeline.iterate.iterator.PipelineIterator`).

        Returns:
            The iterator.
        """
        return PipelineIterator(self._me(), start_step, **options)

    def resume(
        self, state: dict[str, Any], force: bool = False, **options: Unpack[IteratorOptions]
    ) -> PipelineIterator:
        """An iterator starting at ``state["step"]`` (from ``it.state()``), after :meth:`check_state`.

        Args:
            state: the saved state.
            force: resume even from a state of another definition or without a fingerprint.
            **options: as for :meth:`iterator`.

        Returns:
            The iterator.

        Raises:
            ValueError: the state does not match this pipeline (unless ``force``).
        """
        return self.iterator(self.check_state(state, force), **options)

    def check_state(self, state: dict[str, Any], force: bool = False) -> int:
        """The step of an iterator state, after checking that it was saved from this pipeline.

        Args:
            state: from ``it.state()``.
            force: accept a state from another definition or without a fingerprint.

        Returns:
            The step.

        Raises:
            ValueError: another fingerprint (naming what changed, for a schedule) or none, unless ``force``.
        """
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError(f"state must be a dict with a 'step' key, as from iterator.state(); got {state!r}")
        fp = state.get("fingerprint")
        if not force:
            if fp is None:
                raise ValueError(
                    "state has no fingerprint, so it cannot be checked against this pipeline (another definition "
                    "or other data would resume silently); save it with iterator.state(), or pass force=True "
                    "to resume anyway"
                )
            mine = self.fingerprint()
            if fp != mine:
                step = self._me().check_step(state["step"], name="state['step']", end_ok=True)
                past = self.describe_until(step)  # the whole description when the past depends on all of it
                if fingerprint_of(past) in (state.get("past"), fp):
                    # only the schedule or the edits from ``step`` on changed (or were added to a pipeline
                    # whose whole description is this one's past): the batches taken are the same
                    return step
                changed = ""
                if self.stream.describes_past and isinstance(state.get("parts"), dict):
                    mine_parts, theirs = self.stream.parts(past), state["parts"]
                    diff = sorted(k for k in set(mine_parts) | set(theirs) if mine_parts.get(k) != theirs.get(k))
                    if diff:
                        changed = f"; what changed for the steps before {step}: {', '.join(diff)}"
                edits = self.stream.edits_before(step)
                if edits:
                    changed += f"; edits that change steps before the saved step {step}: {'; '.join(edits)}"
                raise ValueError(
                    f"state fingerprint {fp} does not match this pipeline's {mine}: the definition, the data "
                    f"order version or the data changed since the state was saved{changed}; pass force=True "
                    "to resume anyway"
                )
        return self._me().check_step(state["step"], name="state['step']", end_ok=True)

    def to_config(self) -> dict:
        """This pipeline as a config dict; ``quern.load_config`` of it gives the same fingerprint and batches.

        Returns:
            The config.

        Raises:
            ValueError: a part has no config form (an in-memory source, a lambda), naming its key path.
        """
        return require(self.stream, Configurable, "to_config").to_config(self._me())

    # ------------------------------------------------------------------ digests

    def row_digests(self, step: int, process_index: int = 0, process_count: int = 1) -> list[str]:
        """One digest per row of this host's batch at ``step``, over the row's canonical content.

        The content is each leaf's path, dtype, row shape and bytes, independent of memory
        layout (:mod:`quern.pipeline.integrity.batch_digest`). The hosts' lists concatenated in host
        order are the global batch's list, for any host count (except with ``balance_hosts``,
        whose rows are ordered by the host count). Computed from :meth:`~quern.Pipeline.batch_at`.

        Args:
            step: the step.
            process_index: this host.
            process_count: the number of hosts.

        Returns:
            32 hex digits per row, in row order.

        Raises:
            ValueError: a leaf of the batch has no row axis (named).
            StepError: the step failed.

        Example:
            >>> import numpy as np, quern
            >>> pipe = quern.Pipeline.from_source({"x": np.arange(8)}, seed=0).batch(4)
            >>> pipe.row_digests(0, 0, 2) + pipe.row_digests(0, 1, 2) == pipe.row_digests(0)
            True
        """
        from ..integrity.batch_digest import row_digests_of

        batch = cast(Any, self).batch_at(step, process_index, process_count)
        return row_digests_of(batch, where=f"step {step} (host {process_index} of {process_count})")

    def step_digest(self, step: int) -> str:
        """The digest of the global batch at ``step``: a hash of its row digests in row order.

        It does not depend on the host count or the worker count that made the batch
        (:func:`quern.pipeline.integrity.batch_digest.step_digest_of` of ``row_digests(step)``).

        Args:
            step: the step.

        Returns:
            32 hex digits.

        Example:
            >>> import numpy as np, quern
            >>> pipe = quern.Pipeline.from_source({"x": np.arange(8)}, seed=0).batch(4)
            >>> pipe.step_digest(1) == pipe.step_digest(1), pipe.step_digest(0) == pipe.step_digest(1)
            (True, False)
        """
        from ..integrity.batch_digest import step_digest_of

        return step_digest_of(self.row_digests(step))

    def fingerprint_at(self, step: int) -> str:
        """The fingerprint of the definition as it applies to the steps up to and including ``step``.

        :meth:`fingerprint` when the past never depends on part of the definition; for a
        stream that describes its past (a schedule, edits), the fingerprint of
        ``describe_until(step + 1)``: the same for every step between two of the stream's
        ``change_steps()``, and unchanged for the steps before a later edit. Memoized per
        such span. A ledger line holds it (:mod:`quern.pipeline.integrity.ledger`).

        Args:
            step: the step.

        Returns:
            32 hex digits.

        Example:
            >>> import numpy as np, quern
            >>> pipe = quern.Pipeline.from_source({"x": np.arange(8)}, seed=0).batch(4)
            >>> pipe.fingerprint_at(1) == pipe.fingerprint()
            True
        """
        import bisect

        step = self._me().check_step(step)
        if not self.stream.describes_past:
            return self.fingerprint()
        span = bisect.bisect_right(self.stream.change_steps(), step)
        memo = self.__dict__.get("_fingerprints_at")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_fingerprints_at", memo)
        fp = memo.get(span)
        if fp is None:
            fp = memo[span] = fingerprint_of(self.describe_until(step + 1))
        return fp
