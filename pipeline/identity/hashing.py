"""Content digests of plain values: the bytes of a fingerprint.

:func:`digest` hashes a value by its content and type, never by its ``repr``
or its address: ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``,
``bytes``, ``...``, slices, numpy arrays and scalars (dtype, shape and values),
numpy dtypes,
enum members, compiled regular expressions, and any nesting
of ``dict``, ``list``, ``tuple``, ``set``, ``frozenset`` and ``range`` of them.
An object with a ``fingerprint()`` method is described by what it returns.
Anything else raises :class:`~quern.pipeline.core.errors.FingerprintError` naming
where it was found, so that no value is ever hashed by its type name alone.

The digest depends only on the value (dict and set order do not matter; list
and tuple order do), and is the same in every process and Python session.

A dtype is described completely (:func:`quern.pipeline.identity.canonical.layout_text`):
NumPy's own by ``dtype.str`` (byte order included), another library's by its
type's name too (``ml_dtypes.float8_e4m3fn:<V1``: ``dtype.str`` alone is
``<V1`` for 17 ml_dtypes), a structured one by its fields' names, titles,
offsets and dtypes, its itemsize and alignment. An array's values are its bytes
in C order, except that a structured array's are its fields' values packed
(:func:`quern.pipeline.identity.canonical.values`: padding bytes, whose content is
undefined, never enter), an x87 long double's its 10 value bytes, and the items
of an object or ``StringDType`` array are described one by one.
"""

from __future__ import annotations

import enum
import hashlib
import re
import struct
from typing import Any

import numpy as np

from ..core.errors import FingerprintError
from .canonical import is_plain, layout_text, values

__all__ = ["digest", "update", "HOW_TO_DECLARE"]

HOW_TO_DECLARE = (
    "give it a fingerprint() method that returns a string describing everything that changes its output "
    "(quern calls it instead of hashing the object), or pass the value to the transform as an argument "
    "(functools.partial, a dataclass field) in a form quern can hash: numbers, strings, bytes, numpy arrays, "
    "and dicts, lists, tuples and sets of them"
)


def digest(value: Any, where: str = "value") -> str:
    """Hex digest of ``value``'s content (see the module docstring for what can be described).

    Args:
        value: the value to describe.
        where: names ``value`` in errors (``"transform pad, argument 0"``, say).

    Returns:
        32 hex digits (BLAKE2b, 16 bytes), depending only on the content and type of ``value``.

    Raises:
        FingerprintError: a part of ``value`` cannot be described by its content;
            the message names where it was found and how to declare it.

    Example:
        >>> digest({"a": [1, 2.0], "b": b"x"}) == digest({"b": b"x", "a": [1, 2.0]})
        True
        >>> digest((1, 2)) == digest([1, 2])
        False
    """
    return _digest(value, where, 0)


def _digest(value: Any, where: str, depth: int) -> str:
    h = hashlib.blake2b(digest_size=16)
    update(h, value, where=where, _depth=depth)
    return h.hexdigest()


def _array_bytes(arr: np.ndarray, where: str) -> bytes:
    """An array's values: its bytes in C order; a structure's fields packed, x87 padding zeroed.

    Raises:
        FingerprintError: a structured array with a field of Python objects.
    """
    if is_plain(arr.dtype.newbyteorder("<")):
        return np.ascontiguousarray(arr).tobytes()  # byte order kept: the text names it
    try:
        return values(arr, where).tobytes()
    except TypeError as e:
        raise FingerprintError(f"{e}; {HOW_TO_DECLARE}") from None


def _tag(h: Any, tag: bytes, payload: bytes = b"") -> None:
    h.update(tag + struct.pack("<Q", len(payload)) + payload)


def update(h: Any, value: Any, *, where: str = "value", _depth: int = 0) -> None:
    """Feed ``value``'s content into the hash object ``h`` (see :func:`digest`).

    Args:
        h: a ``hashlib`` hash object (anything with ``update(bytes)``).
        value: the value to describe.
        where: names ``value`` in errors.
        _depth: the nesting depth reached (internal; values nest at most 64 levels).

    Raises:
        FingerprintError: as :func:`digest`.
    """
    if _depth > 64:
        raise FingerprintError(f"{where}: nested more than 64 levels deep (a self-referencing value?)")
    if value is None or value is Ellipsis or isinstance(value, bool):
        _tag(h, b"c", repr(value).encode())
    elif isinstance(value, int):
        _tag(h, b"i", str(value).encode())
    elif isinstance(value, float):
        _tag(h, b"f", struct.pack("<d", value))
    elif isinstance(value, complex):
        _tag(h, b"z", struct.pack("<dd", value.real, value.imag))
    elif isinstance(value, str):
        _tag(h, b"s", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _tag(h, b"b", bytes(value))
    elif isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
        _tag(h, b"a" if isinstance(value, np.ndarray) else b"g", f"{layout_text(arr.dtype)}{arr.shape}".encode())
        if arr.dtype.kind in "OT":  # objects, NumPy's StringDType: item by item
            for i, item in enumerate(arr.reshape(-1).tolist()):
                update(h, item, where=f"{where}[{i}]", _depth=_depth + 1)
        else:
            _tag(h, b"v", _array_bytes(arr, where))
    elif isinstance(value, (list, tuple)):
        _tag(h, b"l" if isinstance(value, list) else b"t", str(len(value)).encode())
        for i, item in enumerate(value):
            update(h, item, where=f"{where}[{i}]", _depth=_depth + 1)
    elif isinstance(value, dict):
        d = _depth + 1
        items = sorted((_digest(k, f"{where} key", d), _digest(v, f"{where}[{k!r}]", d)) for k, v in value.items())
        _tag(h, b"d", "".join(k + v for k, v in items).encode())
    elif isinstance(value, (set, frozenset)):
        _tag(h, b"S", "".join(sorted(_digest(v, f"{where} item", _depth + 1) for v in value)).encode())
    elif isinstance(value, slice):
        _tag(h, b"L")
        for part in (value.start, value.stop, value.step):
            update(h, part, where=f"{where} slice", _depth=_depth + 1)
    elif isinstance(value, enum.Enum):  # by class name, not module: the same as __main__ and imported
        _tag(h, b"e", f"{type(value).__qualname__}.{value.name}".encode())
        update(h, value.value, where=f"{where}.value", _depth=_depth + 1)
    elif isinstance(value, np.dtype):
        _tag(h, b"D", layout_text(value).encode())
    elif isinstance(value, re.Pattern):
        _tag(h, b"R", repr((value.pattern, value.flags)).encode())
    elif isinstance(value, range):
        _tag(h, b"r", f"{value.start}:{value.stop}:{value.step}".encode())
    elif callable(getattr(value, "fingerprint", None)) and not isinstance(value, type):
        fp = value.fingerprint()
        if not isinstance(fp, str):
            raise FingerprintError(
                f"{where}: {type(value).__qualname__}.fingerprint() returned {type(fp).__name__}, not a string"
            )
        _tag(h, b"F", f"{type(value).__qualname__}:{fp}".encode())
    else:
        raise FingerprintError(
            f"{where}: cannot describe a {type(value).__module__}.{type(value).__qualname__} by its content; "
            + HOW_TO_DECLARE
        )
