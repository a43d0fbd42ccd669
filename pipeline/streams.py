"""The definitions of the streams made of other pipelines: a mixture of components
(:func:`quern.mix`), a packed stream (:meth:`Pipeline.pack`) and a bucketed one
(:meth:`Pipeline.bucket`). Each holds the pipelines it is made of and what its
plan needs (:mod:`quern.pipeline.plan`); a :class:`~quern.pipeline.dataset.Pipeline`
holds one of them instead of a source."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Any

import numpy as np

from . import index as _index
from .fingerprint import fingerprint_of
from .plan import indexfile
from .plan import mixture as _mixture
from .plan import packing as _packing

__all__ = ["Mixture", "Packing", "Bucketing"]


@dataclasses.dataclass(frozen=True)
class Mixture:
    """A mixture's definition (see :func:`quern.mix`): named component pipelines
    (without batch), the schedule of their weights, the seed of the assignment and
    the block size (:mod:`quern.pipeline.plan.mixture`)."""

    names: tuple[str, ...]
    components: tuple[Any, ...]  # Pipelines without batch
    stages: tuple[_mixture.Stage, ...]
    seed: int
    block: int

    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        """JSON-able; with ``until_step``, what the steps before ``until_step`` depend on:
        only the stages that start before it (at least the first), and only the
        components with a weight above zero in one of them, in their order. A component
        zero in all those stages takes no slot of their blocks, and its index moves no
        other component's slots or quantized weight, so the steps before
        ``until_step`` are the same with or without it, wherever it is among the
        components, as long as the block size is the same (it is in the description:
        it grows with the number of components, see
        :func:`~quern.pipeline.plan.mixture.block_size`)."""
        stages, live = self.stages, list(range(len(self.names)))
        if until_step is not None:
            stages = tuple(st for st in stages if st.start_step < max(1, until_step))
            live = [c for c in live if any(st.weights[c] for st in stages)]
        return {
            "names": [self.names[c] for c in live],
            "components": [self.components[c].describe() for c in live],
            "schedule": [[st.start_step, [st.weights[c] for c in live]] for st in stages],
            "seed": self.seed,
            "block": self.block,
        }


@dataclasses.dataclass(frozen=True)
class Packing:
    """A packed stream's definition (see :meth:`Pipeline.pack`): the pipeline whose
    records are packed, the row length, the mode, the key of the tokens and the
    length index (one value per record of its source). Plans of epochs are
    computed on demand and kept (:mod:`quern.pipeline.plan.packing`)."""

    inner: Any  # the Pipeline it is made of
    seq_len: int
    mode: str
    key: str | None
    lengths: np.ndarray = dataclasses.field(compare=False, repr=False)
    lengths_digest: str = ""
    cache_dir: str | None = dataclasses.field(default=None, compare=False, repr=False)
    lengths_file: str | None = dataclasses.field(default=None, compare=False, repr=False)  # the .npy it came from

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_plans"}  # plans are recomputed where needed

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def describe(self) -> dict[str, Any]:
        return {
            "inner": self.inner.describe(),
            "seq_len": self.seq_len,
            "mode": self.mode,
            "key": self.key,
            "lengths": self.lengths_digest,
        }

    def epoch(self, e: int) -> tuple[_packing.EpochPlan, np.ndarray]:
        """Epoch ``e``'s plan and the record ids of its documents in stream order (cached, two epochs)."""
        plans = self.__dict__.setdefault("_plans", {})
        hit = plans.get(e)
        if hit is None:
            n = self.inner.stream_len
            assert n is not None
            ids = self.inner.record_ids(np.arange(e * n, (e + 1) * n, dtype=np.int64))
            hit = (_packing.plan_epoch(self.lengths[ids], self.seq_len, self.mode, self.inner.seed, e), ids)
            if hit[0].rows != self.rows_before(1):
                raise RuntimeError(
                    f"packing: epoch {e} has {hit[0].rows} rows where every epoch has {self.rows_before(1)}; the "
                    f"cached count {self._rows_path()} is wrong: delete it"
                )
            plans[e] = hit
            while len(plans) > 2:
                plans.pop(next(iter(plans)))
        return hit

    def rows_before(self, e: int) -> int:
        """Rows in the epochs before ``e``: ``e`` times the rows of one epoch, which are the
        same in every epoch (``concat``: ``ceil(tokens / seq_len)``; ``best_fit``: best-fit
        decreasing depends only on the lengths, not on their order). For ``best_fit`` that
        count is computed once from the lengths and kept in memory and on disk (under
        ``cache_dir/packing/``, keyed by the fingerprint of this definition), so a cold
        resume in any epoch plans only that epoch."""
        per = self.__dict__.get("_rows_per_epoch")
        if per is None:
            live = np.asarray(self.lengths)
            live = live[live > 0]
            if self.mode == "concat":
                per = -(-int(live.sum()) // self.seq_len)
            else:
                per = self._load_rows()
                if per is None:
                    whole = live // self.seq_len
                    rem = live - whole * self.seq_len
                    per = int(whole.sum()) + _packing.best_fit_decreasing(rem[rem > 0], self.seq_len)[1]
                    self._store_rows(per)
            self.__dict__["_rows_per_epoch"] = per
        return e * per

    def _rows_path(self) -> str:
        key = fingerprint_of({"index_format": _index.INDEX_FORMAT_VERSION, "packing": self.describe()})
        return os.path.join(indexfile.cache_dir(self.cache_dir), "packing", f"{key}.rows.json")

    def _load_rows(self) -> int | None:
        """The rows per epoch cached on disk, or ``None``: used only if the file is
        ``{"rows_per_epoch": n, "check": ...}`` with a positive ``n`` whose check (a hash of
        the file's key and ``n``) matches; every epoch planned later is compared with it."""
        try:
            with open(self._rows_path()) as f:
                got = json.load(f)
        except (OSError, ValueError):
            return None
        rows = got.get("rows_per_epoch") if isinstance(got, dict) else None
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1 or got.get("check") != self._check(rows):
            return None
        return rows

    def _check(self, rows: int) -> str:
        return fingerprint_of({"file": os.path.basename(self._rows_path()), "rows_per_epoch": rows})

    def _store_rows(self, rows: int) -> None:
        """Write the count atomically (a temporary file renamed); a cache that cannot be
        written (read-only, full) is skipped, and the temporary file removed."""
        path = self._rows_path()
        tmp = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"rows_per_epoch": rows, "check": self._check(rows)}, f)
            os.replace(tmp, path)
        except OSError:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The epoch of each row position and the row's index within its epoch."""
        rows = np.asarray(rows, dtype=np.int64)
        if not rows.size:
            return rows.copy(), rows.copy()
        top, e = int(rows.max()), 0
        while self.rows_before(e + 1) <= top:
            e += 1
        cum = np.asarray([self.rows_before(k) for k in range(e + 2)], dtype=np.int64)
        epochs = np.searchsorted(cum, rows, side="right") - 1
        return epochs, rows - cum[epochs]


@dataclasses.dataclass(frozen=True)
class Bucketing:
    """A bucketed stream's definition (see :meth:`Pipeline.bucket`): the pipeline whose
    records are bucketed, the bucket bounds and batch sizes, and the batched
    pipeline of each bucket (the records of its length range, padded to its upper
    bound); steps are assigned to buckets by a mixture at step granularity."""

    inner: Any  # the Pipeline it is made of
    boundaries: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    key: str | None
    pad_value: Any
    buckets: tuple[int, ...]  # the buckets that hold records (indices into boundaries)
    components: tuple[Any, ...]  # one batched Pipeline per bucket that holds records
    stages: tuple[_mixture.Stage, ...]
    block: int
    lengths_digest: str
    lengths: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)  # per source record
    lengths_file: str | None = dataclasses.field(default=None, compare=False, repr=False)  # the .npy it came from

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"len<={self.boundaries[b]}" for b in self.buckets)

    def describe(self) -> dict[str, Any]:
        return {
            "inner": self.inner.describe(),
            "boundaries": list(self.boundaries),
            "batch_sizes": list(self.batch_sizes),
            "key": self.key,
            "pad_value": self.pad_value,
            "weights": [list(st.weights) for st in self.stages],
            "block": self.block,
            "lengths": self.lengths_digest,
        }

    def check_hosts(self, process_count: int) -> None:
        """That every bucket's batch splits over ``process_count`` hosts (each host takes
        ``batch_size / process_count`` rows of every step of the bucket): a ``ValueError``
        naming the first bucket whose batch size is not a multiple of the host count.
        Checked once per host count (by the iterator when it is created, by ``batch_at``
        and ``explain``), so it fails before the first step, not at the first step of that
        bucket."""
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
        a = _mixture.assign(np.asarray(steps, dtype=np.int64), self.stages, self.inner.seed, 1, self.block)
        return a.component, a.position
