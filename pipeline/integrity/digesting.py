"""The ledger values of consecutive batches, with one C call per batch: :class:`Digesting`.

The ledger (:mod:`quern.pipeline.integrity.ledger`) digests every batch an iterator yields. A
batch of numeric leaves is digested by one call into the C library the wheel builds
(:func:`quern.pipeline.integrity.rowhash.batch_digests_into`: the rows hashed, the seeds folded,
the leaf digests, with the GIL released), and the row digests of all the batches kept are turned
into their JSON text together, into a buffer that is reused. A batch with an object leaf, or every
batch where the C library is not used, takes the Python path of
:mod:`quern.pipeline.integrity.batch_digest`. Both give the digests
:func:`~quern.pipeline.integrity.batch_digest.ledger_digests` gives: the C call is checked against the
Python path on a few batches before it is first used, and not used where they differ.

:func:`made_of` makes the ledger values of a chunk of batches where the chunk is made (a prefetch
thread, while the batches are in the CPU's cache), to be written as each batch is yielded.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from . import rowhash
from .batch_digest import _hashed, _hex_rows, _leaf_hex, _prepare, _row_raw

__all__ = ["Digesting", "Made", "made_of", "native"]

_U8 = np.dtype(np.uint8)


def _python(batch: Any) -> tuple[bytes, list[str]]:
    """A batch's row digests (16 bytes each) and leaf digests (hex) by the Python path."""
    plan, arrays = _prepare(batch, "batch")
    hashed = _hashed(plan, arrays)
    return _row_raw(plan, hashed, arrays), _leaf_hex(plan, hashed, arrays)


def _c(batch: Any) -> tuple[bytes, list[str]] | None:
    """A batch's digests as :func:`_python` gives them, by the C call (``None``: it is not used)."""
    plan, arrays = _prepare(batch, "batch")
    rows, leaves = np.empty(16 * plan.n, _U8), np.empty(16 * len(arrays), _U8)
    at = rowhash.address(rows), rowhash.address(leaves)
    if plan.native is None or not rowhash.batch_digests_into(plan.native, arrays, plan.n, *at):
        return None
    return rows.tobytes(), _hex_rows(leaves)


@functools.cache
def native() -> bool:
    """Whether batches of numeric leaves are digested by the C call.

    It is where the C library is used (:func:`quern.pipeline.integrity.rowhash.is_native`) and its
    digests equal the Python path's on a few batches of several layouts (large and small leaves,
    several of each, no small bytes, only small bytes, a leaf of no bytes, no rows; every byte value);
    otherwise a warning says so, once.
    """
    if not rowhash.is_native():
        return False
    rng = np.random.default_rng(0)

    def ints(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return rng.integers(0, 256, (*shape, np.dtype(dtype).itemsize), np.uint8).view(dtype).reshape(shape)

    batches = [
        {"tokens": ints((5, 7), np.int32), "length": ints((5,), np.int32)},
        {"image": ints((3, 40), np.uint8)},  # large leaves and no small bytes
        {"a": ints((4, 2), np.int64), "b": ints((4, 3), np.float32)},  # small leaves only, over 16 bytes a row
        {
            "a": ints((3, 5), np.uint8),
            "b": ints((3, 2), np.int64),
            "c": ints((3, 40), np.uint8),
            "d": ints((3, 9), np.float32),
            "e": ints((3, 0), np.int8),
        },
        {"x": ints((4,), np.int16), "y": ints((4, 3), np.uint8)},
        {"x": ints((0, 20), np.uint8), "n": ints((0,), np.int64)},
    ]
    for batch in batches:
        if _c(batch) != _python(batch):
            shapes = {k: (v.shape, str(v.dtype)) for k, v in batch.items()}
            warnings.warn(
                f"{rowhash.LIBRARY} digests a batch of {shapes} unlike quern's Python path (a bad build): "
                "the ledger digests in Python instead (the same digests, slower)",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
    return True


class Made(NamedTuple):
    """A batch's ledger values as :meth:`Digesting.finish_views` gives them (and :func:`made_of`, before it is yielded)."""

    rows: int  # the batch's rows
    items: memoryview  # its row digests, the items of their JSON array as ASCII bytes (no brackets)
    leaves: str  # its leaf digests' JSON object


class Digesting:
    """The :func:`~quern.pipeline.integrity.batch_digest.ledger_digests` of consecutive batches, made with less work.

    :meth:`add` digests a batch at once (one C call for numeric leaves) and keeps its row digests'
    16-byte values; :meth:`finish_views` turns those of all the batches added into their JSON text
    with one more call, into a buffer it reuses. The results equal ``ledger_digests`` of each batch.

    Example:
        >>> import numpy as np
        >>> from quern.pipeline.integrity.batch_digest import ledger_digests
        >>> d = Digesting()
        >>> d.add({"x": np.arange(4)}); d.add({"x": np.arange(2, 6)})
        >>> d.finish() == [ledger_digests({"x": np.arange(4)}), ledger_digests({"x": np.arange(2, 6)})]
        True
    """

    def __init__(self) -> None:
        self._batches: list[tuple[int, str]] = []  # per batch added: its rows and its leaf digests' JSON
        self._raw = np.empty(0, _U8)  # the row digests of the batches added, 16 bytes a row
        self._leaves = np.empty(0, _U8)  # one batch's leaf digests, 16 bytes a leaf
        self._at = (0, 0)  # the addresses of _raw and _leaves
        self._rows = 0  # the rows of the batches added
        self._text = np.empty(0, _U8)  # the row digests' hex digits, reused by each finish_views

    def add(self, batch: Any, where: str = "batch") -> None:
        """Digest ``batch``, the next batch.

        Args:
            batch: a pytree of arrays sharing a leading row axis; nothing of it is kept, so it may be
                written to once this returns.
            where: what the batch is, for messages.

        Raises:
            ValueError: a leaf without a row axis, named with ``where``.
            TypeError: an object leaf holding other than ``bytes`` or ``str`` (or a structured leaf a field of objects).
        """
        plan, arrays = _prepare(batch, where)
        at, end, k = 16 * self._rows, 16 * (self._rows + plan.n), 16 * len(arrays)
        if self._raw.size < end:
            raw = np.empty(max(end, 2 * self._raw.size), _U8)
            raw[:at] = self._raw[:at]
            self._raw = raw
            self._at = rowhash.address(self._raw), self._at[1]
        if self._leaves.size < k:
            self._leaves = np.empty(k, _U8)
            self._at = self._at[0], rowhash.address(self._leaves)
        if (
            plan.native is not None
            and native()
            and rowhash.batch_digests_into(plan.native, arrays, plan.n, self._at[0] + at, self._at[1])
        ):
            leaf_hex = _hex_rows(self._leaves[:k])
        else:  # the Python path (also where the library was not used after all: nothing was written)
            hashed = _hashed(plan, arrays)
            self._raw[at:end] = np.frombuffer(_row_raw(plan, hashed, arrays), _U8)
            leaf_hex = _leaf_hex(plan, hashed, arrays)
        self._batches.append((plan.n, plan.leaf_json % tuple(leaf_hex)))
        self._rows += plan.n

    def finish(self) -> list[tuple[int, str, str]]:
        """Per batch added, in order: ``(rows, row digests, leaf digests)`` as ``ledger_digests`` gives them."""
        return [(n, f"[{bytes(items).decode()}]", leaf) for n, items, leaf in self.finish_views()]

    def finish_views(self) -> list[Made]:
        """As :meth:`finish`, with each batch's row digests as the items of their JSON array (no brackets).

        The items are ASCII bytes in a buffer this object writes again at its next ``finish_views``
        (no new text object per batch: the ledger writes them as they are); copy them to keep them.
        """
        batches, rows = self._batches, self._rows
        self._batches, self._rows = [], 0
        size = 36 * rows  # '"32 hex digits", ' a row
        if self._text.size < size:
            self._text = np.empty(size, _U8)
        rowhash.json_hex_into(self._raw[: 16 * rows], self._text[: max(size - 2, 0)])
        text = memoryview(self._text)  # type: ignore[arg-type]
        out: list[Made] = []
        at = 0
        for n, leaves in batches:
            out.append(Made(n, text[36 * at : max(36 * (at + n) - 2, 36 * at)], leaves))
            at += n
        return out


def made_of(batches: Sequence[Any]) -> list[Made | None]:
    """The ledger values of each of ``batches``, made together (one hex conversion for all).

    Each depends on its batch's leaves only (keys, dtypes, shapes and bytes), and equals
    :meth:`Digesting.finish_views` of that batch; the row digests' text of all of them is one buffer of
    their own, never written again.

    Args:
        batches: pytrees of arrays, each with a leading row axis shared by its leaves.

    Returns:
        Per batch, in order, its values, or ``None`` where digesting it raised (a leaf without a
        row axis, an object leaf of other than ``bytes`` or ``str``, no memory): :meth:`Digesting.add`
        of it raises again, naming it, where it is yielded.

    Example:
        >>> import numpy as np
        >>> from quern.pipeline.integrity.batch_digest import ledger_digests
        >>> made = made_of([{"x": np.arange(4)}, {"x": np.float32(1)}])
        >>> n, items, leaves = made[0]
        >>> (n, f"[{bytes(items).decode()}]", leaves) == ledger_digests({"x": np.arange(4)}), made[1]
        (True, None)
    """
    digesting, ok = Digesting(), []
    for batch in batches:
        try:
            digesting.add(batch)
        except Exception:  # raised again where the batch is yielded, naming its step
            ok.append(False)
        else:
            ok.append(True)
    views = iter(digesting.finish_views())
    return [next(views) if good else None for good in ok]
