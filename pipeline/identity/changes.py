"""What changed between two descriptions: their leaves, and the first that differs.

A description (:func:`quern.pipeline.definition.identify.describe`) is a JSON tree.
:func:`leaves` flattens it to ``path -> value`` (``packing.seq_len -> 512``), a
long value (a transform's code, a source's identity) given by a short digest
instead, so a saved state can carry it; :func:`first_change` names the first
path whose value differs between two such maps, with both values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .fingerprint import fingerprint_of

__all__ = ["leaves", "first_change", "SHORT"]

SHORT = 64
"""Leaves whose JSON is longer than this many characters are kept as a digest."""


def leaves(description: Any) -> dict[str, Any]:
    """The leaves of a description as ``{dotted path: value}``, in the description's order.

    A list's items are numbered (``transforms.0``); a leaf (or an empty dict or list)
    whose JSON is longer than :data:`SHORT` characters is ``"digest:<16 hex>"``.

    Example:
        >>> leaves({"packing": {"seq_len": 512, "mode": "best_fit"}, "batch": [8, True]})
        {'packing.seq_len': 512, 'packing.mode': 'best_fit', 'batch.0': 8, 'batch.1': True}
    """
    out: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
            return
        if isinstance(value, (list, tuple)) and value:
            for i, v in enumerate(value):
                walk(v, f"{path}.{i}" if path else str(i))
            return
        text = json.dumps(value, sort_keys=True, default=str)
        out[path] = value if len(text) <= SHORT else f"digest:{fingerprint_of(value)[:16]}"

    walk(description, "")
    return out


def first_change(before: Mapping[str, Any], after: Mapping[str, Any]) -> str | None:
    """The first path whose value differs, as ``path: BEFORE -> AFTER``; ``None`` when none does.

    Paths are taken in ``after``'s order, then those only in ``before``; a path missing
    on one side is ``(none)`` there.

    Example:
        >>> first_change({"pack.seq_len": 512, "seed": 1}, {"pack.seq_len": 1024, "seed": 1})
        'pack.seq_len: 512 -> 1024'
    """
    missing = object()
    for path in [*after, *(p for p in before if p not in after)]:
        old, new = before.get(path, missing), after.get(path, missing)
        if old != new or type(old) is not type(new):
            shown = ["(none)" if v is missing else json.dumps(v, default=str) for v in (old, new)]
            return f"{path}: {shown[0]} -> {shown[1]}"
    return None
