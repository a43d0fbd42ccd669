"""Mixture plan: stream position -> (component, position within the component's stream).

Pure index arithmetic over the mixture's definition (names, a schedule of
weights, a seed, a block size) and the rows per step; never reads a record.
Each stage of the schedule cuts its positions into blocks of ``block_len``
positions; a block holds each component's exact share of draws (the weights
quantized to :data:`QUANTUM`), in an order keyed by ``(seed, MIX_SALT, stage
start, block)``. A component's ``k``-th draw is position ``k`` of its own
stream, and the positions before a stage's start do not depend on that stage
or any later one. The construction, its bounds on the deviation from the
weights and its costs are described in ``docs/design/mixture.md``.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import index as _index

__all__ = [
    "BLOCK",
    "MIX_SALT",
    "QUANTUM",
    "Stage",
    "Assignment",
    "check_schedule",
    "quantize",
    "block_size",
    "assign",
    "draws_before",
    "drawn_at",
]

BLOCK = 1024  # default positions per block
MIX_SALT = 3  # part of the published order: keys of a mixture's blocks
QUANTUM = 1 << 32  # weights are quantized to integers summing to this


class Stage(NamedTuple):
    """A stage of a schedule: from ``start_step`` on, these (quantized) weights.

    Attributes:
        start_step: the first step of the stage.
        weights: the quantized weight of each component, summing to :data:`QUANTUM`.
    """

    start_step: int
    weights: tuple[int, ...]  # summing to QUANTUM


class Assignment(NamedTuple):
    """Per position: the component index and the position in that component's stream.

    Attributes:
        component: the component of each position (``int64``).
        position: its position in that component's stream (``int64``).
    """

    component: np.ndarray  # int64
    position: np.ndarray  # int64


def _stage_weights(names: Sequence[str], weights: Any, where: str) -> list[float]:
    """Weights of one stage as floats in component order; ``ValueError`` naming the stage and key."""
    if isinstance(weights, Mapping):
        keys = [str(k) for k in weights]
        if sorted(keys) != sorted(names):
            missing = [n for n in names if n not in keys]
            extra = [k for k in keys if k not in names]
            raise ValueError(
                f"{where}: weights must name exactly the components {list(names)}; missing {missing}, unknown {extra}"
            )
        values = [weights[n] for n in names]
    elif isinstance(weights, Sequence) and not isinstance(weights, (str, bytes)):
        if len(weights) != len(names):
            raise ValueError(f"{where}: {len(weights)} weights for {len(names)} components {list(names)}")
        values = list(weights)
    else:
        raise TypeError(f"{where}: weights must be a dict of component -> weight or a list, got {weights!r}")
    out = []
    for name, w in zip(names, values):
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
            raise TypeError(f"{where}: the weight of {name!r} must be a number, got {w!r}")
        w = float(w)
        if math.isnan(w) or math.isinf(w):
            raise ValueError(f"{where}: the weight of {name!r} is {w}; weights must be finite")
        if w < 0:
            raise ValueError(f"{where}: the weight of {name!r} is {w}; weights must be >= 0")
        out.append(w)
    if sum(out) <= 0:
        raise ValueError(f"{where}: every weight is zero; at least one component must have a weight > 0")
    return out


def quantize(weights: Sequence[float]) -> tuple[int, ...]:
    """Integers proportional to ``weights`` summing to :data:`QUANTUM`.

    Largest remainder, ties to the lower index. A positive weight never becomes
    0 unless it is below ``2**-32`` of the total.

    Args:
        weights: non-negative weights, not all zero.

    Returns:
        One integer per weight.

    Example:
        >>> quantize([1, 1, 2]) == (QUANTUM // 4, QUANTUM // 4, QUANTUM // 2)
        True
    """
    total = math.fsum(weights)
    raw = [w / total * QUANTUM for w in weights]
    ints = [math.floor(r) for r in raw]
    left = QUANTUM - sum(ints)
    order = sorted(range(len(raw)), key=lambda c: (-(raw[c] - ints[c]), c))
    for c in order[:left]:
        ints[c] += 1
    return tuple(ints)


def check_schedule(names: Sequence[str], weights: Any = None, schedule: Any = None) -> tuple[Stage, ...]:
    """The checked stages of ``weights=`` or ``schedule=`` (exactly one of them).

    Args:
        names: the components' names, in order.
        weights: one stage from step 0: a dict of component -> weight, or a list in
            component order.
        schedule: ``[(start_step, weights), ...]`` (or dicts with those keys), the
            first at step 0, in increasing order of ``start_step``.

    Returns:
        The stages, their weights quantized (:func:`quantize`).

    Raises:
        ValueError: both or neither of ``weights`` and ``schedule``; a negative, NaN
            or infinite weight; a stage whose weights are all zero; names that differ
            from the components'; stages out of order or not starting at step 0. The
            message names the stage and key.
        TypeError: a weight or a start step that is not a number.

    Example:
        >>> check_schedule(["a", "b"], schedule=[(0, {"a": 1, "b": 0}), (10, [1, 1])])[1]
        Stage(start_step=10, weights=(2147483648, 2147483648))
    """
    if (weights is None) == (schedule is None):
        raise ValueError("mix() needs exactly one of weights=... or schedule=[(start_step, weights), ...]")
    if weights is not None:
        return (Stage(0, quantize(_stage_weights(names, weights, "weights"))),)
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence) or not schedule:
        raise ValueError(f"schedule must be a non-empty list of (start_step, weights) pairs, got {schedule!r}")
    stages: list[Stage] = []
    for t, item in enumerate(schedule):
        where = f"schedule stage {t}"
        if isinstance(item, Mapping) and set(item) == {"start_step", "weights"}:
            start, w = item["start_step"], item["weights"]
        elif isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and len(item) == 2:
            start, w = item
        else:
            raise ValueError(f"{where}: expected a (start_step, weights) pair, got {item!r}")
        start = _index.check_int(start, f"{where} start_step", 0)
        if t == 0 and start != 0:
            raise ValueError(f"{where} starts at step {start}; the first stage must start at step 0")
        if stages and start <= stages[-1].start_step:
            raise ValueError(
                f"{where} starts at step {start}, not after stage {t - 1} (step {stages[-1].start_step}); "
                "stages must be in increasing order of start_step"
            )
        stages.append(Stage(start, quantize(_stage_weights(names, w, where))))
    return tuple(stages)


def block_size(num_components: int, block: int = BLOCK) -> int:
    """Positions per block of a mixture of ``num_components`` components.

    Args:
        num_components: ``C``, the number of components.
        block: the block size asked for.

    Returns:
        ``block``, raised to ``C * C`` (so that the absorbing component's count per
        block is never negative) and to at least 1.

    Example:
        >>> block_size(2), block_size(40)
        (1024, 1600)
    """
    return max(int(block), num_components * num_components, 1)


def _absorbing(weights: tuple[int, ...]) -> int:
    return max(range(len(weights)), key=lambda c: (weights[c], -c))


def _cumulative(weights: tuple[int, ...], k: int, b: int) -> list[int]:
    """``T_c(b)``: the draws of each component in the first ``b`` blocks of a stage."""
    a = _absorbing(weights)
    t = [w * k * b // QUANTUM for w in weights]
    t[a] = 0
    t[a] = k * b - sum(t)
    return t


def _block_components(counts: list[int], k: int, key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The component of each of a block's ``k`` positions, and each one's rank among its component's.

    The block's slots (``n_0`` of component 0, ``n_1`` of component 1, ...) are
    permuted by the keyed bijection.
    """
    layout = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    comp = layout[_index.permute(np.arange(k, dtype=np.int64), k, key)]
    order = np.argsort(comp, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    rank = np.empty(k, dtype=np.int64)
    rank[order] = np.arange(k, dtype=np.int64) - starts[comp[order]]
    return comp, rank


@functools.lru_cache(maxsize=64)
def _block_of_stage(
    weights: tuple[int, ...], k: int, seed: int, stage_start: int, b: int
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Block ``b`` of the stage starting at position ``stage_start``.

    Returns the component and rank of each of its positions (read-only), and
    ``T_c(b)``. Cached: consecutive steps share blocks.
    """
    before = _cumulative(weights, k, b)
    counts = [x - y for x, y in zip(_cumulative(weights, k, b + 1), before)]
    comp, rank = _block_components(counts, k, _block_key(seed, stage_start, b))
    comp.setflags(write=False)
    rank.setflags(write=False)
    return comp, rank, before


def _block_key(seed: int, stage_start: int, b: int) -> np.ndarray:
    return _index.derive_key(seed, MIX_SALT, stage_start, b)


def _stage_draws(stage: Stage, k: int, seed: int, p0: int, length: int) -> list[int]:
    """Draws of each component in the first ``length`` positions of a stage starting at position ``p0``."""
    full, rest = divmod(length, k)
    t = _cumulative(stage.weights, k, full)
    if rest:
        counts = [x - y for x, y in zip(_cumulative(stage.weights, k, full + 1), t)]
        comp, _ = _block_components(counts, k, _block_key(seed, p0, full))
        extra = np.bincount(comp[:rest], minlength=len(t))
        t = [x + int(e) for x, e in zip(t, extra)]
    return t


_DRAWS_BEFORE: dict[tuple, list[list[int]]] = {}  # (stages, k, seed, rows) -> draws before each stage reached


def _draws_before(stages: tuple[Stage, ...], k: int, seed: int, rows: int, t: int) -> list[int]:
    """Draws of each component before stage ``t``."""
    key = (stages, k, seed, rows)
    known = _DRAWS_BEFORE.setdefault(key, [[0] * len(stages[0].weights)])
    while len(known) <= t:
        s = len(known) - 1
        p0, p1 = stages[s].start_step * rows, stages[s + 1].start_step * rows
        d = _stage_draws(stages[s], k, seed, p0, p1 - p0)
        known.append([x + y for x, y in zip(known[-1], d)])
    if len(_DRAWS_BEFORE) > 64:  # many schedules in one process: keep the newest
        _DRAWS_BEFORE.pop(next(iter(_DRAWS_BEFORE)))
    return known[t]


def draws_before(stages: tuple[Stage, ...], seed: int, rows_per_step: int, block_len: int, position: int) -> list[int]:
    """The draws of each component at the stream positions before ``position``.

    What :func:`assign` of all those positions would count, in O(stages x
    block_len), reading nothing.

    Args:
        stages: the schedule (:func:`check_schedule`).
        seed: the mixture's seed.
        rows_per_step: the rows of a step (stage starts are steps).
        block_len: positions per block (:func:`block_size`).
        position: the stream position.

    Returns:
        One count per component, depending only on the arguments.
    """
    starts = [min(st.start_step * rows_per_step, _index.MAX_RECORDS) for st in stages]
    t = bisect.bisect_right(starts, position) - 1
    within = _stage_draws(stages[t], block_len, seed, starts[t], position - starts[t])
    return [x + y for x, y in zip(_draws_before(stages, block_len, seed, rows_per_step, t), within)]


def assign(
    positions: np.ndarray, stages: tuple[Stage, ...], seed: int, rows_per_step: int, block_len: int
) -> Assignment:
    """The component of each stream position and its position in that component's stream.

    Args:
        positions: stream positions (``>= 0``), flattened.
        stages: the schedule (:func:`check_schedule`).
        seed: the mixture's seed.
        rows_per_step: the rows of a step (stage starts are steps).
        block_len: positions per block (:func:`block_size`).

    Returns:
        The assignment of each position, depending only on the arguments.

    Example:
        >>> stages = check_schedule(["a", "b"], weights=[3, 1])
        >>> a = assign(np.arange(1024), stages, 0, 1, 1024)
        >>> np.bincount(a.component).tolist(), sorted(a.position[a.component == 1].tolist()) == list(range(256))
        ([768, 256], True)
    """
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    comp = np.empty(positions.shape, dtype=np.int64)
    cpos = np.empty(positions.shape, dtype=np.int64)
    if not positions.size:
        return Assignment(comp, cpos)
    # a stage that starts beyond the addressable stream (positions stay below 2**62) is never reached
    starts = np.asarray([min(s.start_step * rows_per_step, _index.MAX_RECORDS) for s in stages], dtype=np.int64)
    stage_of = np.searchsorted(starts, positions, side="right") - 1
    block_of = (positions - starts[stage_of]) // block_len
    within = (positions - starts[stage_of]) % block_len
    # group the positions by (stage, block); positions usually come sorted, so the blocks are runs
    order = np.lexsort((block_of, stage_of))
    st, bl = stage_of[order], block_of[order]
    cuts = np.flatnonzero((np.diff(st) != 0) | (np.diff(bl) != 0)) + 1
    bounds = np.concatenate([[0], cuts, [len(order)]])
    for g in range(len(bounds) - 1):
        sel = order[bounds[g] : bounds[g + 1]]  # the positions in one block of one stage
        t, b = int(stage_of[sel[0]]), int(block_of[sel[0]])
        bcomp, brank, before = _block_of_stage(stages[t].weights, block_len, seed, int(starts[t]), b)
        j = within[sel]
        c = bcomp[j]
        base = np.asarray(_draws_before(stages, block_len, seed, rows_per_step, t), dtype=np.int64) + np.asarray(
            before, dtype=np.int64
        )
        comp[sel] = c
        cpos[sel] = base[c] + brank[j]
    return Assignment(comp, cpos)


def _times_weight(w: int, x: np.ndarray) -> np.ndarray:
    """``w * x // QUANTUM`` exactly in int64, for a weight ``w`` in ``[0, QUANTUM]`` and ``x`` in ``[0, 2**63)``."""
    hi, lo = x >> 32, x & (QUANTUM - 1)
    return w * hi + ((np.uint64(w) * lo.astype(np.uint64)) >> np.uint64(32)).astype(np.int64)


def _cumulative_of(weights: tuple[int, ...], c: int, k: int, b: np.ndarray) -> np.ndarray:
    """``_cumulative(weights, k, b[i])[c]`` for each ``i``: component ``c``'s draws in the first blocks."""
    x = k * b
    a = _absorbing(weights)
    if c != a:
        return _times_weight(weights[c], x)
    out = x.copy()
    for o, w in enumerate(weights):
        if o != a and w:
            out -= _times_weight(w, x)
    return out


def _block_of_draw(weights: tuple[int, ...], c: int, k: int, q: np.ndarray) -> np.ndarray:
    """For each draw ``q`` of component ``c`` in a stage (counted from the stage's start), its block.

    The largest ``b`` with ``T_c(b) <= q`` (:func:`_cumulative`), found by a binary search
    between bounds that follow from ``r*b - 1 < T_c(b) < r*b + C`` (``r = weight * k / QUANTUM``,
    ``C`` components); the weight must be above zero.
    """
    rate = weights[c] * k / QUANTUM
    top = _index.MAX_RECORDS // k + 1  # past the last block of the addressable stream
    qf = q.astype(np.float64)
    cap = float(_index.MAX_RECORDS)  # clipped as floats, then exactly as integers
    lo = np.clip(np.floor((qf - len(weights)) / rate * (1 - 1e-9)) - 2, 0, cap).astype(np.int64)
    hi = np.clip(np.ceil((qf + 1) / rate * (1 + 1e-9)) + 2, 1, cap).astype(np.int64)
    hi = np.minimum(hi, top + 1)
    lo = np.minimum(lo, hi - 1)
    while True:  # T(lo) <= q < T(hi), unless hi is past the addressable stream (checked by the caller)
        wide = hi - lo > 1
        if not wide.any():
            return lo
        mid = (lo + hi) // 2
        ok = _cumulative_of(weights, c, k, mid) <= q
        lo = np.where(wide & ok, mid, lo)
        hi = np.where(wide & ~ok, mid, hi)


def drawn_at(
    component: int, draws: np.ndarray, stages: tuple[Stage, ...], seed: int, rows_per_step: int, block_len: int
) -> np.ndarray:
    """The inverse of :func:`assign`: the stream position of each draw of one component.

    For each ``draws[i]`` (a position in component ``component``'s own stream), the
    stream position ``p`` with ``assign([p]) == (component, draws[i])``, or ``-1`` when
    that draw never happens (the component's weight is zero from some stage on, or the
    position would be beyond the addressable stream). Through the stages (the draws
    before each, :func:`draws_before`), then the block (the closed form of the counts
    per block, searched), then the slot inside the block (its keyed layout).

    Args:
        component: the component's index.
        draws: positions in the component's stream (``>= 0``).
        stages: the schedule (:func:`check_schedule`).
        seed: the mixture's seed.
        rows_per_step: the rows of a step (stage starts are steps).
        block_len: positions per block (:func:`block_size`).

    Returns:
        An int64 array of the shape of ``draws``, depending only on the arguments.

    Example:
        >>> stages = check_schedule(["a", "b"], weights=[3, 1])
        >>> a = assign(np.arange(40), stages, 0, 1, 16)
        >>> bool((drawn_at(1, a.position[a.component == 1], stages, 0, 1, 16) == np.flatnonzero(a.component == 1)).all())
        True
    """
    q = np.asarray(draws, dtype=np.int64)
    shape = q.shape
    q = q.reshape(-1)
    out = np.full(q.shape, -1, dtype=np.int64)
    k, c = block_len, int(component)
    starts = [st.start_step * rows_per_step for st in stages]
    live = [t for t, p in enumerate(starts) if p < _index.MAX_RECORDS]  # later stages are never reached
    before = np.asarray([_draws_before(stages, k, seed, rows_per_step, t)[c] for t in live], dtype=np.int64)
    stage_of = np.searchsorted(before, q, side="right") - 1
    for t in np.unique(stage_of).tolist():
        sel = np.flatnonzero(stage_of == t)
        weights = stages[t].weights
        if not weights[c]:  # the last stage, and the component is never drawn in it
            continue
        within = q[sel] - before[t]
        b = _block_of_draw(weights, c, k, within)
        rank = within - _cumulative_of(weights, c, k, b)
        found = _cumulative_of(weights, c, k, b + 1) > within  # false: past the addressable stream
        for blk in np.unique(b[found]).tolist():
            at = np.flatnonzero(found & (b == blk))
            if starts[t] + blk * k >= _index.MAX_RECORDS:
                continue
            comp, _, _ = _block_of_stage(weights, k, seed, starts[t], blk)
            slots = np.flatnonzero(comp == c)
            pos = starts[t] + blk * k + slots[rank[at]]
            out[sel[at]] = np.where(pos < _index.MAX_RECORDS, pos, -1)
    return out.reshape(shape)
