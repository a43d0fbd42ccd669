"""Mixture plan: stream position -> (component, position within the component's stream).

Pure index arithmetic over the mixture's definition (names, a schedule of
weights, a seed, a block size) and the rows per step; never reads a record.

**Schedule.** Stage ``t`` starts at step ``start_t`` (stage 0 at step 0), so at
position ``P_t = start_t * rows_per_step``, and lasts until the next stage's
start. Its weights are quantized to integers ``W_c`` summing to ``Q = 2**32``
(largest remainder, ties to the lower component index).

**Blocks.** Each stage's positions are cut into blocks of ``K`` positions
(:data:`BLOCK`, 1024 by default, at least ``C * C`` for ``C`` components), counted
from the stage's start. The draws of component ``c`` in the first ``b`` blocks
of a stage are ``T_c(b) = floor(W_c * K * b / Q)`` for every component but the
*absorbing* one (the largest weight, lowest index on ties), which takes the
rest, ``K * b - sum of the others``. So the counts per block are exact (they sum
to ``K``), never negative, and over whole blocks every component's count is
within 1 of ``weight * positions`` (the absorbing component within ``C - 1``).
Inside block ``b`` the ``K`` slots (``n_0`` slots of component 0, then ``n_1`` of
component 1, ...) are permuted by a keyed bijection (:func:`~quern.pipeline.index.permute`)
with key ``derive_key(seed, MIX_SALT, P_t, b)``.

**Deviation from the weights** (``w_c = W_c / Q``, the quantized weight, within
``2**-32`` of the one asked for). Over any window of whole blocks of one stage,
``|count_c - w_c * length| < C - 1`` for the absorbing component and ``< 1``
for the others; over any window of positions of one stage,
``|count_c - w_c * length| < K / 2 + 3 * C`` (``< K / 2 + 3`` for all but the
absorbing component): the whole blocks the window touches deviate as above,
and the part of a block it leaves out at either end holds at most
``K * w_c * (1 - w_c) + |n_c - w_c * K| <= K / 4 + C - 1`` draws more or fewer
than its share.

**Component positions.** The ``k``-th draw (in stream order) of component ``c``
is position ``k`` of that component's own stream: a draw's component position is
the draws of ``c`` in earlier stages, plus ``T_c(b)``, plus its rank among the
draws of ``c`` in its block. A stage that ends inside a block uses that block's
assignment for the positions it has, as if it went on: so the positions before
a stage's start do not depend on that stage or on any later one (appending a
stage at step ``s`` leaves every batch before ``s`` bit-identical).

Cost per call: O(K log K) per distinct block touched plus O(len(positions));
O(K + C) per earlier stage, cached per (schedule, rows per step).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import index as _index

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
]

BLOCK = 1024  # default positions per block
MIX_SALT = 3  # part of the published order: keys of a mixture's blocks
QUANTUM = 1 << 32  # weights are quantized to integers summing to this


class Stage(NamedTuple):
    """A stage of a schedule: from ``start_step`` on, these (quantized) weights."""

    start_step: int
    weights: tuple[int, ...]  # summing to QUANTUM


class Assignment(NamedTuple):
    """Per position: the component index and the position in that component's stream."""

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
    """Integers proportional to ``weights`` summing to :data:`QUANTUM` (largest
    remainder; ties to the lower index). A positive weight never becomes 0 unless it
    is below ``2**-32`` of the total."""
    total = math.fsum(weights)
    raw = [w / total * QUANTUM for w in weights]
    ints = [math.floor(r) for r in raw]
    left = QUANTUM - sum(ints)
    order = sorted(range(len(raw)), key=lambda c: (-(raw[c] - ints[c]), c))
    for c in order[:left]:
        ints[c] += 1
    return tuple(ints)


def check_schedule(names: Sequence[str], weights: Any = None, schedule: Any = None) -> tuple[Stage, ...]:
    """The stages of ``weights=`` (one stage from step 0) or ``schedule=[(start_step,
    weights), ...]`` (exactly one of them), checked: ``ValueError``/``TypeError``
    naming the stage and key for negative, NaN or infinite weights, a stage whose
    weights are all zero, names that differ from the components', stages out of
    order or not starting at step 0."""
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
    """Positions per block: ``block``, raised to ``C * C`` for ``C`` components (so that
    the absorbing component's count per block is never negative)."""
    return max(int(block), num_components * num_components, 1)


def _absorbing(weights: tuple[int, ...]) -> int:
    return max(range(len(weights)), key=lambda c: (weights[c], -c))


def _cumulative(weights: tuple[int, ...], K: int, b: int) -> list[int]:
    """``T_c(b)``: the draws of each component in the first ``b`` blocks of a stage."""
    a = _absorbing(weights)
    t = [w * K * b // QUANTUM for w in weights]
    t[a] = 0
    t[a] = K * b - sum(t)
    return t


def _block_components(counts: list[int], K: int, key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The component of each of a block's ``K`` positions (its slots ``n_0`` of
    component 0, ``n_1`` of component 1, ... permuted by the keyed bijection), and
    each position's rank among its component's positions in the block."""
    layout = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    comp = layout[_index.permute(np.arange(K, dtype=np.int64), K, key)]
    order = np.argsort(comp, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    rank = np.empty(K, dtype=np.int64)
    rank[order] = np.arange(K, dtype=np.int64) - starts[comp[order]]
    return comp, rank


@functools.lru_cache(maxsize=64)
def _block_of_stage(
    weights: tuple[int, ...], K: int, seed: int, stage_start: int, b: int
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Block ``b`` of the stage starting at position ``stage_start``: the component and
    rank of each of its positions (read-only), and ``T_c(b)``. Cached: consecutive
    steps share blocks."""
    before = _cumulative(weights, K, b)
    counts = [x - y for x, y in zip(_cumulative(weights, K, b + 1), before)]
    comp, rank = _block_components(counts, K, _block_key(seed, stage_start, b))
    comp.setflags(write=False)
    rank.setflags(write=False)
    return comp, rank, before


def _block_key(seed: int, stage_start: int, b: int) -> np.ndarray:
    return _index.derive_key(seed, MIX_SALT, stage_start, b)


def _stage_draws(stage: Stage, K: int, seed: int, p0: int, length: int) -> list[int]:
    """Draws of each component in the first ``length`` positions of a stage starting at position ``p0``."""
    full, rest = divmod(length, K)
    t = _cumulative(stage.weights, K, full)
    if rest:
        counts = [x - y for x, y in zip(_cumulative(stage.weights, K, full + 1), t)]
        comp, _ = _block_components(counts, K, _block_key(seed, p0, full))
        extra = np.bincount(comp[:rest], minlength=len(t))
        t = [x + int(e) for x, e in zip(t, extra)]
    return t


_DRAWS_BEFORE: dict[tuple, list[list[int]]] = {}  # (stages, K, seed, rows) -> draws before each stage reached


def _draws_before(stages: tuple[Stage, ...], K: int, seed: int, rows: int, t: int) -> list[int]:
    """Draws of each component before stage ``t``."""
    key = (stages, K, seed, rows)
    known = _DRAWS_BEFORE.setdefault(key, [[0] * len(stages[0].weights)])
    while len(known) <= t:
        s = len(known) - 1
        p0, p1 = stages[s].start_step * rows, stages[s + 1].start_step * rows
        d = _stage_draws(stages[s], K, seed, p0, p1 - p0)
        known.append([x + y for x, y in zip(known[-1], d)])
    if len(_DRAWS_BEFORE) > 64:  # many schedules in one process: keep the newest
        _DRAWS_BEFORE.pop(next(iter(_DRAWS_BEFORE)))
    return known[t]


def draws_before(stages: tuple[Stage, ...], seed: int, rows_per_step: int, K: int, position: int) -> list[int]:
    """The draws of each component at the stream positions before ``position``: what
    :func:`assign` of all those positions would count, in O(stages x K), reading nothing."""
    starts = [min(st.start_step * rows_per_step, _index.MAX_RECORDS) for st in stages]
    t = bisect.bisect_right(starts, position) - 1
    within = _stage_draws(stages[t], K, seed, starts[t], position - starts[t])
    return [x + y for x, y in zip(_draws_before(stages, K, seed, rows_per_step, t), within)]


def assign(positions: np.ndarray, stages: tuple[Stage, ...], seed: int, rows_per_step: int, K: int) -> Assignment:
    """The component of each stream position and its position in that component's
    stream. Depends only on the arguments (see the module docstring)."""
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    comp = np.empty(positions.shape, dtype=np.int64)
    cpos = np.empty(positions.shape, dtype=np.int64)
    if not positions.size:
        return Assignment(comp, cpos)
    # a stage that starts beyond the addressable stream (positions stay below 2**62) is never reached
    starts = np.asarray([min(s.start_step * rows_per_step, _index.MAX_RECORDS) for s in stages], dtype=np.int64)
    stage_of = np.searchsorted(starts, positions, side="right") - 1
    block_of = (positions - starts[stage_of]) // K
    within = (positions - starts[stage_of]) % K
    # group the positions by (stage, block); positions usually come sorted, so the blocks are runs
    order = np.lexsort((block_of, stage_of))
    st, bl = stage_of[order], block_of[order]
    cuts = np.flatnonzero((np.diff(st) != 0) | (np.diff(bl) != 0)) + 1
    bounds = np.concatenate([[0], cuts, [len(order)]])
    for g in range(len(bounds) - 1):
        sel = order[bounds[g] : bounds[g + 1]]  # the positions in one block of one stage
        t, b = int(stage_of[sel[0]]), int(block_of[sel[0]])
        bcomp, brank, before = _block_of_stage(stages[t].weights, K, seed, int(starts[t]), b)
        j = within[sel]
        c = bcomp[j]
        base = np.asarray(_draws_before(stages, K, seed, rows_per_step, t), dtype=np.int64) + np.asarray(
            before, dtype=np.int64
        )
        comp[sel] = c
        cpos[sel] = base[c] + brank[j]
    return Assignment(comp, cpos)
