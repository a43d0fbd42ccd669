"""Counter-based per-row randomness, vectorised: no generator objects.

Every value is a hash of (row key, counter), so it depends only on the row's
key (which ``Pipeline.random_map_batch`` derives from (seed, stream position,
stage)) and its index within the requested shape: never on batch layout,
worker, thread or call order.
"""

from __future__ import annotations

import math

import numpy as np

from ..pipeline.order.index import derive_key, hash64

__all__ = ["row_keys", "bits", "uniform", "integers", "normal"]


def row_keys(seed: int, positions: np.ndarray, *, salt: int = 0) -> np.ndarray:
    """One ``uint64`` key per row, derived from ``(seed, salt, position)``.

    Args:
        seed: the seed.
        positions: the rows' stream positions (any integer array).
        salt: tells apart several key streams of the same seed and positions.

    Returns:
        A ``uint64`` array of ``positions``' shape; each key depends only on
        ``seed``, ``salt`` and its position.

    Example:
        >>> row_keys(7, [0, 1]).dtype
        dtype('uint64')
    """
    return derive_key(seed, salt, np.asarray(positions, dtype=np.int64))


def bits(keys: np.ndarray, shape: tuple[int, ...] = ()) -> np.ndarray:
    """Random ``uint64`` words, ``hash(key, counter)`` for each element of ``shape`` per row.

    Args:
        keys: one ``uint64`` key per row.
        shape: the shape of each row's words.

    Returns:
        A ``uint64`` array of shape ``(len(keys), *shape)``; row ``i`` depends
        only on ``keys[i]`` and ``shape``.
    """
    keys = np.asarray(keys, dtype=np.uint64).reshape(-1, 1)
    shape = tuple(int(s) for s in np.atleast_1d(shape)) if shape != () else ()
    count = math.prod(shape)
    counters = np.arange(count, dtype=np.uint64).reshape(1, -1)
    with np.errstate(over="ignore"):
        words = hash64(keys ^ hash64(counters * np.uint64(0xD1B54A32D192ED03) + np.uint64(1)))
    return words.reshape((keys.shape[0],) + shape)


def uniform(keys: np.ndarray, shape: tuple[int, ...] = (), *, low: float = 0.0, high: float = 1.0) -> np.ndarray:
    """Uniform ``float64`` values in ``[low, high)``, from :func:`bits` (53 bits each).

    Args:
        keys: one ``uint64`` key per row.
        shape: the shape of each row's values.
        low: the lower bound, included.
        high: the upper bound, excluded.

    Returns:
        A ``float64`` array of shape ``(len(keys), *shape)``; row ``i`` depends
        only on ``keys[i]``, ``shape`` and the bounds.

    Example:
        >>> u = uniform(row_keys(0, [0, 1, 2]), (4,))
        >>> u.shape, bool(((0 <= u) & (u < 1)).all())
        ((3, 4), True)
    """
    u = (bits(keys, shape) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return low + (high - low) * u


def integers(keys: np.ndarray, low: int, high: int, shape: tuple[int, ...] = ()) -> np.ndarray:
    """Integers in ``[low, high)``, as numpy's ``integers(low, high, size)`` orders its arguments.

    Args:
        keys: one ``uint64`` key per row.
        low: the lower bound, included.
        high: the upper bound, excluded.
        shape: the shape of each row's values.

    Returns:
        An ``int64`` array of shape ``(len(keys), *shape)``; row ``i`` depends
        only on ``keys[i]``, ``shape`` and the bounds.

    Raises:
        ValueError: ``high <= low``.

    Example:
        >>> values = integers(row_keys(0, [0, 1, 2]), 3, 9)
        >>> values.shape, bool(((3 <= values) & (values < 9)).all())
        ((3,), True)
    """
    if high <= low:
        raise ValueError(f"integers: need low < high, got [{low}, {high})")
    return low + np.floor(uniform(keys, shape) * (high - low)).astype(np.int64)


def normal(keys: np.ndarray, shape: tuple[int, ...] = ()) -> np.ndarray:
    """Standard normal ``float64`` values (Box-Muller over two :func:`uniform` values).

    Args:
        keys: one ``uint64`` key per row.
        shape: the shape of each row's values.

    Returns:
        A ``float64`` array of shape ``(len(keys), *shape)``; row ``i`` depends
        only on ``keys[i]`` and ``shape``.
    """
    shape = tuple(int(s) for s in np.atleast_1d(shape)) if shape != () else ()
    u = uniform(keys, (2,) + shape)
    u1 = 1.0 - u[:, 0]  # in (0, 1]
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u[:, 1])
