"""Pipeline: the immutable, picklable definition of how batches are made, and its fluent API.

A :class:`Pipeline` says which records make each step (source, seed, epochs,
shuffle, the records a filter keeps; or, instead of a source, a mixture of
component pipelines, a packed stream or a bucketed one, defined in
:mod:`quern.pipeline.streams`; batch size, host slices: pure index arithmetic,
see :mod:`quern.pipeline.index` and :mod:`quern.pipeline.plan`) and which
transforms run on them. Computing a step is the step runner's job
(:mod:`quern.pipeline.execute`), iterating the iterator's
(:mod:`quern.pipeline.loader`), hashing the definition the fingerprint's
(:mod:`quern.pipeline.fingerprint`), and the length index, packing and
bucketing :mod:`quern.pipeline.lengths`'; the methods here are thin entry points
to them. ``batch_at(step, process_index, process_count)`` is a
pure function of (the definition, step, host slice).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from . import execute, samedef, scan
from . import index as _index
from . import lengths as _lengths
from .digest import digest
from .dump import to_config
from .errors import FingerprintError
from .fingerprint import describe_callable, fingerprint_of
from .loader import PipelineIterator
from .ops import Op, OpKind
from .plan import Pieces, Segments
from .plan import mixture as _mixture
from .sources import Source, as_source
from .streams import Bucketing, Mixture, Packing

__all__ = ["Pipeline", "Op", "OpKind"]

_check_int = _index.check_int


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The description of a data pipeline. Build it with :meth:`from_source` and chain
    ``shuffle / map / random_map / batch / map_batch``; each call returns a new pipeline.

    A batch depends only on (this description, the step, the host slice): never
    on worker count, thread timing or earlier calls.
    """

    source: Source | None  # None for a mixture (see ``mixture``)
    seed: int = 0
    num_epochs: int | None = None
    shuffle_mode: str | None = None
    block: int = 1
    window: int = 1
    record_ops: tuple[Op, ...] = ()
    batch_size: int | None = None
    drop_remainder: bool = True
    batch_ops: tuple[Op, ...] = ()
    host_lengths: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)  # see balance_hosts
    host_lengths_digest: str | None = None  # the lengths' content: equality and fingerprint alike
    survivors: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)  # see filter
    # per record op, the description a filter had when its survivors were found (None: describe it now)
    filter_descriptions: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)
    mixture: Mixture | None = None  # see quern.mix
    packing: Packing | None = None  # see pack
    bucketing: Bucketing | None = None  # see bucket

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_source(cls, source: Any, seed: int = 0, num_epochs: int | None = None) -> Pipeline:
        """Start a pipeline over ``source`` (a quern source, a dict of arrays, or any
        object with ``__len__``/``__getitem__``). ``seed`` is a 64-bit integer;
        ``num_epochs=None`` makes the stream endless."""
        src = as_source(source)
        n = len(src)
        if n < 1:
            raise ValueError(f"source {src.name!r} is empty: a pipeline needs at least one record")
        if n > _index.MAX_RECORDS:
            raise ValueError(f"source {src.name!r} has {n} records; at most 2**62 are supported")
        seed = _index.check_seed(seed)
        if num_epochs is not None:
            num_epochs = _check_int(num_epochs, "num_epochs", 1)
        return cls(source=src, seed=seed, num_epochs=num_epochs)

    def _replace(self, **kw: Any) -> Pipeline:
        return dataclasses.replace(self, **kw)

    def __getstate__(self) -> dict[str, Any]:
        """The pickled state carries this process's definition of the pipeline
        (:func:`quern.pipeline.samedef.sendable`), so that a fresh process that loads it can
        check it sees the same (:func:`quern.pipeline.samedef.check_sent`)."""
        return {**self.__dict__, samedef.SENT: samedef.sendable(self)}

    def shuffle(self, mode: str = "global", block: int | None = None, window: int = 8) -> Pipeline:
        """Shuffle records with a new permutation each epoch.

        ``mode="global"``: a keyed bijection over all records. ``mode="block"``:
        permute blocks of ``block`` consecutive records (default: the source's
        row-group size) and shuffle within windows of ``window`` blocks, so
        reads stay local to few row groups.
        """
        if self.mixture is not None:
            raise ValueError(
                "shuffle() on a mixture: shuffle each component instead (each has its own order and epochs)"
            )
        if self.packing is not None:
            raise ValueError("shuffle() after pack(): shuffle the records before pack() (best_fit rows come shuffled)")
        if self.batch_size is not None or self.record_ops:
            raise ValueError(
                "shuffle() must come before map(), filter() and batch(): it reorders records of the source "
                "(after a filter, the records it keeps)"
            )
        if mode not in ("global", "block"):
            raise ValueError(f"shuffle mode must be 'global' or 'block', got {mode!r}")
        if mode == "global":
            return self._replace(shuffle_mode="global", block=1, window=1)
        assert self.source is not None
        block = self.source.block_size() if block is None else _check_int(block, "block", 1)
        return self._replace(shuffle_mode="block", block=max(1, block), window=_check_int(window, "window", 1))

    def map(self, fn: Callable[[Any], Any]) -> Pipeline:
        """Apply ``fn(record) -> record`` to every record.

        If ``fn`` has a ``map_many(records) -> records`` method it is called once
        per batch with the list of records instead (vectorised transforms).
        After ``batch()`` use :meth:`map_batch` (a ``ValueError`` says so)."""
        if not callable(fn):
            raise TypeError(f"map() needs a callable, got {fn!r}")
        self._need_no_batch("map", "map_batch(fn)")
        return self._replace(record_ops=self.record_ops + (Op(OpKind.MAP, fn),))

    def random_map(self, fn: Callable[[Any, np.random.Generator], Any]) -> Pipeline:
        """Apply ``fn(record, rng) -> record``; ``rng`` is a ``numpy.random.Generator``
        (Philox) keyed by (seed, stream position, stage) only, so the same record at
        the same position always draws the same numbers. ``rng`` is valid only
        during the call."""
        if not callable(fn):
            raise TypeError(f"random_map() needs a callable, got {fn!r}")
        self._need_no_batch("random_map", "random_map_batch(fn)")
        return self._replace(record_ops=self.record_ops + (Op(OpKind.RANDOM_MAP, fn),))

    def filter(
        self,
        pred: Callable[[Any], bool],
        cache_dir: str | os.PathLike | None = None,
        workers: int | None = None,
    ) -> Pipeline:
        """Keep only the records for which ``pred(record)`` is true; ``pred`` sees the
        record after the record transforms before it and returns ``True``/``False``
        (a ``keep_many(records) -> bool array`` method, if it has one, is called per
        chunk instead).

        The records kept (the *survivors*) are found once, by a scan over all the
        records (the survivors of an earlier filter), in ``workers`` processes when
        there are many (default: the CPU count; see :mod:`quern.pipeline.scan`),
        and cached on disk under ``cache_dir`` (default ``$QUERN_CACHE_DIR`` or
        ``~/.cache/quern``), keyed by the fingerprint of the pipeline up to and
        including this filter; a damaged cache file is detected and rebuilt. The
        stream then counts epochs and shuffles over the survivors: positions stay
        O(1) to address, ``num_steps``, ``explain``, resume, workers and host
        slices work as without a filter. The survivors cost 8 bytes each,
        memory-mapped. A filter that keeps nothing is a ``ValueError``.

        A predicate with a ``keep_metadata(metadata) -> bool array`` method (such as
        :class:`quern.transforms.metadata_range`) is judged on the source's
        metadata index instead (a folder written by ``quern prepare``: per-record
        ``length`` and prepared fields): one vectorised call, no record read, no
        cache; a source without an index is a ``ValueError``.

        ``pred`` must not depend on the stream position, so a ``random_map`` before
        it is refused; a filter on a mixture is refused too (filter its
        components).

        The survivors are fixed when ``filter()`` runs, and so is the
        predicate's description: the fingerprint of the pipeline (and the key
        of its cache file) is the one the survivors were computed with, even if
        a global it reads changes later. ``pred`` must depend only on the record
        and on what its description covers (its code, arguments, closure,
        defaults, attributes and the module globals it reads by name; see
        :mod:`quern.pipeline.fingerprint`). It must not read the environment
        (``os.environ``, ``os.getenv``) or look names up at run time
        (``globals()``, ``vars()``): both are detected and refused with a
        :class:`~quern.pipeline.errors.FingerprintError`. Not detected, and
        not allowed either: another module's attributes (``mycfg.THR``), files,
        the clock. A global changed at run time is in the fingerprint, but a scan
        process imports the module again: it sees the value set at import, and
        refuses to scan (a ``ScanError`` naming the global) rather than keep
        other records."""
        if not callable(pred):
            raise TypeError(f"filter() needs a callable, got {pred!r}")
        self._need_no_batch("filter", "map_batch(fn) to drop rows yourself")
        if self.mixture is not None:
            raise ValueError("filter() on a mixture: filter its components instead (each keeps its own survivors)")
        if self.packing is not None:
            raise ValueError("filter() after pack(): filter the records before pack()")
        if any(op.kind is OpKind.RANDOM_MAP for op in self.record_ops):
            raise ValueError(
                "filter() after random_map(): the records a filter keeps must not depend on the stream position; "
                "put the filter before random_map()"
            )
        assert self.source is not None
        prefix = self._replace(record_ops=self.record_ops + (Op(OpKind.FILTER, pred),))
        k = len(self.record_ops)
        if hasattr(pred, "keep_metadata"):  # e.g. transforms.metadata_range: from the index, no record read
            label = prefix.record_ops[-1].label(k)
            kept = scan.metadata_survivors(self.source, pred, self.survivors, label)
            try:
                frozen = prefix._frozen_with(k, describe_callable(pred, label))
            except FingerprintError:  # described (and refused) when a fingerprint is asked for, as before
                frozen = self.filter_descriptions
            return prefix._replace(survivors=kept, filter_descriptions=frozen)
        ops = prefix._record_ops_description()
        key = prefix._records_key(ops=ops)
        kept = scan.survivors(prefix, key, self.survivors, len(self.source), cache_dir, workers)
        return prefix._replace(survivors=kept, filter_descriptions=prefix._frozen_with(k, ops[k][1]))

    def _frozen_with(self, k: int, description: Any) -> tuple[Any, ...]:
        """:attr:`filter_descriptions` with record op ``k``'s set to ``description``."""
        done = self.filter_descriptions
        frozen = list(done) + [None] * (len(self.record_ops) - len(done))
        frozen[k] = description
        return tuple(frozen)

    def _op_description(self, k: int, op: Op) -> Any:
        """Record op ``k``'s description: the one frozen by :meth:`filter`, else described now."""
        frozen = self.filter_descriptions[k] if k < len(self.filter_descriptions) else None
        if frozen is not None:
            return copy.deepcopy(frozen)
        return describe_callable(op.fn, op.label(k), shown=samedef.active())

    def _record_ops_description(self) -> list[list[Any]]:
        return [[op.kind.value, self._op_description(k, op)] for k, op in enumerate(self.record_ops)]

    def _batch_ops_description(self) -> list[list[Any]]:
        active = samedef.active()
        return [
            [op.kind.value, describe_callable(op.fn, op.label(k), shown=active)] for k, op in enumerate(self.batch_ops)
        ]

    def length_index(
        self,
        key: str | None = None,
        lengths: Any = None,
        cache_dir: str | os.PathLike | None = None,
        workers: int | None = None,
    ) -> np.ndarray:
        """Tokens per record of the source after the record transforms: ``len(record)``,
        or ``len(record[key])``, which must be 1-D. A read-only int64 array with one
        value per record of the source, ``-1`` for the records a filter drops.

        ``lengths`` (an integer array or the path of a ``.npy`` file, one value per
        record of the source) is taken instead of a scan, after checks: its size,
        values ``>= 0``, and the lengths of 5 records (the first, the last and 3
        spread between, of those in the stream) computed here, so that an index
        made for other data or other transforms is refused, naming the record.
        Without ``lengths``, a source with a metadata index (a folder written by
        ``quern prepare``) gives its ``length`` field, taken after the same
        checks (it counts the elements of the stored records: decode arrays with
        their prepared dtype first); when they fail (transforms that change the
        lengths) the index is scanned as below. Otherwise the index is found once by a scan (in processes when there are
        many records, as a filter's, :mod:`quern.pipeline.scan`) and cached under
        ``cache_dir`` (default ``$QUERN_CACHE_DIR`` or ``~/.cache/quern``, folder
        ``lengths/``), keyed by the fingerprint of the source, the record
        transforms and ``key``; a damaged cache file is detected and rebuilt."""
        return _lengths.length_index(self, key, lengths, cache_dir, workers)

    def pack(
        self,
        seq_len: int,
        mode: str = "best_fit",
        key: str | None = None,
        lengths: Any = None,
        cache_dir: str | os.PathLike | None = None,
        workers: int | None = None,
    ) -> Pipeline:
        """Pack the records into rows of ``seq_len`` tokens: a stream of rows
        ``{"tokens", "segment_ids", "positions"}`` (shape ``(seq_len,)``; tokens keep the
        records' dtype, the other two are int32), plus
        packed copies of the record's other per-token arrays (values of a dict
        record that are 1-D and as long as its tokens; other values are dropped).

        Records are 1-D token arrays, or dicts holding one under ``key``, after the
        record transforms. ``mode="best_fit"`` places whole documents (best-fit
        decreasing over each epoch; a document longer than ``seq_len`` is cut into
        ``seq_len`` pieces, each a row, and its remainder is placed like a
        document), and the epoch's rows come in a keyed random order;
        ``mode="concat"`` concatenates the documents in stream order and cuts
        rows. ``segment_ids`` number a row's pieces 1..k, 0 marks padding;
        ``positions`` restart at 0 for every piece with ``best_fit``, and count
        from the piece's offset in its document with ``concat``. Padding tokens
        are 0. An epoch's last partial row is padded, never dropped.

        The plan comes from the :meth:`length_index` (``lengths``, ``cache_dir``,
        ``workers`` as there) and reads nothing: any step's rows are computed from
        the step number (see :mod:`quern.pipeline.plan.packing`). Chain
        ``.map``/``.random_map`` (on rows) and ``.batch(B)`` (B rows per step)."""
        return _lengths.pack(self, seq_len, mode, key, lengths, cache_dir, workers)

    def pieces(self, positions: np.ndarray) -> Pieces:
        """The documents in the packed rows at these stream positions (pure index
        arithmetic over the length index; reads nothing)."""
        p = self.packing
        if p is None:
            raise TypeError("pieces() is for packed pipelines; use segments()")
        positions = np.asarray(positions, dtype=np.int64)
        epochs, within = p.locate(positions)
        parts = []
        for e in np.unique(epochs).tolist():
            sel = np.flatnonzero(epochs == e)
            plan, ids = p.epoch(e)
            k = within[sel]
            first, last = plan.row_ptr[k], plan.row_ptr[k + 1]
            n = last - first
            idx = np.repeat(first, n) + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n))
            rows = np.repeat(sel, n)
            parts.append((rows, ids[plan.doc[idx]], plan.start[idx], plan.length[idx]))
        if not parts:
            z = np.zeros(0, dtype=np.int64)
            return Pieces(z, z, z, z)
        row, ids, start, length = (np.concatenate(x) for x in zip(*parts))
        order = np.argsort(row, kind="stable")
        return Pieces(row[order], ids[order], start[order], length[order])

    def bucket(
        self,
        boundaries: Any,
        batch_sizes: Any,
        key: str | None = None,
        pad_value: Any = 0,
        lengths: Any = None,
        cache_dir: str | os.PathLike | None = None,
        workers: int | None = None,
        block: int = _mixture.BLOCK,
    ) -> Pipeline:
        """Length bucketing: every step is a batch from one bucket of lengths, padded to
        the bucket's upper bound (few static shapes, one per bucket).

        Bucket ``b`` holds the records whose length (:meth:`length_index`, ``key``
        as there) is in ``(boundaries[b-1], boundaries[b]]`` (the first from 0, so
        it also holds empty records; records longer than the last bound go to the
        last bucket and are truncated to it); its batches have ``batch_sizes[b]``
        rows, each record padded with ``pad_value`` (:func:`quern.transforms.pad`:
        ``{"tokens", "length"}``, other fields kept). Each bucket is a stream of
        its own (the pipeline's shuffle over its records, its own epochs); steps
        are assigned to buckets by a mixture at step granularity (exact counts per
        block of ``block`` steps, :mod:`quern.pipeline.plan.mixture`) with weights
        ``records in the bucket / its batch size``, so every bucket goes through
        its records at the same pace. Step-addressable, the same for any worker or
        host count; the stream is endless. Chain batch transforms after it.

        A step measures its records again: one whose tokens differ from the length
        index (made for other data or transforms) is a :class:`~quern.StepError`
        naming the step, the record and both lengths, never cut silently to a
        bound. Every bucket's batch size must be a multiple of the host count:
        checked for all buckets when an iterator is created and at the first
        ``batch_at`` or ``explain`` with that ``process_count`` (a ``ValueError``
        naming the bucket)."""
        return _lengths.bucket(self, boundaries, batch_sizes, key, pad_value, lengths, cache_dir, workers, block)

    def _records_key(self, ops: list[list[Any]] | None = None, **extra: Any) -> str:
        """The fingerprint of what this pipeline's records are (the data order's version,
        the source's identity, the record transforms: ``ops``, their description, when
        given) and ``extra``: the key of a filter's survivors and of a length index, which
        do not depend on the seed, shuffle or batch."""
        assert self.source is not None
        if ops is None:
            ops = self._record_ops_description()
        return fingerprint_of(
            {"index_format": _index.INDEX_FORMAT_VERSION, "source": self.source.identity(), "record_ops": ops, **extra}
        )

    def balance_hosts(self, lengths: Any = None, key: str | None = None) -> Pipeline:
        """Token-balanced host slices: ``lengths[i]`` is the length (token count) of
        record ``i``; by default the pipeline's :meth:`length_index` (``key``: which
        field of a record holds its tokens). Each host still gets ``B / H``
        rows of every full global batch, but which rows is chosen so that the hosts'
        token counts are even: rows sorted by length (longest first, ties by
        position) are dealt to hosts in a snake order (0..H-1, H-1..0, ...), so the
        token counts of two hosts differ by at most the longest row. Deterministic;
        the set of rows of a global batch is unchanged, but their order in the
        assembled global batch then depends on the host count. A partial last
        batch is split into contiguous slices as usual."""
        if self.source is None:
            raise ValueError(
                "balance_hosts() on a mixture or a packed pipeline is not supported: its rows come from several "
                "records (packed rows hold seq_len tokens each already)"
            )
        if lengths is None:
            lengths = self.length_index(key)
        lengths = np.asarray(lengths)
        if lengths.shape != (len(self.source),) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(
                f"balance_hosts needs one integer length per record of source {self.source.name!r} "
                f"(shape ({len(self.source)},)), got an array of shape {lengths.shape} and dtype {lengths.dtype}"
            )
        if lengths.size and lengths.dtype.kind == "u" and lengths.max() > np.iinfo(np.int64).max:
            raise ValueError(f"balance_hosts: record {int(lengths.argmax())} has a length beyond 2**63")
        live = lengths if self.survivors is None else lengths[np.asarray(self.survivors)]  # a filter's drops: any
        if live.size and live.min() < 0:
            bad = int(live.argmin()) if self.survivors is None else int(self.survivors[int(live.argmin())])
            raise ValueError(f"balance_hosts: lengths must be >= 0, record {bad} has {int(lengths[bad])}")
        lengths = lengths.astype(np.int64)
        lengths.setflags(write=False)
        return self._replace(host_lengths=lengths, host_lengths_digest=digest(lengths))

    def batch(self, global_batch_size: int, drop_remainder: bool = True) -> Pipeline:
        """Group ``global_batch_size`` consecutive stream positions into a step.

        Batches cross epoch boundaries. With a finite ``num_epochs`` the last
        partial batch is dropped unless ``drop_remainder=False``."""
        if self.batch_size is not None:
            raise ValueError("batch() was already called on this pipeline")
        b = _check_int(global_batch_size, "global_batch_size", 1)
        p = self._replace(batch_size=b, drop_remainder=bool(drop_remainder))
        if p.num_steps == 0:
            raise ValueError(
                f"{self._records_text()} x {self.num_epochs} epoch(s), "
                f"fewer than one batch of {b}: no full batch; use drop_remainder=False, more epochs or a smaller batch"
            )
        return p

    def map_batch(self, fn: Callable[[Any], Any]) -> Pipeline:
        """Apply ``fn(batch) -> batch`` to each host's collated batch (vectorised)."""
        if not callable(fn):
            raise TypeError(f"map_batch() needs a callable, got {fn!r}")
        self._need_batch("map_batch")
        return self._replace(batch_ops=self.batch_ops + (Op(OpKind.MAP_BATCH, fn),))

    def random_map_batch(self, fn: Callable[[Any, np.ndarray], Any]) -> Pipeline:
        """Apply ``fn(batch, keys) -> batch`` where ``keys`` is a ``uint64`` array, one
        key per row, derived from (seed, stream position of the row, stage) only.
        Use :mod:`quern.transforms.random` to turn keys into uniforms, integers or
        normals without creating generators."""
        if not callable(fn):
            raise TypeError(f"random_map_batch() needs a callable, got {fn!r}")
        self._need_batch("random_map_batch")
        return self._replace(batch_ops=self.batch_ops + (Op(OpKind.RANDOM_MAP_BATCH, fn),))

    def _need_batch(self, what: str) -> int:
        """The global batch size; a ``ValueError`` naming ``what`` before ``batch()``."""
        if self.batch_size is None:
            raise ValueError(f"{what}() needs batch() first: a step is a batch")
        return self.batch_size

    def _need_no_batch(self, what: str, instead: str) -> None:
        if self.batch_size is not None:
            raise ValueError(
                f"{what}() after batch(): {what}() is a record-level stage; use {instead} "
                "for a batch-level transform, or move it before batch()"
            )

    # ------------------------------------------------------------------ addressing

    @property
    def num_steps(self) -> int | None:
        """Number of steps in the stream, or ``None`` when it is endless."""
        b = self._need_batch("num_steps")
        total = self._total()
        if total is None:
            return None
        return total // b if self.drop_remainder else -(-total // b)

    def check_step(self, step: object, name: str = "step", end_ok: bool = False) -> int:
        """``step`` as an int after checking it is an integer (``TypeError``), ``>= 0``
        (``ValueError``) and inside the stream (``IndexError``): below :attr:`num_steps`,
        or equal to it when ``end_ok`` (a start step at the end of the stream yields
        nothing). The one end-of-stream check of every entry point."""
        b = self._need_batch("a step")
        step = _check_int(step, name, 0)
        n_steps = self.num_steps
        if n_steps is not None and (step > n_steps or (step == n_steps and not end_ok)):
            raise IndexError(
                f"{name} {step} is past the end of the stream: {n_steps} steps "
                f"({self._records_text()} x {self.num_epochs} epochs, batch {self.batch_size})"
            )
        if (step + 1) * b > _index.MAX_RECORDS:
            raise IndexError(f"{name} {step} is beyond the addressable stream (positions must stay below 2**62)")
        return step

    def positions(self, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Stream positions of this host's rows at ``step`` (int64 array); for a bucketed
        pipeline, the positions in the stream of the step's bucket."""
        step = self.check_step(step)
        if self.bucketing is not None:
            self.bucketing.check_hosts(process_count)  # every bucket's batch size, at the first call per count
            comp, k = self.bucketing.assign(np.asarray([step]))
            return self.bucketing.components[int(comp[0])].positions(int(k[0]), process_index, process_count)
        b = self._need_batch("positions")
        lo, hi = _index.host_rows(b, process_index, process_count)
        start = step * b
        end = start + hi
        total = self._total()
        if total is not None:
            end = min(end, total)
        full = total is None or start + b <= total
        if self.host_lengths is not None and process_count > 1 and full:
            return self._balanced_positions(start, process_index, process_count)
        return np.arange(start + lo, max(start + lo, end), dtype=np.int64)

    def _balanced_positions(self, start: int, process_index: int, process_count: int) -> np.ndarray:
        """This host's positions of the full global batch at ``start`` (see :meth:`balance_hosts`)."""
        B, H = self._need_batch("positions"), process_count
        assert self.host_lengths is not None
        positions = np.arange(start, start + B, dtype=np.int64)
        order = np.argsort(-self.host_lengths[self.record_ids(positions)], kind="stable")
        rank = np.arange(B)
        within, rnd = rank % H, rank // H
        host = np.where(rnd % 2 == 0, within, H - 1 - within)
        return np.sort(positions[order[host == process_index]])

    @property
    def stream_len(self) -> int | None:
        """Records in one epoch of the stream: the filter's survivors, else the
        source's records; ``None`` for a mixture (its components have their own epochs)."""
        if self.source is None:
            return None
        return len(self.survivors) if self.survivors is not None else len(self.source)

    def _total(self) -> int | None:
        """Positions in a finite stream (records, or a packed stream's rows, over all
        epochs); ``None`` when it is endless."""
        if self.num_epochs is None:
            return None
        if self.packing is not None:
            return self.packing.rows_before(self.num_epochs)
        n = self.stream_len
        return None if n is None else n * self.num_epochs

    def _records_text(self) -> str:
        if self.packing is not None:
            p = self.packing
            return f"the packed stream has {p.rows_before(1)} rows of {p.seq_len} tokens in its first epoch"
        assert self.source is not None
        kept = f" ({len(self.survivors)} kept by the filter)" if self.survivors is not None else ""
        return f"source {self.source.name!r} has {len(self.source)} records{kept}"

    @property
    def leaves(self) -> tuple[Pipeline, ...]:
        """The single-source pipelines rows come from: this one, or a mixture's components."""
        if self.packing is not None:
            return (self.packing.inner,)
        if self.bucketing is not None:
            return (self.bucketing.inner,)
        return (self,) if self.mixture is None else self.mixture.components

    @property
    def leaf_names(self) -> tuple[str, ...]:
        """Names of :attr:`leaves`: the source's name, or the mixture's component keys."""
        if self.mixture is not None:
            return self.mixture.names
        if self.packing is not None:
            return self.packing.inner.leaf_names
        if self.bucketing is not None:
            return self.bucketing.inner.leaf_names
        assert self.source is not None
        return (self.source.name,)

    def record_ids(self, positions: np.ndarray) -> np.ndarray:
        """Record id at each stream position of a single-source pipeline (pure index
        arithmetic; with a filter, ids of the survivors). A mixture has
        :meth:`segments` instead."""
        n = self.stream_len
        if n is None:
            raise TypeError("a mixture's rows come from several sources: use segments(positions)")
        ids = _index.epoch_record_ids(positions, n, self.seed, self.shuffle_mode, self.block, self.window)
        return ids if self.survivors is None else np.asarray(self.survivors[ids], dtype=np.int64)

    def segments(self, positions: np.ndarray) -> Segments:
        """The plan of these stream positions: per row, the leaf it comes from (an
        index into :attr:`leaves`), the record id in that leaf's source and the
        position in that leaf's stream. Pure index arithmetic."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.packing is not None:
            raise TypeError("a packed row holds several documents: use pieces(positions)")
        if self.bucketing is not None:
            raise TypeError("a bucketed pipeline's steps come from several streams: use explain(step)")
        if self.mixture is None:
            return Segments(np.zeros(len(positions), dtype=np.int64), self.record_ids(positions), positions)
        m = self.mixture
        if self.batch_size is None and len(m.stages) > 1:
            raise ValueError("a schedule's stages start at steps: call batch() before segments()")
        comp, cpos = _mixture.assign(positions, m.stages, m.seed, self.batch_size or 1, m.block)
        ids = np.empty(len(positions), dtype=np.int64)
        for c in np.unique(comp).tolist():
            sel = comp == c
            part = m.components[c]
            ids[sel] = part.record_ids(cpos[sel]) if part.packing is None else -1  # a packed row: see pieces()
        return Segments(comp, ids, cpos)

    def explain(self, step: int, process_index: int = 0, process_count: int = 1) -> list[list[tuple[str, int]]]:
        """For each row of this host's batch at ``step``: the ``(name, record_index)``
        pairs it was made from, ``name`` being the source's name or, in a mixture,
        the component's key (the record index is then in that component's source).
        O(batch) time; reads nothing."""
        if self.bucketing is not None:
            self.bucketing.check_hosts(process_count)  # every bucket's batch size, at the first call per count
            comp, k = self.bucketing.assign(np.asarray([self.check_step(step)]))
            return self.bucketing.components[int(comp[0])].explain(int(k[0]), process_index, process_count)
        positions = self.positions(step, process_index, process_count)
        names = self.leaf_names
        if self.packing is not None:  # every document in every row
            pieces = self.pieces(positions)
            out: list[list[tuple[str, int]]] = [[] for _ in positions]
            for r, i in zip(pieces.row.tolist(), pieces.ids.tolist()):
                out[r].append((names[0], i))
            return out
        seg = self.segments(positions)
        out = [[(names[c], i)] for c, i in zip(seg.component.tolist(), seg.ids.tolist())]
        if self.mixture is not None:  # a packed component's rows: every document in them
            for c, part in enumerate(self.mixture.components):
                rows = np.flatnonzero(seg.component == c)
                if part.packing is None or not rows.size:
                    continue
                pieces = part.pieces(seg.positions[rows])
                for r in rows.tolist():
                    out[r] = []
                for r, i in zip(pieces.row.tolist(), pieces.ids.tolist()):
                    out[int(rows[r])].append((names[c], i))
        return out

    # ------------------------------------------------------------------ computing

    def batch_at(self, step: int, process_index: int = 0, process_count: int = 1) -> Any:
        """This host's rows of the global batch at ``step``, collated.

        Depends only on the pipeline definition, ``step`` and the host slice
        ``(process_index, process_count)``. Concatenating the slices of all hosts
        gives the global batch. A failing stage raises :class:`~quern.StepError`
        naming the step, host slice, stage and records."""
        return execute.batches_at(self, step, 1, process_index, process_count)[0]

    def batches_at(self, step: int, count: int, process_index: int = 0, process_count: int = 1) -> list[Any]:
        """``[batch_at(s) for s in range(step, step + count)]``, with the records of all
        ``count`` steps read in one bulk ``read_many`` call (fewer, larger reads).

        Each batch is bit-identical to ``batch_at(s)``: record transforms, collation
        and batch transforms still run step by step. Raises the error of the first
        step that fails."""
        return execute.batches_at(self, step, count, process_index, process_count)

    # ------------------------------------------------------------------ identity and iteration

    def describe(self) -> dict[str, Any]:
        """JSON-able description of everything that changes the bytes of a batch: the
        index-format version (the data order), the source's identity (see its
        ``identity()``), seed, epochs, shuffle, batch, every transform (by its code,
        arguments and the values it reads; see :mod:`quern.pipeline.fingerprint`)
        and the ``balance_hosts`` lengths. Raises
        :class:`~quern.pipeline.errors.FingerprintError` naming a value it cannot
        describe. A mixture is described by its components' descriptions, its
        schedule, seed and block size. A filter is described as it was when its
        survivors were found. Computed once per pipeline object."""
        if samedef.active():  # the definition to compare (see quern.pipeline.samedef): afresh, no identity
            return self.describe_until(None)
        d = self.__dict__.get("_description")
        if d is None:
            d = self.describe_until(None)
            object.__setattr__(self, "_description", d)
        return copy.deepcopy(d)

    def describe_until(self, step: int | None) -> dict[str, Any]:
        """:meth:`describe` as it applies to the steps before ``step`` (``None``: all):
        for a mixture, only the schedule stages that start before ``step`` (at least
        the first), which are all that those steps depend on."""
        ops = {
            "record_ops": self._record_ops_description(),
            "batch": [self.batch_size, self.drop_remainder],
            "batch_ops": self._batch_ops_description(),
        }
        if self.mixture is not None:
            return {"index_format": _index.INDEX_FORMAT_VERSION, "mixture": self.mixture.describe(step), **ops}
        if self.packing is not None:
            return {"index_format": _index.INDEX_FORMAT_VERSION, "packing": self.packing.describe(), **ops}
        if self.bucketing is not None:
            return {"index_format": _index.INDEX_FORMAT_VERSION, "bucketing": self.bucketing.describe(), **ops}
        assert self.source is not None
        return {
            "index_format": _index.INDEX_FORMAT_VERSION,
            "source": samedef.IDENTITY if samedef.active() else self.source.identity(),
            "seed": self.seed,
            "num_epochs": self.num_epochs,
            "shuffle": [self.shuffle_mode, self.block, self.window],
            **ops,
            "balance_hosts": self.host_lengths_digest,
        }

    def fingerprint(self) -> str:
        """Stable hash (32 hex digits) of :meth:`describe`: the definition, the data
        order's version and the identity of the data. The same in every process and
        session, and for a script run as ``__main__`` or imported.

        Computed once per pipeline object (it reads a sample of every data file),
        like the record counts its source took when it was built: build the
        pipeline again to see data that changed since."""
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            fp = fingerprint_of(self.describe())
            object.__setattr__(self, "_fingerprint", fp)
        return fp

    def state_at(self, step: int) -> dict[str, Any]:
        """The checkpoint of an iterator whose next step is ``step``: ``{"step",
        "fingerprint"}``, and for a mixture also ``"past"``, the fingerprint of the
        definition as it applies to the steps before ``step``
        (:meth:`describe_until`), and ``"parts"``, a digest of each part of it, so
        that a resume can accept a schedule edited only after ``step`` and name
        what changed otherwise. JSON-serialisable."""
        state: dict[str, Any] = {"step": step, "fingerprint": self.fingerprint()}
        if self.mixture is not None:
            past = self.describe_until(step)
            state["past"] = fingerprint_of(past)
            state["parts"] = _parts(past)
        return state

    def iterator(
        self,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        num_workers: int = 0,
        prefetch: int | None = None,
        num_threads: int = 1,
        read_ahead: int | None = None,
        copy_batches: bool = False,
        lookahead: int = 64,
        prefetch_memory: int = 2 << 30,
        timings: bool = True,
        step_timeout: float | None = None,
    ) -> PipelineIterator:
        """An iterator yielding ``batch_at(s)`` for ``s = start_step, start_step+1, ...``.

        See :class:`quern.pipeline.loader.PipelineIterator` for the arguments."""
        return PipelineIterator(
            self,
            start_step=start_step,
            process_index=process_index,
            process_count=process_count,
            num_workers=num_workers,
            prefetch=prefetch,
            num_threads=num_threads,
            read_ahead=read_ahead,
            copy_batches=copy_batches,
            lookahead=lookahead,
            prefetch_memory=prefetch_memory,
            timings=timings,
            step_timeout=step_timeout,
        )

    def resume(self, state: dict[str, Any], force: bool = False, **iterator_kwargs: Any) -> PipelineIterator:
        """An iterator starting at ``state["step"]`` (from ``it.state()``), after
        :meth:`check_state`: a state from another definition or other data, or one
        without a fingerprint, is refused unless ``force``."""
        return self.iterator(start_step=self.check_state(state, force), **iterator_kwargs)

    def check_state(self, state: dict[str, Any], force: bool = False) -> int:
        """The step of an iterator state (``it.state()``), after checking that it was
        saved from this pipeline: a fingerprint that differs (another definition,
        another data order version, or other data) or is missing (``None``) is a
        ``ValueError`` unless ``force``."""
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
                step = self.check_step(state["step"], "state['step']", end_ok=True)
                past = self.describe_until(step) if self.mixture is not None else None
                if past is not None and state.get("past") == fingerprint_of(past):
                    return step  # only the schedule from ``step`` on changed: the batches taken are the same
                changed = ""
                if past is not None and isinstance(state.get("parts"), dict):
                    mine_parts, theirs = _parts(past), state["parts"]
                    diff = sorted(k for k in set(mine_parts) | set(theirs) if mine_parts.get(k) != theirs.get(k))
                    if diff:
                        changed = f"; what changed for the steps before {step}: {', '.join(diff)}"
                raise ValueError(
                    f"state fingerprint {fp} does not match this pipeline's {mine}: the definition, the data "
                    f"order version or the data changed since the state was saved{changed}; pass force=True "
                    "to resume anyway"
                )
        return self.check_step(state["step"], "state['step']", end_ok=True)

    def to_config(self) -> dict:
        """This pipeline as a config dict (see :mod:`quern.pipeline.config`);
        ``quern.load_config`` of it gives the same fingerprint and batches."""
        return to_config(self)

    def __iter__(self) -> PipelineIterator:
        return self.iterator()

    def __repr__(self) -> str:
        if self.bucketing is not None:
            bk = self.bucketing
            parts = [f"{bk.inner!r}.bucket({list(bk.boundaries)}, {list(bk.batch_sizes)}, key={bk.key!r})"]
        elif self.packing is not None:
            p = self.packing
            parts = [f"{p.inner!r}.pack({p.seq_len}, mode={p.mode!r}, key={p.key!r})"]
        elif self.mixture is not None:
            m = self.mixture
            parts = [f"quern.mix({dict(zip(m.names, m.components))!r}, schedule={[tuple(st) for st in m.stages]})"]
        else:
            parts = [f"Pipeline.from_source({self.source!r}, seed={self.seed}, num_epochs={self.num_epochs})"]
        if self.shuffle_mode == "global":
            parts.append(".shuffle()")
        elif self.shuffle_mode == "block":
            parts.append(f".shuffle('block', block={self.block}, window={self.window})")
        parts += [f".{op.kind.value}({op.name})" for op in self.record_ops]
        if self.batch_size is not None and self.bucketing is None:
            parts.append(f".batch({self.batch_size}, drop_remainder={self.drop_remainder})")
        parts += [f".{op.kind.value}({op.name})" for op in self.batch_ops]
        if self.host_lengths is not None:
            parts.append(".balance_hosts(...)")
        return "".join(parts)


def _parts(description: dict[str, Any]) -> dict[str, str]:
    """A digest of each part of a description (a mixture's components one by one), to
    name what differs between two of them."""
    out: dict[str, str] = {}
    for key, value in description.items():
        if key == "mixture":
            for name, comp in zip(value["names"], value["components"]):
                out[f"component {name!r}"] = fingerprint_of(comp)
            for sub in ("names", "schedule", "seed", "block"):
                out[f"mixture {sub}"] = fingerprint_of(value[sub])
        else:
            out[key] = fingerprint_of(value)
    return out
