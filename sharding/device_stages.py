"""Device stages: a pipeline's ``map_device`` and ``random_map_device`` stages, jitted on the global batch.

A pipeline's last batch stages may run on the accelerators instead of the host
(:meth:`~quern.Pipeline.map_device`, :meth:`~quern.Pipeline.random_map_device`):
:class:`DeviceStages` applies them, in order and under one ``jax.jit``, to the
global ``jax.Array`` batch after its transfer. A random stage gets one typed
``jax.random`` key per row (``threefry2x32``) whose data is
:func:`~quern.pipeline.execute.stages.device_keys` of (seed, the row's stream
position, the stage), computed on each host for its own rows and sharded as the
rows are; so the output at a step depends only on the pipeline and the step, never
on the host count, the device count or a resume. :func:`global_batch_at` gives the
global batch of any step as :func:`~quern.sharding.global_iterator` yields it.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..pipeline.core.errors import StepError
from ..pipeline.core.ops import DEVICE_KINDS, Op, OpKind
from ..pipeline.execute.stages import device_keys

__all__ = ["DeviceStages", "device_ops", "key_data"]

_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pipeline -> its DeviceStages
_JITTED: Any = None  # jax.jit(_apply), keyed by the stages: equal stages of another pipeline object reuse it


def _apply(stages: tuple[tuple[bool, Any], ...], batch: Any, datas: tuple) -> Any:
    """The device stages ``(random?, fn)`` applied in order, each random one with its key data's typed keys."""
    import jax

    keys = iter(datas)
    for random, fn in stages:
        batch = fn(batch, jax.random.wrap_key_data(next(keys), impl="threefry2x32")) if random else fn(batch)
    return batch


def device_ops(pipe: Any) -> list[tuple[int, Op]]:
    """The pipeline's device stages, with their index among its batch stages (the key's ``stage``)."""
    return [(k, op) for k, op in enumerate(pipe.batch_ops) if op.kind in DEVICE_KINDS]


def key_data(seed: int, positions: np.ndarray, k: int, rows: int, first_row: int = 0) -> np.ndarray:
    """The ``(rows, 2)`` ``uint32`` key data of device stage ``k`` for rows at ``positions``.

    A row's key is :func:`~quern.pipeline.execute.stages.device_keys` of its position, split
    into its high and low words (``jax.random.wrap_key_data(..., impl="threefry2x32")``
    makes the keys). Rows past ``positions`` (the padding of an evaluation batch) take
    the keys of positions ``-1 - g``, ``g`` their row in the global batch (this host's rows
    start at ``first_row``): the same on any host count.

    Example:
        >>> key_data(0, np.arange(3), 5, 3).shape, key_data(0, np.arange(3), 5, 3).dtype
        ((3, 2), dtype('uint32'))
    """
    pos = np.asarray(positions, dtype=np.int64)
    if len(pos) < rows:
        pad = first_row + np.arange(len(pos), rows, dtype=np.int64)
        pos = np.concatenate([pos, -1 - pad])
    keys = device_keys(seed, pos[:rows], k)
    return np.stack([(keys >> np.uint64(32)).astype(np.uint32), (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)], 1)


class DeviceStages:
    """A pipeline's device stages as one jitted function of (global batch, key data per random stage).

    The jitted function is keyed by the stages themselves (their kinds and functions), so a
    pipeline object built again with the same stages (a resumed run) reuses its compilations.

    Args:
        pipe: the pipeline.

    Attributes:
        ops: ``(batch stage index, op)`` of each device stage, in order.
        random: the indices of the random ones (each needs its key data).
    """

    def __init__(self, pipe: Any) -> None:
        self.seed = pipe.seed
        self.ops = device_ops(pipe)
        self.random = [k for k, op in self.ops if op.kind is OpKind.RANDOM_MAP_DEVICE]

    @classmethod
    def of(cls, pipe: Any) -> DeviceStages:
        """The pipeline's :class:`DeviceStages`, made once per pipeline object (so compiled once per shape)."""
        hit = _MADE.get(pipe)
        if hit is None:
            hit = _MADE[pipe] = cls(pipe)
        return hit

    def __bool__(self) -> bool:
        """Whether there is a device stage."""
        return bool(self.ops)

    def local_keys(self, positions: np.ndarray, rows: int, first_row: int = 0) -> list[np.ndarray]:
        """This host's key data of each random stage: ``(rows, 2)`` ``uint32`` for its rows at ``positions``."""
        return [key_data(self.seed, positions, k, rows, first_row) for k in self.random]

    def __call__(self, batch: Any, datas: list[Any], step: int) -> Any:
        """The device stages applied to the global ``batch`` of ``step``, with each random stage's global key data.

        Raises:
            StepError: a stage failed (while traced or run), naming the step and the stages.
        """
        if not self.ops:
            return batch
        import jax

        global _JITTED
        if _JITTED is None:
            _JITTED = jax.jit(_apply, static_argnums=0)
        stages = tuple((op.kind is OpKind.RANDOM_MAP_DEVICE, op.fn) for _, op in self.ops)
        try:
            return _JITTED(stages, batch, tuple(datas))
        except Exception as e:
            labels = ", ".join(op.label(k) for k, op in self.ops)
            raise StepError(f"step {step}, the device stages ({labels}): {type(e).__name__}: {e}") from e
