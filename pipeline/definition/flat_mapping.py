"""A flat map: one record to zero or more, its outputs the records of a new source.

The body of :meth:`Pipeline.flat_map <quern.pipeline.definition.dataset.Pipeline.flat_map>`.
A one-time scan counts the outputs of every record (:func:`quern.pipeline.definition.scan.counts`,
cached under the fingerprint of the pipeline up to and including the flat map, as a
filter's survivors are); the outputs then are the records of a
:class:`FlatMappedSource`, output ``v`` being output ``v - offsets[r]`` of source
record ``r`` where ``offsets`` are the prefix sums of the counts and
``offsets[r] <= v < offsets[r + 1]``. Everything after the flat map (shuffle, filter,
pack, batch, workers, resume) sees an ordinary source of that many records.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.batching import need_no_batch
from ..core.errors import SourceError, StepError
from ..core.ops import Op, OpKind
from ..execute import stages
from ..sources import Source
from ..sources.base import check_ids
from ..streams.capabilities import Filterable, require
from ..streams.source import SourceStream
from . import scan
from .identify import record_ops_description, records_key

if TYPE_CHECKING:
    from .dataset import Pipeline

__all__ = ["FlatMappedSource", "flat_map"]


class FlatMappedSource(Source):
    """The outputs of a flat map over the records of one source, as the records of a source.

    Reading outputs reads each of their source records once (one bulk call), runs the
    inner pipeline's record transforms and the flat map on them, and checks that each
    record gives as many outputs as the count scan found (a flat map that changed, or
    that does not depend on its record alone, is an error naming the record). Its
    identity is the fingerprint of the inner pipeline's source and record transforms
    with the flat map, so a change to any of them is a change of the data.

    Attributes:
        prefix: the inner pipeline, its last record stage the flat map.
        key: the fingerprint of the inner source, its record transforms and the flat map (the counts' cache key).
        counts: the outputs of each record of the inner source (``0`` for a record a filter drops).
        offsets: the first output of each record, and the number of outputs (``len + 1`` values).
        label: the flat map's stage label (``flat_map[k] name``).
    """

    def __init__(self, prefix: Pipeline, counts: np.ndarray, key: str) -> None:
        src = prefix.stream.source
        assert src is not None
        self.prefix = prefix
        self.counts = counts
        self.offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(counts, dtype=np.int64)])
        k = len(prefix.record_ops) - 1
        self.label = prefix.record_ops[k].label(k)
        self.name = src.name
        self.key = key

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self) -> dict[str, Any]:
        """The state without the offsets (recomputed from the counts)."""
        return {k: v for k, v in self.__dict__.items() if k != "offsets"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore :meth:`__getstate__`'s state."""
        self.__dict__.update(state)
        self.offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(self.counts, dtype=np.int64)])

    def origin(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source record of each output ``ids`` and its index among that record's outputs.

        Args:
            ids: output ids in ``[0, len(self))``.

        Returns:
            ``(records, outputs)``, two ``int64`` arrays; they depend only on the counts.
        """
        ids = np.asarray(ids, dtype=np.int64)
        rec = np.searchsorted(self.offsets, ids, side="right") - 1
        return rec, ids - self.offsets[rec]

    def record_labels(self, ids: np.ndarray) -> list[int | str]:
        """How ``explain`` names outputs: ``"record R output K"`` of the inner source."""
        rec, k = self.origin(ids)
        return [f"record {r} output {j}" for r, j in zip(rec.tolist(), k.tolist())]

    def read_many(self, ids: np.ndarray) -> Sequence[Any]:
        """The outputs ``ids``, in that order (see the class docstring).

        Raises:
            IndexError: an id out of range.
            SourceError: a transform or the flat map failed, or a record gave another
                number of outputs than the count scan found (naming the record).
        """
        ids = check_ids(ids, len(self), self.name)
        rec, k = self.origin(ids)
        uniq, inverse = np.unique(rec, return_inverse=True)
        ops = self.prefix.record_ops
        where = f"flat map {self.label}"
        try:
            records = stages.read(self.prefix, uniq, where)
            for j in range(len(ops) - 1):
                records = stages.apply_record_op(self.prefix, j, records, uniq, uniq, where)
        except StepError as e:
            raise SourceError(str(e)) from e.__cause__
        fn = ops[-1].fn
        outputs = []
        for r, record in zip(uniq.tolist(), records):
            named = f"record {r} of source {self.name!r}"
            try:
                got = fn(record)
            except Exception as e:
                raise SourceError(f"{where}, {named}: {type(e).__name__}: {e}") from e
            n = scan.outputs_count(got, self.label, named, SourceError)
            if n != int(self.counts[r]):
                raise SourceError(
                    f"{where}, {named}: it gave {n} outputs where the count scan found {int(self.counts[r])}; the "
                    "flat map must depend only on its record (the same outputs at every call)"
                )
            outputs.append(got)
        return [outputs[i][j] for i, j in zip(inverse.tolist(), k.tolist())]

    def identity(self) -> dict:
        """The key of the counts: the fingerprint of the inner source, its record transforms and the flat map."""
        return {"type": "FlatMapped", "name": self.name, "len": len(self), "records": self.key}

    def config_base(self) -> tuple[Source, tuple[Op, ...]]:
        """The inner source (its own base) and the record transforms up to and including the flat map."""
        base, before = self.prefix.stream.source.config_base()  # type: ignore[union-attr]
        return base, before + self.prefix.record_ops

    def block_size(self) -> int:
        """The inner source's block, in outputs at the mean outputs per record (at least 1)."""
        mean = len(self) / max(1, int(np.count_nonzero(self.counts)))
        return max(1, round(self.prefix.stream.source.block_size() * mean))  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"FlatMappedSource(name={self.name!r}, len={len(self)}, stage={self.label!r})"


def flat_map(  # noqa: D417  (a method of Pipeline: self is the pipeline)
    self: Pipeline,
    fn: Callable[[Any], Sequence[Any]],
    *,
    cache_dir: str | os.PathLike | None = None,
    num_workers: int | None = None,
) -> Pipeline:
    """Replace each record by the records ``fn(record)`` returns (a list or tuple, empty for none).

    ``fn`` sees the record after the record transforms before it. The outputs per record
    are counted once, by a scan over all the records (the survivors of a filter), in
    processes when there are many, and cached on disk keyed by the fingerprint of the
    pipeline up to and including this flat map, as a filter's survivors are
    (:mod:`quern.pipeline.definition.scan`). The outputs then are the records of a new
    source (:class:`~quern.pipeline.definition.flat_mapping.FlatMappedSource`): output
    ``v`` is output ``k`` of source record ``r`` by the prefix sums of the counts, so a
    position is still O(1) to address, and ``explain`` names ``record r output k``.
    The seed, the epochs and a shuffle (before or after the flat map) apply to the
    outputs; the stages after it see the outputs. A step reads each source record it
    needs once and calls ``fn`` once per record; a record whose outputs are not as many
    as the scan counted is an error naming it. ``fn`` must depend only on the record
    and on what its description covers, as a filter's predicate.

    Args:
        fn: the flat map, ``fn(record) -> list of records``.
        cache_dir: where the counts are cached (default ``$QUERN_CACHE_DIR`` or ``~/.cache/quern``).
        num_workers: scan processes (default: the CPU count).

    Returns:
        The pipeline of the outputs, without record transforms.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: after ``batch()`` or ``random_map()``, on a stream that is not one
            source's records, or no output at all.
        ScanError: the count scan failed, or ``fn`` returned no list (naming the record).

    Example:
        >>> import numpy as np, quern
        >>> pipe = quern.Pipeline.from_source({"n": np.arange(4)}, seed=0)
        >>> repeated = pipe.flat_map(lambda r: [int(r["n"])] * int(r["n"]))
        >>> repeated.batch(6).batch_at(0).tolist()
        [1, 2, 2, 3, 3, 3]
        >>> repeated.batch(6).explain(0)[1:3]
        [[('arrays', 'record 2 output 0')], [('arrays', 'record 2 output 1')]]
    """
    if not callable(fn):
        raise TypeError(f"flat_map() needs a callable, got {fn!r}")
    pipe = self
    need_no_batch(pipe, "flat_map", "map_batch(fn) to make rows yourself")
    pipe.stream.check("flat_map")
    require(pipe.stream, Filterable, "flat_map")
    stream = pipe.stream
    assert isinstance(stream, SourceStream)
    if any(op.kind is OpKind.RANDOM_MAP for op in pipe.record_ops):
        raise ValueError(
            "flat_map() after random_map(): the outputs must not depend on the stream position; put the "
            "flat_map before random_map()"
        )
    if stream.host_lengths is not None:
        raise ValueError("flat_map() after balance_hosts(): balance the hosts after the flat map")
    src = stream.source
    prefix = dataclasses.replace(pipe, record_ops=pipe.record_ops + (Op(OpKind.FLAT_MAP, fn),))
    key = records_key(prefix, ops=record_ops_description(prefix), flat_map="counts")
    counts = scan.counts(
        prefix, key, candidates=stream.survivors, n=len(src), cache_dir=cache_dir, num_workers=num_workers
    )
    outputs = FlatMappedSource(prefix, counts, key)
    if not len(outputs):
        label = prefix.record_ops[-1].label(len(pipe.record_ops))
        raise ValueError(f"flat_map {label} gives no output for any record of {stream.size_text()}")
    # the outputs are the new records: the seed, the epochs and the shuffle apply to them
    fields = {f.name: getattr(stream, f.name) for f in dataclasses.fields(SourceStream)}
    return type(pipe)(stream=SourceStream(**{**fields, "source": outputs}))
