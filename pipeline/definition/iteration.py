"""Iterating a pipeline: an iterator from a step, or from a saved state.

Functions over a :class:`~quern.pipeline.definition.dataset.Pipeline`; its methods
``iterator``, ``resume`` and ``__iter__`` call them. The iterator itself
(prefetching, workers, its state) is :mod:`quern.pipeline.iterate.iterator`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Unpack

from ..iterate.iterator import IteratorOptions, PipelineIterator
from .identify import check_state

if TYPE_CHECKING:
    from .dataset import Pipeline

__all__ = ["iterator", "resume"]


def iterator(pipe: Pipeline, start_step: int = 0, **options: Unpack[IteratorOptions]) -> PipelineIterator:
    """An iterator yielding ``batch_at(s)`` for ``s = start_step, start_step+1, ...``.

    Args:
        pipe: the pipeline.
        start_step: the first step.
        **options: the iterator's options, keyword-only (see
            :class:`quern.pipeline.iterate.iterator.PipelineIterator`).

    Returns:
        The iterator.
    """
    return PipelineIterator(pipe, start_step, **options)


def resume(
    pipe: Pipeline, state: dict[str, Any], force: bool = False, **options: Unpack[IteratorOptions]
) -> PipelineIterator:
    """An iterator starting at ``state["step"]`` (from ``it.state()``), once the state is checked.

    The state is checked by :func:`~quern.pipeline.definition.identify.check_state`.

    Args:
        pipe: the pipeline.
        state: the saved state.
        force: resume even from a state of another definition or without a fingerprint.
        **options: as for :func:`iterator`.

    Returns:
        The iterator.

    Raises:
        ValueError: the state does not match this pipeline (unless ``force``).
    """
    return iterator(pipe, check_state(pipe, state, force), **options)
