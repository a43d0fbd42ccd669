"""A pipeline's identity: its description, fingerprint, checkpoint state and config.

The description holds everything that changes the bytes of a batch: the
index-format version, the stream's part (:meth:`~quern.pipeline.streams.protocol.Stream.describe`:
the source's identity, seed, epochs and shuffle, or a mixture's components and
schedule, ...), the record transforms, the batch and the batch transforms. The
fingerprint is its hash; a state saved at step ``k`` is accepted by a pipeline
whose description as it applies to the steps before ``k`` is the same.
Functions over a :class:`~quern.pipeline.definition.dataset.Pipeline`; its methods
of the same names call them. What they compute once per pipeline object is kept in
the pipeline's :class:`Memo`.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
from typing import TYPE_CHECKING, Any

from ..identity import changes, samedef
from ..identity.fingerprint import describe_callable, fingerprint_of
from ..order import index as _index
from ..streams import config_form
from . import addressing

if TYPE_CHECKING:
    from .dataset import Pipeline

__all__ = [
    "Memo",
    "record_ops_description",
    "records_key",
    "describe",
    "describe_until",
    "fingerprint",
    "fingerprint_at",
    "state_at",
    "check_state",
    "to_config",
    "row_digests",
    "step_digest",
]


@dataclasses.dataclass
class Memo:
    """What a pipeline object computes once: a field of :class:`~quern.pipeline.definition.dataset.Pipeline`.

    Not part of the definition (not compared, not in the repr); ``dataclasses.replace``
    gives the new pipeline an empty one, and a pickled pipeline carries it (a worker
    gets the fingerprint its parent computed).

    Attributes:
        description: :func:`describe`'s result, or ``None`` before its first call.
        leaves: its leaves (:func:`quern.pipeline.identity.changes.leaves`), or ``None`` before a state is saved.
        fingerprint: :func:`fingerprint`'s result, or ``None`` before its first call.
        fingerprints_at: :func:`fingerprint_at`'s results, by span between the stream's change steps.
    """

    description: dict[str, Any] | None = None
    leaves: dict[str, Any] | None = None
    fingerprint: str | None = None
    fingerprints_at: dict[int, str] = dataclasses.field(default_factory=dict)


def record_ops_description(pipe: Pipeline) -> list[list[Any]]:
    """The description of the record transforms of ``pipe``.

    A filter's is the one it had when its survivors were found.

    Args:
        pipe: the pipeline.

    Returns:
        ``[[kind, description]]``, one pair per record transform.
    """
    out = []
    for k, op in enumerate(pipe.record_ops):
        frozen = pipe.filter_descriptions[k] if k < len(pipe.filter_descriptions) else None
        if frozen is not None:
            out.append([op.kind.value, copy.deepcopy(frozen)])
        else:
            out.append([op.kind.value, describe_callable(op.fn, op.label(k), shown=samedef.active())])
    return out


def records_key(pipe: Pipeline, ops: list[list[Any]] | None = None, **extra: Any) -> str:
    """The fingerprint of what the records of ``pipe`` are, plus ``extra``.

    The data order's version, the source's identity and the record transforms
    (``ops``: their description, when given): the key of a filter's survivors and of
    a length index, which do not depend on the seed, shuffle or batch.

    Args:
        pipe: a pipeline over one source's records.
        ops: the record transforms' description (default: computed).
        **extra: more keys (``length_key``).

    Returns:
        32 hex digits.
    """
    src = pipe.stream.source
    assert src is not None
    if ops is None:
        ops = record_ops_description(pipe)
    return fingerprint_of(
        {"index_format": _index.INDEX_FORMAT_VERSION, "source": src.identity(), "record_ops": ops, **extra}
    )


def describe(pipe: Pipeline) -> dict[str, Any]:
    """JSON-able description of everything that changes the bytes of a batch.

    The index-format version, the stream's part (the source's identity, seed,
    epochs, shuffle; a mixture's components and schedule; ...), every transform
    (by its code, arguments and the values it reads; quern's own by name,
    version and arguments: :mod:`quern.pipeline.identity.fingerprint`), the batch. A filter
    is described as it was when its survivors were found. Computed once per
    pipeline object.

    Args:
        pipe: the pipeline.

    Returns:
        The description (a copy).

    Raises:
        FingerprintError: a value it cannot describe, named.
    """
    if samedef.active():  # the definition to compare (see quern.pipeline.identity.samedef): afresh, no identity
        return describe_until(pipe, None)
    memo = pipe._memo
    if memo.description is None:
        memo.description = describe_until(pipe, None)
    return copy.deepcopy(memo.description)


def describe_until(pipe: Pipeline, step: int | None) -> dict[str, Any]:
    """:func:`describe` as it applies to the steps before ``step`` (``None``: all).

    Args:
        pipe: the pipeline.
        step: the first step not covered.

    Returns:
        The description.
    """
    active = samedef.active()
    return {
        "index_format": _index.INDEX_FORMAT_VERSION,
        **pipe.stream.describe(step),
        "record_ops": record_ops_description(pipe),
        "batch": [pipe.batch_size, pipe.drop_remainder, *([] if pipe.pad_remainder is None else [pipe.pad_remainder])],
        "batch_ops": [
            [op.kind.value, describe_callable(op.fn, op.label(k), shown=active)] for k, op in enumerate(pipe.batch_ops)
        ],
    }


def fingerprint(pipe: Pipeline) -> str:
    """Stable hash (32 hex digits) of :func:`describe`.

    The same in every process and session, and for a script run as ``__main__``
    or imported. Computed once per pipeline object: build the pipeline again to
    see data that changed since.

    Args:
        pipe: the pipeline.

    Returns:
        The fingerprint.
    """
    memo = pipe._memo
    if memo.fingerprint is None:
        memo.fingerprint = fingerprint_of(describe(pipe))
    return memo.fingerprint


def state_at(pipe: Pipeline, step: int) -> dict[str, Any]:
    """The checkpoint of an iterator whose next step is ``step``.

    Args:
        pipe: the pipeline.
        step: the next step.

    Returns:
        ``{"step", "fingerprint", "description"}`` (the description's leaves, short values
        or their digests: :func:`quern.pipeline.identity.changes.leaves`, so a refused resume
        names what changed), and for a stream whose past depends on part of its
        definition (a schedule) also ``"past"`` (the fingerprint of the description until
        ``step``) and ``"parts"`` (a digest of each part of it); JSON-serialisable.
    """
    state: dict[str, Any] = {"step": step, "fingerprint": fingerprint(pipe)}
    memo = pipe._memo
    if memo.leaves is None:
        memo.leaves = changes.leaves(describe(pipe))
    state["description"] = dict(memo.leaves)
    if pipe.stream.describes_past:
        past = describe_until(pipe, step)
        state["past"] = fingerprint_of(past)
        state["parts"] = pipe.stream.parts(past)
    return state


def check_state(pipe: Pipeline, state: dict[str, Any], force: bool = False) -> int:
    """The step of an iterator state, after checking that it was saved from this pipeline.

    Args:
        pipe: the pipeline.
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
        mine = fingerprint(pipe)
        if fp != mine:
            step = addressing.check_step(pipe, state["step"], name="state['step']", end_ok=True)
            past = describe_until(pipe, step)  # the whole description when the past depends on all of it
            if fingerprint_of(past) in (state.get("past"), fp):
                # only the schedule or the edits from ``step`` on changed (or were added to a pipeline
                # whose whole description is this one's past): the batches taken are the same
                return step
            changed = ""
            if isinstance(state.get("description"), dict):
                first = changes.first_change(state["description"], changes.leaves(describe(pipe)))
                if first is not None:
                    changed = f"; the first difference (saved -> now): {first}"
            if pipe.stream.describes_past and isinstance(state.get("parts"), dict):
                mine_parts, theirs = pipe.stream.parts(past), state["parts"]
                diff = sorted(k for k in set(mine_parts) | set(theirs) if mine_parts.get(k) != theirs.get(k))
                if diff:
                    changed += f"; what changed for the steps before {step}: {', '.join(diff)}"
            edits = pipe.stream.edits_before(step)
            if edits:
                changed += f"; edits that change steps before the saved step {step}: {'; '.join(edits)}"
            raise ValueError(
                f"state fingerprint {fp} does not match this pipeline's {mine}: the definition, the data "
                f"order version or the data changed since the state was saved{changed}; pass force=True "
                "to resume anyway"
            )
    return addressing.check_step(pipe, state["step"], name="state['step']", end_ok=True)


def to_config(pipe: Pipeline) -> dict:
    """This pipeline as a config dict; ``quern.load_config`` of it gives the same fingerprint and batches.

    Args:
        pipe: the pipeline.

    Returns:
        The config.

    Raises:
        ValueError: a part has no config form (an in-memory source, a lambda), naming its key path.
    """
    return config_form.to_config(pipe)


def row_digests(pipe: Pipeline, step: int, process_index: int = 0, process_count: int = 1) -> list[str]:
    """One digest per row of this host's batch at ``step``, over the row's canonical content.

    The content is each leaf's path, dtype, row shape and bytes, independent of memory
    layout (:mod:`quern.pipeline.integrity.batch_digest`). The hosts' lists concatenated in host
    order are the global batch's list, for any host count (except with ``balance_hosts``,
    whose rows are ordered by the host count). Computed from :func:`~quern.pipeline.definition.addressing.batch_at`.

    Args:
        pipe: the pipeline.
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

    batch = addressing.batch_at(pipe, step, process_index, process_count)
    return row_digests_of(batch, where=f"step {step} (host {process_index} of {process_count})")


def step_digest(pipe: Pipeline, step: int) -> str:
    """The digest of the global batch at ``step``: a hash of its row digests in row order.

    It does not depend on the host count or the worker count that made the batch
    (:func:`quern.pipeline.integrity.batch_digest.step_digest_of` of ``row_digests(step)``).

    Args:
        pipe: the pipeline.
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

    return step_digest_of(row_digests(pipe, step))


def leaves_at(pipe: Pipeline, step: int) -> dict[str, Any]:
    """The leaves of the description whose fingerprint is :func:`fingerprint_at` ``step``.

    (:func:`quern.pipeline.identity.changes.leaves`): what a ledger line names when its fingerprint first appears.

    Args:
        pipe: the pipeline.
        step: the step.

    Returns:
        ``{dotted path: short value or digest}``, JSON-able.
    """
    if not pipe.stream.describes_past:
        memo = pipe._memo
        if memo.leaves is None:
            memo.leaves = changes.leaves(describe(pipe))
        return dict(memo.leaves)
    return changes.leaves(describe_until(pipe, addressing.check_step(pipe, step) + 1))


def fingerprint_at(pipe: Pipeline, step: int) -> str:
    """The fingerprint of the definition as it applies to the steps up to and including ``step``.

    :func:`fingerprint` when the past never depends on part of the definition; for a
    stream that describes its past (a schedule, edits), the fingerprint of
    ``describe_until(step + 1)``: the same for every step between two of the stream's
    ``change_steps()``, and unchanged for the steps before a later edit. Memoized per
    such span. A ledger line holds it (:mod:`quern.pipeline.integrity.ledger`).

    Args:
        pipe: the pipeline.
        step: the step.

    Returns:
        32 hex digits.

    Example:
        >>> import numpy as np, quern
        >>> pipe = quern.Pipeline.from_source({"x": np.arange(8)}, seed=0).batch(4)
        >>> pipe.fingerprint_at(1) == pipe.fingerprint()
        True
    """
    step = addressing.check_step(pipe, step)
    if not pipe.stream.describes_past:
        return fingerprint(pipe)
    span = bisect.bisect_right(pipe.stream.change_steps(), step)
    memo = pipe._memo.fingerprints_at
    fp = memo.get(span)
    if fp is None:
        fp = memo[span] = fingerprint_of(describe_until(pipe, step + 1))
    return fp
