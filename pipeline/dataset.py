"""Pipeline: the immutable, picklable definition of how batches are made, and its fluent API.

A :class:`Pipeline` says which records make each step (source, seed, epochs,
shuffle, batch size, host slices: pure index arithmetic, see
:mod:`quern.pipeline.index`) and which transforms run on them. Computing a step
is the step runner's job (:mod:`quern.pipeline.execute`), iterating the
iterator's (:mod:`quern.pipeline.loader`), and hashing the definition the
fingerprint's (:mod:`quern.pipeline.fingerprint`); the methods here are thin
entry points to them. ``batch_at(step, process_index, process_count)`` is a
pure function of (the definition, step, host slice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from . import execute
from . import index as _index
from .digest import digest
from .dump import to_config
from .fingerprint import describe_callable, fingerprint_of
from .loader import PipelineIterator
from .ops import Op, OpKind
from .sources import Source, as_source

__all__ = ["Pipeline", "Op", "OpKind"]

_check_int = _index.check_int


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The description of a data pipeline. Build it with :meth:`from_source` and chain
    ``shuffle / map / random_map / batch / map_batch``; each call returns a new pipeline.

    A batch depends only on (this description, the step, the host slice): never
    on worker count, thread timing or earlier calls.
    """

    source: Source
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

    def shuffle(self, mode: str = "global", block: int | None = None, window: int = 8) -> Pipeline:
        """Shuffle records with a new permutation each epoch.

        ``mode="global"``: a keyed bijection over all records. ``mode="block"``:
        permute blocks of ``block`` consecutive records (default: the source's
        row-group size) and shuffle within windows of ``window`` blocks, so
        reads stay local to few row groups.
        """
        if self.batch_size is not None or self.record_ops:
            raise ValueError("shuffle() must come before map() and batch(): it reorders records of the source")
        if mode not in ("global", "block"):
            raise ValueError(f"shuffle mode must be 'global' or 'block', got {mode!r}")
        if mode == "global":
            return self._replace(shuffle_mode="global", block=1, window=1)
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

    def balance_hosts(self, lengths: Any) -> Pipeline:
        """Token-balanced host slices: ``lengths[i]`` is the length (token count) of
        record ``i``, a length index computed once. Each host still gets ``B / H``
        rows of every full global batch, but which rows is chosen so that the hosts'
        token counts are even: rows sorted by length (longest first, ties by
        position) are dealt to hosts in a snake order (0..H-1, H-1..0, ...), so the
        token counts of two hosts differ by at most the longest row. Deterministic;
        the set of rows of a global batch is unchanged, but their order in the
        assembled global batch then depends on the host count. A partial last
        batch is split into contiguous slices as usual."""
        lengths = np.asarray(lengths)
        if lengths.shape != (len(self.source),) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(
                f"balance_hosts needs one integer length per record of source {self.source.name!r} "
                f"(shape ({len(self.source)},)), got an array of shape {lengths.shape} and dtype {lengths.dtype}"
            )
        if lengths.size and lengths.dtype.kind == "u" and lengths.max() > np.iinfo(np.int64).max:
            raise ValueError(f"balance_hosts: record {int(lengths.argmax())} has a length beyond 2**63")
        if lengths.size and lengths.min() < 0:
            raise ValueError(f"balance_hosts: lengths must be >= 0, record {int(lengths.argmin())} has {lengths.min()}")
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
                f"source {self.source.name!r} has {len(self.source)} records x {self.num_epochs} epoch(s), "
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
        if self.num_epochs is None:
            return None
        total = len(self.source) * self.num_epochs
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
                f"({len(self.source)} records x {self.num_epochs} epochs, batch {self.batch_size})"
            )
        if (step + 1) * b > _index.MAX_RECORDS:
            raise IndexError(f"{name} {step} is beyond the addressable stream (positions must stay below 2**62)")
        return step

    def positions(self, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Stream positions of this host's rows at ``step`` (int64 array)."""
        step = self.check_step(step)
        b = self._need_batch("positions")
        lo, hi = _index.host_rows(b, process_index, process_count)
        start = step * b
        end = start + hi
        if self.num_epochs is not None:
            end = min(end, len(self.source) * self.num_epochs)
        full = self.num_epochs is None or start + b <= len(self.source) * self.num_epochs
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

    def record_ids(self, positions: np.ndarray) -> np.ndarray:
        """Record id at each stream position (pure index arithmetic)."""
        return _index.epoch_record_ids(
            positions, len(self.source), self.seed, self.shuffle_mode, self.block, self.window
        )

    def explain(self, step: int, process_index: int = 0, process_count: int = 1) -> list[list[tuple[str, int]]]:
        """For each row of this host's batch at ``step``: the ``(source_name, record_index)``
        pairs it was made from. O(batch) time; reads nothing."""
        ids = self.record_ids(self.positions(step, process_index, process_count))
        name = self.source.name
        return [[(name, i)] for i in ids.tolist()]

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
        describe."""
        return {
            "index_format": _index.INDEX_FORMAT_VERSION,
            "source": self.source.identity(),
            "seed": self.seed,
            "num_epochs": self.num_epochs,
            "shuffle": [self.shuffle_mode, self.block, self.window],
            "record_ops": [
                [op.kind.value, describe_callable(op.fn, op.label(k))] for k, op in enumerate(self.record_ops)
            ],
            "batch": [self.batch_size, self.drop_remainder],
            "batch_ops": [
                [op.kind.value, describe_callable(op.fn, op.label(k))] for k, op in enumerate(self.batch_ops)
            ],
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

    def iterator(
        self,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        num_workers: int = 0,
        prefetch: int = 2,
        num_threads: int = 1,
        read_ahead: int | None = None,
        copy_batches: bool = False,
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
                raise ValueError(
                    f"state fingerprint {fp} does not match this pipeline's {mine}: the definition, the data "
                    "order version or the data changed since the state was saved; pass force=True to resume anyway"
                )
        return self.check_step(state["step"], "state['step']", end_ok=True)

    def to_config(self) -> dict:
        """This pipeline as a config dict (see :mod:`quern.pipeline.config`);
        ``quern.load_config`` of it gives the same fingerprint and batches."""
        return to_config(self)

    def __iter__(self) -> PipelineIterator:
        return self.iterator()

    def __repr__(self) -> str:
        parts = [f"Pipeline.from_source({self.source!r}, seed={self.seed}, num_epochs={self.num_epochs})"]
        if self.shuffle_mode == "global":
            parts.append(".shuffle()")
        elif self.shuffle_mode == "block":
            parts.append(f".shuffle('block', block={self.block}, window={self.window})")
        parts += [f".{op.kind.value}({op.name})" for op in self.record_ops]
        if self.batch_size is not None:
            parts.append(f".batch({self.batch_size}, drop_remainder={self.drop_remainder})")
        parts += [f".{op.kind.value}({op.name})" for op in self.batch_ops]
        if self.host_lengths is not None:
            parts.append(".balance_hosts(...)")
        return "".join(parts)
