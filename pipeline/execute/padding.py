"""Eval padding: the last partial batch of a finite stream padded to whole batches (``batch(pad_remainder=True)``).

:func:`padded` wraps a step runner's results: every batch gets a boolean leaf
``valid`` (``True`` for real rows), and a batch with fewer rows than the host's
share of the global batch gets padding rows after its own (every leaf's value
``pad_value``). A batch depends only on the unpadded batch, the host's share and
``pad_value``: the host slices of a padded step put together are the padded
global batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import StepError
from ..core.steps import StepRequest, StepResult

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["VALID", "pad_setting", "padded"]

VALID = "valid"
"""The boolean leaf a padded pipeline's batches hold: ``True`` for the real rows."""


def pad_setting(pad_remainder: bool, pad_value: Any, drop_remainder: bool) -> int | float | None:
    """The ``pad_remainder`` field of a batched pipeline: ``pad_value`` when padding, else ``None``.

    Raises:
        ValueError: padding with ``drop_remainder=True`` (the remainder is dropped), or a pad value that is not a
            number.
    """
    if not pad_remainder:
        return None
    if drop_remainder:
        raise ValueError(
            "batch(pad_remainder=True) pads the last partial batch, which drop_remainder=True drops: pass "
            "drop_remainder=False"
        )
    if isinstance(pad_value, bool) or not isinstance(pad_value, (int, float, np.integer, np.floating)):
        raise ValueError(f"batch(pad_value=...) must be a number, got {pad_value!r}")
    return pad_value.item() if isinstance(pad_value, np.generic) else pad_value


def padded(pipe: Pipeline, request: StepRequest, results: Iterator[StepResult]) -> Iterator[StepResult]:
    """``results`` with each batch given ``valid`` and padded to the host's share of the global batch.

    Yields:
        One result per result of ``results``; an error stays as it is, and a batch that is
        not a dict, or already has a ``valid`` leaf, becomes a :class:`StepError`.
    """
    assert pipe.batch_size is not None and pipe.pad_remainder is not None
    rows = pipe.batch_size // request.process_count
    for result in results:
        if result.error is not None:
            yield result
            continue
        batch = result.batch
        where = request.where(result.step)
        if not isinstance(batch, Mapping) or VALID in batch:
            what = f"has a {VALID!r} leaf already" if isinstance(batch, Mapping) else f"is a {type(batch).__name__}"
            error = StepError(
                f"{where}: batch(pad_remainder=True) adds a boolean leaf {VALID!r} to every batch, and this batch "
                f"{what}; make the batch a dict without it"
            )
            yield StepResult(result.step, None, error)
            continue
        have = _rows(batch)
        out = {k: _pad(v, rows - have, pipe.pad_remainder) for k, v in batch.items()}
        out[VALID] = np.arange(rows) < have
        yield StepResult(result.step, out, None)


def _rows(batch: Mapping[str, Any]) -> int:
    """The rows of a dict batch: the first dimension of its first array leaf."""
    for value in batch.values():
        if isinstance(value, Mapping):
            return _rows(value)
        return int(np.shape(value)[0])
    return 0


def _pad(value: Any, extra: int, pad_value: int | float) -> Any:
    """``value`` (a leaf, or a dict of them) with ``extra`` rows of ``pad_value`` after its own."""
    if isinstance(value, Mapping):
        return {k: _pad(v, extra, pad_value) for k, v in value.items()}
    if not extra:
        return value
    arr = np.asarray(value)
    fill = np.full((extra, *arr.shape[1:]), pad_value, dtype=arr.dtype)
    return np.concatenate([arr, fill])
