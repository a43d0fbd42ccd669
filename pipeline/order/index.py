"""Index arithmetic: stream position -> record id, with no state and no O(N) memory.

Everything here is a pure, vectorised function of its arguments. The
pipeline's data order is defined by these functions alone:

* ``position p`` (0, 1, 2, ...) is a slot in the endless stream of records;
* ``epoch = p // N`` and ``j = p % N``;
* ``record = perm(key(seed, epoch))(j)`` where ``perm`` is a keyed bijection on
  ``[0, N)`` (a Feistel network with cycle walking), or the block shuffle
  variant for row-group formats;
* step ``s`` of global batch ``B`` covers positions ``[s*B, (s+1)*B)``, and
  host ``h`` of ``H`` owns rows ``[h*B/H, (h+1)*B/H)`` of it.

Nothing depends on hosts, workers, threads or time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np

__all__ = [
    "INDEX_FORMAT_VERSION",
    "MAX_RECORDS",
    "ShuffleMode",
    "check_int",
    "check_seed",
    "hash64",
    "derive_key",
    "permute",
    "block_permute",
    "unpermute",
    "block_unpermute",
    "epoch_record_ids",
    "epoch_positions",
    "host_rows",
]

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
MAX_RECORDS = 1 << 62
"""Largest supported source length (positions and ids fit in int64 with room)."""

_FEISTEL_ROUNDS = 6

ShuffleMode = Literal["global", "block"]
"""The shuffles of :func:`epoch_record_ids` (``None``: no shuffle)."""

INDEX_FORMAT_VERSION = 1
"""Version of the data order these functions define (permutations, block shuffle,
key derivation, per-record random keys). It is part of every pipeline's
fingerprint: a deliberate change of order bumps it, so checkpoints saved under
another order are refused instead of resumed on different data. The exact
outputs are pinned by golden values in ``tests/test_golden.py``."""


def check_int(value: object, name: str, minimum: int) -> int:
    """``value`` as an int, checked to be an integer (not a bool) of at least ``minimum``.

    Args:
        value: the value to check (a Python or NumPy integer).
        name: what it is, for the messages.
        minimum: the smallest value allowed.

    Returns:
        ``int(value)``.

    Raises:
        TypeError: ``value`` is not an integer, or is a bool.
        ValueError: ``value`` is below ``minimum``.

    Example:
        >>> check_int(np.int32(3), "window", 1)
        3
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_seed(seed: object) -> int:
    """``seed`` as a Python int, checked to be an integer in ``[0, 2**64)``.

    Args:
        seed: the seed to check (a Python or NumPy integer, not a bool).

    Returns:
        ``int(seed)``.

    Raises:
        TypeError: ``seed`` is not an integer, or is a bool.
        ValueError: ``seed`` is outside ``[0, 2**64)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an integer in [0, 2**64), got {seed!r} ({type(seed).__name__})")
    seed = int(seed)
    if not 0 <= seed <= _MASK64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def hash64(x: np.ndarray | int) -> np.ndarray:
    """SplitMix64 finaliser, element-wise on ``uint64`` (wrapping arithmetic).

    A bijective mixing function on 64-bit words.

    Args:
        x: an integer or an array of them, taken as ``uint64``.

    Returns:
        A ``uint64`` array of the shape of ``x``, depending only on ``x``.
    """
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=_U64) + _U64(0x9E3779B97F4A7C15)
        z ^= z >> _U64(30)
        z *= _U64(0xBF58476D1CE4E5B9)
        z ^= z >> _U64(27)
        z *= _U64(0x94D049BB133111EB)
        z ^= z >> _U64(31)
    return z


def derive_key(seed: int, *parts: int | np.ndarray) -> np.ndarray:
    """Hash ``(seed, *parts)`` into a ``uint64`` key, broadcast over array parts.

    The key depends only on the values and their order: ``derive_key(s, e + 1)``
    is unrelated to ``derive_key(s + 1, e)`` (unlike ``seed + epoch`` schemes).

    Args:
        seed: an integer in ``[0, 2**64)``.
        *parts: integers or integer arrays, taken modulo ``2**64`` (so ``-1`` and
            ``2**64 - 1`` agree).

    Returns:
        A ``uint64`` array: a scalar, or the broadcast shape of the array parts.

    Raises:
        TypeError: the seed or a part is not an integer.
        ValueError: the seed is outside ``[0, 2**64)``.

    Example:
        >>> derive_key(0, 1).shape, derive_key(0, np.arange(3)).shape
        ((), (3,))
    """
    k = hash64(np.asarray(check_seed(seed), dtype=_U64))
    for i, part in enumerate(parts):
        p = np.asarray(part)
        if p.dtype.kind not in "iu":
            raise TypeError(f"derive_key parts must be integers, got {part!r}")
        if p.dtype.kind == "i":
            p = p.astype(np.int64).view(_U64) if p.ndim else np.asarray(int(p) & _MASK64, dtype=_U64)
        p = np.asarray(p, dtype=_U64)
        with np.errstate(over="ignore"):
            k = hash64(k ^ hash64(p + _U64(i + 1) * _U64(0xD1B54A32D192ED03)))
    return k


def _round_keys(key: np.ndarray) -> list[np.ndarray]:
    """Per-round subkeys of a Feistel key (scalar or per-element array)."""
    with np.errstate(over="ignore"):
        return [hash64(key + _U64(r + 1) * _U64(0x9E3779B97F4A7C15)) for r in range(_FEISTEL_ROUNDS)]


def _feistel(x: np.ndarray, half_bits: int, round_keys: list[np.ndarray]) -> np.ndarray:
    """Balanced Feistel permutation of ``uint64`` values on ``[0, 2**(2*half_bits))``."""
    mask = _U64((1 << half_bits) - 1)
    shift = _U64(half_bits)
    left = (x >> shift) & mask
    right = x & mask
    for rk in round_keys:
        f = hash64(right ^ rk)
        f &= mask
        f ^= left
        left, right = right, f
    return (left << shift) | right


_Rounds = Callable[[np.ndarray, int, list[np.ndarray]], np.ndarray]


def _feistel_inverse(x: np.ndarray, half_bits: int, round_keys: list[np.ndarray]) -> np.ndarray:
    """The inverse of :func:`_feistel`: the rounds undone in reverse order."""
    mask = _U64((1 << half_bits) - 1)
    shift = _U64(half_bits)
    left = (x >> shift) & mask
    right = x & mask
    for rk in reversed(round_keys):
        f = hash64(left ^ rk)
        f &= mask
        f ^= right
        left, right = f, left
    return (left << shift) | right


def _domain(j: np.ndarray, n: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """``j`` as a flat int64 array and its shape, checked to lie in ``[0, n)`` with ``n`` in ``[1, 2**62]``."""
    if not 1 <= n <= MAX_RECORDS:
        raise ValueError(f"permutation domain must be in [1, 2**62], got {n}")
    j = np.asarray(j, dtype=np.int64)
    shape = j.shape
    j = j.reshape(-1)
    if j.size and (j.min() < 0 or j.max() >= n):
        raise IndexError(f"index out of range for permutation of {n}")
    return j, shape


def permute(j: np.ndarray, n: int, key: np.ndarray | int) -> np.ndarray:
    """Map indices ``j`` in ``[0, n)`` through the keyed bijection on ``[0, n)``.

    A Feistel network on the smallest even bit width covering ``n`` (domain
    below ``4n``), with cycle walking back into ``[0, n)``: a bijection for every
    ``n >= 1``. Memory is O(len(j)).

    Args:
        j: indices in ``[0, n)``, of any shape.
        n: the size of the domain, in ``[1, 2**62]``.
        key: a ``uint64`` scalar, or an array broadcast against ``j`` (one key per index).

    Returns:
        An ``int64`` array of the shape of ``j``, depending only on ``(j, n, key)``.

    Raises:
        ValueError: ``n`` is outside ``[1, 2**62]``.
        IndexError: an index is outside ``[0, n)``.

    Example:
        >>> sorted(permute(np.arange(5), 5, derive_key(0, 0)).tolist())
        [0, 1, 2, 3, 4]
    """
    n = int(n)
    j, shape = _domain(j, n)
    return _walk(j, shape, n, key, _feistel)


def unpermute(x: np.ndarray, n: int, key: np.ndarray | int) -> np.ndarray:
    """The inverse of :func:`permute`: the ``j`` with ``permute(j, n, key) == x``, element-wise.

    The Feistel rounds undone in reverse order, with cycle walking back into ``[0, n)``
    (the inverse rounds applied until the value is below ``n``). Memory is O(len(x)).

    Args:
        x: values in ``[0, n)``, of any shape.
        n: the size of the domain, in ``[1, 2**62]``.
        key: a ``uint64`` scalar, or an array broadcast against ``x`` (one key per value).

    Returns:
        An ``int64`` array of the shape of ``x``, depending only on ``(x, n, key)``.

    Raises:
        ValueError: ``n`` is outside ``[1, 2**62]``.
        IndexError: a value is outside ``[0, n)``.

    Example:
        >>> key = derive_key(0, 0)
        >>> unpermute(permute(np.arange(5), 5, key), 5, key).tolist()
        [0, 1, 2, 3, 4]
    """
    n = int(n)
    x, shape = _domain(x, n)
    return _walk(x, shape, n, key, _feistel_inverse)


def _walk(j: np.ndarray, shape: tuple[int, ...], n: int, key: np.ndarray | int, rounds: _Rounds) -> np.ndarray:
    """``rounds`` (the Feistel network or its inverse) applied to ``j`` with cycle walking into ``[0, n)``."""
    if n == 1:
        return np.zeros(shape, dtype=np.int64)
    bits = max(2, int(n - 1).bit_length())
    half = (bits + 1) // 2
    key = np.asarray(key, dtype=_U64)
    per_element = key.size > 1
    key = np.broadcast_to(key, shape).reshape(-1) if per_element else key.reshape(())
    rks = _round_keys(key)
    out = rounds(j.astype(_U64), half, rks)
    todo = np.nonzero(out >= _U64(n))[0]
    while todo.size:  # cycle walking: expected < 4 rounds since the domain is < 4n
        sub = [rk[todo] for rk in rks] if per_element else rks
        out[todo] = rounds(out[todo], half, sub)
        todo = todo[out[todo] >= _U64(n)]
    return out.astype(np.int64).reshape(shape)


def block_permute(j: np.ndarray, n: int, key: np.ndarray | int, block: int, window: int) -> np.ndarray:
    """Block shuffle on ``[0, n)``: blocks of consecutive ids shuffled, then ids within windows of blocks.

    Full blocks of ``block`` ids are permuted among themselves; the partial
    tail block (if ``n % block``) keeps the last slot. Within window ``g`` (of
    ``window`` consecutive shuffled blocks) the offsets are permuted with a key
    derived from ``(key, g)``. Consecutive positions mostly fall in the same few
    blocks, so a host reading a contiguous range of positions touches few row
    groups.

    Args:
        j: indices in ``[0, n)``.
        n: the size of the domain.
        key: a ``uint64`` scalar, or one key per element of ``j``.
        block: ids per block (a source's row-group size), at least 1.
        window: blocks per window, at least 1.

    Returns:
        A flat ``int64`` array: a bijection on ``[0, n)`` applied to ``j``, depending
        only on ``(j, n, key, block, window)``.

    Raises:
        ValueError: ``block`` or ``window`` is below 1.
    """
    if block < 1 or window < 1:
        raise ValueError(f"block and window must be >= 1, got block={block}, window={window}")
    j = np.asarray(j, dtype=np.int64).reshape(-1)
    n = int(n)
    key = np.broadcast_to(np.asarray(key, dtype=_U64), j.shape)
    span = block * window
    full_blocks = n // block
    g = j // span
    u = j % span
    out_u = np.empty_like(u)
    last_g = (n - 1) // span
    last_size = n - last_g * span
    wkey = derive_key(0, key, g)
    for is_last in (False, True):
        sel = (g == last_g) if is_last else (g != last_g)
        if sel.any():
            size = last_size if is_last else span
            out_u[sel] = permute(u[sel], size, wkey[sel])
    slot = g * window + out_u // block
    offset = out_u % block
    blk = slot.copy()
    full = slot < full_blocks
    if full.any():
        blk[full] = permute(slot[full], full_blocks, key[full])
    return blk * block + offset


def block_unpermute(x: np.ndarray, n: int, key: np.ndarray | int, block: int, window: int) -> np.ndarray:
    """The inverse of :func:`block_permute`: the ``j`` with ``block_permute(j, n, key, block, window) == x``.

    Record ``x`` is offset ``x % block`` of block ``x // block``; the block's slot is
    the inverse block permutation of it (the partial tail block keeps the last slot),
    slot ``s`` lies in window ``s // window``, and the offset within the window is
    the inverse of that window's permutation.

    Args:
        x: values in ``[0, n)``.
        n: the size of the domain.
        key: a ``uint64`` scalar, or one key per element of ``x``.
        block: ids per block, at least 1.
        window: blocks per window, at least 1.

    Returns:
        A flat ``int64`` array, depending only on ``(x, n, key, block, window)``.

    Raises:
        ValueError: ``block`` or ``window`` is below 1.
        IndexError: a value is outside ``[0, n)``.

    Example:
        >>> key = derive_key(0, 0)
        >>> block_unpermute(block_permute(np.arange(7), 7, key, 2, 2), 7, key, 2, 2).tolist()
        [0, 1, 2, 3, 4, 5, 6]
    """
    if block < 1 or window < 1:
        raise ValueError(f"block and window must be >= 1, got block={block}, window={window}")
    n = int(n)
    x, _ = _domain(x, n)
    key = np.broadcast_to(np.asarray(key, dtype=_U64), x.shape)
    span = block * window
    full_blocks = n // block
    blk = x // block
    offset = x % block
    slot = blk.copy()
    full = blk < full_blocks
    if full.any():
        slot[full] = unpermute(blk[full], full_blocks, key[full])
    g = slot // window
    out_u = slot * block + offset - g * span
    last_g = (n - 1) // span
    last_size = n - last_g * span
    wkey = derive_key(0, key, g)
    u = np.empty_like(out_u)
    for is_last in (False, True):
        sel = (g == last_g) if is_last else (g != last_g)
        if sel.any():
            u[sel] = unpermute(out_u[sel], last_size if is_last else span, wkey[sel])
    return g * span + u


def epoch_positions(
    records: np.ndarray,
    n: int,
    seed: int,
    shuffle: ShuffleMode | None,
    block: int = 1,
    window: int = 1,
    epoch: int | np.ndarray = 0,
) -> np.ndarray:
    """The inverse of :func:`epoch_record_ids` within one epoch: each record's offset in it.

    For each ``records[i]``, the ``j`` in ``[0, n)`` with
    ``epoch_record_ids([epoch[i] * n + j], n, seed, shuffle, block, window) == records[i]``.

    Args:
        records: record ids in ``[0, n)``, of any shape.
        n: the number of records.
        seed: the shuffle's seed, in ``[0, 2**64)``.
        shuffle: ``None``, ``"global"`` or ``"block"``.
        block: ids per block of the block shuffle.
        window: blocks per window of the block shuffle.
        epoch: the epoch (``>= 0``), or one per record (broadcast against ``records``).

    Returns:
        An ``int64`` array of the shape of ``records``, depending only on the arguments.

    Raises:
        ValueError: an unknown ``shuffle``, or as :func:`unpermute` and :func:`block_unpermute`.
        IndexError: a record id outside ``[0, n)``.

    Example:
        >>> ids = epoch_record_ids(np.arange(3, 6), 3, 7, "global")
        >>> epoch_positions(ids, 3, 7, "global", epoch=1).tolist()
        [0, 1, 2]
    """
    records = np.asarray(records, dtype=np.int64)
    shape = records.shape
    flat, _ = _domain(records, int(n))
    if shuffle is None or not flat.size:
        return flat.reshape(shape)
    if shuffle not in ("global", "block"):
        raise ValueError(f"unknown shuffle mode {shuffle!r}; expected None, 'global' or 'block'")
    e = np.asarray(epoch, dtype=np.int64)
    if e.ndim:
        e = np.broadcast_to(e, shape).reshape(-1)
        uniq = np.unique(e)
        keys = derive_key(seed, int(uniq[0])) if len(uniq) == 1 else derive_key(seed, e)
    else:
        keys = derive_key(seed, int(e))
    if shuffle == "global":
        out = unpermute(flat, n, keys)
    else:
        out = block_unpermute(flat, n, keys, block, window)
    return out.reshape(shape)


def epoch_record_ids(
    positions: np.ndarray,
    n: int,
    seed: int,
    shuffle: ShuffleMode | None,
    block: int = 1,
    window: int = 1,
) -> np.ndarray:
    """The record id at each stream position.

    With ``epoch = p // n`` and ``j = p % n``: ``shuffle=None`` gives ``j``;
    ``"global"`` gives ``permute(j, n, derive_key(seed, epoch))``; ``"block"``
    gives ``block_permute(j, n, derive_key(seed, epoch), block, window)``.

    Args:
        positions: stream positions (``>= 0``), of any shape.
        n: the number of records.
        seed: the shuffle's seed, in ``[0, 2**64)``.
        shuffle: ``None``, ``"global"`` or ``"block"``.
        block: ids per block of the block shuffle.
        window: blocks per window of the block shuffle.

    Returns:
        An ``int64`` array of record ids in ``[0, n)``, depending only on the arguments.

    Raises:
        ValueError: an unknown ``shuffle``, or as :func:`permute` and :func:`block_permute`.

    Example:
        >>> epoch_record_ids(np.arange(6), 3, 0, None).tolist()
        [0, 1, 2, 0, 1, 2]
        >>> sorted(epoch_record_ids(np.arange(3), 3, 0, "global").tolist())
        [0, 1, 2]
    """
    positions = np.asarray(positions, dtype=np.int64)
    epoch = positions // n
    j = positions % n
    if shuffle is None or not positions.size:
        return j
    if shuffle not in ("global", "block"):
        raise ValueError(f"unknown shuffle mode {shuffle!r}; expected None, 'global' or 'block'")
    epochs = np.unique(epoch)
    # one key per epoch; a scalar key when the positions lie in one epoch (the usual case: cheaper rounds)
    keys = derive_key(seed, int(epochs[0])) if len(epochs) == 1 else derive_key(seed, epoch)
    if shuffle == "global":
        return permute(j, n, keys)
    return block_permute(j, n, keys, block, window)


def host_rows(global_batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    """The rows of a global batch that host ``process_index`` of ``process_count`` owns.

    Host ``h`` of ``H`` owns rows ``[h*B/H, (h+1)*B/H)`` of a batch of ``B`` rows.

    Args:
        global_batch_size: ``B``, the rows of the global batch.
        process_index: ``h``, this host, in ``[0, H)``.
        process_count: ``H``, the number of hosts; it must divide ``B``.

    Returns:
        ``(start, stop)``.

    Raises:
        TypeError: an argument is not an integer.
        ValueError: an argument is out of range, or ``B % H != 0``.

    Example:
        >>> host_rows(8, 1, 4)
        (2, 4)
    """
    b = check_int(global_batch_size, "global batch size", 1)
    h = check_int(process_index, "process_index", 0)
    n_hosts = check_int(process_count, "process_count", 1)
    if not 0 <= h < n_hosts:
        raise ValueError(f"process_index must be in [0, {n_hosts}), got {h}")
    if b % n_hosts:
        raise ValueError(
            f"the global batch size {b} is not divisible by the host count (process_count) {n_hosts}; "
            f"choose a batch size that is a multiple of the host count"
        )
    per = b // n_hosts
    return h * per, (h + 1) * per
