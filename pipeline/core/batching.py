"""Where a stage may come: the checks that a pipeline has, or has not yet, a batch.

A step is a batch, so what addresses steps needs ``batch()`` first
(:func:`need_batch`), and a record-level stage must come before it
(:func:`need_no_batch`). The builder, the addressing functions and the stream
kinds call these; the module imports no other part of quern at run time (the
pipeline's type only under ``TYPE_CHECKING``), so any layer may.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["need_batch", "need_no_batch"]


def need_batch(pipe: Pipeline, what: str) -> int:
    """The global batch size of ``pipe``.

    Args:
        pipe: the pipeline.
        what: the call that needs it, for the message.

    Returns:
        The batch size.

    Raises:
        ValueError: before ``batch()``, naming ``what``.
    """
    if pipe.batch_size is None:
        raise ValueError(f"{what}() needs batch() first: a step is a batch")
    return pipe.batch_size


def need_no_batch(pipe: Pipeline, what: str, instead: str) -> None:
    """Check that ``batch()`` was not called on ``pipe`` yet (``what`` is a record-level stage).

    Args:
        pipe: the pipeline.
        what: the call, for the message.
        instead: what to use after ``batch()``.

    Raises:
        ValueError: after ``batch()``.
    """
    if pipe.batch_size is not None:
        raise ValueError(
            f"{what}() after batch(): {what}() is a record-level stage; use {instead} "
            "for a batch-level transform, or move it before batch()"
        )
