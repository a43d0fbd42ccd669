"""Pipeline: an immutable, picklable description of how batches are made.

``Pipeline.batch_at(step, process_index, process_count)`` is a pure function of
(the pipeline definition, step, host slice): it computes the stream positions
of the host's rows, maps them to record ids with :mod:`quern.pipeline.index`,
reads the records in bulk, runs the record transforms, collates, and runs the
batch transforms. No stage keeps state between calls, so resuming is just
calling it with another step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from typing import Any, Callable, Sequence

import numpy as np

from . import index as _index
from .collate import collate, take
from .dump import to_config
from .errors import StepError
from .sources import Source, as_source

__all__ = ["Pipeline", "StepError", "Op"]


@dataclasses.dataclass(frozen=True)
class Op:
    """One transform stage: ``kind`` is map, random_map, map_batch or random_map_batch."""

    kind: str
    fn: Callable


def _describe(obj: Any, depth: int = 0) -> Any:
    """A stable, JSON-able description of a transform for the fingerprint.

    Objects with a ``fingerprint()`` method or a class-defined ``__repr__`` are
    described by it; functions by module, qualified name, a hash of their code
    and constants, defaults and closure values; ``functools.partial`` by its
    function and arguments.
    """
    if depth > 4:
        return type(obj).__qualname__
    fp = getattr(obj, "fingerprint", None)
    if callable(fp) and not inspect.isclass(obj):
        return str(fp())
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, (list, tuple)):
        return [_describe(x, depth + 1) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _describe(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return hashlib.blake2b(np.ascontiguousarray(obj).tobytes() + obj.dtype.str.encode(), digest_size=8).hexdigest()
    if isinstance(obj, np.generic):
        return repr(obj)
    func = getattr(obj, "func", None)
    if func is not None and hasattr(obj, "args") and hasattr(obj, "keywords"):  # functools.partial
        return {"partial": _describe(func, depth + 1), "args": _describe(list(obj.args), depth + 1),
                "kwargs": _describe(dict(obj.keywords), depth + 1)}
    code = getattr(obj, "__code__", None)
    if code is not None:
        h = hashlib.blake2b(digest_size=8)
        names = _hash_code(code, h)
        glb = getattr(obj, "__globals__", {})
        used = {n: _describe_global(glb[n], depth) for n in sorted(names) if n in glb}
        closure = [_describe(c.cell_contents, depth + 1) for c in (obj.__closure__ or ()) if _cell_ok(c)]
        return {"fn": f"{obj.__module__}:{obj.__qualname__}", "code": h.hexdigest(), "globals": used,
                "defaults": _describe(list(obj.__defaults__ or ()), depth + 1), "closure": closure}
    if type(obj).__repr__ is not object.__repr__:
        return f"{type(obj).__module__}.{type(obj).__qualname__}:{obj!r}"
    call = getattr(type(obj), "__call__", None)
    return {"callable": f"{type(obj).__module__}:{type(obj).__qualname__}",
            "call": _describe(call, depth + 1) if call is not None else None}


def _hash_code(code, h) -> set[str]:
    """Feed a code object (bytecode, constants, names, nested code) into ``h``; return the names it uses."""
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    names = set(code.co_names)
    for c in code.co_consts:
        if inspect.iscode(c):
            names |= _hash_code(c, h)
        else:
            h.update(repr(c).encode())
    return names


def _describe_global(value: Any, depth: int) -> Any:
    """A module-level name a transform uses: modules by name, plain values by value, functions recursively."""
    if inspect.ismodule(value):
        return f"module {value.__name__}"
    if isinstance(value, (str, int, float, bool, bytes, type(None), tuple, frozenset)):
        return repr(value)
    if inspect.isfunction(value) or isinstance(value, np.ndarray):
        return _describe(value, depth + 1)
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _cell_ok(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


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
    host_lengths: Any = dataclasses.field(default=None, compare=False)  # per-record lengths, see balance_hosts

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_source(cls, source: Any, seed: int = 0, num_epochs: int | None = None) -> "Pipeline":
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

    def _replace(self, **kw) -> "Pipeline":
        return dataclasses.replace(self, **kw)

    def shuffle(self, mode: str = "global", block: int | None = None, window: int = 8) -> "Pipeline":
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

    def map(self, fn: Callable[[Any], Any]) -> "Pipeline":
        """Apply ``fn(record) -> record`` to every record (after ``batch()``: to every batch).

        If ``fn`` has a ``map_many(records) -> records`` method it is called once
        per batch with the list of records instead (vectorised transforms)."""
        if not callable(fn):
            raise TypeError(f"map() needs a callable, got {fn!r}")
        if self.batch_size is not None:
            return self.map_batch(fn)
        return self._replace(record_ops=self.record_ops + (Op("map", fn),))

    def random_map(self, fn: Callable[[Any, np.random.Generator], Any]) -> "Pipeline":
        """Apply ``fn(record, rng) -> record``; ``rng`` is a ``numpy.random.Generator``
        (Philox) keyed by (seed, stream position, stage) only, so the same record at
        the same position always draws the same numbers. ``rng`` is valid only
        during the call."""
        if not callable(fn):
            raise TypeError(f"random_map() needs a callable, got {fn!r}")
        if self.batch_size is not None:
            raise ValueError("random_map() after batch(): use random_map_batch(fn) for batch-level randomness")
        return self._replace(record_ops=self.record_ops + (Op("random_map", fn),))

    def balance_hosts(self, lengths: Any) -> "Pipeline":
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
        return self._replace(host_lengths=lengths)

    def batch(self, global_batch_size: int, drop_remainder: bool = True) -> "Pipeline":
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

    def map_batch(self, fn: Callable[[Any], Any]) -> "Pipeline":
        """Apply ``fn(batch) -> batch`` to each host's collated batch (vectorised)."""
        if not callable(fn):
            raise TypeError(f"map_batch() needs a callable, got {fn!r}")
        self._need_batch("map_batch")
        return self._replace(batch_ops=self.batch_ops + (Op("map_batch", fn),))

    def random_map_batch(self, fn: Callable[[Any, np.ndarray], Any]) -> "Pipeline":
        """Apply ``fn(batch, keys) -> batch`` where ``keys`` is a ``uint64`` array, one
        key per row, derived from (seed, stream position of the row, stage) only.
        Use :mod:`quern.transforms.random` to turn keys into uniforms, integers or
        normals without creating generators."""
        if not callable(fn):
            raise TypeError(f"random_map_batch() needs a callable, got {fn!r}")
        self._need_batch("random_map_batch")
        return self._replace(batch_ops=self.batch_ops + (Op("random_map_batch", fn),))

    def _need_batch(self, what: str) -> None:
        if self.batch_size is None:
            raise ValueError(f"{what}() needs batch() first: a step is a batch")

    # ------------------------------------------------------------------ addressing

    @property
    def num_steps(self) -> int | None:
        """Number of steps in the stream, or ``None`` when it is endless."""
        self._need_batch("num_steps")
        if self.num_epochs is None:
            return None
        total = len(self.source) * self.num_epochs
        b = self.batch_size
        return total // b if self.drop_remainder else -(-total // b)

    def positions(self, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Stream positions of this host's rows at ``step`` (int64 array)."""
        self._need_batch("positions")
        step = _check_int(step, "step", 0)
        n_steps = self.num_steps
        if n_steps is not None and step >= n_steps:
            raise IndexError(
                f"step {step} is past the end of the stream: {n_steps} steps "
                f"({len(self.source)} records x {self.num_epochs} epochs, batch {self.batch_size})"
            )
        lo, hi = _index.host_rows(self.batch_size, process_index, process_count)
        if (step + 1) * self.batch_size > _index.MAX_RECORDS:
            raise IndexError(f"step {step} is beyond the addressable stream (positions must stay below 2**62)")
        start = step * self.batch_size
        end = start + hi
        if self.num_epochs is not None:
            end = min(end, len(self.source) * self.num_epochs)
        full = self.num_epochs is None or start + self.batch_size <= len(self.source) * self.num_epochs
        if self.host_lengths is not None and process_count > 1 and full:
            return self._balanced_positions(start, process_index, process_count)
        return np.arange(start + lo, max(start + lo, end), dtype=np.int64)

    def _balanced_positions(self, start: int, process_index: int, process_count: int) -> np.ndarray:
        """This host's positions of the full global batch at ``start`` (see :meth:`balance_hosts`)."""
        B, H = self.batch_size, process_count
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
        gives the global batch."""
        return self.batches_at(step, 1, process_index, process_count)[0]

    def batches_at(self, step: int, count: int, process_index: int = 0, process_count: int = 1) -> list:
        """``[batch_at(s) for s in range(step, step + count)]``, with the records of all
        ``count`` steps read in one bulk ``read_many`` call (fewer, larger reads).

        Each batch is bit-identical to ``batch_at(s)``: record transforms, collation
        and batch transforms still run step by step. Raises the error of the first
        step that fails."""
        count = _check_int(count, "count", 1)
        out = []
        for _, batch, error in self.step_results(range(step, step + count), process_index, process_count):
            if error is not None:
                raise error
            out.append(batch)
        return out

    def step_results(self, steps: Sequence[int], process_index: int = 0, process_count: int = 1):
        """Yield ``(step, batch_at(step), None)`` or ``(step, None, error)`` for each of
        ``steps`` in order (any steps, not necessarily consecutive).

        The records of all the steps are read with one bulk ``read_many`` call; if
        that read fails, each step is read on its own so that a read error is
        reported at its own step and the other steps still succeed. A failing step
        does not stop the later ones. Each batch is bit-identical to ``batch_at``."""
        steps = [_check_int(s, "step", 0) for s in steps]
        if not steps:
            return
        positions = [self.positions(s, process_index, process_count) for s in steps]
        wheres = [f"step {s} (host {process_index} of {process_count})" for s in steps]
        for i, s in enumerate(steps):  # a host with no rows in a partial last batch: probe row 0 for the structure
            if not positions[i].size:
                positions[i] = np.asarray([s * self.batch_size], dtype=np.int64)
                wheres[i] = None
        all_ids = self.record_ids(np.concatenate(positions))
        try:
            all_records = self.source.read_many(all_ids)
        except Exception as e:
            if len(steps) > 1:  # find the step(s) whose records fail, one read each
                for s in steps:
                    yield from self.step_results([s], process_index, process_count)
                return
            error = StepError(
                f"step {steps[0]} (host {process_index} of {process_count}), stage 'read' of source "
                f"{self.source.name!r} (records {_ids_text(self, all_ids)}): {type(e).__name__}: {e}"
            )
            error.__cause__ = e
            yield steps[0], None, error
            return
        lo = 0
        for s, pos, where in zip(steps, positions, wheres):
            hi = lo + len(pos)
            ids, records = all_ids[lo:hi], all_records[lo:hi]
            lo = hi
            try:
                if where is None:
                    batch = take(self._transform(records, pos, ids, f"step {s}"), slice(0, 0))
                    pos, ids = pos[:0], ids[:0]
                else:
                    batch = self._transform(records, pos, ids, where)
                batch = self._batch_ops(batch, pos, ids, where or f"step {s}")
            except Exception as e:
                yield s, None, e
                continue
            yield s, batch, None

    def _transform(self, records: list, positions: np.ndarray, ids: np.ndarray, where: str) -> Any:
        """Run the record transforms on one step's records and collate them."""
        for k, op in enumerate(self.record_ops):
            records = self._apply_record_op(k, op, records, positions, ids, where)
        try:
            return collate(records)
        except Exception as e:
            row = getattr(e, "row", None)
            blame = (
                f" row {row} = record {int(ids[row])} of source {self.source.name!r}"
                if row is not None and row < len(ids) else f" (records {_ids_text(self, ids)})"
            )
            raise StepError(f"{where}, stage 'collate'{blame}: {e}") from e

    def _batch_ops(self, batch: Any, positions: np.ndarray, ids: np.ndarray, where: str) -> Any:
        for k, op in enumerate(self.batch_ops):
            try:
                if op.kind == "random_map_batch":
                    batch = op.fn(batch, self._keys(positions, "batch", k))
                else:
                    batch = op.fn(batch)
            except Exception as e:
                raise StepError(
                    f"{where}, stage {op.kind}[{k}] {_name(op.fn)} (records {_ids_text(self, ids)}): "
                    f"{type(e).__name__}: {e}"
                ) from e
        return batch

    def _keys(self, positions: np.ndarray, level: str, k: int) -> np.ndarray:
        salt = 1 if level == "record" else 2
        return _index.derive_key(self.seed, salt, k, positions)

    def _apply_record_op(self, k: int, op: Op, records: list, positions: np.ndarray, ids: np.ndarray, where: str) -> list:
        stage = f"{op.kind}[{k}] {_name(op.fn)}"
        many = getattr(op.fn, "map_many", None) if op.kind == "map" else None
        if many is not None:
            try:
                out = many(records)
            except Exception as e:
                raise StepError(f"{where}, stage {stage} (records {_ids_text(self, ids)}): {type(e).__name__}: {e}") from e
            if len(out) != len(records):
                raise StepError(f"{where}, stage {stage}: map_many returned {len(out)} records for {len(records)}")
            return out
        out = [None] * len(records)
        if op.kind == "random_map":
            keys = self._keys(positions, "record", k)
            bitgen = np.random.Philox(key=0)
            rng = np.random.Generator(bitgen)
            state = bitgen.state
            state["state"]["counter"][:] = 0
        fn = op.fn
        for i, rec in enumerate(records):
            try:
                if op.kind == "random_map":
                    state["state"]["key"][:] = (keys[i], k)
                    bitgen.state = state
                    out[i] = fn(rec, rng)
                else:
                    out[i] = fn(rec)
            except Exception as e:
                raise StepError(
                    f"{where}, stage {stage}, row {i} = record {int(ids[i])} of source {self.source.name!r} "
                    f"(position {int(positions[i])}): {type(e).__name__}: {e}"
                ) from e
        return out

    # ------------------------------------------------------------------ identity and iteration

    def describe(self) -> dict:
        """JSON-able description of everything that changes the bytes of a batch."""
        return {
            "format": 1,
            "source": self.source.identity(),
            "seed": self.seed,
            "num_epochs": self.num_epochs,
            "shuffle": [self.shuffle_mode, self.block, self.window],
            "record_ops": [[op.kind, _describe(op.fn)] for op in self.record_ops],
            "batch": [self.batch_size, self.drop_remainder],
            "batch_ops": [[op.kind, _describe(op.fn)] for op in self.batch_ops],
            **({} if self.host_lengths is None else
               {"balance_hosts": hashlib.sha256(self.host_lengths.tobytes()).hexdigest()[:32]}),
        }

    def fingerprint(self) -> str:
        """Stable hash of :meth:`describe`: the definition and the identity of the data.

        Computed once per pipeline object (it reads a sample of every data file),
        like the record counts its source took when it was built: build the
        pipeline again to see data that changed since."""
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            text = json.dumps(self.describe(), sort_keys=True, default=repr)
            fp = hashlib.sha256(text.encode()).hexdigest()[:32]
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
    ):
        """An iterator yielding ``batch_at(s)`` for ``s = start_step, start_step+1, ...``.

        See :class:`quern.pipeline.loader.PipelineIterator`."""
        from .loader import PipelineIterator

        return PipelineIterator(
            self,
            start_step=start_step,
            process_index=process_index,
            process_count=process_count,
            num_workers=num_workers,
            prefetch=prefetch,
            num_threads=num_threads,
            read_ahead=read_ahead,
        )

    def resume(self, state: dict, force: bool = False, **iterator_kwargs):
        """An iterator starting at ``state["step"]`` (from ``it.state()``).

        Refuses (``ValueError``) a state whose fingerprint differs from this
        pipeline's, i.e. a different definition or different data, unless ``force``."""
        return self.iterator(start_step=self.check_state(state, force), **iterator_kwargs)

    def to_config(self) -> dict:
        """This pipeline as a config dict (see :mod:`quern.pipeline.config`);
        ``quern.load_config`` of it gives the same fingerprint and batches."""
        return to_config(self)

    def check_state(self, state: dict, force: bool = False) -> int:
        """The step of an iterator state (``it.state()``), after checking that it was
        saved from this pipeline: a different fingerprint (another definition or other
        data) is a ``ValueError`` unless ``force``."""
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError(f"state must be a dict with a 'step' key, as from iterator.state(); got {state!r}")
        fp, mine = state.get("fingerprint"), self.fingerprint()
        if fp is not None and fp != mine and not force:
            raise ValueError(
                f"state fingerprint {fp} does not match this pipeline's {mine}: the definition or "
                "the data changed since the state was saved; pass force=True to resume anyway"
            )
        return _check_int(state["step"], "state['step']", 0)

    def __iter__(self):
        return self.iterator()

    def __repr__(self) -> str:
        parts = [f"Pipeline.from_source({self.source!r}, seed={self.seed}, num_epochs={self.num_epochs})"]
        if self.shuffle_mode == "global":
            parts.append(".shuffle()")
        elif self.shuffle_mode == "block":
            parts.append(f".shuffle('block', block={self.block}, window={self.window})")
        parts += [f".{op.kind}({_name(op.fn)})" for op in self.record_ops]
        if self.batch_size is not None:
            parts.append(f".batch({self.batch_size}, drop_remainder={self.drop_remainder})")
        parts += [f".{op.kind}({_name(op.fn)})" for op in self.batch_ops]
        if self.host_lengths is not None:
            parts.append(".balance_hosts(...)")
        return "".join(parts)


def _name(fn: Any) -> str:
    n = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return n if isinstance(n, str) else repr(fn)


def _ids_text(p: Pipeline, ids: np.ndarray) -> str:
    shown = ids[:8].tolist()
    return f"{p.source.name} {shown}{'...' if len(ids) > 8 else ''}"
