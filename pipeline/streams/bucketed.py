"""A bucketed stream: every step is a batch from one bucket of record lengths (:meth:`Pipeline.bucket`).

Bucket ``b`` holds the records whose length is in ``(boundaries[b-1],
boundaries[b]]``; each is a batched pipeline of its own (its records padded to
its bound, its own epochs), and steps are assigned to buckets by a mixture at
step granularity (:mod:`quern.pipeline.order.components`). Every output depends only
on the inner pipeline's definition, the length index, the bounds, the batch
sizes, the padding and the block size.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ...transforms.pad import pad
from ..core.batching import need_batch, need_no_batch
from ..core.errors import StepError
from ..core.tree import to_plain
from ..execute.stages import LengthCheck, StepRequest, StepResult, Where, batch_stages
from ..identity.hashing import digest
from ..order import Segments
from ..order import components as _mixture
from ..order import index as _index
from ..sources import Source
from .capabilities import BucketOfStep, Component, Filterable, NeutralReports, RecordPositions, SingleSource, require
from .config_form import stages_config
from .protocol import Explanation, Stream, locate_inner

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["BucketedStream", "bucket"]

_BATCHED = (
    "must come before map(), filter() and batch(): it reorders records of the source (after a filter, the "
    "records it keeps)"
)
_REFUSALS = {
    "shuffle": f"shuffle() {_BATCHED}",
    "filter": "filter() after batch(): filter() is a record-level stage; use map_batch(fn) to drop rows yourself, or move it before batch()",
    "length_index": "length_index() measures records: call it on the pipeline before batch()",
    "pack": "pack() needs a single-source pipeline without batch (not a bucketed one)",
    "bucket": "bucket() needs a single-source pipeline (not a mixture or a packed pipeline)",
    "balance_hosts": "balance_hosts() on a bucketed pipeline is not supported: its steps come from several streams",
    "batch": "batch() was already called on this pipeline",
    "segments": "a bucketed pipeline's steps come from several streams: use explain(step)",
}


@dataclasses.dataclass(frozen=True)
class BucketedStream(NeutralReports, Stream):
    """Steps assigned to buckets of record lengths, each bucket a batched pipeline of its own.

    Capabilities: inverted (``where``), reportable (a step's bucket), written as a config.

    Attributes:
        inner: the single-source pipeline (endless, without batch) whose records are bucketed.
        boundaries: the buckets' upper bounds, increasing.
        batch_sizes: the buckets' batch sizes.
        key: the field of a dict record that holds its tokens.
        pad_value: what records are padded with.
        buckets: the buckets that hold records (indices into ``boundaries``).
        components: one batched pipeline per bucket that holds records.
        stages: the assignment's weights (records in the bucket / its batch size).
        block: steps per block of exact counts.
        lengths_digest: the length index's digest.
        lengths: the length index, one value per record of the source.
        lengths_file: the ``.npy`` file it was read from, if any.
        seed: the inner pipeline's seed (keys the assignment and the batch transforms).
        source: the inner pipeline's source.
    """

    inner: Pipeline
    boundaries: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    key: str | None
    pad_value: Any
    buckets: tuple[int, ...]  # the buckets that hold records (indices into boundaries)
    components: tuple[Pipeline, ...]  # one batched pipeline per bucket that holds records
    stages: tuple[_mixture.Stage, ...]
    block: int
    lengths_digest: str
    lengths: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)  # per source record
    lengths_file: str | None = dataclasses.field(default=None, compare=False, repr=False)  # the .npy it came from
    seed: int = 0
    source: Source | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def names(self) -> tuple[str, ...]:
        """The buckets' names, ``len<=BOUND``."""
        return tuple(f"len<={self.boundaries[b]}" for b in self.buckets)

    def leaves(self, pipe: Pipeline) -> tuple[Pipeline, ...]:
        """``(inner,)``."""
        return (self.inner,)

    def segments(self, positions: np.ndarray) -> Segments:
        """Refused: a bucketed pipeline's steps come from several streams.

        Raises:
            TypeError: always, naming :meth:`explain`.
        """
        raise TypeError(_REFUSALS["segments"])

    def length(self) -> None:
        """``None``: the stream is endless."""
        return None

    def refusal(self, stage: str) -> str | None:
        """Only batch transforms may follow: the buckets make the batches."""
        return _REFUSALS.get(stage)

    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        """``{"bucketing": ...}``: the inner pipeline, bounds, batch sizes, key, padding, weights, block, lengths."""
        return {
            "bucketing": {
                "inner": self.inner.describe(),
                "boundaries": list(self.boundaries),
                "batch_sizes": list(self.batch_sizes),
                "key": self.key,
                "pad_value": self.pad_value,
                "weights": [list(st.weights) for st in self.stages],
                "block": self.block,
                "lengths": self.lengths_digest,
            }
        }

    def check_hosts(self, process_count: int) -> None:
        """Check that every bucket's batch splits over ``process_count`` hosts.

        Each host takes ``batch_size / process_count`` rows of every step of the bucket: a ``ValueError``
        naming the first bucket whose batch size is not a multiple of the host count.
        Checked once per host count (by the iterator when it is created, by ``batch_at``
        and ``explain``), so it fails before the first step, not at the first step of that
        bucket.
        """
        n = _index.check_int(process_count, "process_count", 1)
        done = self.__dict__.setdefault("_host_counts", set())
        if n in done:
            return
        for bound, size in zip(self.boundaries, self.batch_sizes):
            if size % n:
                raise ValueError(
                    f"bucket 'len<={bound}' has batch size {size}, which is not divisible by the host count "
                    f"(process_count) {n}: each host takes batch_size / process_count rows of every step of a "
                    f"bucket; give every bucket a batch size that is a multiple of {n}"
                )
        done.add(n)

    def assign(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The bucket (an index into ``components``) of each step and the step within that bucket's stream."""
        a = _mixture.assign(np.asarray(steps, dtype=np.int64), self.stages, self.seed, 1, self.block)
        return a.component, a.position

    def positions(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> np.ndarray:
        """This host's positions in the stream of the step's bucket."""
        self.check_hosts(process_count)  # every bucket's batch size, at the first call per count
        comp, k = self.assign(np.asarray([step]))
        return self.components[int(comp[0])].positions(int(k[0]), process_index, process_count)

    def where(self, pipe: Pipeline, record: int, component: str | None, epochs: int) -> list[tuple[int, int]]:
        """The ``(step, row)`` pairs whose rows hold record ``record``, in the first ``epochs`` epochs of its bucket.

        The record's positions in its bucket's stream (each bucket is a filtered stream of
        its own, with its own epochs), cut into that bucket's steps, each mapped to the
        step that draws it (the step-level mixture's inverse,
        :func:`~quern.pipeline.order.components.drawn_at`). A record in no bucket (dropped by a
        filter before ``bucket()``) appears nowhere. Reads nothing.

        Args:
            pipe: the bucketed pipeline.
            record: a record id of the source (checked by the caller).
            component: must be ``None``.
            epochs: epochs of the bucket's stream to look in, at least 1.

        Returns:
            The pairs in increasing order.

        Raises:
            ValueError: ``component`` is given (a bucketed pipeline has no components).
        """
        if component is not None:
            raise ValueError(
                f"component={component!r}: a bucketed pipeline is not a mixture (its buckets are {list(self.names)})"
            )
        out: list[tuple[int, int]] = []
        for c, part in enumerate(self.components):
            own = require(part.stream, RecordPositions, "where").record_positions(record, epochs)
            if not own.size:
                continue
            size = need_batch(part, "where")
            steps = _mixture.drawn_at(c, own // size, self.stages, self.seed, 1, self.block)
            out += [(s, r) for s, r in zip(steps.tolist(), (own % size).tolist()) if s >= 0]
        return sorted(out)

    def reads(self, positions: np.ndarray) -> list[tuple[Source, np.ndarray, np.ndarray]]:
        """``[]``: a bucketed stream's reads are not planned ahead."""
        return []

    def explain(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> Explanation:
        """The rows of step ``k`` of the step's bucket."""
        self.check_hosts(process_count)
        comp, k = self.assign(np.asarray([step]))
        return self.components[int(comp[0])].explain(int(k[0]), process_index, process_count)

    def bucket_of(self, step: int, process_index: int, process_count: int) -> BucketOfStep:
        """The step's bucket, and with the length index its rows' real tokens (index arithmetic)."""
        c, k = self.assign(np.asarray([step], dtype=np.int64))
        b = int(c[0])
        bound = self.boundaries[self.buckets[b]]
        real = None
        if self.lengths is not None:
            part = self.components[b]
            ids = require(part.stream, SingleSource, "bucket_of").record_ids(
                part.positions(int(k[0]), process_index, process_count)
            )
            real = int(np.minimum(np.asarray(self.lengths)[ids], bound).sum())
        return BucketOfStep(bucket=b, name=self.names[b], bound=bound, real_tokens=real)

    def results(self, pipe: Pipeline, request: StepRequest) -> Iterator[StepResult]:
        """The bucketed runner: :func:`bucketed_results`."""
        return bucketed_results(pipe, self, request)

    def locate(self, path: tuple) -> tuple[str, Pipeline, tuple] | None:
        """``("bucketing", "inner", ...)`` leads into the inner pipeline."""
        return locate_inner(path, "bucketing", "the bucketed pipeline's", self.inner)

    def to_config(self, pipe: Pipeline) -> dict[str, Any]:
        """The inner pipeline's config with a ``bucket:`` section instead of ``batch:``, and ``batch_transforms``."""
        return {
            **require(self.inner.stream, Component, "to_config").component_config(self.inner, ""),
            "bucket": {
                "boundaries": list(self.boundaries),
                "batch_sizes": list(self.batch_sizes),
                "key": self.key,
                "pad_value": to_plain(self.pad_value),
                "block": self.block,
                "lengths": self.lengths_file,  # the file it was read from, if recorded
            },
            "batch_transforms": stages_config(pipe.batch_ops, "batch_transforms"),
        }

    def text(self) -> str:
        """``INNER.bucket([...], [...], key=...)``."""
        return f"{self.inner!r}.bucket({list(self.boundaries)}, {list(self.batch_sizes)}, key={self.key!r})"


def bucketed_results(pipe: Pipeline, bk: BucketedStream, request: StepRequest) -> Iterator[StepResult]:
    """The results of a bucketed pipeline.

    Each step is step ``k`` of one bucket's batched pipeline (the plan's assignment), then the bucketed pipeline's own
    batch transforms (keys from the step and row). Steps of one bucket are computed together. Every bucket's batch must
    split over the hosts (checked once per host count), and every record must have the tokens the length index says
    (:class:`LengthCheck`); the request's own check does not apply.
    """
    steps, timings = list(request.steps), request.timings
    process_index, process_count = request.process_index, request.process_count
    bk.check_hosts(process_count)
    for s in steps:
        pipe.check_step(s)
    comp, within = bk.assign(np.asarray(steps, dtype=np.int64))
    done: dict[int, StepResult] = {}
    for c in np.unique(comp).tolist():
        sel = np.flatnonzero(comp == c)
        part = bk.components[c]
        check = None if bk.lengths is None else LengthCheck(bk.lengths, bk.key, len(part.record_ops) - 1)  # its pad
        results = part.stream.results(part, request._replace(steps=tuple(within[sel].tolist()), check=check))
        for i, r in zip(sel.tolist(), results):
            s = steps[i]
            if r.error is not None:
                error = StepError(f"step {s}, bucket {bk.names[c]!r} (its step {int(within[i])}): {r.error}")
                error.__cause__ = r.error
                done[s] = StepResult(s, None, error)
                continue
            try:
                pos = part.positions(int(within[i]), process_index, process_count)
                rows = s * (pipe.batch_size or 1) + np.arange(len(pos), dtype=np.int64)  # keys: the step and row
                seg = Segments(np.zeros(len(pos), dtype=np.int64), part.stream.row_ids(pos), rows)
                batch = batch_stages(pipe, r.batch, rows, seg, Where(s, process_index, process_count), timings)
            except Exception as e:
                done[s] = StepResult(s, None, e)
                continue
            done[s] = StepResult(s, batch, None)
    for s in steps:
        yield done[s]


def bucket(
    pipe: Pipeline,
    boundaries: Any,
    batch_sizes: Any,
    key: str | None,
    pad_value: Any,
    lengths: Any,
    cache_dir: str | os.PathLike | None,
    num_workers: int | None,
    block: int,
) -> tuple[BucketedStream, int]:
    """The stream and batch size of :meth:`Pipeline.bucket <quern.pipeline.definition.dataset.Pipeline.bucket>` (whose docstring says what it does).

    Raises:
        ValueError: a stream that cannot be bucketed, bad bounds or batch sizes, no record in any bucket.
    """
    pipe.stream.check("bucket")
    require(
        pipe.stream, SingleSource, "bucket"
    )  # returns the stream and the batch size: the pipeline module builds the pipeline
    need_no_batch(pipe, "bucket", "bucket() instead of batch(): it makes the batches")
    if pipe.num_epochs is not None:
        raise ValueError("bucket(): the pipeline must be endless (num_epochs=None); each bucket has its own epochs")
    bounds = [_index.check_int(b, "boundaries", 1) for b in boundaries]
    sizes = [_index.check_int(b, "batch_sizes", 1) for b in batch_sizes]
    if not bounds or any(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:])):
        raise ValueError(f"bucket(): boundaries must be increasing positive lengths, got {bounds}")
    if len(sizes) != len(bounds):
        raise ValueError(f"bucket(): {len(sizes)} batch sizes for {len(bounds)} buckets; give one per bucket")
    if isinstance(pad_value, np.generic):
        pad_value = pad_value.item()  # the same value, the same fingerprint
    lens = np.asarray(pipe.length_index(key, lengths=lengths, cache_dir=cache_dir, num_workers=num_workers))
    survivors = pipe.stream.survivors
    live = np.arange(len(lens)) if survivors is None else np.asarray(survivors)
    which = np.minimum(np.searchsorted(np.asarray(bounds), lens[live], side="left"), len(bounds) - 1)
    buckets, comps, weights = [], [], []
    for b, (upper, size) in enumerate(zip(bounds, sizes)):
        ids = live[which == b]
        if not ids.size:
            continue
        part = (
            dataclasses.replace(pipe, stream=require(pipe.stream, Filterable, "bucket").filtered(ids))
            .map(pad(upper, key=key, pad_value=pad_value))
            .batch(size)
        )
        buckets.append(b)
        comps.append(part)
        weights.append(len(ids) / size)
    if not comps:
        raise ValueError("bucket(): no record in any bucket")
    stages = (_mixture.Stage(0, _mixture.quantize(weights)),)
    k = _mixture.block_size(len(comps), _index.check_int(block, "block", 1))
    file = os.path.abspath(os.fspath(lengths)) if isinstance(lengths, (str, os.PathLike)) else None
    stream = BucketedStream(
        inner=pipe,
        boundaries=tuple(bounds),
        batch_sizes=tuple(sizes),
        key=key,
        pad_value=pad_value,
        buckets=tuple(buckets),
        components=tuple(comps),
        stages=stages,
        block=k,
        lengths_digest=digest(lens),
        lengths=lens,
        lengths_file=file,
        seed=pipe.stream.seed,
        source=pipe.stream.source,
    )
    return stream, max(sizes)
