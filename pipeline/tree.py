"""Walking batches: nested dicts, tuples (named or not) and lists whose leaves are arrays.

The one place that knows how a batch nests. :func:`map_leaves` rebuilds the
same structure (a namedtuple stays one); :func:`leaves` lists the leaves with
their key paths; :func:`to_plain` makes plain JSON-able data of a value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["map_leaves", "leaves", "to_plain"]


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf ``x`` replaced by ``fn(x)``; lists, tuples and namedtuples
    keep their type, any mapping becomes a ``dict``; order is kept."""
    if isinstance(tree, Mapping):
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(map_leaves(fn, v) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_leaves(fn, v) for v in tree)
    return fn(tree)


def leaves(tree: Any, path: str = "batch") -> list[tuple[str, Any]]:
    """``[(key path, leaf), ...]`` in order; paths read like ``batch['tokens']`` or ``batch[0]``."""
    if isinstance(tree, Mapping):
        return [item for k, v in tree.items() for item in leaves(v, f"{path}[{k!r}]")]
    if isinstance(tree, (tuple, list)):
        return [item for i, v in enumerate(tree) for item in leaves(v, f"{path}[{i}]")]
    return [(path, tree)]


def to_plain(value: Any) -> Any:
    """``value`` as plain data: dicts, lists (from tuples too), and numpy arrays and
    scalars as Python lists and numbers; other leaves unchanged."""
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return value
