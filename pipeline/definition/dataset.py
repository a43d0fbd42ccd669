"""Pipeline: the immutable, picklable definition of how batches are made, and its fluent API.

A :class:`Pipeline` holds one stream (:mod:`quern.pipeline.streams`: which
records make each stream position), its record transforms, its batch size and
its batch transforms. Computing a step is the step runner's job
(:mod:`quern.pipeline.execute`), iterating the iterator's
(:mod:`quern.pipeline.iterate.iterator`). Addressing, identity and iteration are
functions over a pipeline (:mod:`quern.pipeline.definition.addressing`,
:mod:`quern.pipeline.definition.identify`, :mod:`quern.pipeline.definition.iteration`);
the methods here are one-line entry points to them. ``batch_at(step, process_index, process_count)`` is a pure
function of (the definition, step, host slice).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Literal, Unpack

import numpy as np

from ..core.batching import need_batch, need_no_batch
from ..core.deprecation import renamed
from ..core.ops import DEVICE_KINDS, Op, OpKind
from ..execute.padding import pad_setting
from ..identity import samedef
from ..iterate.iterator import IteratorOptions, PipelineIterator
from ..order import Pieces, Segments
from ..order import components as _mixture
from ..order import index as _index
from ..sources import Source, as_source
from ..streams.bucketed import bucket as _bucket
from ..streams.capabilities import Shuffleable, require
from ..streams.live import LiveStream
from ..streams.protocol import Stream
from ..streams.source import SourceStream
from . import addressing, editing, filtering, flat_mapping, identify, iteration, on_device
from . import lengths as _lengths
from . import pack as _pack

__all__ = ["Pipeline", "Op", "OpKind"]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The description of a data pipeline: one stream, its record stages, a batch and batch stages.

    Build it with :meth:`from_source` (or :func:`quern.mix`) and chain ``shuffle``,
    ``map``, ``filter``, ``pack``, ``batch``, ``map_batch``...; each call returns a new
    pipeline. A batch depends only on (this description, the step, the host slice):
    never on worker count, thread timing or earlier calls.

    Attributes:
        stream: which records make each stream position (:class:`~quern.pipeline.streams.Stream`).
        record_ops: the record transforms, in order.
        batch_size: the global batch size (``None`` before ``batch()``).
        drop_remainder: whether a finite stream's last partial batch is dropped.
        pad_remainder: the value a finite stream's last partial batch is padded with to whole batches
            (``None``: not padded; see :meth:`batch`).
        batch_ops: the batch transforms, in order.
        filter_descriptions: per record op, the description a filter had when its survivors were found.

    Addressing (:mod:`~quern.pipeline.definition.addressing`), identity
    (:mod:`~quern.pipeline.definition.identify`) and iteration
    (:mod:`~quern.pipeline.definition.iteration`) are functions over a pipeline; the
    methods of the same names here call them. What a pipeline object computes once
    (its description and fingerprint) is kept in a :class:`~quern.pipeline.definition.identify.Memo`
    that is not part of the definition: :func:`dataclasses.replace` starts a new one.

    Example:
        >>> import numpy as np, quern
        >>> pipe = quern.Pipeline.from_source({"x": np.arange(10)}, seed=0).batch(4)
        >>> pipe.batch_at(1)["x"].tolist()
        [4, 5, 6, 7]
    """

    stream: Stream
    record_ops: tuple[Op, ...] = ()
    batch_size: int | None = None
    drop_remainder: bool = True
    batch_ops: tuple[Op, ...] = ()
    pad_remainder: int | float | None = None
    filter_descriptions: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)
    _memo: identify.Memo = dataclasses.field(default_factory=identify.Memo, compare=False, repr=False, init=False)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_source(cls, source: Any, seed: int = 0, num_epochs: int | None = None) -> Pipeline:
        """Start a pipeline over the records of ``source``.

        Args:
            source: a quern source, a dict of arrays, or any object with ``__len__``/``__getitem__``.
            seed: a 64-bit integer.
            num_epochs: epochs of the stream; ``None`` makes it endless.

        Returns:
            A pipeline whose stream is the source's records in order.

        Raises:
            ValueError: an empty source, more than ``2**62`` records, a bad seed or epoch count.
        """
        src = as_source(source)
        if getattr(src, "STREAM", None) == "live":  # a live source: entries of a log that grows
            if num_epochs is not None:
                raise ValueError(f"num_epochs={num_epochs}: a live stream ({src!r}) is endless and has no epochs")
            return cls(stream=LiveStream(source=src, seed=_index.check_seed(seed)))
        n = len(src)
        if n < 1:
            raise ValueError(f"source {src.name!r} is empty: a pipeline needs at least one record")
        if n > _index.MAX_RECORDS:
            raise ValueError(f"source {src.name!r} has {n} records; at most 2**62 are supported")
        seed = _index.check_seed(seed)
        if num_epochs is not None:
            num_epochs = _index.check_int(num_epochs, "num_epochs", 1)
        return cls(stream=SourceStream(source=src, seed=seed, num_epochs=num_epochs))

    def _replace(self, **kw: Any) -> Pipeline:
        return dataclasses.replace(self, **kw)

    def __getstate__(self) -> dict[str, Any]:
        """The pickled state, with this process's definition of the pipeline.

        A fresh process that loads it checks that it sees the same definition
        (:func:`quern.pipeline.identity.samedef.check_sent`).
        """
        return {**self.__dict__, samedef.SENT: samedef.sendable(self)}

    @renamed(block="block_size")
    def shuffle(
        self,
        mode: Literal["global", "block", "steps"] = "global",
        *,
        block_size: int | None = None,
        window: int = 8,
        steps: int | None = None,
    ) -> Pipeline:
        """Shuffle the records with a new permutation each epoch.

        Args:
            mode: ``"global"``: a keyed bijection over all records. ``"block"``: permute blocks
                of ``block_size`` consecutive records and shuffle within windows of ``window``
                blocks, so reads stay local to few row groups. ``"steps"`` (a live stream only):
                permute the positions of each group of ``steps`` whole steps, so a step is still
                a function of the log (it waits for its group's entries).
            block_size: records per block (default: the source's row-group size). The old
                spelling ``block=`` still works, with a ``DeprecationWarning``.
            window: blocks per window.
            steps: ``"steps"`` mode: the steps of each group.

        Returns:
            The shuffled pipeline.

        Raises:
            ValueError: after ``map``, ``filter`` or ``batch``, on a stream that cannot be shuffled, or a bad mode.
        """
        self.stream.check("shuffle")
        shuffleable = require(self.stream, Shuffleable, "shuffle")
        if self.batch_size is not None or self.record_ops:
            raise ValueError(
                "shuffle() must come before map(), filter() and batch(): it reorders records of the source "
                "(after a filter, the records it keeps)"
            )
        return self._replace(stream=shuffleable.shuffled(mode, block_size, window, steps))

    def map(self, fn: Callable[[Any], Any]) -> Pipeline:
        """Apply ``fn(record) -> record`` to every record.

        If ``fn`` has a ``map_many(records) -> records`` method it is called once per
        step with the list of records instead (vectorised transforms).

        Args:
            fn: the transform.

        Returns:
            The pipeline with the transform appended.

        Raises:
            TypeError: ``fn`` is not callable.
            ValueError: after ``batch()`` (use :meth:`map_batch`).
        """
        return self._record_op(OpKind.MAP, fn, "map_batch(fn)")

    def random_map(self, fn: Callable[[Any, np.random.Generator], Any]) -> Pipeline:
        """Apply ``fn(record, rng) -> record`` with a generator keyed by the record's position.

        ``rng`` is a ``numpy.random.Generator`` (Philox) keyed by (seed, stream position,
        stage) only, so the same record at the same position always draws the same
        numbers; it is valid only during the call.

        Args:
            fn: the transform.

        Returns:
            The pipeline with the transform appended.

        Raises:
            TypeError: ``fn`` is not callable.
            ValueError: after ``batch()`` (use :meth:`random_map_batch`).
        """
        return self._record_op(OpKind.RANDOM_MAP, fn, "random_map_batch(fn)")

    def _record_op(self, kind: OpKind, fn: Callable[..., Any], instead: str) -> Pipeline:
        """This pipeline with record transform ``fn`` of ``kind`` appended (``instead``: what to use after batch())."""
        if not callable(fn):
            raise TypeError(f"{kind.value}() needs a callable, got {fn!r}")
        need_no_batch(self, kind.value, instead)
        return self._replace(record_ops=self.record_ops + (Op(kind, fn),))

    @renamed(workers="num_workers")
    def filter(
        self,
        pred: Callable[[Any], bool],
        *,
        cache_dir: str | os.PathLike | None = None,
        num_workers: int | None = None,
    ) -> Pipeline:
        """Keep only the records for which ``pred(record)`` is true.

        ``pred`` sees the record after the record transforms before it (a
        ``keep_many(records) -> bool array`` method, if it has one, is called per
        chunk instead). The records kept (the *survivors*) are found once, by a scan
        over all the records (the survivors of an earlier filter), in processes when
        there are many (:mod:`quern.pipeline.definition.scan`), and cached on disk keyed by the
        fingerprint of the pipeline up to and including this filter; a damaged cache
        file is detected and rebuilt. The stream then counts epochs and shuffles over
        the survivors: positions stay O(1) to address. A predicate with a
        ``keep_metadata(metadata) -> bool array`` method (such as
        :func:`quern.transforms.metadata_range`) is judged on the source's metadata
        index instead, with no record read and no cache.

        ``pred`` must depend only on the record and on what its description covers
        (its code, arguments, closure, defaults, attributes and the module globals it
        reads by name; see :mod:`quern.pipeline.identity.fingerprint`); reading the
        environment or ``globals()``/``vars()`` is refused with a
        :class:`~quern.pipeline.core.errors.FingerprintError`. The survivors and the
        predicate's description are fixed when ``filter()`` runs.

        Args:
            pred: the predicate.
            cache_dir: where the survivors are cached (default ``$QUERN_CACHE_DIR`` or ``~/.cache/quern``).
            num_workers: scan processes (default: the CPU count). The old spelling
                ``workers=`` still works, with a ``DeprecationWarning``.

        Returns:
            The filtered pipeline.

        Raises:
            TypeError: ``pred`` is not callable.
            ValueError: after ``batch()`` or ``random_map()``, on a stream that cannot be
                filtered, a metadata predicate on a source without an index, or a
                filter that keeps nothing.
            ScanError: the scan failed (naming the record) or saw another definition.
        """
        return filtering.filtered(self, pred, cache_dir, num_workers)

    flat_map = flat_mapping.flat_map  # one record to several (its docstring: quern.pipeline.definition.flat_mapping)

    @renamed(workers="num_workers")
    def length_index(
        self,
        key: str | None = None,
        *,
        lengths: Any = None,
        cache_dir: str | os.PathLike | None = None,
        num_workers: int | None = None,
    ) -> np.ndarray:
        """Tokens per record of the source after the record transforms (:func:`.lengths.length_index`)."""
        return _lengths.length_index(self, key, lengths, cache_dir, num_workers)

    pack = _pack.pack  # documents into rows of seq_len tokens (its docstring: quern.pipeline.definition.pack)

    @renamed(workers="num_workers")
    def bucket(
        self,
        boundaries: Any,
        batch_sizes: Any,
        *,
        key: str | None = None,
        pad_value: Any = 0,
        lengths: Any = None,
        cache_dir: str | os.PathLike | None = None,
        num_workers: int | None = None,
        block: int = _mixture.BLOCK,
    ) -> Pipeline:
        """Length bucketing: every step is a batch from one bucket of lengths, padded to its bound.

        Bucket ``b`` holds the records whose length (:meth:`length_index`) is in
        ``(boundaries[b-1], boundaries[b]]`` (the first from 0; longer records go to the
        last bucket and are truncated to it); its batches have ``batch_sizes[b]`` rows,
        each record padded with ``pad_value`` (:func:`quern.transforms.pad`). Each bucket
        is a stream of its own; steps are assigned to buckets by a mixture at step
        granularity (exact counts per block of ``block`` steps) with weights ``records in
        the bucket / its batch size``. The stream is endless. A step measures its records
        again: one whose tokens differ from the length index is a
        :class:`~quern.StepError`. Every bucket's batch size must be a multiple of the
        host count (checked when an iterator is created and at the first ``batch_at`` or
        ``explain`` with that count).

        Args:
            boundaries: the buckets' upper bounds, increasing.
            batch_sizes: one batch size per bucket.
            key: the field of a dict record holding its tokens.
            pad_value: the padding value.
            lengths: as for :meth:`length_index`.
            cache_dir: as for :meth:`length_index`.
            num_workers: as for :meth:`length_index` (``workers=`` is deprecated).
            block: steps per block of exact counts.

        Returns:
            The bucketed pipeline (batched); chain batch transforms after it.

        Raises:
            ValueError: a stream that cannot be bucketed, a batch, epochs, bad bounds or sizes.
        """
        stream, size = _bucket(self, boundaries, batch_sizes, key, pad_value, lengths, cache_dir, num_workers, block)
        return Pipeline(stream=stream, batch_size=size)

    def balance_hosts(self, lengths: Any = None, key: str | None = None) -> Pipeline:
        """Token-balanced host slices.

        Each host still gets ``B / H`` rows of every full global batch, but rows sorted
        by length (longest first, ties by position) are dealt to hosts in a snake order
        (0..H-1, H-1..0, ...), so the token counts of two hosts differ by at most the
        longest row. The set of rows of a global batch is unchanged; their order in the
        assembled global batch then depends on the host count. A partial last batch is
        split into contiguous slices as usual.

        Args:
            lengths: ``lengths[i]`` is the token count of record ``i`` (default: :meth:`length_index`).
            key: the field of a dict record holding its tokens (for the default).

        Returns:
            The balanced pipeline.

        Raises:
            ValueError: a stream that cannot be balanced, or lengths of the wrong shape or sign.
        """
        return _lengths.balanced(self, lengths, key)

    def batch(
        self, global_batch_size: int, drop_remainder: bool = True, *, pad_remainder: bool = False, pad_value: Any = 0
    ) -> Pipeline:
        """Group ``global_batch_size`` consecutive stream positions into a step.

        Batches cross epoch boundaries. For evaluation, ``drop_remainder=False,
        pad_remainder=True`` pads the last partial batch of a finite stream to
        ``global_batch_size`` rows: every leaf with ``pad_value`` and a boolean leaf
        ``valid`` (``True`` for the real rows) in every batch, so every host gets
        ``global_batch_size / process_count`` rows of every step (a host past the data
        gets padding only) and every batch has one shape. The batch must be a dict.

        Args:
            global_batch_size: rows per step over all hosts.
            drop_remainder: with a finite ``num_epochs``, drop the last partial batch.
            pad_remainder: pad the last partial batch instead (needs ``drop_remainder=False``).
            pad_value: the number the padding rows hold.

        Returns:
            The batched pipeline.

        Raises:
            ValueError: ``batch()`` twice, a bad size or pad value, padding a dropped remainder, or no
                full batch in a finite stream.
        """
        self.stream.check("batch")
        if self.batch_size is not None:
            raise ValueError("batch() was already called on this pipeline")
        b = _index.check_int(global_batch_size, "global_batch_size", 1)
        pad = pad_setting(pad_remainder, pad_value, drop_remainder)
        p = self._replace(
            stream=self.stream.batched(b), batch_size=b, drop_remainder=bool(drop_remainder), pad_remainder=pad
        )
        if addressing.num_steps(p) == 0:
            raise ValueError(
                f"{self.stream.size_text()} x {self.num_epochs} epoch(s), "
                f"fewer than one batch of {b}: no full batch; use drop_remainder=False, more epochs or a smaller batch"
            )
        return p

    def map_batch(self, fn: Callable[[Any], Any]) -> Pipeline:
        """Apply ``fn(batch) -> batch`` to each host's collated batch (vectorised).

        Args:
            fn: the transform; it must return a batch of the kind it was given.

        Returns:
            The pipeline with the transform appended.

        Raises:
            TypeError: ``fn`` is not callable.
            ValueError: before ``batch()``.
        """
        return self._batch_op(OpKind.MAP_BATCH, fn)

    def random_map_batch(self, fn: Callable[[Any, np.ndarray], Any]) -> Pipeline:
        """Apply ``fn(batch, keys) -> batch`` with one ``uint64`` key per row.

        The keys derive from (seed, stream position of the row, stage) only; use
        :mod:`quern.transforms.random` to turn them into uniforms, integers or normals
        without creating generators.

        Args:
            fn: the transform.

        Returns:
            The pipeline with the transform appended.

        Raises:
            TypeError: ``fn`` is not callable.
            ValueError: before ``batch()``.
        """
        return self._batch_op(OpKind.RANDOM_MAP_BATCH, fn)

    map_device = on_device.map_device  # device stages (their docstrings: quern.pipeline.definition.on_device)
    random_map_device = on_device.random_map_device

    def _batch_op(self, kind: OpKind, fn: Callable[..., Any]) -> Pipeline:
        """This pipeline with batch transform ``fn`` of ``kind`` appended."""
        if not callable(fn):
            raise TypeError(f"{kind.value}() needs a callable, got {fn!r}")
        need_batch(self, kind.value)
        if kind not in DEVICE_KINDS and any(op.kind in DEVICE_KINDS for op in self.batch_ops):
            raise ValueError(
                f"{kind.value}() after a device stage: the host's batch stages come first (the device stages "
                "run after the transfer); put it before map_device()/random_map_device()"
            )
        return self._replace(batch_ops=self.batch_ops + (Op(kind, fn),))

    # ------------------------------------------------------------------ edits that keep the past

    def skip_steps(self, start: int, stop: int) -> Pipeline:
        """Skip the data of steps ``[start, stop)``, keeping every earlier step (:func:`.editing.skip_steps`)."""
        return editing.skip_steps(self, start, stop)

    def exclude(self, records: Any, *, from_step: int, component: str | None = None) -> Pipeline:
        """Never use the records ``records`` from step ``from_step`` on (:func:`.editing.exclude`)."""
        return editing.exclude(self, records, from_step, component)

    def __repr__(self) -> str:
        """The Python expression that builds this pipeline (transforms by name)."""
        parts = [self.stream.text()]
        parts += [f".{op.kind.value}({op.name})" for op in self.record_ops]
        if self.batch_size is not None and self.stream.refusal("batch") is None:
            pad = "" if self.pad_remainder is None else f", pad_remainder=True, pad_value={self.pad_remainder!r}"
            parts.append(f".batch({self.batch_size}, drop_remainder={self.drop_remainder}{pad})")
        parts += [f".{op.kind.value}({op.name})" for op in self.batch_ops]
        return "".join(parts) + self.stream.stage_text()

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
        """The record ids of the source a filter keeps, in order (``None``: all, or several sources)."""
        return self.stream.survivors

    @property
    def stream_len(self) -> int | None:
        """Positions in one epoch of the stream; ``None`` for a stream without epochs of its own."""
        return self.stream.epoch_length

    @property
    def leaves(self) -> tuple[Pipeline, ...]:
        """The single-source pipelines rows are read from (:func:`.addressing.leaves`)."""
        return addressing.leaves(self)

    @property
    def leaf_names(self) -> tuple[str, ...]:
        """Names of :attr:`leaves`: the source's name, or the mixture's component keys."""
        return addressing.leaf_names(self)

    @property
    def sources(self) -> tuple[Source, ...]:
        """The source of each of :attr:`leaves`."""
        return addressing.sources(self)

    @property
    def num_steps(self) -> int | None:
        """Steps in the stream, ``None`` when it is endless (:func:`.addressing.num_steps`)."""
        return addressing.num_steps(self)

    # ------------------------------------------------------------------ addressing

    def check_step(self, step: object, *, name: str = "step", end_ok: bool = False) -> int:
        """``step`` as an int, checked against the end of the stream (:func:`.addressing.check_step`)."""
        return addressing.check_step(self, step, name=name, end_ok=end_ok)

    def positions(self, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Stream positions of this host's rows at ``step`` (:func:`.addressing.positions`)."""
        return addressing.positions(self, step, process_index, process_count)

    def record_ids(self, positions: np.ndarray) -> np.ndarray:
        """Record id at each stream position of a single-source pipeline (:func:`.addressing.record_ids`)."""
        return addressing.record_ids(self, positions)

    def segments(self, positions: np.ndarray) -> Segments:
        """Per row at these stream positions: its leaf, record id and leaf position (:func:`.addressing.segments`)."""
        return addressing.segments(self, positions)

    def pieces(self, positions: np.ndarray) -> Pieces:
        """The documents in the packed rows at these stream positions (:func:`.addressing.pieces`)."""
        return addressing.pieces(self, positions)

    def explain(self, step: int, process_index: int = 0, process_count: int = 1) -> list[list[tuple[str, int | str]]]:
        """Per row of this host's batch at ``step``, its ``(name, record)`` pairs (:func:`.addressing.explain`)."""
        return addressing.explain(self, step, process_index, process_count)

    def where(self, record: int, *, component: str | None = None, epochs: int = 1) -> list[tuple[int, int]]:
        """The ``(step, row)`` pairs where source record ``record`` appears (:func:`.addressing.where`)."""
        return addressing.where(self, record, component=component, epochs=epochs)

    def batch_at(self, step: int, process_index: int = 0, process_count: int = 1) -> Any:
        """This host's rows of the global batch at ``step``, collated (:func:`.addressing.batch_at`)."""
        return addressing.batch_at(self, step, process_index, process_count)

    def batches_at(self, step: int, count: int, process_index: int = 0, process_count: int = 1) -> list[Any]:
        """The batches of ``count`` steps from ``step``, read in bulk (:func:`.addressing.batches_at`)."""
        return addressing.batches_at(self, step, count, process_index, process_count)

    # ------------------------------------------------------------------ identity

    def describe(self) -> dict[str, Any]:
        """JSON-able description of all that changes a batch's bytes (:func:`.identify.describe`)."""
        return identify.describe(self)

    def describe_until(self, step: int | None) -> dict[str, Any]:
        """The description as it applies to the steps before ``step`` (:func:`.identify.describe_until`)."""
        return identify.describe_until(self, step)

    def fingerprint(self) -> str:
        """Stable hash (32 hex digits) of :meth:`describe` (:func:`.identify.fingerprint`)."""
        return identify.fingerprint(self)

    def fingerprint_at(self, step: int) -> str:
        """The fingerprint of the definition for the steps up to ``step`` (:func:`.identify.fingerprint_at`)."""
        return identify.fingerprint_at(self, step)

    def leaves_at(self, step: int) -> dict[str, Any]:
        """The leaves of the description behind :meth:`fingerprint_at` (:func:`.identify.leaves_at`)."""
        return identify.leaves_at(self, step)

    def state_at(self, step: int) -> dict[str, Any]:
        """The checkpoint of an iterator whose next step is ``step`` (:func:`.identify.state_at`)."""
        return identify.state_at(self, step)

    def check_state(self, state: dict[str, Any], force: bool = False) -> int:
        """The step of a saved state, checked against this pipeline (:func:`.identify.check_state`)."""
        return identify.check_state(self, state, force)

    def to_config(self) -> dict:
        """This pipeline as a config dict for ``quern.load_config`` (:func:`.identify.to_config`)."""
        return identify.to_config(self)

    def row_digests(self, step: int, process_index: int = 0, process_count: int = 1) -> list[str]:
        """One digest per row of this host's batch at ``step`` (:func:`.identify.row_digests`)."""
        return identify.row_digests(self, step, process_index, process_count)

    def step_digest(self, step: int) -> str:
        """The digest of the global batch at ``step``, for any host count (:func:`.identify.step_digest`)."""
        return identify.step_digest(self, step)

    # ------------------------------------------------------------------ iteration

    def iterator(self, start_step: int = 0, **options: Unpack[IteratorOptions]) -> PipelineIterator:
        """An iterator of ``batch_at(s)`` from ``s = start_step`` on (:func:`.iteration.iterator`)."""
        return iteration.iterator(self, start_step, **options)

    def resume(
        self, state: dict[str, Any], force: bool = False, **options: Unpack[IteratorOptions]
    ) -> PipelineIterator:
        """An iterator from a saved state, after :meth:`check_state` (:func:`.iteration.resume`)."""
        return iteration.resume(self, state, force, **options)

    def __iter__(self) -> PipelineIterator:
        """``self.iterator()``."""
        return iteration.iterator(self)
