"""Pipeline: the immutable, picklable definition of how batches are made, and its fluent API.

A :class:`Pipeline` holds one stream (:mod:`quern.pipeline.streams`: which
records make each stream position), its record transforms, its batch size and
its batch transforms. Computing a step is the step runner's job
(:mod:`quern.pipeline.execute`), iterating the iterator's
(:mod:`quern.pipeline.iterate.iterator`), addressing :mod:`quern.pipeline.definition.addressing`'s,
identity and resume :mod:`quern.pipeline.definition.identify`'s; the methods here are thin
entry points to them. ``batch_at(step, process_index, process_count)`` is a pure
function of (the definition, step, host slice).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from ..core.deprecation import renamed
from ..core.errors import FingerprintError
from ..core.ops import Op, OpKind
from ..identity import samedef
from ..identity.fingerprint import describe_callable, fingerprint_of
from ..identity.hashing import digest
from ..iterate.iterator import PipelineIterator
from ..order import components as _mixture
from ..order import index as _index
from ..sources import as_source
from ..streams.bucketed import bucket as _bucket
from ..streams.capabilities import Balanceable, Editable, Filterable, Shuffleable, require
from ..streams.edited import EXCLUDE, SKIP, EditedStream
from ..streams.live import LiveStream
from ..streams.packed import pack as _pack
from ..streams.protocol import Stream
from ..streams.source import SourceStream
from . import lengths as _lengths
from . import scan
from .addressing import Addressed
from .identify import Identified, record_ops_description

__all__ = ["Pipeline", "Op", "OpKind"]


@dataclasses.dataclass(frozen=True)
class Pipeline(Addressed, Identified):
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
        batch_ops: the batch transforms, in order.
        filter_descriptions: per record op, the description a filter had when its survivors were found.

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
    filter_descriptions: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)

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
        self.need_no_batch(kind.value, instead)
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
        if not callable(pred):
            raise TypeError(f"filter() needs a callable, got {pred!r}")
        self.need_no_batch("filter", "map_batch(fn) to drop rows yourself")
        self.stream.check("filter")
        filterable = require(self.stream, Filterable, "filter")
        if any(op.kind is OpKind.RANDOM_MAP for op in self.record_ops):
            raise ValueError(
                "filter() after random_map(): the records a filter keeps must not depend on the stream position; "
                "put the filter before random_map()"
            )
        src = self.stream.source
        assert src is not None  # a stream of one source's records (the check above)
        prefix = self._replace(record_ops=self.record_ops + (Op(OpKind.FILTER, pred),))
        k = len(self.record_ops)
        if hasattr(pred, "keep_metadata"):  # e.g. transforms.metadata_range: from the index, no record read
            label = prefix.record_ops[-1].label(k)
            kept = scan.metadata_survivors(src, pred, candidates=self.stream.survivors, label=label)
            try:
                frozen = prefix._frozen_with(k, describe_callable(pred, label))
            except FingerprintError:  # described (and refused) when a fingerprint is asked for, as before
                frozen = self.filter_descriptions
            return prefix._replace(stream=filterable.filtered(kept), filter_descriptions=frozen)
        ops = record_ops_description(prefix)
        key = prefix.records_key(ops=ops)
        kept = scan.survivors(
            prefix, key, candidates=self.stream.survivors, n=len(src), cache_dir=cache_dir, num_workers=num_workers
        )
        return prefix._replace(stream=filterable.filtered(kept), filter_descriptions=prefix._frozen_with(k, ops[k][1]))

    def replace_stream(self, stream: Stream) -> Pipeline:
        """This pipeline, its stages kept, over ``stream`` (a filtered one, say)."""
        return self._replace(stream=stream)

    def _frozen_with(self, k: int, description: Any) -> tuple[Any, ...]:
        """:attr:`filter_descriptions` with record op ``k``'s set to ``description``."""
        done = self.filter_descriptions
        frozen = list(done) + [None] * (len(self.record_ops) - len(done))
        frozen[k] = description
        return tuple(frozen)

    @renamed(workers="num_workers")
    def length_index(
        self,
        key: str | None = None,
        *,
        lengths: Any = None,
        cache_dir: str | os.PathLike | None = None,
        num_workers: int | None = None,
    ) -> np.ndarray:
        """Tokens per record of the source after the record transforms.

        ``len(record)``, or ``len(record[key])``, which must be 1-D. ``lengths`` is
        taken instead of a scan after checks (its size, values ``>= 0``, and the
        lengths of 5 records computed here, so an index made for other data or other
        transforms is refused, naming the record). Without it, a prepared folder's
        ``length`` metadata is taken after the same checks; otherwise the index is
        found once by a scan (:mod:`quern.pipeline.definition.scan`) and cached under
        ``cache_dir`` (folder ``lengths/``), keyed by the fingerprint of the source,
        the record transforms and ``key``.

        Args:
            key: the field of a dict record holding its tokens (``None``: the record).
            lengths: an integer array or the path of a ``.npy`` file, one value per record.
            cache_dir: the cache folder (default ``$QUERN_CACHE_DIR`` or ``~/.cache/quern``).
            num_workers: scan processes (default: the CPU count; ``workers=`` is deprecated).

        Returns:
            A read-only int64 array, one value per record of the source, ``-1`` for the
            records a filter drops.

        Raises:
            ValueError: a stream without records of its own, after ``batch()`` or
                ``random_map()``, or lengths that do not fit.
        """
        return _lengths.length_index(self, key, lengths, cache_dir, num_workers)

    @renamed(workers="num_workers")
    def pack(
        self,
        seq_len: int,
        mode: Literal["best_fit", "concat"] = "best_fit",
        *,
        key: str | None = None,
        lengths: Any = None,
        cache_dir: str | os.PathLike | None = None,
        num_workers: int | None = None,
    ) -> Pipeline:
        """Pack the records into rows of ``seq_len`` tokens.

        The rows are ``{"tokens", "segment_ids", "positions"}`` (shape ``(seq_len,)``;
        tokens keep the records' dtype, the other two are int32), plus packed copies
        of a dict record's other per-token arrays. ``best_fit`` places whole
        documents (best-fit decreasing over each epoch; a document longer than
        ``seq_len`` is cut into rows), and an epoch's rows come in a keyed random
        order; ``concat`` concatenates the documents in stream order and cuts rows.
        ``segment_ids`` number a row's pieces 1..k, 0 marks padding; ``positions``
        restart at 0 per piece with ``best_fit`` and count from the piece's offset in
        its document with ``concat``. The plan comes from the :meth:`length_index`
        and reads nothing (:mod:`quern.pipeline.order.packing`).

        Args:
            seq_len: tokens per row.
            mode: ``"best_fit"`` or ``"concat"``.
            key: the field of a dict record holding its tokens.
            lengths: as for :meth:`length_index`.
            cache_dir: as for :meth:`length_index`.
            num_workers: as for :meth:`length_index` (``workers=`` is deprecated).

        Returns:
            A pipeline of packed rows; chain ``.map`` (on rows) and ``.batch(B)``.

        Raises:
            ValueError: a bad ``seq_len`` or mode, a stream that cannot be packed, a batch, no token.
        """
        return Pipeline(stream=_pack(self, seq_len, mode, key, lengths, cache_dir, num_workers))

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

    def records_key(self, ops: list[list[Any]] | None = None, **extra: Any) -> str:
        """The fingerprint of what this pipeline's records are, plus ``extra``.

        The data order's version, the source's identity and the record transforms
        (``ops``: their description, when given): the key of a filter's survivors and of
        a length index, which do not depend on the seed, shuffle or batch.

        Args:
            ops: the record transforms' description (default: computed).
            **extra: more keys (``length_key``).

        Returns:
            32 hex digits.
        """
        src = self.stream.source
        assert src is not None
        if ops is None:
            ops = record_ops_description(self)
        return fingerprint_of(
            {"index_format": _index.INDEX_FORMAT_VERSION, "source": src.identity(), "record_ops": ops, **extra}
        )

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
        self.stream.check("balance_hosts")
        balanceable = require(self.stream, Balanceable, "balance_hosts")
        src = self.stream.source
        assert src is not None
        if lengths is None:
            lengths = self.length_index(key)
        lengths = np.asarray(lengths)
        if lengths.shape != (len(src),) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(
                f"balance_hosts needs one integer length per record of source {src.name!r} "
                f"(shape ({len(src)},)), got an array of shape {lengths.shape} and dtype {lengths.dtype}"
            )
        if lengths.size and lengths.dtype.kind == "u" and lengths.max() > np.iinfo(np.int64).max:
            raise ValueError(f"balance_hosts: record {int(lengths.argmax())} has a length beyond 2**63")
        survivors = self.stream.survivors
        live = lengths if survivors is None else lengths[np.asarray(survivors)]  # a filter's drops: any
        if live.size and live.min() < 0:
            bad = int(live.argmin()) if survivors is None else int(survivors[int(live.argmin())])
            raise ValueError(f"balance_hosts: lengths must be >= 0, record {bad} has {int(lengths[bad])}")
        lengths = lengths.astype(np.int64)
        lengths.setflags(write=False)
        return self._replace(stream=balanceable.balanced(lengths, digest(lengths)))

    def batch(self, global_batch_size: int, drop_remainder: bool = True) -> Pipeline:
        """Group ``global_batch_size`` consecutive stream positions into a step.

        Batches cross epoch boundaries.

        Args:
            global_batch_size: rows per step over all hosts.
            drop_remainder: with a finite ``num_epochs``, drop the last partial batch.

        Returns:
            The batched pipeline.

        Raises:
            ValueError: ``batch()`` twice, a bad size, or no full batch in a finite stream.
        """
        self.stream.check("batch")
        if self.batch_size is not None:
            raise ValueError("batch() was already called on this pipeline")
        b = _index.check_int(global_batch_size, "global_batch_size", 1)
        p = self._replace(stream=self.stream.batched(b), batch_size=b, drop_remainder=bool(drop_remainder))
        if p.num_steps == 0:
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

    def _batch_op(self, kind: OpKind, fn: Callable[..., Any]) -> Pipeline:
        """This pipeline with batch transform ``fn`` of ``kind`` appended."""
        if not callable(fn):
            raise TypeError(f"{kind.value}() needs a callable, got {fn!r}")
        self.need_batch(kind.value)
        return self._replace(batch_ops=self.batch_ops + (Op(kind, fn),))

    # ------------------------------------------------------------------ edits that keep the past

    def skip_steps(self, start: int, stop: int) -> Pipeline:
        """Skip the data of steps ``[start, stop)``: training steps from ``start`` on get that of ``stop``, ``stop + 1``, ...

        For a loss spike: the batches of the steps before ``start`` are unchanged, and the
        data of ``[start, stop)`` is never used. ``start`` and ``stop`` are steps of this
        pipeline, so edits compose in the order they are made. A state saved at step ``k``
        resumes on the edited pipeline when ``start >= k`` (:meth:`check_state`).

        Args:
            start: the first training step that gets other data.
            stop: the step whose data training step ``start`` gets.

        Returns:
            The edited pipeline.

        Raises:
            ValueError: before ``batch()``, ``stop <= start``, or ``stop`` past the end of a finite stream.
            TypeError: a step that is not an integer.

        Example:
            >>> import numpy as np, quern
            >>> pipe = quern.Pipeline.from_source({"x": np.arange(100)}).batch(2)
            >>> [pipe.skip_steps(1, 3).batch_at(s)["x"].tolist() for s in range(3)]
            [[0, 1], [6, 7], [8, 9]]
        """
        b = self.need_batch(SKIP)
        self.stream.check(SKIP)
        start = _index.check_int(start, "skip_steps start", 0)
        stop = _index.check_int(stop, "skip_steps stop", 0)
        if stop <= start:
            raise ValueError(f"skip_steps(start={start}, stop={stop}): stop must be greater than start")
        n_steps = self.num_steps
        if n_steps is not None and stop > n_steps:
            raise ValueError(
                f"skip_steps(start={start}, stop={stop}): stop is past the end of the stream ({n_steps} steps)"
            )
        return self._replace(stream=EditedStream.of(self.stream, b).with_skip(start, stop))

    def exclude(self, records: Any, *, from_step: int, component: str | None = None) -> Pipeline:
        """Never use the records ``records`` from step ``from_step`` on (a takedown).

        The stream continues with the remaining records (their positions shift); every step
        before ``from_step`` is unchanged. In a packed stream an excluded document's pieces
        become padding in the rows that hold them (the plan is not redone, so no row moves).
        A state saved at step ``k`` resumes on the edited pipeline when ``from_step >= k``.

        Args:
            records: record ids of the source (of ``component``'s source): integers, any order.
            from_step: the first step without them.
            component: the mixture component the ids are of (required for a mixture).

        Returns:
            The edited pipeline.

        Raises:
            ValueError: before ``batch()``, no id, an id out of range, every record excluded, a
                mixture without ``component`` (the message lists the components), or a stream
                kind that cannot exclude records (named).
            TypeError: ids or a step that are not integers.

        Example:
            >>> import numpy as np, quern
            >>> pipe = quern.Pipeline.from_source({"x": np.arange(6)}, num_epochs=1).batch(2)
            >>> edited = pipe.exclude([3, 4], from_step=1)
            >>> [edited.batch_at(s)["x"].tolist() for s in range(edited.num_steps)]
            [[0, 1], [2, 5]]
        """
        b = self.need_batch(EXCLUDE)
        self.stream.check(EXCLUDE)
        require(self.stream, Editable, EXCLUDE)
        from_step = self.check_step(from_step, name="exclude from_step", end_ok=True)
        names = self.leaf_names
        src = None  # the source the ids are of; a mixture without a valid component: its refusal names them
        if component is not None and component in names:
            src = self.sources[names.index(component)]
        elif len(names) == 1:
            src = self.sources[0]
        ids = np.asarray(records)
        if ids.dtype == object or ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise TypeError(f"exclude() needs a 1-D sequence of integer record ids, got {records!r:.200}")
        if not ids.size:
            raise ValueError("exclude() needs at least one record id")
        bad = ids[(ids < 0) | (ids >= len(src))] if src is not None else ids[:0]
        if bad.size and src is not None:
            raise ValueError(
                f"exclude(): record id {int(bad[0])} is out of range: source {src.name!r} has {len(src)} records "
                f"(ids 0..{len(src) - 1})"
            )
        ids = np.unique(ids.astype(np.int64))
        return self._replace(stream=EditedStream.of(self.stream, b).with_exclude(self, ids, from_step, component))

    def __iter__(self) -> PipelineIterator:
        """``self.iterator()``."""
        return self.iterator()

    def __repr__(self) -> str:
        """The Python expression that builds this pipeline (transforms by name)."""
        parts = [self.stream.text()]
        parts += [f".{op.kind.value}({op.name})" for op in self.record_ops]
        if self.batch_size is not None and self.stream.refusal("batch") is None:
            parts.append(f".batch({self.batch_size}, drop_remainder={self.drop_remainder})")
        parts += [f".{op.kind.value}({op.name})" for op in self.batch_ops]
        return "".join(parts) + self.stream.stage_text()
