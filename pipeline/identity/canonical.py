"""The canonical form of an array for digests: its dtype's description and its values' bytes.

A digest is over values, never memory layout. :func:`values` gives the array every layout
of the same values maps to, and :func:`dtype_text` the description of its value type:

- byte order: values little-endian (a ``>i4`` array of the values of a ``<i4`` one is the same);
- strides, Fortran order, views: the values in C order;
- a structured dtype: each element field by field, in the dtype's field order (``dtype.names``),
  each field in its own canonical form (nested structures and sub-array fields recursively),
  packed: the padding bytes, the bytes outside the fields of a multi-field view, the offsets,
  the itemsize and the alignment never enter;
- x87 extended precision (``np.longdouble`` where it has 64 mantissa bits: 10 bytes of value in
  16 or 12): the bytes past the tenth are set to zero (NumPy leaves them undefined).

The values are compared as bit patterns: ``-0.0`` and ``0.0`` differ, so do NaNs with other
payloads, and a bool array made by viewing bytes other than 0 and 1 (what NumPy's own
operations never make) differs from its ``astype(bool)``.

:func:`dtype_text` names the value type exactly, by name, never by ``dtype.str`` alone (``<V1``
for 17 ml_dtypes): NumPy's own types by ``dtype.str`` made little-endian (``<i4``, ``|u1``,
``<M8[ns]``, ``<U5``, ``|S3``, ``|V8``); another library's (ml_dtypes' ``float8_e4m3fn``,
``int4``, ``bfloat16``...) by its scalar type's module and name and ``dtype.str``
(``ml_dtypes.float8_e4m3fn:<V1``); a structured dtype by its fields' names, titles and
descriptions in order (JSON); a sub-array field by its base and shape. :func:`layout_text` is the
complete description of a dtype as a value in itself (a fingerprint's argument): byte order,
offsets, itemsize and alignment included.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import numpy as np

__all__ = ["dtype_text", "is_plain", "layout_text", "values"]

_U8 = np.dtype(np.uint8)
_NUMPY_KINDS = frozenset("biufcmMSUV")  # NumPy's own fixed-size kinds: dtype.str names them exactly
_X87 = np.finfo(np.longdouble).nmant == 63 and np.dtype(np.longdouble).itemsize > 10
_X87_TYPES = (np.longdouble, np.clongdouble) if _X87 else ()


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _named(dtype: np.dtype, text: str) -> str:
    """A plain dtype's description: ``text`` for NumPy's own types, else prefixed with its type's name."""
    if dtype.type.__module__ == "numpy" and dtype.kind in _NUMPY_KINDS:
        return text
    if dtype.kind == "T":  # NumPy's variable-width strings (StringDType): no fixed bytes
        return repr(dtype)
    return f"{dtype.type.__module__}.{dtype.type.__qualname__}:{text}"


def _fields(dtype: np.dtype) -> list[tuple[str, np.dtype, int, Any]]:
    """A structured dtype's fields in order: ``(name, dtype, offset, title or None)``."""
    out = []
    for name in dtype.names or ():
        field: tuple[Any, ...] = dtype.fields[name]  # type: ignore[index]
        out.append((name, field[0], field[1], field[2] if len(field) > 2 else None))
    return out


def _describe(dtype: np.dtype) -> Any:
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        return [_describe(base), list(shape)]
    if dtype.names is not None:
        return {"fields": [[name, title, _describe(dt)] for name, dt, _, title in _fields(dtype)]}
    if dtype.kind == "O":
        return "|O"
    if dtype.kind == "T":
        return repr(dtype)
    return _named(dtype, dtype.newbyteorder("<").str)


def dtype_text(dtype: np.dtype) -> str:
    """The description of ``dtype``'s value type: distinct for distinct types, whatever the layout.

    Args:
        dtype: any dtype.

    Returns:
        ``<i4``, ``ml_dtypes.bfloat16:<V2``, ``{"fields":[["a",null,"<i4"],...]}``, ``|O``...
        (see the module docstring); the same for a big-endian dtype, and for a structured dtype
        whatever its offsets, padding and alignment.

    Example:
        >>> import ml_dtypes
        >>> dtype_text(np.dtype(">i4")), dtype_text(np.dtype(ml_dtypes.int4))
        ('<i4', 'ml_dtypes.int4:<V1')
    """
    d = _describe(dtype)
    return d if isinstance(d, str) else _json(d)


def _layout(dtype: np.dtype) -> Any:
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        return [_layout(base), list(shape)]
    if dtype.names is not None:
        fields = [[name, title, offset, _layout(dt)] for name, dt, offset, title in _fields(dtype)]
        return {"fields": fields, "itemsize": dtype.itemsize, "aligned": bool(dtype.isalignedstruct)}
    return "|O" if dtype.kind == "O" else _named(dtype, dtype.str)


def layout_text(dtype: np.dtype) -> str:
    """The complete description of ``dtype``: its value type (:func:`dtype_text`) and its layout.

    NumPy's own plain dtypes are ``dtype.str`` (``>i4`` and ``<i4`` differ); a structured
    dtype's fields come with their offsets, and its itemsize and alignment.

    Args:
        dtype: any dtype.

    Returns:
        The description (a string).
    """
    d = _layout(dtype)
    return d if isinstance(d, str) else _json(d)


def _packed(dtype: np.dtype, field: str = "") -> np.dtype:
    """``dtype``'s canonical form: little-endian, structures packed in field order (titles kept).

    Raises:
        TypeError: a field holds Python objects; the message is its path (``outer.inner``).
    """
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        return np.dtype((_packed(base, field), shape))
    if dtype.names is None:
        if dtype.hasobject:
            raise TypeError(field)
        return dtype.newbyteorder("<")
    fields = _fields(dtype)
    return np.dtype(
        {
            "names": [name for name, *_ in fields],
            "formats": [_packed(dt, f"{field}.{name}" if field else name) for name, dt, _, _ in fields],
            "titles": [title for *_, title in fields],
        }
    )


def _mask(dtype: np.dtype) -> np.ndarray | None:
    """Per byte of a canonical ``dtype``, 0xFF where it holds value and 0 where padding (``None``: all value)."""
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        sub = _mask(base)
        return None if sub is None else np.tile(sub, math.prod(shape))
    if dtype.names is not None:
        parts = [(offset, _mask(dt)) for _, dt, offset, _ in _fields(dtype)]
        if all(m is None for _, m in parts):
            return None
        out = np.full(dtype.itemsize, 0xFF, _U8)
        for offset, m in parts:
            if m is not None:
                out[offset : offset + m.size] = m
        return out
    if dtype.type in _X87_TYPES:  # 10 bytes of value per real part, then padding
        unit = dtype.itemsize // (2 if dtype.kind == "c" else 1)
        one = np.concatenate([np.full(10, 0xFF, _U8), np.zeros(unit - 10, _U8)])
        return np.tile(one, dtype.itemsize // unit)
    return None


@functools.lru_cache(maxsize=256)
def _target(dtype: np.dtype) -> tuple[np.dtype, np.ndarray | None]:
    """The canonical dtype of ``dtype`` and its mask (:func:`_packed`, :func:`_mask`), kept per dtype.

    Raises:
        TypeError: a field holds Python objects (the message: its path).
    """
    packed = _packed(dtype)
    return packed, _mask(packed)


def is_plain(dtype: np.dtype) -> bool:
    """Whether an array of ``dtype`` in C order is its own canonical form (no copy, no mask).

    True for little-endian (or byte-order-free) dtypes without fields, objects or padding:
    NumPy's numbers, datetimes, fixed-size strings and raw bytes, and other libraries' types
    (ml_dtypes). False for a structured dtype, a big-endian one, objects, and x87 long doubles.
    """
    return (
        dtype.names is None
        and not dtype.hasobject
        and dtype.type not in _X87_TYPES
        and dtype == dtype.newbyteorder("<")
    )


def values(arr: np.ndarray, what: str = "the array") -> np.ndarray:
    """``arr``'s values in canonical form: C order, little-endian, structures packed, padding zeroed.

    Args:
        arr: an array of a dtype without Python objects (a structured dtype's fields included).
        what: names the array in errors (``step 3: leaf batch['x']``).

    Returns:
        A C-contiguous array of the canonical dtype (``arr`` itself when it is already canonical):
        its bytes are the values' canonical bytes.

    Raises:
        TypeError: a field of a structured dtype holds Python objects (named).

    Example:
        >>> aligned = np.array([(1, 2.0)], dtype=np.dtype([("n", "u1"), ("x", ">f8")], align=True))
        >>> packed = aligned.astype([("n", "u1"), ("x", "<f8")])
        >>> aligned.dtype.itemsize, values(aligned).tobytes() == values(packed).tobytes() == packed.tobytes()
        (16, True)
    """
    dtype = arr.dtype
    try:
        target, mask = _target(dtype)
    except TypeError as e:
        raise TypeError(
            f"{what} has a structured dtype whose field {e.args[0]!r} holds Python objects ({dtype}): it cannot "
            "be digested by value; make that field a leaf of its own (bytes or str rows) or of a numeric type"
        ) from None
    if dtype.names is None and mask is None:
        return np.ascontiguousarray(arr if target == dtype else arr.astype(target))
    out = arr.astype(target, order="C")  # a copy: fields by position (the same names, in order), packed
    if mask is not None and out.size:
        flat = out.reshape(-1).view(_U8).reshape(-1, target.itemsize)
        flat &= mask
    return out
