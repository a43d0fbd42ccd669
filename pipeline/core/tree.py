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
    """``tree`` with every leaf ``x`` replaced by ``fn(x)``.

    Lists, tuples and namedtuples keep their type, any mapping becomes a
    ``dict``; order is kept. Anything that is not a mapping, list or tuple is a
    leaf.

    Args:
        fn: called once per leaf, in order.
        tree: a leaf, or nested mappings, lists and tuples of leaves.

    Returns:
        The same structure holding ``fn``'s results.

    Example:
        >>> map_leaves(lambda x: x * 2, {"a": 1, "b": (2, [3])})
        {'a': 2, 'b': (4, [6])}
    """
    if isinstance(tree, Mapping):
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(map_leaves(fn, v) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_leaves(fn, v) for v in tree)
    return fn(tree)


def leaves(tree: Any, path: str = "batch") -> list[tuple[str, Any]]:
    """The leaves of ``tree`` with their key paths, in order.

    Args:
        tree: a leaf, or nested mappings, lists and tuples of leaves.
        path: the name of ``tree`` itself, the start of every key path.

    Returns:
        ``[(key path, leaf), ...]``; paths read like ``batch['tokens']`` or ``batch[0]``.

    Example:
        >>> leaves({"tokens": 1, "pair": (2, 3)})
        [("batch['tokens']", 1), ("batch['pair'][0]", 2), ("batch['pair'][1]", 3)]
    """
    if isinstance(tree, Mapping):
        return [item for k, v in tree.items() for item in leaves(v, f"{path}[{k!r}]")]
    if isinstance(tree, (tuple, list)):
        return [item for i, v in enumerate(tree) for item in leaves(v, f"{path}[{i}]")]
    return [(path, tree)]


def to_plain(value: Any) -> Any:
    """``value`` as plain, JSON-able data.

    Args:
        value: a leaf, or nested mappings, lists and tuples of leaves.

    Returns:
        Mappings as dicts, lists and tuples as lists, NumPy arrays and scalars as
        Python lists and numbers; other leaves unchanged.

    Example:
        >>> import numpy as np
        >>> to_plain({"x": np.arange(2), "y": (np.float32(0.5),)})
        {'x': [0, 1], 'y': [0.5]}
    """
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return value
