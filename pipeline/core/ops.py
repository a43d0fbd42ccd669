"""The transform stages of a pipeline definition: their kinds and the ``Op`` record."""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
from collections.abc import Callable
from typing import Any

from .registry import builtin_name

__all__ = ["OpKind", "Op", "RECORD_KINDS", "BATCH_KINDS", "DEVICE_KINDS", "stage_name"]


class OpKind(enum.StrEnum):
    """What a stage applies to and what it is given.

    ``MAP``: ``fn(record)``; ``RANDOM_MAP``: ``fn(record, rng)`` with a numpy
    Generator keyed by (seed, stream position, stage); ``MAP_BATCH``:
    ``fn(batch)``; ``RANDOM_MAP_BATCH``: ``fn(batch, keys)`` with one ``uint64``
    key per row; ``FILTER``: ``fn(record) -> bool``, evaluated once per record by a
    scan (never while a step is computed: the plan holds only the records it
    keeps); ``FLAT_MAP``: ``fn(record) -> list of records``, whose outputs become the
    records of a new source (:meth:`Pipeline.flat_map`; it is the last record stage of
    that source's inner pipeline, never of a stream's); ``MAP_DEVICE``: ``fn(batch)`` and
    ``RANDOM_MAP_DEVICE``: ``fn(batch, keys)`` with a typed ``jax.random`` key per row, both
    under ``jax.jit`` on the global arrays (:mod:`quern.sharding.device_stages`), the last
    batch stages. The values are the names used in configs and messages.
    """

    MAP = "map"
    RANDOM_MAP = "random_map"
    MAP_BATCH = "map_batch"
    RANDOM_MAP_BATCH = "random_map_batch"
    FILTER = "filter"
    FLAT_MAP = "flat_map"
    MAP_DEVICE = "map_device"
    RANDOM_MAP_DEVICE = "random_map_device"


RECORD_KINDS = (OpKind.MAP, OpKind.RANDOM_MAP, OpKind.FILTER, OpKind.FLAT_MAP)
BATCH_KINDS = (OpKind.MAP_BATCH, OpKind.RANDOM_MAP_BATCH)
DEVICE_KINDS = (OpKind.MAP_DEVICE, OpKind.RANDOM_MAP_DEVICE)
"""The batch stages that run on the devices, after the host's batch stages and the transfer."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One transform stage of a pipeline: its kind and the user's callable.

    Attributes:
        kind: what the stage applies to and what ``fn`` is given (an :class:`OpKind`,
            or its value, e.g. ``"map"``).
        fn: the transform.
    """

    kind: OpKind
    fn: Callable[..., Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind))

    @property
    def name(self) -> str:
        """The callable's name, for labels, metrics and messages: :func:`stage_name` (never its arguments)."""
        return stage_name(self.fn)

    def label(self, k: int) -> str:
        """The stage's label in messages and timings: its kind, index and name.

        Args:
            k: the stage's index among its level's stages (record or batch stages).

        Returns:
            ``"map[0] decode"``: the kind's value, ``[k]``, and :attr:`name`.

        Example:
            >>> Op("map", len).label(0)
            'map[0] len'
        """
        return f"{self.kind.value}[{k}] {self.name}"


_NAME = re.compile(r"[\w.<>]{1,200}")  # a qualified name: decode, Tokenizer.encode, make.<locals>.<lambda>
_NAMED = (  # callables whose __qualname__ is the name of their code
    type,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.MethodWrapperType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
)
_MAX_DEPTH = 8  # wrappers of wrappers


def stage_name(fn: Any) -> str:
    """The name of the transform ``fn``: what it is, never what it holds, the same in every process.

    It is the name in stage labels (``map[0] decode``), in ``it.stats()``, the
    metrics' ``stage`` label, ``quern bench`` and messages. (Its ``repr`` would
    put argument values, such as a ``token=`` of a ``functools.partial``, into
    metrics labels, and an object address that makes a new series at every restart.)

    Args:
        fn: the transform.

    Returns:
        A function's, class's, builtin's or bound method's ``__qualname__``
        (``decode``, ``Tokenizer.encode``, ``make.<locals>.<lambda>``); for a
        ``functools.partial``, ``partial(NAME)`` of its function; for a wrapper with
        ``__wrapped__`` (``jax.jit``, a ``functools.wraps`` decorator object), the
        name of what it wraps; for any other callable (an instance with
        ``__call__``), its class's ``__qualname__``; for quern's own transforms, the
        name they are registered under (``pad``, ``decode``).

    Example:
        >>> import functools
        >>> stage_name(functools.partial(int, base=2)), stage_name(str.upper)
        ('partial(int)', 'str.upper')
    """
    return _stage_name(fn, 0)


def _stage_name(fn: Any, depth: int) -> str:
    builtin = builtin_name(fn)
    if builtin is not None:
        return builtin
    if depth < _MAX_DEPTH and isinstance(fn, functools.partial):
        return f"partial({_stage_name(fn.func, depth + 1)})"
    if isinstance(fn, _NAMED) or type(fn).__name__ == "ufunc":  # numpy's ufuncs: np.sqrt
        for attribute in ("__qualname__", "__name__"):
            name = getattr(fn, attribute, None)
            if isinstance(name, str) and _NAME.fullmatch(name):
                return name
    elif depth < _MAX_DEPTH:
        try:
            wrapped = getattr(fn, "__wrapped__", None)
        except Exception:  # a __getattr__ that fails
            wrapped = None
        if wrapped is not None and wrapped is not fn and callable(wrapped):
            return _stage_name(wrapped, depth + 1)
    name = type(fn).__qualname__
    return name if _NAME.fullmatch(name) else type(fn).__name__
