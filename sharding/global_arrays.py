"""Global ``jax.Array`` batches: each host computes its rows, JAX assembles the global batch.

:func:`global_iterator` yields, for steps ``start_step, start_step + 1, ...``, the
pipeline's global batch at that step as a tree of ``jax.Array`` of the global
shape ``(global_batch_size, ...)``, sharded over ``mesh``. Each process computes
only the rows its own devices hold (its host slice), with
``jax.make_array_from_process_local_data``. The batch at step ``s`` depends only
on the pipeline and ``s``: not on the number of hosts, devices or workers, so a
run stopped at step ``k`` on H hosts resumes on H' hosts with the same batches
(with ``Pipeline.balance_hosts``, the same rows in an order that depends on H).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

from ..pipeline.core.timing import DEVICE_PUT, LIVE, StepClock
from ..pipeline.order.index import host_rows
from .device_stages import DeviceStages

__all__ = ["DEVICE_PREFETCH", "global_iterator", "global_batch_at", "GlobalIterator", "process_rows", "host_slice"]

DEVICE_PREFETCH = 2  # global batches kept in flight to the devices, by default


def host_slice() -> tuple[int, int]:
    """This process's host slice, from JAX: what to pass to ``pipe.batch_at`` or ``pipe.iterator``.

    Returns:
        ``(jax.process_index(), jax.process_count())``.
    """
    import jax

    return jax.process_index(), jax.process_count()


def _batch_sharding(mesh: Any, partition_spec: Any) -> Any:
    from jax.sharding import NamedSharding, PartitionSpec

    if partition_spec is None:  # the batch axis over every mesh axis
        partition_spec = PartitionSpec(tuple(mesh.axis_names))
    return NamedSharding(mesh, partition_spec)


def process_rows(sharding: Any, global_batch_size: int) -> tuple[int, int]:
    """The rows of a global batch that this process's devices hold.

    Args:
        sharding: the batch's ``jax.sharding.Sharding``.
        global_batch_size: the rows of the global batch.

    Returns:
        ``(lo, hi)``: the rows ``[lo, hi)``.

    Raises:
        ValueError: the rows are not contiguous (the mesh's devices are not
            ordered by process).
    """
    shape = (global_batch_size,)
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        sl = index[0] if index else slice(None)
        lo, hi, _ = sl.indices(global_batch_size)
        rows.update(range(lo, hi))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ValueError(
            f"the devices of this process hold rows {sorted(rows)[:8]}... of the global batch, which are not "
            "contiguous; order the mesh's devices by process (e.g. jax.make_mesh) so that each host owns a block"
        )
    return lo, hi


def _host_of(sharding: Any, global_batch_size: int) -> tuple[int, int]:
    """``(process_index, process_count)``: this process's host slice of a global batch sharded by ``sharding``.

    Raises:
        ValueError: its rows are not one of equal host slices.
    """
    B = global_batch_size  # noqa: N806
    lo, hi = process_rows(sharding, B)
    count = B // (hi - lo)
    if B % (hi - lo) or lo % (hi - lo):
        raise ValueError(f"this process holds rows [{lo}, {hi}) of {B}: not one of {B} // n equal host slices")
    index = lo // (hi - lo)
    host_rows(B, index, count)  # validates
    return index, count


def _to_global(pipe: Any, batch: Any, sharding: Any, index: int, count: int, step: int) -> Any:
    """This host's ``batch`` of ``step`` as the global batch of ``jax.Array``, after the device stages."""
    import jax

    B = pipe.batch_size  # noqa: N806
    rows = B // count

    def one(x: Any) -> Any:
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] != rows or x.dtype.kind not in "biufc":
            raise ValueError(
                f"global_iterator: every leaf of a batch must be a numeric array with a leading axis of this "
                f"host's {rows} rows; got {x.dtype} of shape {x.shape}"
            )
        return jax.make_array_from_process_local_data(sharding, x, (B,) + x.shape[1:])

    out = jax.tree_util.tree_map(one, batch)
    stages = DeviceStages.of(pipe)
    if not stages:
        return out
    positions = pipe.positions(step, index, count) if stages.random else np.zeros(0, dtype=np.int64)
    datas = [one(d) for d in stages.local_keys(positions, rows, index * rows)]
    return stages(out, datas, step)


def global_batch_at(pipe: Any, step: int, mesh: Any, *, partition_spec: Any = None) -> Any:
    """The global batch at ``step``, as :func:`global_iterator` yields it (the device stages applied).

    Every process calls it with the same arguments: each computes its own rows
    (``pipe.batch_at(step, process_index, process_count)``, its host slice found from the mesh)
    and JAX assembles them, as in :func:`global_iterator`.

    Args:
        pipe: the pipeline, with ``batch()``.
        step: the step.
        mesh: the ``jax.sharding.Mesh``.
        partition_spec: as for :func:`global_iterator`.

    Returns:
        A tree of ``jax.Array`` of the global shape, sharded over ``mesh``.

    Raises:
        ValueError: ``pipe`` has no batch size, or this process's rows are not one of equal host slices.
        StepError: the step could not be computed (on the host or on the devices).
    """
    if pipe.batch_size is None:
        raise ValueError("global_batch_at() needs batch() first: a step is a batch")
    sharding = _batch_sharding(mesh, partition_spec)
    index, count = _host_of(sharding, pipe.batch_size)
    return _to_global(pipe, pipe.batch_at(step, index, count), sharding, index, count, step)


class GlobalIterator:
    """Iterator of global batches: see :func:`global_iterator`, which makes one and takes the same arguments.

    Attributes:
        step: the next step to be yielded.
        process_index: this host's slice of each batch.
        process_count: the number of host slices.
        global_batch_size: the rows of a global batch.
        device_prefetch: the most global batches kept in flight to the devices.
    """

    def __init__(
        self,
        pipe: Any,
        mesh: Any,
        *,
        start_step: int = 0,
        partition_spec: Any = None,
        num_workers: int = 0,
        device_prefetch: int = DEVICE_PREFETCH,
        step_timeout: float | None = None,
    ) -> None:
        import jax

        if pipe.batch_size is None:
            raise ValueError("global_iterator() needs batch() first: a step is a batch")
        partial = pipe.num_steps is not None and (pipe.stream.length() or 0) % pipe.batch_size
        if not pipe.drop_remainder and pipe.pad_remainder is None and partial:
            raise ValueError(
                "global_iterator needs batches of one global shape: use .batch(B, drop_remainder=True), or "
                ".batch(B, drop_remainder=False, pad_remainder=True) to pad the last batch (evaluation)"
            )
        self.sharding = _batch_sharding(mesh, partition_spec)
        B = pipe.batch_size  # noqa: N806 - the global batch size, as in the shapes (B, ...)
        index, count = _host_of(self.sharding, B)
        self.process_index, self.process_count = index, count
        self.global_batch_size = B
        self.device_prefetch = max(0, int(device_prefetch))
        self.pipe = pipe

        self._host = pipe.iterator(
            start_step=start_step,
            process_index=index,
            process_count=count,
            num_workers=num_workers,
            step_timeout=step_timeout,
        )
        self.step = self._host.step
        self._host_step = self._host.step  # the step of the next host batch (its keys are this step's)
        self._ready: collections.deque = collections.deque()
        self._jax = jax
        self.clock = StepClock()  # the training loop's data wait, which includes the device put
        self._device_put = 0.0  # seconds handing batches to jax
        self._held: Any = None  # the host's batch of the next step not yet handed to jax (its handing failed)
        LIVE.discard(self._host)  # quern.metrics reports this iterator, not the host one inside it
        LIVE.add(self)

    def _to_global(self, batch: Any) -> Any:
        return _to_global(self.pipe, batch, self.sharding, self.process_index, self.process_count, self._host_step)

    def __iter__(self) -> GlobalIterator:
        return self

    def __next__(self) -> Any:
        """The global batch of the next step, its transfer to the devices started.

        Returns:
            A tree of ``jax.Array`` of the global shape, sharded over the mesh.

        Raises:
            StopIteration: the pipeline has no more steps.
            ValueError: a leaf of the host's batch is not a numeric array with a
                leading axis of this host's rows.
        """
        t0 = self.clock.begin()
        while len(self._ready) <= self.device_prefetch:
            try:
                if self._held is None:
                    self._held = next(self._host)
                t1 = time.perf_counter()
                self._ready.append(self._to_global(self._held))  # transfers start now, asynchronously
                self._held = None
                self._host_step += 1
                self._device_put += time.perf_counter() - t1
            except StopIteration:
                break
            except Exception:
                if self._ready:  # yield the good steps first; the failing one is retried when reached
                    break
                raise  # a host batch that jax refused stays held: asked again, it is tried again
        if not self._ready:
            raise StopIteration
        self.step += 1
        self.clock.end(t0)
        return self._ready.popleft()

    def state(self) -> dict:
        """The iterator's state, to checkpoint: what ``resume`` and ``QuernRestore`` take.

        Returns:
            ``{"step": the next step to be yielded, "fingerprint": ...}``: JSON-serialisable.
        """
        return self._host.pipe.state_at(self.step)

    def stats(self) -> dict:
        """What the iterator did so far, for monitoring (:mod:`quern.metrics` reads it).

        Returns:
            The host iterator's :meth:`~quern.pipeline.iterate.iterator.PipelineIterator.stats`
            (disk cache, host prefetch, workers, stages), with the training loop's
            figures (``steps``, ``data_wait``, ``step_period``, ``bubble_rate``,
            ``health``...) measured in this iterator's ``next()`` (the device put
            included), the stage ``device_put`` (seconds handing host batches to
            jax), and ``"device_prefetch"``: ``{"ready": global batches whose
            transfer has started, "depth": the most kept}``.
        """
        out = self._host.stats()
        out.update(self.clock.figures())
        out["stages"] = {**out.get("stages", {}), DEVICE_PUT: self._device_put}
        out["device_prefetch"] = {"ready": len(self._ready), "depth": self.device_prefetch}
        return out

    def close(self) -> None:
        """Stop: drop the batches in flight and close the host iterator (its workers end)."""
        LIVE.discard(self)  # no longer reported to quern.metrics
        self._ready.clear()
        self._held = None
        self._host.close()

    def __enter__(self) -> GlobalIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def global_iterator(
    pipe: Any,
    mesh: Any,
    *,
    start_step: int = 0,
    partition_spec: Any = None,
    num_workers: int = 0,
    device_prefetch: int = DEVICE_PREFETCH,
    step_timeout: float | None = None,
) -> GlobalIterator:
    """Global batches of ``pipe`` as ``jax.Array`` trees sharded over ``mesh``.

    This process computes only its own rows and keeps ``device_prefetch``
    batches in flight to the devices, so host-to-device copies overlap the
    training step. The batch at step ``s`` depends only on the pipeline and
    ``s``: not on the number of processes, devices or workers.

    Args:
        pipe: the pipeline, with ``batch()``.
        mesh: the ``jax.sharding.Mesh`` the batches are sharded over.
        start_step: the first step to yield.
        partition_spec: a one-entry spec for axis 0, the batch axis (default:
            over all mesh axes); the other axes are replicated.
        num_workers: worker processes computing this host's rows (see ``pipe.iterator``).
        device_prefetch: the most global batches kept in flight to the devices.
        step_timeout: the host iterator's per-step deadline in seconds
            (:class:`quern.StepTimeoutError`; default: none).

    Returns:
        A :class:`GlobalIterator` (also a context manager that closes it).

    Raises:
        ValueError: ``pipe`` has no batch size, its batches are not all of one
            shape, or this process's rows are not one of equal host slices.
    """
    return GlobalIterator(
        pipe,
        mesh,
        start_step=start_step,
        partition_spec=partition_spec,
        num_workers=num_workers,
        device_prefetch=device_prefetch,
        step_timeout=step_timeout,
    )
