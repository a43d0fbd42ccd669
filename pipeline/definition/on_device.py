"""Device stages of a pipeline: the bodies of ``Pipeline.map_device`` and ``Pipeline.random_map_device``.

Device stages are a pipeline's last batch stages, run on the accelerators under
``jax.jit`` on the global batch after the transfer (:mod:`quern.sharding.device_stages`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.ops import OpKind

if TYPE_CHECKING:
    from .dataset import Pipeline

__all__ = ["map_device", "random_map_device"]


def map_device(self: Pipeline, fn: Callable[[Any], Any]) -> Pipeline:  # noqa: D417  (a method of Pipeline)
    """Apply ``fn(batch) -> batch`` on the devices, under ``jax.jit``, to the global batch.

    Device stages come after every host stage and run where the global ``jax.Array``
    batch is: in :func:`quern.sharding.global_iterator` and
    :func:`quern.sharding.global_batch_at`, after the transfer. ``batch_at`` and
    ``iterator`` give the host's batch before them. Move a stage here when its
    per-row cost passes about 1 ms and the batch passes 32 rows
    (``docs/guides/images.md``).

    Args:
        fn: a function of ``jax.Array`` trees that ``jax.jit`` can trace; it returns a batch.

    Returns:
        The pipeline with the stage appended.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: before ``batch()``.
    """
    return self._batch_op(OpKind.MAP_DEVICE, fn)


def random_map_device(self: Pipeline, fn: Callable[[Any, Any], Any]) -> Pipeline:  # noqa: D417  (a method of Pipeline)
    """Apply ``fn(batch, keys) -> batch`` on the devices, ``keys`` a typed ``jax.random`` key per row.

    ``keys`` has shape ``(rows,)``; a row's key derives from (seed, stream position of
    the row, stage) only, as ``random_map_batch``'s do, so it does not depend on
    the batch size, the host count or a resume. Otherwise as :func:`map_device`.

    Args:
        fn: the transform (typically ``jax.vmap`` of a per-row function of an image and a key).

    Returns:
        The pipeline with the stage appended.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: before ``batch()``.
    """
    return self._batch_op(OpKind.RANDOM_MAP_DEVICE, fn)
